"""coreai_opt's ``quantize`` / ``dequantize`` against `qstats.quantize` / `qstats.dequantize`
under ``QuantSpec.from_coreai_opt``: the same code values (in qstats' code dtype), and qstats'
``dequantize`` of either library's codes equal to coreai_opt's.

Reference: Apple coreai_opt 0.4.0's ``_DefaultFakeQuantizeImpl.quantize`` and ``dequantize``.
"""

import warnings

import pytest
import torch

import qstats

warnings.filterwarnings("ignore")

spec_lib = pytest.importorskip("coreai_opt.quantization.spec.spec")
from coreai_opt.config.spec import CompressionTargetTensor  # noqa: E402
from coreai_opt.quantization.spec.factory import QuantizationComponentFactory  # noqa: E402

QuantizationSpec = spec_lib.QuantizationSpec
TARGETS = [(torch.int8, "symmetric", None), (torch.uint4, "symmetric", None), (torch.uint6, "asymmetric", None),
           (torch.int2, "symmetric_with_clipping", None), (torch.int8, "symmetric", torch.float8_e8m0fnu),
           (torch.float8_e4m3fn, "symmetric", None), (torch.float8_e5m2, "symmetric", torch.float8_e8m0fnu),
           (torch.float4_e2m1fn_x2, "symmetric", None)]
WEIGHTS = {"linear": ({"type": "per_block", "axis": 1, "block_size": 8}, (6, 32)),
           "conv": ({"type": "per_block", "axis": 1, "block_size": 3}, (4, 6, 3, 3))}


@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("weight", list(WEIGHTS))
@pytest.mark.parametrize("dtype,qscheme,scale_dtype", TARGETS, ids=str)
def test_codes_and_values_are_coreai_opts(dtype, qscheme, scale_dtype, weight, input_dtype):
    granularity, shape = WEIGHTS[weight]
    extra = {} if scale_dtype is None else {"scale_dtype": scale_dtype}
    coreai_spec = QuantizationSpec(dtype=dtype, qscheme=qscheme, granularity=granularity,
                                   qparam_calculator_cls="static", **extra)
    fake_quantizer = QuantizationComponentFactory.create_fake_quantizer(coreai_spec, CompressionTargetTensor.WEIGHT)
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 3).to(input_dtype)
    scale, zero_point, minval = fake_quantizer.qparams_calculator(x)
    codes = fake_quantizer.quantize(x, scale, zero_point, minval)
    values = fake_quantizer.dequantize(codes, scale, zero_point, minval)

    spec = qstats.QuantSpec.from_coreai_opt(coreai_spec, shape=shape, input_dtype=input_dtype)
    obs = qstats.memoryless_minmax(spec)
    qp = qstats.compute_qparams(obs.update(obs.init(x), x), spec)
    ours = qstats.quantize(x, qp, spec)
    assert ours.dtype == qstats.code_dtype(spec)
    ours_values = qstats.dequantize(ours, qp, spec)
    assert torch.equal(ours_values, values)
    assert torch.equal(qstats.dequantize(codes, qp, spec), values)
    if dtype == torch.float4_e2m1fn_x2:  # qstats' fp4 codes are E2M1 bit codes, coreai_opt's their values
        assert ours.dtype == torch.uint8 and codes.dtype == torch.float8_e4m3fn
    else:
        assert torch.equal(ours.float(), codes.float())
