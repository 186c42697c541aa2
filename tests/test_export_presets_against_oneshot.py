"""More of compressed-tensors 0.19's presets and kv-cache schemes exported by qstats against llm-compressor
0.14's ``oneshot`` + ``save_pretrained`` of the same tiny Llama, recipe and batches (the cases of
``tests/test_export_roundtrip.py`` left out there): every tensor bit for bit, the whole ``config.json``
(``quantization_config`` with its ``format``, ``ignore``, ``kv_cache_scheme``, ``global_compression_ratio``),
and the logits of both checkpoints loaded by transformers (its compressed-tensors quantizer, decompressed)."""

from __future__ import annotations

import warnings

import pytest
import torch
from _shared import bit_equal, llm_compressor_oneshot, load_causal_lm
from test_export_roundtrip import _llama, assert_same_checkpoint

import qstats

pytest.importorskip("llmcompressor")
from compressed_tensors.quantization import QuantizationScheme  # noqa: E402
from llmcompressor.modifiers.quantization import QuantizationModifier  # noqa: E402
from transformers.utils.quantization_config import CompressedTensorsConfig  # noqa: E402

FP8_HEADS = dict(num_bits=8, type="float", symmetric=True, strategy="attn_head", dynamic=False)
INT8_ASYMMETRIC = dict(num_bits=8, type="int", symmetric=False, strategy="tensor", dynamic=False)

ODD_WIDTHS = {"hidden_size": 100, "head_dim": 24, "intermediate_size": 196, "vocab_size": 61}


def _channel(bits: int) -> dict:
    """One config group's fields: asymmetric int weights of ``bits`` bits per channel."""
    return {"weights": dict(num_bits=bits, type="int", symmetric=False, strategy="channel")}


# case: (scheme: a preset's name or one group's fields, model dtype, Llama overrides, ignore, kv_cache_scheme)
CASES = {
    "MXFP4-bf16": ("MXFP4", torch.bfloat16, {}, ("lm_head",), None),
    "MXFP8-bf16": ("MXFP8", torch.bfloat16, {}, ("lm_head",), None),
    "NVFP4A16-bf16": ("NVFP4A16", torch.bfloat16, {}, ("lm_head",), None),
    "W4AFP8-bf16": ("W4AFP8", torch.bfloat16, {}, ("lm_head",), None),
    "W4A4": ("W4A4", torch.float32, {}, ("lm_head",), None),
    "INT8-static-inputs-bf16": ("INT8", torch.bfloat16, {}, ("lm_head",), None),
    # 200 gate/up rows: partial 128x128 blocks; down_proj's 200 inputs take no 128-wide dynamic group
    "FP8_BLOCK-partial-rows-bf16": ("FP8_BLOCK", torch.bfloat16, {"intermediate_size": 200},
                                    ("lm_head", "re:.*down_proj"), None),
    # a quantized lm_head tied to the embeddings, 61 rows: zero points packed along an odd dimension
    "W4A16_ASYM-tied-lm_head-61-rows-fp16": ("W4A16_ASYM", torch.float16, {"vocab_size": 61,
                                                                          "tie_word_embeddings": True}, (), None),
    "W4A16-int8-asymmetric-kv": ("W4A16", torch.float32, {}, ("lm_head",), INT8_ASYMMETRIC),
    "FP8-per-head-kv-bf16": ("FP8", torch.bfloat16, {}, ("lm_head",), FP8_HEADS),
    # 100 and 196 columns: int32 words of codes padded at the end of each row; lm_head's 61 rows of zero points
    "W4-channel-asymmetric-odd-widths": (_channel(4), torch.float32, ODD_WIDTHS, (), None),
    "W2-channel-asymmetric-odd-widths-fp16": (_channel(2), torch.float16, ODD_WIDTHS, (), None),
}


@pytest.fixture(scope="module")
def samples():
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(1, 61, (12,), generator=generator) for _ in range(2)]


def _both(tmp_path, samples, scheme, dtype, overrides, ignore, kv) -> tuple:
    """The float Llama calibrated by ``oneshot`` and by qstats with ``scheme`` and ``kv``, both exported:
    ``(our folder, their folder)``."""
    base, theirs, ours = (str(tmp_path / name) for name in ("base", "theirs", "ours"))
    _llama(base, dtype, **overrides)
    if isinstance(scheme, dict):  # fields of one config group
        modifier = QuantizationModifier(config_groups={"group_0": QuantizationScheme(targets=["Linear"], **scheme)},
                                        ignore=list(ignore), kv_cache_scheme=kv)
    else:
        modifier = QuantizationModifier(scheme=scheme, targets=["Linear"], ignore=list(ignore), kv_cache_scheme=kv)
    llm_compressor_oneshot(load_causal_lm(base), samples, modifier, theirs)
    model = load_causal_lm(base)
    model.set_attn_implementation("eager")  # as llm-compressor calibrates
    recipe = qstats.Recipe.from_scheme(scheme, ignore=ignore, kv_cache_scheme=kv,
                                       observed_dtype=None if dtype == torch.float32 else dtype)
    plan = recipe.resolve(model)
    states = qstats.calibrate(model, [{"input_ids": s[None]} for s in samples], plan, progress=False)
    qstats.export.compressed_tensors(model, qstats.compute_qparams_tree(states, plan), ours, plan)
    return ours, theirs


def _logits(folder, batch):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = load_causal_lm(folder, quantization_config=CompressedTensorsConfig(run_compressed=False))
    model.set_attn_implementation("eager")
    with torch.no_grad():
        return model(batch).logits


@pytest.mark.parametrize("case", sorted(CASES))
def test_preset_export_equals_oneshots_checkpoint(tmp_path, samples, case):
    scheme, dtype, overrides, ignore, kv = CASES[case]
    ours, theirs = _both(tmp_path, samples, scheme, dtype, overrides, ignore, kv)
    assert_same_checkpoint(ours, theirs)
    assert bit_equal(_logits(ours, samples[1][None]), _logits(theirs, samples[1][None]))
