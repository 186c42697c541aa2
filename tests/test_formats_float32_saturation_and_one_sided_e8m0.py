"""Dequantized values past float32 saturate; e8m0 scales need codes on both sides of the zero point.

torchao's ``choose_qparams_affine`` with a bfloat16 ``scale_dtype`` rounds the scale of a one-sided
range near float32's limit up, so its farthest code dequantizes past float32 (int4 code -8 of a row
whose minimum is -3.4025e38: -Inf): qstats' scales, zero points and codes stay torchao's and its values
saturate at float32's largest value there. int1/uint1 have no code on one side of their symmetric zero
point, so a power-of-two scale had no element maximum to aim at (``math domain error`` from inside
qstats, or the largest scale with every value 0): such specs are refused.
"""

import warnings

import pytest
import torch

import qstats

warnings.filterwarnings("ignore")

qp_lib = pytest.importorskip("torchao.quantization.quant_primitives")
from torchao.quantization import granularity as tao_granularity  # noqa: E402

FLOAT32_MAX = torch.finfo(torch.float32).max


@pytest.mark.parametrize("target", [torch.int4, torch.int8, torch.uint8], ids=str)
def test_one_sided_ranges_under_bfloat16_scales_at_the_float32_limit(target):
    x = torch.tensor([[-3.4e38, -1e38, -5.0, -0.0], [3.4e38, 2e38, 1.0, 0.0],
                      [-3.4025e38, -1.0, -2.0, -3.0], [-3.38e38, -1.0, -2.0, -3.0], [0.5, -0.25, 1.0, 2.0]])
    block_size = (1, 4)
    qmin, qmax = qp_lib._get_and_check_qmin_qmax(target, None, None)
    scale, zero_point = qp_lib.choose_qparams_affine(x, qp_lib.MappingType.ASYMMETRIC, block_size, target,
                                                     scale_dtype=torch.bfloat16)
    codes = qp_lib._quantize_affine_no_dtype_cast(x, block_size, scale, zero_point, qmin, qmax)
    theirs = qp_lib._dequantize_affine_no_dtype_check(codes, block_size, scale, zero_point, qmin, qmax, torch.float32)
    spec = qstats.QuantSpec.from_torchao(target, granularity=tao_granularity.PerRow(), mapping_type="ASYMMETRIC",
                                         scale_dtype=torch.bfloat16)
    obs = qstats.minmax(spec)
    qp = qstats.compute_qparams(obs.update(obs.init(x), x), spec)
    assert torch.equal(qp.scale.reshape(scale.shape), scale.float())
    assert torch.equal(qp.zero_point.reshape(zero_point.shape).long(), zero_point.long())
    ours_codes = qstats.quantize(x, qp, spec)
    assert torch.equal(ours_codes.long(), codes.long())
    finite = torch.isfinite(theirs)
    if target == torch.int4:
        assert not finite.all()  # the case this test is for: torchao's code -8 of row 2 is -Inf
    for ours in (qstats.fake_quantize(x, qp, spec), qstats.dequantize(ours_codes, qp, spec)):
        assert torch.isfinite(ours).all()
        assert torch.equal(ours[finite], theirs[finite])
        assert torch.equal(ours[~finite], theirs[~finite].sign() * FLOAT32_MAX)


@pytest.mark.parametrize("rounding", ["floor", "ceil", "even", "rceil", "round_then_floor", "round"])
@pytest.mark.parametrize("dtype", ["int1", "uint1"])
def test_e8m0_scales_of_one_bit_targets_are_refused(dtype, rounding):
    with pytest.raises(ValueError, match="e8m0.*both sides of the symmetric zero point"):
        qstats.QuantSpec(dtype=dtype, scale_dtype="e8m0", scale_rounding=rounding, granularity=qstats.PerGroup(32))


def test_e8m0_scales_of_two_bit_targets_are_the_ocp_floor():
    # int2 codes [-2, 1] around zero point 0: element maximum 1, so the scale is 2**floor(log2(amax))
    x = torch.tensor([[0.3, -0.7, 0.1, 0.0] * 8, [5.0, -3.0, 1.0, 2.0] * 8])
    spec = qstats.QuantSpec(dtype="int2", scale_dtype="e8m0", granularity=qstats.PerGroup(32))
    obs = qstats.minmax(spec)
    qp = qstats.compute_qparams(obs.update(obs.init(x), x), spec)
    expected = torch.exp2(torch.floor(torch.log2(x.abs().amax(-1, keepdim=True))))
    assert torch.equal(qp.scale, expected)


def test_an_infinite_float32_scale_stays_visible_in_dequantized_values():
    """Saturation is for half-precision outputs and scales that round up past float32; a float32 scale
    a caller made Inf gives Inf values, as ``(codes - zero_point) * scale`` does in plain torch."""
    spec = qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0))
    codes = torch.tensor([[-3, 5], [7, -1]], dtype=torch.int8)
    scale = torch.tensor([float("inf"), 0.5])
    qparams = qstats.QParams(scale, torch.zeros(2, dtype=torch.int32), torch.ones(()), torch.ones(2, dtype=torch.bool))
    expected = (codes.float() - 0.0) * scale[:, None]
    assert torch.equal(qstats.dequantize(codes, qparams, spec), expected)
