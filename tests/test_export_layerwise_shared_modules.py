"""`compressed_tensors_layerwise` of a model holding one module under paths in two decoder layers
(``layers[1].mlp.down_proj = layers[0].mlp.down_proj``): each path's tensors are written once, as the
in-memory `compressed_tensors` export writes them (quantized under both paths). The part of the
second layer must not keep the alias's float weight beside the quantized copy the first layer's part
writes: the shard index then pointed the alias at the float tensor."""

from __future__ import annotations

import json
import os

import pytest
import torch
from _shared import bit_equal

import qstats

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

ALIAS = "model.layers.1.mlp.down_proj"


def _model(device):
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=32, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).eval()
    model.model.layers[1].mlp.down_proj = model.model.layers[0].mlp.down_proj  # one module, two layers
    return model


def _shards(folder):
    """``{tensor name: [shard file, ...]}`` and every tensor, over a checkpoint folder's shards."""
    files, tensors = {}, {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            for key, tensor in load_file(os.path.join(folder, name)).items():
                files.setdefault(key, []).append(name)
                tensors[key] = tensor
    return files, tensors


def test_a_module_shared_by_two_layers_is_written_once_per_path(tmp_path):
    model = _model("cpu")
    checkpoint = str(tmp_path / "checkpoint")
    model.config.save_pretrained(checkpoint)
    save_file({k: v.detach().clone() for k, v in model.state_dict().items()},
              os.path.join(checkpoint, "model.safetensors"))
    recipe = qstats.Recipe.from_scheme("W8A8", ignore=["lm_head"])
    states = qstats.calibrate(model, [{"input_ids": torch.randint(1, 64, (1, 8))}], recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    in_memory, layerwise = str(tmp_path / "in_memory"), str(tmp_path / "layerwise")
    qstats.export.compressed_tensors(model, qparams, in_memory, recipe)
    qstats.export.compressed_tensors_layerwise(_model("meta"), checkpoint, qparams, layerwise, recipe, progress=False)

    _, want = _shards(in_memory)
    files, got = _shards(layerwise)
    assert {name: where for name, where in files.items() if len(where) > 1} == {}
    assert sorted(got) == sorted(want)
    assert [name for name in want if not bit_equal(got[name], want[name])] == []
    assert got[f"{ALIAS}.weight"].dtype == torch.int8
    with open(os.path.join(layerwise, "model.safetensors.index.json")) as file:
        weight_map = json.load(file)["weight_map"]
    assert {name: where[0] for name, where in files.items()} == weight_map
