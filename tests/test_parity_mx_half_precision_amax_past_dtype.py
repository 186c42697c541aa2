"""compressed-tensors' MX schemes on float16 weights whose range rule estimates an amax past float16.

compressed-tensors holds MX scales in the observed dtype. A range rule may estimate an amax past that
dtype's largest value (moments' ``mean + k * std`` of a float16 weight holding +-65504, k=4: 262016):
its e8m0 scale, 2**16 for fp4, is Inf in float16, and every value came back 0. The amax saturates at
float16's largest value first, so the scale is compressed-tensors' own scale of a 65504 amax (computed
in float32, where it is finite) and the values are its fake-quantized values of that scale, saturated
at float16's largest value.
"""

import warnings

import pytest
import torch

import qstats

warnings.filterwarnings("ignore")

ct_forward = pytest.importorskip("compressed_tensors.quantization.lifecycle.forward")
from compressed_tensors.quantization import quant_scheme  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402

FP16_MAX = float(torch.finfo(torch.float16).max)


@pytest.mark.parametrize("scheme", ["MXFP4", "MXFP8"])
@pytest.mark.parametrize("k", [4.0, 8.0])
def test_moments_amax_past_float16(scheme, k):
    args = getattr(quant_scheme, scheme)["weights"].model_copy(deep=True)
    spec = qstats.QuantSpec.from_compressed_tensors(args, observed_dtype=torch.float16)
    weight = torch.full((2, 32), FP16_MAX)
    weight[:, ::2] = -FP16_MAX
    weight[1] *= 0.5
    weight = weight.half()
    obs = qstats.moments(spec)
    qp = qstats.compute_qparams(obs.update(obs.init(weight), weight), spec, method="mean_std", k=k)
    # the rule's estimate lies past float16 (the case this test is for)
    estimate = qstats.compute_qparams(obs.update(obs.init(weight.float()), weight.float()),
                                      qstats.QuantSpec.from_compressed_tensors(args), method="mean_std", k=k)
    assert (-estimate.minval > FP16_MAX).all()  # minval: -amax of a symmetric range
    amax = torch.full((2, 1), FP16_MAX)  # both rows' estimates (4 * 65504, 4 * 32752 and more) saturate
    scale, zero_point = calculate_qparams(-amax, amax, args)  # float32: finite
    assert torch.equal(qp.scale, scale.reshape(qp.scale.shape))
    ours = qstats.fake_quantize(weight, qp, spec)
    theirs = ct_forward.fake_quantize(weight.float(), scale, zero_point, args).clamp(-FP16_MAX, FP16_MAX).half()
    assert torch.isfinite(ours).all() and (ours != 0).all()
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("rounding", ["rceil", "ceil", "floor"])
def test_power_of_two_scales_rounded_past_float16_are_its_largest(rounding):
    """int2 (element maximum 1) under e8m0 scales held in float16: an amax of 65504 rounds up to
    2**16 under rceil/ceil, past float16 (Inf there, every value 0 or NaN): the scale is float16's
    largest power of two, 2**15, and every value stays finite."""
    spec = qstats.QuantSpec(dtype="int2", scale_dtype="e8m0", scale_rounding=rounding, granularity=qstats.PerToken(),
                            convention="compressed_tensors", compute_dtype="float16")
    x = torch.tensor([[FP16_MAX, -1.0, 2.0, 0.5], [1e5, 3.0, -2.0, 1.0]])
    obs = qstats.minmax(spec)
    qp = qstats.compute_qparams(obs.update(obs.init(x), x), spec)
    exponent = torch.log2(torch.tensor(FP16_MAX))
    exponent = torch.ceil(exponent) if rounding != "floor" else torch.floor(exponent)
    expected = torch.exp2(exponent).clamp(max=2.0**15)  # OCP: 2**(round(log2 amax) - log2 1), held in float16
    assert torch.equal(qp.scale, expected.expand(2))
    for values in (qstats.fake_quantize(x, qp, spec), qstats.fake_quantize(x.half(), qp, spec)):
        assert torch.isfinite(values).all() and (values[:, 0] != 0).all()
