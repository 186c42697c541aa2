"""A sharded checkpoint holding a tensor of the wrong shape or dtype, or missing one: the error of
`calibrate_layerwise` names the tensor and the shard holding it, the shard the checkpoint's own
``model.safetensors.index.json`` gives (the reference read here with ``json``), or the checkpoint
folder for a tensor no shard holds. A float16 tensor in a float32 checkpoint is no error: it is
cast, as ``from_pretrained`` casts it, and the states equal `qstats.calibrate` of the loaded model."""

from __future__ import annotations

import json
import os
import re
import warnings

import pytest
import torch

import qstats

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

RECIPE = qstats.Recipe([
    qstats.Rule("Linear", sites=("input",), spec=qstats.QuantSpec(dtype="int8", mapping="asymmetric")),
    qstats.Rule("Linear", sites=("weight",), spec=qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0))),
])  # fmt: skip
CONFIG = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8)
NAME = "model.layers.1.mlp.up_proj.weight"


def _checkpoint(folder, config, change) -> str:
    """``config``'s model saved in shards of 20KB, the shard holding ``NAME`` rewritten by ``change``
    (``change(tensors)``); returns the path of that shard, as the index gives it."""
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder, max_shard_size="20KB")
    with open(os.path.join(folder, "model.safetensors.index.json")) as file:
        shard = os.path.join(folder, json.load(file)["weight_map"][NAME])
    tensors = load_file(shard)
    change(tensors)
    save_file(tensors, shard, metadata={"format": "pt"})
    return shard


def _calibrate(folder, config):
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
    batches = [{"input_ids": torch.randint(0, 96, (2, 6), generator=torch.Generator().manual_seed(1))}]
    states = qstats.calibrate_layerwise(model, folder, batches, RECIPE, progress=False)
    return states, batches


def _narrower(tensors):
    tensors[NAME] = tensors[NAME][:, :-1].contiguous()


def _int8(tensors):
    tensors[NAME] = tensors[NAME].to(torch.int8)


@pytest.mark.parametrize("change, message", [(_narrower, r"has shape \(48, 31\), the model's \(48, 32\)"),
                                             (_int8, "is stored as torch.int8")])
def test_a_tensor_of_the_wrong_shape_or_dtype_is_named_with_its_shard(tmp_path, change, message):
    config = transformers.LlamaConfig(**CONFIG)
    shard = _checkpoint(tmp_path, config, change)
    with pytest.raises(ValueError, match=re.escape(repr(NAME))) as raised:
        _calibrate(tmp_path, config)
    assert re.search(message, str(raised.value))
    assert repr(shard) in str(raised.value), str(raised.value)


def test_a_tensor_no_shard_holds_is_named_with_the_checkpoint_folder(tmp_path):
    config = transformers.LlamaConfig(**CONFIG)
    _checkpoint(tmp_path, config, lambda tensors: tensors.pop(NAME))
    index = os.path.join(tmp_path, "model.safetensors.index.json")
    with open(index) as file:
        content = json.load(file)
    del content["weight_map"][NAME]  # the index agrees with its shards: the checkpoint lacks the tensor
    with open(index, "w") as file:
        json.dump(content, file)
    with pytest.raises(ValueError, match=re.escape(f"checkpoint {str(tmp_path)!r} has no tensor {NAME!r}")):
        _calibrate(tmp_path, config)


def test_stacked_experts_stored_per_expert_of_the_wrong_shape_name_their_shards(tmp_path):
    config = transformers.Qwen3MoeConfig(**CONFIG, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path, max_shard_size="20KB")
    with open(os.path.join(tmp_path, "model.safetensors.index.json")) as file:
        weight_map = json.load(file)["weight_map"]
    prefix = "model.layers.1.mlp.experts"
    keys = [key for key in weight_map if key.startswith(prefix + ".") and key.endswith("down_proj.weight")]
    assert len(keys) == 4, keys  # transformers writes the experts one by one
    for key in keys:  # every expert narrower: a stack of another shape than the model's
        shard = os.path.join(tmp_path, weight_map[key])
        tensors = load_file(shard)
        tensors[key] = tensors[key][:, :-1].contiguous()
        save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=re.escape(f"'{prefix}.down_proj' has shape")) as raised:
        _calibrate(tmp_path, config)
    shards = {repr(os.path.join(tmp_path, weight_map[key])) for key in keys}
    assert all(shard in str(raised.value) for shard in list(shards)[:3]), str(raised.value)


def test_a_float16_tensor_in_a_float32_checkpoint_is_cast_as_from_pretrained_casts_it(tmp_path):
    config = transformers.LlamaConfig(**CONFIG)
    _checkpoint(tmp_path, config, lambda tensors: tensors.update({NAME: tensors[NAME].to(torch.float16)}))
    states, batches = _calibrate(tmp_path, config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    full = qstats.calibrate(loaded, batches, RECIPE, progress=False)
    assert set(full) == set(states)
    for path in full:
        for site in full[path]:
            assert all(torch.equal(a, b) for a, b in zip(full[path][site], states[path][site])), (path, site)


@pytest.mark.parametrize("change", [_narrower, _int8])
def test_a_bad_tensor_of_the_last_layer_fails_before_the_first_layer_runs(tmp_path, change):
    config = transformers.LlamaConfig(**{**CONFIG, "num_hidden_layers": 2})  # NAME is in the last layer
    shard = _checkpoint(tmp_path, config, change)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
    calls = []
    model.model.layers[0].register_forward_pre_hook(lambda module, args: calls.append(1))
    batches = [{"input_ids": torch.randint(0, 96, (2, 6), generator=torch.Generator().manual_seed(1))}]
    with pytest.raises(ValueError, match=re.escape(repr(NAME))) as raised:
        qstats.calibrate_layerwise(model, tmp_path, batches, RECIPE, progress=False)
    assert repr(shard) in str(raised.value)
    assert calls == []  # found from the shards' headers, before any batch ran through a layer
    assert all(p.device.type == "meta" for p in model.parameters())
