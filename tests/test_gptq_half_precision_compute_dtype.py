"""qstats.gptq on a bfloat16/float16 weight under `QuantSpec.from_compressed_tensors(args)` without
``observed_dtype``: llm-compressor 0.14's weight observer computes the scales in the weight's dtype and
its quantize_weight dequantizes each GPTQ column in the scales' dtype, so on the same scale values the
float32-computing spec drifts from its weights (0.06% of int4 fp16 ones to 19% of int8 bf16 ones). `qstats.gptq` warns, naming
``observed_dtype``; with it the codes are llm-compressor's."""

from __future__ import annotations

import warnings

import pytest
import torch

import qstats
from qstats.observers.hessian import gptq_hessian, hessian

llmc_gptq = pytest.importorskip("llmcompressor.modifiers.gptq.gptq_quantize")
llmc_observers = pytest.importorskip("llmcompressor.observers")
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402


def _data(dtype):
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(64, 128, generator=gen) * 0.05).to(dtype)
    x = torch.randn(240, 128, generator=gen) * torch.linspace(0.05, 2.0, 128)
    return weight, hessian().update(hessian().init(x), x)


def _llmc(args, weight, state):
    """llm-compressor's own observer scales (in the weight's dtype) and its GPTQ of the weight."""
    observer = llmc_observers.Observer.load_from_registry("memoryless_minmax", base_name="weight",
                                                          args=args.model_copy(deep=True))
    observer(weight)
    found = observer.get_qparams()
    out, _, fallback = llmc_gptq.quantize_weight(weight.clone()[None], gptq_hessian(state)[None], found["scale"][None],
                                                 found["zero_point"][None], None, args)
    assert not fallback.any()
    return found, out[0]


def _gptq(args, weight, state, found, spec):
    obs = qstats.minmax(spec)
    shape = qstats.compute_qparams(obs.update(obs.init(weight), weight), spec)
    qparams = shape._replace(scale=found["scale"].reshape(shape.scale.shape).to(shape.scale.dtype),
                             zero_point=found["zero_point"].reshape(shape.zero_point.shape).to(shape.zero_point.dtype))
    return qstats.gptq(weight, state, spec, actorder=args.actorder and "static", qparams=qparams)[0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fields", [dict(num_bits=8, symmetric=False, strategy="channel", actorder="static"),
                                    dict(num_bits=4, symmetric=True, strategy="group", group_size=32)],
                         ids=["int8-channel-static", "int4-group32"])
def test_a_half_precision_weight_under_a_float32_spec_warns_and_observed_dtype_gives_llm_compressor_codes(dtype,
                                                                                                         fields):
    args = QuantizationArgs(**fields)
    weight, state = _data(dtype)
    found, want = _llmc(args, weight, state)
    assert found["scale"].dtype == dtype  # llm-compressor's scales are in the weight's dtype
    plain = qstats.QuantSpec.from_compressed_tensors(args)
    with pytest.warns(UserWarning, match=f"observed_dtype=torch.{str(dtype)[6:]}"):
        drifted = _gptq(args, weight, state, found, plain)
    drift = 1 - (drifted == want).float().mean()
    assert drift > 0  # the same scale values, dequantized in float32
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = _gptq(args, weight, state, found, qstats.QuantSpec.from_compressed_tensors(args, observed_dtype=dtype))
        qstats.gptq(weight.float(), state, plain)  # a float32 weight under a float32 spec: nothing to warn
        qstats.gptq(weight, state, qstats.QuantSpec(dtype="int4", granularity=qstats.PerGroup(32)))  # not compressed-tensors'
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mx_scales_give_llm_compressor_codes_in_any_compute_dtype_without_a_warning(dtype):
    """MXFP4's e8m0 scales are powers of two, the same in either dtype and exact when dequantized: the
    float32-computing spec gives llm-compressor's codes, so nothing to warn of."""
    from compressed_tensors.quantization import preset_name_to_scheme

    args = preset_name_to_scheme("MXFP4", ["Linear"]).weights
    weight, state = _data(dtype)
    found, want = _llmc(args, weight, state)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = _gptq(args, weight, state, found, qstats.QuantSpec.from_compressed_tensors(args))
    assert torch.equal(got, want)
