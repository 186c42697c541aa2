"""Where convention="torchao" departs from torchao on purpose (docs/differences.md), against torchao:
NaN/Inf in a float8 or ``choose_qparams_affine`` row; a quant_min/quant_max the input's dtype does
not hold (torchao's zero point lands outside the range); float64 inputs to float8 scales."""

import warnings

import pytest
import torch

import qstats

warnings.filterwarnings("ignore")

qp_lib = pytest.importorskip("torchao.quantization.quant_primitives")
from torchao.quantization import granularity as G  # noqa: E402

MappingType = qp_lib.MappingType


def _qparams(spec, x):
    obs = qstats.minmax(spec)
    return qstats.compute_qparams(obs.update(obs.init(x), x), spec)


def _rows_with_inf_and_nan():
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(0)) * 2
    x[1, 3], x[2, 5] = float("inf"), float("nan")
    finite = torch.where(torch.isfinite(x), x, torch.zeros_like(x))
    return x, finite


@pytest.mark.parametrize("target", (torch.float8_e4m3fn, torch.int8), ids=str)
def test_nonfinite_values_stay_out_of_the_row_scale(target):
    """torchao: the row's scale is Inf/NaN and every value NaN; qstats: the row's finite values
    give its scale (that of the row with the NaN/Inf replaced by 0), its other values finite."""
    x, finite = _rows_with_inf_and_nan()
    spec = qstats.QuantSpec.from_torchao(target, granularity=G.PerRow())
    if target == torch.int8:
        scale, _ = qp_lib.choose_qparams_affine(x, MappingType.SYMMETRIC, (1, 32), torch.int8)
        finite_scale, _ = qp_lib.choose_qparams_affine(finite, MappingType.SYMMETRIC, (1, 32), torch.int8)
    else:
        scale = qp_lib._choose_scale_float8(x, (1, 32), target)
        finite_scale = qp_lib._choose_scale_float8(finite, (1, 32), target)
    assert torch.isinf(scale[1]).all() and torch.isnan(scale[2]).all()
    qp = _qparams(spec, x)
    assert torch.equal(qp.scale.reshape(finite_scale.shape), finite_scale)
    out = qstats.fake_quantize(x, qp, spec)
    assert torch.isfinite(out[torch.isfinite(x)]).all() and torch.isnan(out[2, 5])


@pytest.mark.parametrize(
    "input_dtype, quant_min, quant_max, sign, torchao_zero_point",
    [(torch.float16, -30477, 23322, 1.0, -30480), (torch.bfloat16, -4878, 14176, -1.0, 14208)],
    ids=("fp16", "bf16"),
)
def test_zero_point_of_a_bound_the_input_dtype_does_not_hold(input_dtype, quant_min, quant_max, sign,
                                                             torchao_zero_point):
    """A one-sided tensor puts the asymmetric zero point at a bound: torchao clamps to the bound rounded
    to the input's dtype (outside the range), qstats to the bound itself."""
    x = (sign * 1000 * (torch.rand(1, 32, generator=torch.Generator().manual_seed(1)) + 0.5)).to(input_dtype)
    kwargs = dict(quant_min=quant_min, quant_max=quant_max, scale_dtype=torch.float32)
    scale, zero_point = qp_lib.choose_qparams_affine(x, MappingType.ASYMMETRIC, (1, 32), torch.int16, **kwargs)
    assert int(zero_point) == torchao_zero_point and not quant_min <= torchao_zero_point <= quant_max
    spec = qstats.QuantSpec.from_torchao(torch.int16, mapping_type=MappingType.ASYMMETRIC, input_dtype=input_dtype,
                                         granularity=G.PerTensor(), **kwargs)
    qp = _qparams(spec, x)
    assert torch.equal(qp.scale.reshape(scale.shape), scale)
    assert int(qp.zero_point) == (quant_min if sign > 0 else quant_max)


def test_float64_row_scales_round_the_amax_to_float32_first():
    """Float8Tensor.from_hp divides a float64 amax by 448 and rounds once; qstats' float32 extremes
    round the amax first: at most one float32 ulp apart, in about a quarter of the rows."""
    from torchao.quantization.quantize_.workflows.float8.float8_tensor import Float8Tensor

    g = torch.Generator().manual_seed(2)
    x = torch.randn(4000, 16, generator=g, dtype=torch.float64)
    reference = Float8Tensor.from_hp(x, float8_dtype=torch.float8_e4m3fn, granularity=G.PerRow())
    spec = qstats.QuantSpec.from_torchao(torch.float8_e4m3fn, granularity=G.PerRow())
    qp = _qparams(spec, x)
    ulps = (qp.scale.view(torch.int32) - reference.scale.reshape(qp.scale.shape).view(torch.int32)).abs()
    assert ulps.max() == 1 and 0.2 < (ulps > 0).float().mean() < 0.33
    assert torch.equal(qp.scale, x.abs().amax(-1).float() / 448.0)
    same = (ulps == 0).flatten()
    out = qstats.fake_quantize(x, qp, spec)
    assert out.dtype == torch.float64 and torch.equal(out[same], reference.dequantize()[same])
