"""docs/export.md, "Which transformers loads what": a tiny random Qwen3's checkpoint, exported from
`Recipe.from_scheme`, loaded by transformers' ``AutoModelForCausalLM.from_pretrained`` (its
compressed-tensors quantizer, ``run_compressed`` True and False), against ``qstats.fake_quantized``
on the float model: int8 W8A8 and FP8_DYNAMIC give its logits bit for bit, and so do NVFP4, MXFP4
and MXFP8 on a bfloat16 model; on a float32 or float16 model those load, but transformers' CPU
forward fails on a bfloat16 matmul. A transformers whose forward runs them fails the last test, so
the table gets updated."""

from __future__ import annotations

import warnings

import pytest
import torch

import qstats

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")
from transformers.utils.quantization_config import CompressedTensorsConfig  # noqa: E402


def _qwen3(dtype: torch.dtype, folder):
    """A tiny random Qwen3 in ``dtype``, as ``from_pretrained`` loads it (its rotary frequencies stay
    float32, as in the checkpoint's loaded model)."""
    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                      max_position_embeddings=64)
    transformers.Qwen3ForCausalLM(config).save_pretrained(str(folder))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).eval()
    model.set_attn_implementation("eager")
    return model


def _export(scheme: str, dtype: torch.dtype, folder):
    """(the float model, its qparams, plan, a batch) after exporting ``scheme`` to ``folder``."""
    model = _qwen3(dtype, folder / "float")
    folder = folder / "quantized"
    g = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(0, 96, (1, 12), generator=g)} for _ in range(3)]
    plan = qstats.Recipe.from_scheme(scheme, ignore=["lm_head"], observed_dtype=dtype).resolve(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qparams = qstats.compute_qparams_tree(qstats.calibrate(model, batches, plan, progress=False), plan)
        qstats.export.compressed_tensors(model, qparams, str(folder), plan)
    return model, qparams, plan, batches[0]


def _loaded(folder, run_compressed: bool):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(folder), quantization_config=CompressedTensorsConfig(run_compressed=run_compressed)).eval()
    model.set_attn_implementation("eager")
    return model


@pytest.mark.parametrize("run_compressed", [True, False])
@pytest.mark.parametrize("scheme", ["W8A8", "FP8_DYNAMIC"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_transformers_runs_int8_and_fp8_checkpoints_as_fake_quantized(tmp_path, scheme, dtype, run_compressed):
    _assert_loaded_equals_fake_quantized(tmp_path, scheme, dtype, run_compressed)


@pytest.mark.parametrize("run_compressed", [True, False])
@pytest.mark.parametrize("scheme", ["NVFP4", "MXFP4", "MXFP8"])
def test_transformers_runs_fp4_and_mx_checkpoints_of_bfloat16_models_as_fake_quantized(tmp_path, scheme,
                                                                                       run_compressed):
    _assert_loaded_equals_fake_quantized(tmp_path, scheme, torch.bfloat16, run_compressed)


def _assert_loaded_equals_fake_quantized(tmp_path, scheme, dtype, run_compressed):
    model, qparams, plan, batch = _export(scheme, dtype, tmp_path)
    with torch.no_grad(), qstats.fake_quantized(model, qparams, plan):
        ours = model(**batch).logits
    with torch.no_grad():
        theirs = _loaded(tmp_path / "quantized", run_compressed)(**batch).logits
    assert torch.equal(theirs, ours)


@pytest.mark.parametrize("run_compressed", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("scheme", ["NVFP4", "MXFP4", "MXFP8"])
def test_transformers_cpu_forward_of_fp4_and_mx_checkpoints_fails(tmp_path, scheme, dtype, run_compressed):
    *_, batch = _export(scheme, dtype, tmp_path)
    loaded = _loaded(tmp_path / "quantized", run_compressed)
    with pytest.raises(RuntimeError, match="same dtype"), torch.no_grad():
        loaded(**batch)


def test_a_model_cast_to_bfloat16_casts_its_rotary_frequencies_but_a_loaded_one_keeps_them_float32(tmp_path):
    """Why the docs say to calibrate a half-precision model as ``from_pretrained`` loads it."""
    loaded = _qwen3(torch.bfloat16, tmp_path)
    cast = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).to(torch.bfloat16)
    assert loaded.model.rotary_emb.inv_freq.dtype == torch.float32
    assert cast.model.rotary_emb.inv_freq.dtype == torch.bfloat16
