"""MX (MXFP4/MXFP8) fake quantization of inputs whose dtype differs from the observed one,
bit for bit against compressed-tensors 0.19.

compressed-tensors divides the input by its scale held in the observed dtype with torch's type
promotion (``x / scale``): a float32 input by a bf16 scale in float32, an fp16 one by a bf16 scale
in float32, a bf16 one in bf16. The scales are compressed-tensors' own (``calculate_qparams`` on
the observed weight's group extremes: its e8m0 exponents, converted back to the observed dtype),
which qstats' must equal; the codes (`qstats.quantize`) are compared with its ``quantize``.
"""

import warnings

import pytest
import torch

import qstats

warnings.filterwarnings("ignore")

ct_forward = pytest.importorskip("compressed_tensors.quantization.lifecycle.forward")
from compressed_tensors.quantization import quant_scheme  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# e2m1 by its bit code (sign bit 8), independent of qstats' decoder
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _weights():
    """(64, 64): normal values over several octaves per row, and the reported row (one value
    just past the midpoint between fp4's 1 and 1.5 under scale 2**-6, which bf16 rounds onto it)."""
    g = torch.Generator().manual_seed(12)
    x = torch.randn(64, 64, generator=g) * torch.exp2(torch.randint(-6, 6, (64, 1), generator=g).float())
    x[0, :32] = torch.tensor([0.019587719812989235] + [0.09375] * 31)
    return x


def _ours_qparams(spec, observed):
    obs = qstats.minmax(spec)
    return qstats.compute_qparams(obs.update(obs.init(observed), observed), spec)


def _theirs_qparams(args, observed):
    groups = observed.reshape(observed.shape[0], -1, args.group_size)
    return calculate_qparams(groups.amin(-1), groups.amax(-1), args)


def _bits(t):
    return t.float().view(torch.int32)


def _decoded(codes, scheme):
    if scheme == "MXFP8":
        return codes.float()
    magnitude = E2M1[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -magnitude, magnitude)


@pytest.mark.parametrize("scheme", ("MXFP4", "MXFP8"))
@pytest.mark.parametrize("observed_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("input_dtype", DTYPES, ids=str)
def test_mx_input_dtype_promotes_with_the_observed_dtype(scheme, observed_dtype, input_dtype):
    args = getattr(quant_scheme, scheme)["weights"].model_copy(deep=True)
    spec = qstats.QuantSpec.from_compressed_tensors(args, observed_dtype=observed_dtype)
    weight = _weights()
    x, observed = weight.to(input_dtype), weight.to(observed_dtype)
    qp = _ours_qparams(spec, observed)
    scale, zero_point = _theirs_qparams(args, observed)
    assert scale.dtype == observed_dtype
    assert torch.equal(qp.scale, scale.float())  # the e8m0 path, in the observed dtype

    theirs = ct_forward.fake_quantize(x, scale, zero_point, args)
    ours = qstats.fake_quantize(x, qp, spec)
    assert ours.dtype == input_dtype
    assert torch.equal(_bits(ours), _bits(theirs))

    their_codes = ct_forward.quantize(x, scale, zero_point, args)
    assert torch.equal(_bits(_decoded(qstats.quantize(x, qp, spec), scheme)), _bits(their_codes))


@pytest.mark.parametrize("observed_dtype", (torch.bfloat16, torch.float16), ids=str)
def test_reported_float32_input_under_a_half_precision_mxfp4_spec(observed_dtype):
    """0.019587719812989235 / 2**-6 = 1.2536 in float32 rounds to fp4's 1.5 (0.0234375); in bf16
    it is 1.25 and ties to 1 (0.015625), which qstats gave."""
    args = quant_scheme.MXFP4["weights"].model_copy(deep=True)
    spec = qstats.QuantSpec.from_compressed_tensors(args, observed_dtype=observed_dtype)
    x = torch.tensor([[0.019587719812989235] + [0.09375] * 31])
    qp = _ours_qparams(spec, x.to(observed_dtype))
    scale, zero_point = _theirs_qparams(args, x.to(observed_dtype))
    assert scale.item() == 2.0**-6
    theirs = ct_forward.fake_quantize(x, scale, zero_point, args)
    assert theirs[0, 0].item() == 0.0234375
    assert torch.equal(qstats.fake_quantize(x, qp, spec), theirs)
