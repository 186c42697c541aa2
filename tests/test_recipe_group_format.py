"""A config group's ``format`` against llm-compressor 0.14's ``oneshot``: the format compressed-tensors
infers for the scheme (every group of a checkpoint's ``config.json``) reads as the scheme alone; another
one (an unpacked ``naive-quantized`` W8 weight), which ``oneshot`` writes, is refused by name, and the
export's ``format=`` then writes llm-compressor's checkpoint bit for bit."""

from __future__ import annotations

import json
import os

import pytest
import torch
from _oneshot import calibrated_qparams, load_eager, saved_random_model, token_samples
from _shared import bit_equal, llm_compressor_oneshot, load_causal_lm

import qstats

transformers = pytest.importorskip("transformers")
pytest.importorskip("llmcompressor")
from safetensors.torch import load_file  # noqa: E402

W8_GROUP = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}
FP8 = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": False}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                      tie_word_embeddings=False)
    return saved_random_model(tmp_path_factory, "format_llama", transformers.LlamaForCausalLM, config)


def _config(folder) -> dict:
    with open(os.path.join(folder, "config.json")) as file:
        return json.load(file)["quantization_config"]


def _groups(group: dict) -> dict:
    return {"config_groups": {"group_0": {"targets": ["Linear"], **group}}, "ignore": ["lm_head"]}


def _modifier(group: dict):
    from llmcompressor.modifiers.quantization import QuantizationModifier

    return QuantizationModifier(**_groups(group))


def _export(path, recipe, folder, **options) -> None:
    model = load_eager(path)
    plan = recipe.resolve(model)
    qstats.export.compressed_tensors(model, calibrated_qparams(model, token_samples(2), plan), folder, plan, **options)


def test_a_group_format_other_than_the_inferred_one_is_refused_and_format_reproduces_it(llama, tmp_path):
    group = {"weights": W8_GROUP, "format": "naive-quantized"}
    theirs, ours = str(tmp_path / "llm_compressor"), str(tmp_path / "qstats")
    llm_compressor_oneshot(load_causal_lm(llama), token_samples(2), _modifier(group), theirs)
    their_tensors = load_file(os.path.join(theirs, "model.safetensors"))
    assert their_tensors["model.layers.0.mlp.up_proj.weight"].dtype == torch.int8  # unpacked, as the group says
    for config in (_modifier(group), _groups(group), _config(theirs)):
        with pytest.raises(ValueError, match="format 'naive-quantized' is not the 'pack-quantized'"):
            qstats.Recipe.from_compressed_tensors(config)
    with pytest.raises(ValueError, match="format 'naive-quantized'"):
        qstats.Recipe.from_scheme({"targets": ["Linear"], **group}, ignore=["lm_head"])

    _export(llama, qstats.Recipe.from_compressed_tensors(_groups({"weights": W8_GROUP})), ours,
            format="naive-quantized")
    our_tensors = load_file(os.path.join(ours, "model.safetensors"))
    assert sorted(our_tensors) == sorted(their_tensors)
    assert all(bit_equal(our_tensors[name], their_tensors[name]) for name in their_tensors)
    assert _config(ours) == _config(theirs)


@pytest.mark.parametrize("group", [{"weights": W8_GROUP}, {"weights": FP8, "input_activations": FP8},
                                   {"weights": {**W8_GROUP, "num_bits": 4}}])
def test_a_checkpoint_config_with_the_inferred_formats_reads_and_reproduces_it(llama, tmp_path, group):
    """Every group of llm-compressor's ``config.json`` names its format: the one compressed-tensors
    infers, so the config reads back and the export writes the same checkpoint."""
    theirs, ours = str(tmp_path / "llm_compressor"), str(tmp_path / "qstats")
    llm_compressor_oneshot(load_causal_lm(llama), token_samples(2), _modifier(group), theirs)
    assert _config(theirs)["config_groups"]["group_0"]["format"] is not None
    _export(llama, qstats.Recipe.from_compressed_tensors(_config(theirs)), ours)
    their_tensors, our_tensors = (load_file(os.path.join(folder, "model.safetensors")) for folder in (theirs, ours))
    assert sorted(our_tensors) == sorted(their_tensors)
    assert all(bit_equal(our_tensors[name], their_tensors[name]) for name in their_tensors)
    assert _config(ours) == _config(theirs)


def test_a_group_format_the_export_does_not_write_is_refused_saying_so():
    """2:4-sparse W4A16 checkpoints name ``marlin-24``, a format compressed-tensors writes and the export does not."""
    from compressed_tensors.config import CompressionFormat

    assert CompressionFormat("marlin-24")  # a compressed-tensors format
    group = {"weights": {**W8_GROUP, "num_bits": 4}, "format": "marlin-24"}
    with pytest.raises(ValueError, match="format 'marlin-24' .* writes none of that format"):
        qstats.Recipe.from_compressed_tensors(_groups(group))
