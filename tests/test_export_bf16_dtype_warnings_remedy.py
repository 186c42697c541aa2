"""A bf16 model exported from compressed-tensors specs computing in float32 (Recipe.from_scheme without
observed_dtype) gets two warnings (scales rounded to bf16; qparams computed in another dtype than
llm-compressor's), and both now name the remedy a from_scheme user has, observed_dtype=<the model's
dtype>; before, the first told to use a spec whose scale_dtype is bf16, which from_scheme does not
take. With observed_dtype neither warns, and the checkpoint's scales are compressed-tensors' own
qparams of the bf16 weights."""

import json
import warnings

import pytest
import torch

import qstats

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")
from compressed_tensors.quantization import preset_name_to_scheme  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402


def _model():
    config = transformers.Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1, head_dim=16, vocab_size=64)
    torch.manual_seed(0)
    return transformers.Qwen3ForCausalLM(config).to(torch.bfloat16).eval()


def _export(model, recipe, out):
    batches = [torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(1))]
    qparams = qstats.compute_qparams_tree(qstats.calibrate(model, batches, recipe, progress=False), recipe, model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qstats.export.compressed_tensors(model, qparams, str(out), recipe)
    return [str(c.message) for c in caught if issubclass(c.category, qstats.export.ExportWarning)]


def test_both_warnings_name_observed_dtype(tmp_path):
    messages = _export(_model(), qstats.Recipe.from_scheme("FP8", ignore=["lm_head"]), tmp_path / "a")
    dtype = [m for m in messages if "dtype" in m]
    assert len(dtype) == 2 and all("observed_dtype=" in m for m in dtype), messages


def test_observed_dtype_removes_it_and_writes_compressed_tensors_scales(tmp_path):
    model = _model()
    recipe = qstats.Recipe.from_scheme("FP8", ignore=["lm_head"], observed_dtype=torch.bfloat16)
    assert not [m for m in _export(model, recipe, tmp_path / "b") if "dtype" in m]
    json.loads((tmp_path / "b" / "config.json").read_text())  # a checkpoint was written
    saved = safetensors.load_file(str(tmp_path / "b" / "model.safetensors"))
    weight = model.model.layers[0].self_attn.q_proj.weight.detach()
    args = preset_name_to_scheme("FP8", ["Linear"]).weights
    scale, _ = calculate_qparams(weight.amin().reshape(1), weight.amax().reshape(1), args)
    assert torch.equal(saved["model.layers.0.self_attn.q_proj.weight_scale"].reshape(-1), scale.reshape(-1))
