"""Edge values of the low-precision formats (fp8, fp4, MX, NVFP4) against compressed-tensors.

compressed-tensors' ``fake_quantize`` / ``quantize`` add the zero point (zeros, also for symmetric
args) to ``x / scale`` before rounding, so that -0.0 comes back +0 (and gets fp4 code 0 from its
``pack_fp4_to_uint8``), while a tiny negative value still rounds to -0.
"""

import warnings

import pytest
import torch

import qstats

warnings.filterwarnings("ignore")

ct_forward = pytest.importorskip("compressed_tensors.quantization.lifecycle.forward")
from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402
from compressed_tensors.quantization.quant_scheme import MXFP4, MXFP8, NVFP4  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam  # noqa: E402

from qstats.export.packing import pack_fp4  # noqa: E402

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _observe(spec, x):
    obs = qstats.minmax(spec)
    return qstats.compute_qparams(obs.update(obs.init(x), x), spec)


def _bits(t):
    t = t.contiguous()
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def _args(scheme):
    if scheme == "FP4_GROUP":  # fp4 elements under unrounded group scales
        return QuantizationArgs(num_bits=4, type="float", symmetric=True, strategy="group", group_size=16)
    return {"NVFP4": NVFP4, "MXFP4": MXFP4, "MXFP8": MXFP8}[scheme]["weights"].model_copy(deep=True)


def _compressed_tensors_qparams(x, args, two_level):
    groups = x.reshape(x.shape[0], -1, args.group_size)
    global_scale = generate_gparam(x.amin(), x.amax()) if two_level else None
    scale, zero_point = calculate_qparams(groups.amin(-1), groups.amax(-1), args, global_scale=global_scale)
    return scale, zero_point, global_scale


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scheme", ("NVFP4", "MXFP4", "MXFP8", "FP4_GROUP"))
def test_negative_zero_comes_back_positive_as_compressed_tensors(scheme, dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4, 64, generator=g) * 3).to(dtype)
    x[0, :5] = -0.0  # -0.0 in a nonzero block
    x[1, :] = -0.0  # blocks of -0.0 only
    x[2, 7] = -1e-4  # a tiny negative value: -0 in both
    args = _args(scheme)
    spec = qstats.QuantSpec.from_compressed_tensors(args, observed_dtype=dtype)
    qp = _observe(spec, x)
    scale, zero_point, global_scale = _compressed_tensors_qparams(x, args, scheme == "NVFP4")
    assert torch.equal(qp.scale, scale.float())

    reference = ct_forward.fake_quantize(x, scale, zero_point, args, global_scale=global_scale)
    ours = qstats.fake_quantize(x, qp, spec)
    assert not torch.signbit(reference[0, :5]).any() and torch.signbit(reference[2, 7])
    assert torch.equal(_bits(ours), _bits(reference))

    codes = qstats.quantize(x, qp, spec)
    assert torch.equal(_bits(qstats.dequantize(codes, qp, spec, dtype=dtype)), _bits(ours))
    theirs = ct_forward.quantize(x, scale, zero_point, args, global_scale=global_scale)
    if codes.dtype == torch.uint8:  # fp4: the packed bytes of compressed-tensors' compressor
        assert torch.equal(pack_fp4(codes), pack_fp4_to_uint8(theirs))
    else:
        assert torch.equal(codes.view(torch.uint8), theirs.to(torch.float8_e4m3fn).view(torch.uint8))


@pytest.mark.parametrize("code_dtype", (torch.int32, torch.int64, torch.int16), ids=str)
@pytest.mark.parametrize("scheme", ("NVFP4", "MXFP4"))
def test_fp4_codes_in_any_integer_dtype_dequantize_as_compressed_tensors(scheme, code_dtype):
    """fp4 bit codes held in a wider integer dtype (unpacked with integer arithmetic) are decoded,
    not taken as values (code 15, -6.0, dequantized to 15 times the scale)."""
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1)) * 3
    args = _args(scheme)
    spec = qstats.QuantSpec.from_compressed_tensors(args)
    qp = _observe(spec, x)
    scale, zero_point, global_scale = _compressed_tensors_qparams(x, args, scheme == "NVFP4")
    reference = ct_forward.fake_quantize(x, scale, zero_point, args, global_scale=global_scale)
    codes = qstats.quantize(x, qp, spec).to(code_dtype)
    assert torch.equal(qstats.dequantize(codes, qp, spec), reference)


def test_integer_codes_of_an_fp8_format_are_refused_naming_the_dtype():
    """MXFP8 codes are float8_e4m3fn; their bytes as uint8 were dequantized as the numbers 0-255."""
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(2))
    args = _args("MXFP8")
    spec = qstats.QuantSpec.from_compressed_tensors(args)
    qp = _observe(spec, x)
    codes = qstats.quantize(x, qp, spec)
    scale, zero_point, _ = _compressed_tensors_qparams(x, args, False)
    assert torch.equal(qstats.dequantize(codes, qp, spec), ct_forward.fake_quantize(x, scale, zero_point, args))
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        qstats.dequantize(codes.view(torch.uint8), qp, spec)
    # per-tensor fp8 under the default convention (not a block format) was read as values too
    spec = qstats.QuantSpec(dtype="fp8_e4m3fn", zero_point_domain="none")
    qp = _observe(spec, x)
    codes = qstats.quantize(x, qp, spec)
    assert torch.equal(qstats.dequantize(codes, qp, spec), codes.float() * qp.scale)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        qstats.dequantize(codes.view(torch.uint8), qp, spec)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("scheme", ("MXFP4", "MXFP8"))
def test_mx_blocks_near_the_float32_limit(scheme, dtype):
    """compressed-tensors rounds a block's amax to one mantissa bit: from 1.75 * 2**127 on it carries
    past float32 (an Inf scale, NaN values); below, qstats' scales and values are its own."""
    amax = torch.tensor([1.5 * 2.0**127, 1.74 * 2.0**127, 1.75 * 2.0**127, torch.finfo(dtype).max]).to(dtype)
    x = torch.zeros(len(amax), 32, dtype=dtype)
    x[:, 0], x[:, 1], x[:, 2] = amax, -amax / 3, 1.0
    args = _args(scheme)
    spec = qstats.QuantSpec.from_compressed_tensors(args, observed_dtype=dtype)
    qp = _observe(spec, x)
    scale, zero_point = calculate_qparams(x.amin(-1, keepdim=True), x.amax(-1, keepdim=True), args)
    reference = ct_forward.fake_quantize(x, scale, zero_point, args)
    below = torch.tensor([True, True, False, False])
    assert torch.isinf(scale[~below]).all() and torch.isnan(reference[~below]).all()
    assert torch.equal(qp.scale[below], scale[below].float())
    ours = qstats.fake_quantize(x, qp, spec)
    assert torch.equal(ours[below], reference[below])
    element_max = spec.float_format.max
    assert torch.isfinite(ours).all() and (qp.scale[~below] * element_max * 2 > torch.finfo(torch.float32).max).all()
