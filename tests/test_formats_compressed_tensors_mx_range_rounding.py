"""MX scales under compressed-tensors' convention for bf16/fp16 weights take the range in the weight's
dtype, as its ``calculate_qparams`` does (llm-compressor's observers hold the range in that dtype).

A range that is no value of the dtype (a range rule's estimate, a pinned ``float_range`` end) was
rounded to the e8m0 scale straight from float32: ``generate_mx_scales`` rounds the amax to one
mantissa bit, so an amax just below ``1.75 * 2**k`` that the dtype rounds to ``1.75 * 2**k`` (bf16:
1.7499) got half compressed-tensors' scale; in float16, an amax just below ``0.75 * 2**-14`` got the
scale 1 where compressed-tensors' is ``2**-14``-based. Int, fp8 and NVFP4 ranges were already rounded.
"""

import warnings

import pytest
import torch

import qstats

warnings.filterwarnings("ignore")
pytest.importorskip("compressed_tensors")
from compressed_tensors.quantization import quant_scheme  # noqa: E402
from compressed_tensors.quantization.lifecycle.forward import fake_quantize as ct_fake_quantize  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402

DTYPES = (torch.bfloat16, torch.float16)


def _args(scheme):
    return getattr(quant_scheme, scheme)["weights"].model_copy(deep=True)


def _float32_ranges(dtype):
    """float32 ends of (64, 8) ranges: random ones (most are no bf16/fp16 value) and ends just below
    the one-mantissa-bit rounding boundaries, which the dtype rounds onto them."""
    g = torch.Generator().manual_seed(0)
    exponents = torch.randint(-12, 10, (64, 8), generator=g).float()
    amax = (1 + torch.rand(64, 8, generator=g)) * 2.0**exponents
    below = torch.tensor(1.75 * (1 - 2.0**-12)) * 2.0 ** torch.arange(-12, 4).float()  # 1.7499... * 2**k
    amax[0, :] = below[:8]
    amax[1, :] = below[8:]
    if dtype == torch.float16:  # a subnormal amax just below 0.75 * 2**-14 (carried to 2**-14 there)
        amax[2, :4] = 0.75 * 2.0**-14 * (1 - 2.0**-12)
    assert not torch.equal(amax.to(dtype).float(), amax)  # the case: ends that the dtype rounds
    return -amax * torch.rand(64, 8, generator=g) * 1.5, amax


@pytest.mark.parametrize("scheme", ("MXFP4", "MXFP8"))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mx_scales_of_float32_ranges_are_those_of_the_range_in_the_observed_dtype(dtype, scheme):
    args = _args(scheme)
    spec = qstats.QuantSpec.from_compressed_tensors(args, observed_dtype=dtype)
    min_val, max_val = _float32_ranges(dtype)
    qp = qstats.qparams_from_minmax(min_val, max_val, spec)
    scale, _ = calculate_qparams(min_val.to(dtype), max_val.to(dtype), args)
    assert scale.dtype == dtype
    assert torch.equal(qp.scale, scale.float())


@pytest.mark.parametrize("scheme", ("MXFP4", "MXFP8"))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_pinned_float_range_of_a_half_precision_weight_equals_compressed_tensors(dtype, scheme):
    """``float_range`` pins a float32 end (1.7499 rounds to 1.75 in bf16 and fp16): scales and
    fake-quantized weights are compressed-tensors' for that range held in the weight's dtype."""
    args = _args(scheme)
    spec = qstats.QuantSpec.from_compressed_tensors(args, observed_dtype=dtype)
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(8, 64, generator=g).to(dtype)
    lo, hi = -1.0, 1.75 * (1 - 2.0**-12)
    obs = qstats.minmax(spec)
    qp = qstats.compute_qparams(obs.update(obs.init(weight), weight), spec, float_range=(lo, hi))
    shape = (8, 2)
    scale, zero_point = calculate_qparams(torch.full(shape, lo, dtype=dtype), torch.full(shape, hi, dtype=dtype), args)
    assert torch.equal(qp.scale, scale.float())
    reference = ct_fake_quantize(weight, scale, zero_point, args)
    assert torch.equal(qstats.fake_quantize(weight, qp, spec), reference)
