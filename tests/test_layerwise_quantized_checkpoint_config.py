"""`qstats.calibrate_layerwise` and `export.compressed_tensors_layerwise` refuse a quantized checkpoint
up front, naming the ``quantization_config`` of its ``config.json``, before any module of the model runs
or any tensor is read: compressed-tensors' int8 (``int-quantized``), float8 (``float-quantized``) and
packed int4 (``pack-quantized``) checkpoints, as `qstats.export.compressed_tensors` writes them (oneshot's
bit for bit), and another library's (an ``fp8`` quant_method). The format named is compressed-tensors'
reading of the config (``QuantizationConfig.model_validate``). A compressed-tensors config whose weights
are stored as floats (``dense``) is read as a float checkpoint: its states equal `qstats.calibrate`'s of
the loaded model. Without a config, the weights themselves are refused when read
(tests/test_layerwise_quantized_checkpoint_refusal.py)."""

from __future__ import annotations

import json
import os
import re
import warnings

import pytest
import torch

import qstats
from _shared import assert_site_states_equal

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

CONFIG = dict(vocab_size=96, hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
BATCHES = [{"input_ids": torch.arange(14).reshape(2, 7) % 96}]
RECIPE = qstats.Recipe.from_scheme("W8A8", ignore=["lm_head"], observed_dtype=torch.float32)


def _float_model():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).eval()


def _meta():
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).eval()


def _config(folder) -> dict:
    with open(os.path.join(folder, "config.json")) as file:
        return json.load(file)


def _exported(folder, scheme: str) -> str:
    model = _float_model()
    recipe = qstats.Recipe.from_scheme(scheme, ignore=["lm_head"], observed_dtype=torch.float32)
    qparams = qstats.compute_qparams_tree(qstats.calibrate(model, BATCHES, recipe, progress=False), recipe, model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qstats.export.compressed_tensors(model, qparams, str(folder), recipe)
    return str(folder)


def _calls(model) -> list:
    """Appends each module's name when its forward starts (the meta model's)."""
    called: list = []
    for name, module in model.named_modules():
        module.register_forward_pre_hook(lambda *_, name=name: called.append(name))
    return called


@pytest.mark.parametrize("scheme", ["W8A8", "FP8", "W4A16"])
def test_a_compressed_tensors_checkpoint_is_refused_naming_its_config(tmp_path, scheme):
    from compressed_tensors.quantization import QuantizationConfig

    folder = _exported(tmp_path / "quantized", scheme)
    written = QuantizationConfig.model_validate(_config(folder)["quantization_config"])
    named = f"quant_method='compressed-tensors', format='{written.format}'"
    assert written.format in {"int-quantized", "float-quantized", "pack-quantized"}
    model = _meta()
    called = _calls(model)
    with pytest.raises(ValueError, match=re.escape(named)):
        qstats.calibrate_layerwise(model, folder, BATCHES, RECIPE, progress=False)
    assert called == [] and all(value.device.type == "meta" for value in model.parameters())
    out = tmp_path / "again"
    with pytest.raises(ValueError, match=re.escape(named)):
        qstats.export.compressed_tensors_layerwise(model, folder, {}, str(out), RECIPE, progress=False)
    assert not out.exists()


def test_another_librarys_quantized_checkpoint_is_refused_naming_its_quant_method(tmp_path):
    """DeepSeek-V3's config: float8 weights with ``weight_scale_inv`` beside them."""
    _float_model().save_pretrained(str(tmp_path))
    config = _config(tmp_path)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"checkpoint .* is quantized: .*quant_method='fp8'"):
        qstats.calibrate_layerwise(_meta(), str(tmp_path), BATCHES, RECIPE, progress=False)


def test_a_config_whose_weights_are_dense_reads_as_a_float_checkpoint(tmp_path):
    """Float weights under a compressed-tensors config of ``format: dense`` (an activation-only
    scheme's): calibrated as the float model."""
    model = _float_model()
    model.save_pretrained(str(tmp_path))
    quantization = _config(_exported(tmp_path / "quantized", "W8A8"))["quantization_config"]
    quantization["format"] = "dense"
    for group in quantization["config_groups"].values():
        group["format"] = "dense"
    config = {**_config(tmp_path), "quantization_config": quantization}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = qstats.calibrate_layerwise(_meta(), str(tmp_path), BATCHES, RECIPE, progress=False)
    assert_site_states_equal(got, qstats.calibrate(model, BATCHES, RECIPE, progress=False))
