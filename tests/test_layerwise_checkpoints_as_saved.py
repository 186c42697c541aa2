"""`calibrate_layerwise` on checkpoints as users have them: copies of non-persistent buffers an older
``save_pretrained`` wrote (rotary ``inv_freq``, GPT-Neo's causal mask) are not read, as
``from_pretrained`` leaves them unread, so the states equal a full-model `calibrate` of the loaded
model; a folder of pytorch ``.bin`` weights, or shards without their index, is refused naming them."""

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

W8 = qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0))
A8 = qstats.QuantSpec(dtype="int8", mapping="asymmetric")
RECIPE = qstats.Recipe([qstats.Rule("Linear", sites=("input",), spec=A8), qstats.Rule("Linear", sites=("weight",), spec=W8)])


def _llama():
    return transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8)


def _gpt_neo():
    return transformers.GPTNeoConfig(vocab_size=96, hidden_size=32, num_layers=2, num_heads=4, max_position_embeddings=16,
                                     attention_types=[[["global", "local"], 1]], window_size=4)


def _old_buffers(model) -> dict:
    """The non-persistent buffers an older transformers saved: ``inv_freq`` in bfloat16 of another
    base (a config edited since), causal masks as uint8."""
    saved = {}
    for name, value in model.named_buffers():
        if name.endswith("inv_freq"):
            saved[name] = (value * 1.5).to(torch.bfloat16)
        elif name.endswith("attention.bias"):
            saved[name] = torch.ones_like(value, dtype=torch.uint8)  # no causal mask at all
    assert saved and not set(saved) & set(model.state_dict())  # non-persistent, as transformers 5 declares them
    return saved


@pytest.mark.parametrize("config", [_llama, _gpt_neo])
def test_non_persistent_buffers_in_the_checkpoint_are_computed_as_from_pretrained_does(tmp_path, config):
    config = config()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path)
    file = os.path.join(tmp_path, "model.safetensors")
    save_file({**load_file(file), **_old_buffers(model)}, file, metadata={"format": "pt"})

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config).eval()
    generator = torch.Generator().manual_seed(1)
    batches = [{"input_ids": torch.randint(0, 96, (2, 8), generator=generator)} for _ in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        states = qstats.calibrate_layerwise(meta, tmp_path, batches, RECIPE, progress=False)
    full = qstats.calibrate(loaded, batches, RECIPE, progress=False)
    assert set(states) == set(full)
    for path in full:
        for site in full[path]:
            assert all(torch.equal(a, b) for a, b in zip(full[path][site], states[path][site])), (path, site)


def test_pytorch_bin_weights_or_shards_without_their_index_are_refused_naming_them(tmp_path):
    config = _llama()
    state = transformers.AutoModelForCausalLM.from_config(config).state_dict()
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config).eval()
    batches = [{"input_ids": torch.zeros(1, 4, dtype=torch.long)}]
    pickled = tmp_path / "bin"
    pickled.mkdir()
    torch.save(state, pickled / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"pytorch_model\.bin: pytorch \.bin weights are not read"):
        qstats.calibrate_layerwise(meta, pickled, batches, RECIPE, progress=False)
    shards = tmp_path / "shards"
    shards.mkdir()
    save_file({key: value.contiguous() for key, value in state.items()}, shards / "model-00001-of-00001.safetensors")
    with pytest.raises(ValueError, match=r"model-00001-of-00001\.safetensors: safetensors files without "):
        qstats.export.compressed_tensors_layerwise(meta, shards, {}, str(tmp_path / "out"), RECIPE, progress=False)


def _sharded(folder):
    config = _llama()
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder, max_shard_size="10KB")
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("weight_map, message", [
    ({"lm_head.weight": 3}, r"puts 'lm_head.weight' in 3, not a file name"),
    ({"lm_head.weight": None}, r"puts 'lm_head.weight' in None, not a file name"),
    ([["lm_head.weight", "model.safetensors"]], r"weight_map is a list"),
])
def test_an_index_whose_weight_map_is_no_map_of_file_names_is_refused_naming_it(tmp_path, weight_map, message):
    meta = _sharded(tmp_path)
    index = tmp_path / "model.safetensors.index.json"
    with open(index, "w") as file:
        json.dump({"weight_map": weight_map}, file)
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json' is not a safetensors index .*" + message):
        qstats.calibrate_layerwise(meta, tmp_path, [{"input_ids": torch.zeros(1, 4, dtype=torch.long)}], RECIPE,
                                   progress=False)


@pytest.mark.parametrize("how", ["missing", "truncated"])
def test_a_missing_or_broken_shard_is_named_with_the_tensors_the_index_puts_there(tmp_path, how):
    meta = _sharded(tmp_path)
    with open(tmp_path / "model.safetensors.index.json") as file:
        weight_map = json.load(file)["weight_map"]
    shard = weight_map["lm_head.weight"]
    held = [key for key, name in weight_map.items() if name == shard]
    if how == "missing":
        os.remove(tmp_path / shard)
    else:
        with open(tmp_path / shard, "r+b") as file:
            file.truncate(100)
    with pytest.raises(ValueError, match=re.escape(shard) + rf".*the index puts {len(held)} tensor\(s\) there: "
                       + re.escape(held[0])):
        qstats.calibrate_layerwise(meta, tmp_path, [{"input_ids": torch.zeros(1, 4, dtype=torch.long)}], RECIPE,
                                   progress=False)


def _deberta_v2():  # DebertaV2Encoder: `output_states = self.conv(hidden_states, output_states, input_mask)` after layer 0
    return transformers.DebertaV2Model, transformers.DebertaV2Config(
        vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
        max_position_embeddings=40, relative_attention=True, position_buckets=8, pos_att_type=["p2c", "c2p"],
        conv_kernel_size=3, norm_rel_ebd="layer_norm")  # fmt: skip


def _funnel():  # FunnelDecoder: `layer(hidden, hidden, hidden, attention_inputs)`, query, key and value
    return transformers.FunnelModel, transformers.FunnelConfig(vocab_size=96, d_model=32, n_head=4, d_head=8, d_inner=48,
                                                               block_sizes=[1, 1])


@pytest.mark.parametrize("family, message", [
    (_deberta_v2, r"changes the hidden states encoder\.layer\.0 returns before passing them to encoder\.layer\.1"),
    (_funnel, r"passes decoder\.layers\.1 the hidden states decoder\.layers\.0 returns in another argument too"),
])
def test_a_forward_that_changes_or_repeats_the_hidden_states_between_layers_is_refused(tmp_path, family, message):
    cls, config = family()
    torch.manual_seed(0)
    cls(config).save_pretrained(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = cls.from_pretrained(tmp_path).eval()
    generator = torch.Generator().manual_seed(1)
    batches = [{"input_ids": torch.randint(3, 90, (2, 8), generator=generator)} for _ in range(2)]
    full = qstats.calibrate(loaded, batches, RECIPE, progress=False)
    with torch.device("meta"):
        meta = cls(config).eval()
    try:  # what it gave before: other states from the second layer on, in silence
        states = qstats.calibrate_layerwise(meta, tmp_path, batches, RECIPE, progress=False)
    except ValueError as error:
        assert re.search(message, str(error)), error
    else:
        assert set(states) == set(full)
        differ = [(path, site) for path in full for site in full[path]
                  if not all(torch.equal(a, b) for a, b in zip(full[path][site], states[path][site]))]
        pytest.fail(f"calibrated, not refused; differing from the full model at {differ[:3]}")


def _qwen3_vl_moe():
    text = dict(vocab_size=160, hidden_size=32, intermediate_size=48, moe_intermediate_size=8, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                max_position_embeddings=64)  # fmt: skip
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=2, spatial_merge_size=1,
                  temporal_patch_size=1, out_hidden_size=32, num_position_embeddings=16, deepstack_visual_indexes=[0])
    return transformers.Qwen3VLMoeConfig(text_config=text, vision_config=vision, image_token_id=150,
                                         video_token_id=151, vision_start_token_id=152)  # fmt: skip


def _tensors(folder) -> dict:
    tensors: dict = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(folder, name)))
    return tensors


def test_stacked_experts_stored_transposed_read_as_from_pretrained_transposes_them(tmp_path):
    """Qwen3-VL-MoE's released checkpoints store the stacked experts ``[experts, in, out]``;
    transformers transposes them on load where their shape is not the model's (its
    ``Transpose(check_dims=True)``). Before: a ValueError on the shape."""
    cls, config = transformers.Qwen3VLMoeForConditionalGeneration, _qwen3_vl_moe()
    torch.manual_seed(0)
    checkpoint = tmp_path / "checkpoint"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cls(config).save_pretrained(checkpoint)
    file = os.path.join(checkpoint, "model.safetensors")
    stacked = ("experts.gate_up_proj", "experts.down_proj")
    save_file({key: value.transpose(1, 2).contiguous() if key.endswith(stacked) else value
               for key, value in load_file(file).items()}, file, metadata={"format": "pt"})  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = cls.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.device("meta"):
        meta = cls(config).eval()
    recipe = qstats.Recipe.from_scheme("W8A8", ignore=["lm_head", "re:.*visual.*"])
    generator = torch.Generator().manual_seed(1)
    batches = [{"input_ids": torch.randint(0, 140, (2, 6), generator=generator)} for _ in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        full = qstats.calibrate(loaded, batches, recipe, progress=False)
        states = qstats.calibrate_layerwise(meta, checkpoint, batches, recipe, progress=False)
        assert set(states) == set(full)
        for path in full:
            for site in full[path]:
                assert all(torch.equal(a, b) for a, b in zip(full[path][site], states[path][site])), (path, site)
        qparams = qstats.compute_qparams_tree(full, recipe, loaded)
        qstats.export.compressed_tensors(loaded, qparams, str(tmp_path / "in_memory"), recipe)
        qstats.export.compressed_tensors_layerwise(meta, checkpoint, qparams, str(tmp_path / "layerwise"), recipe,
                                                   progress=False)
    want, got = _tensors(tmp_path / "in_memory"), _tensors(tmp_path / "layerwise")
    assert set(got) == set(want)
    assert all(got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]) for key in want)
