"""The shard index of `qstats.export.compressed_tensors_layerwise` holds the ``metadata`` transformers 5's
``save_pretrained`` writes (``total_parameters`` beside ``total_size``), as the in-memory export's does:
a float export's equals ``save_pretrained``'s index of the same model (tied embeddings counted once), and
a W4A16 export's ``total_parameters`` is the parameter count of compressed-tensors' ``compress_model``
of the model (the reference ``oneshot``'s save counts; packed int4 codes as the int32 elements written)."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

import qstats

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

SHARD = "40KB"


def _index(folder) -> dict:
    with open(os.path.join(folder, "model.safetensors.index.json")) as file:
        return json.load(file)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    torch.manual_seed(0)
    folder = str(tmp_path_factory.mktemp("source"))
    transformers.LlamaForCausalLM(config).save_pretrained(folder, max_shard_size=SHARD)
    return folder


def _meta(folder):
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(folder)).eval()


@pytest.mark.parametrize("max_shard_size", [None, SHARD])
def test_a_float_exports_index_metadata_is_save_pretrained(source, tmp_path, max_shard_size):
    theirs = _index(source)
    assert set(theirs["metadata"]) == {"total_parameters", "total_size"}
    recipe = qstats.Recipe.from_scheme("W8A8", targets=["Conv1d"])  # no such module: the float model
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qstats.export.compressed_tensors_layerwise(_meta(source), source, {}, str(tmp_path), recipe,
                                                   max_shard_size=max_shard_size, progress=False)
    ours = _index(tmp_path)
    assert ours["metadata"] == theirs["metadata"]
    assert ours["weight_map"].keys() == theirs["weight_map"].keys()


def test_a_w4a16_exports_total_parameters_is_compress_models(source, tmp_path):
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config

    recipe = qstats.Recipe.from_scheme("W4A16", ignore=["lm_head"], observed_dtype=torch.float32)
    model = transformers.AutoModelForCausalLM.from_pretrained(source).eval()
    qparams = qstats.compute_qparams_tree(qstats.calibrate(model, [], recipe, progress=False), recipe, model)
    written = qstats.export.compressed_tensors_layerwise(_meta(source), source, qparams, str(tmp_path), recipe,
                                                         progress=False)
    config = QuantizationConfig.model_validate(written)
    apply_quantization_config(model, config)
    ModelCompressor(quantization_config=config).compress_model(model)
    index = _index(tmp_path)
    assert len(set(index["weight_map"].values())) > 1
    assert sorted(index["weight_map"]) == sorted(model.state_dict().keys() - {"lm_head.weight"})  # tied: written once
    assert index["metadata"]["total_parameters"] == sum(parameter.numel() for parameter in model.parameters())
