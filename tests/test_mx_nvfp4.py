"""MX, NVFP4 and FP8 block/token formats, bit for bit against torchao and compressed-tensors.

torchao: ``to_mx`` / ``to_dtype`` (every element dtype x every ScaleCalculationMode),
``nvfp4_quantize`` / ``NVFP4Tensor`` with ``per_tensor_amax_to_scale`` (two levels) and without
(block scales only). compressed-tensors: ``calculate_qparams`` + ``generate_gparam`` +
``fake_quantize`` for NVFP4 (TENSOR_GROUP), MXFP4/MXFP8 and FP8 block / group / token / channel
args, through ``QuantSpec.from_compressed_tensors``.
"""

import warnings

import pytest
import torch

import qstats

warnings.filterwarnings("ignore")

torchao_mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
from torchao.prototype.mx_formats.config import ScaleCalculationMode  # noqa: E402
from torchao.prototype.mx_formats.kernels import unpack_uint4  # noqa: E402
from torchao.prototype.mx_formats.nvfp4_tensor import (  # noqa: E402
    NVFP4Tensor,
    nvfp4_quantize,
    per_tensor_amax_to_scale,
)
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402
from compressed_tensors.quantization.lifecycle.forward import fake_quantize as ct_fake_quantize  # noqa: E402
from compressed_tensors.quantization.quant_scheme import MXFP4, MXFP8, NVFP4  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam  # noqa: E402


def _tensors():
    """Random and edge-case tensors of shape (4, 64): zeros, tiny, huge, a single outlier."""
    g = torch.Generator().manual_seed(0)
    random = torch.randn(4, 64, generator=g) * 2
    mixed = random.clone()
    mixed[0, :32] = 0.0  # an all-zero block
    mixed[1, :16] = 1e-6 * mixed[1, :16]  # a tiny block
    outlier = random.clone()
    outlier[2, 7] = 3e4
    return {
        "random": random,
        "mixed": mixed,
        "zeros": torch.zeros(4, 64),
        "tiny": random * 1e-30,
        "huge": random * 1e30,
        "outlier": outlier,
        "subnormal_block": torch.cat([random[:2], random[2:] * 1e-39]),
    }


TENSORS = _tensors()
MX_ELEMENTS = (torch.float8_e4m3fn, torch.float8_e5m2, "fp6_e2m3", "fp6_e3m2", torch.float4_e2m1fn_x2)
MODES = (ScaleCalculationMode.FLOOR, ScaleCalculationMode.CEIL, ScaleCalculationMode.EVEN, ScaleCalculationMode.RCEIL)


def _observe(spec, x):
    obs = qstats.minmax(spec)
    return qstats.compute_qparams(obs.update(obs.init(x), x), spec)


def _bits(t):
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("elem", MX_ELEMENTS, ids=str)
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_mx_matches_torchao_to_mx(elem, mode):
    spec = qstats.QuantSpec.from_torchao(elem_dtype=elem, block_size=32, scaling_mode=mode)
    for name, x in TENSORS.items():
        scale_e8m0, data_lp = torchao_mx.to_mx(x, elem, 32, mode)
        reference = torchao_mx.to_dtype(data_lp, scale_e8m0, elem, 32, torch.float32)
        qp = _observe(spec, x)
        expected_scale = torch.pow(2.0, scale_e8m0.view(torch.uint8).to(torch.float32) - 127)
        assert torch.equal(qp.scale, expected_scale), name
        codes = qstats.quantize(x, qp, spec)
        if elem == torch.float4_e2m1fn_x2:
            data_lp = unpack_uint4(data_lp).reshape(x.shape)
        assert torch.equal(codes.view(torch.uint8), data_lp.view(torch.uint8)), name
        assert torch.equal(_bits(qstats.dequantize(codes, qp, spec)), _bits(reference)), name
        assert torch.equal(_bits(qstats.fake_quantize(x, qp, spec)), _bits(reference)), name


def test_mx_from_torchao_kwargs_object():
    from torchao.prototype.mx_formats.mx_tensor import QuantizeTensorToMXKwargs

    config = QuantizeTensorToMXKwargs(elem_dtype="fp6_e3m2", block_size=32, scaling_mode=ScaleCalculationMode.RCEIL)
    spec = qstats.QuantSpec.from_torchao(config)
    assert (spec.dtype, spec.granularity, spec.scale_dtype, spec.scale_rounding) == (
        "fp6_e3m2",
        qstats.PerGroup(32),
        "e8m0",
        "rceil",
    )


NVFP4_CASES = [name for name in TENSORS if name not in ("zeros", "subnormal_block")]


@pytest.mark.parametrize("name", NVFP4_CASES)
def test_nvfp4_two_level_matches_torchao(name):
    x = TENSORS[name]
    spec = qstats.QuantSpec.from_torchao(nvfp4=True)
    qp = _observe(spec, x)
    per_tensor_scale = per_tensor_amax_to_scale(torch.amax(torch.abs(x)))
    block_scales, packed = nvfp4_quantize(x, 16, per_tensor_scale)
    assert torch.equal(qp.global_scale, per_tensor_scale)
    assert torch.equal(qp.scale, block_scales.float())
    codes = qstats.quantize(x, qp, spec)
    assert torch.equal(codes, unpack_uint4(packed).reshape(x.shape))
    reference = NVFP4Tensor.to_nvfp4(x, per_tensor_scale=per_tensor_scale).dequantize(torch.float32)
    assert torch.equal(_bits(qstats.dequantize(codes, qp, spec)), _bits(reference))
    assert torch.equal(_bits(qstats.fake_quantize(x, qp, spec)), _bits(reference))


@pytest.mark.parametrize("name", list(TENSORS))
def test_nvfp4_block_scales_only_matches_torchao(name):
    x = TENSORS[name]
    spec = qstats.QuantSpec.from_torchao(nvfp4=True, per_tensor_scale=False)
    qp = _observe(spec, x)
    block_scales, packed = nvfp4_quantize(x, 16, None)
    assert torch.equal(qp.scale, block_scales.float())
    codes = qstats.quantize(x, qp, spec)
    assert torch.equal(codes, unpack_uint4(packed).reshape(x.shape))
    reference = NVFP4Tensor.to_nvfp4(x).dequantize(torch.float32)
    assert torch.equal(_bits(qstats.fake_quantize(x, qp, spec)), _bits(reference))


def test_nvfp4_all_zero_tensor_is_finite_where_torchao_is_nan():
    x = TENSORS["zeros"]
    spec = qstats.QuantSpec.from_torchao(nvfp4=True)
    qp = _observe(spec, x)
    block_scales, _ = nvfp4_quantize(x, 16, per_tensor_amax_to_scale(torch.zeros(())))
    assert torch.isnan(block_scales.float()).all()  # torchao divides 0 by 0: the documented deviation
    assert torch.equal(qp.global_scale, torch.tensor(1.0))
    assert (qp.scale > 0).all() and torch.isfinite(qp.scale).all()
    assert torch.equal(qstats.fake_quantize(x, qp, spec), x)


def test_nvfp4_tiny_tensor_keeps_its_zeros_where_torchao_loses_them():
    """amax below 2688 x 2^-126: torchao's global scale is subnormal and 1 / it overflows, so its
    zeros come back nonzero (and qstats' came back NaN before its floor); qstats floors the global
    scale at the smallest normal float32."""
    x = torch.tensor([[1e-37, 0.0] * 8, [-3e-38, 2e-37] * 8])
    spec = qstats.QuantSpec.from_torchao(nvfp4=True)
    qp = _observe(spec, x)
    torchao_scale = per_tensor_amax_to_scale(torch.amax(torch.abs(x)))
    assert 0 < torchao_scale < torch.finfo(torch.float32).tiny and torch.isinf(1 / torchao_scale)
    theirs = NVFP4Tensor.to_nvfp4(x, per_tensor_scale=torchao_scale).dequantize(torch.float32)
    assert (theirs[x == 0] != 0).all()
    assert qp.global_scale == torch.finfo(torch.float32).tiny
    fake = qstats.fake_quantize(x, qp, spec)
    assert torch.isfinite(fake).all() and torch.equal(fake == 0, x == 0)
    torch.testing.assert_close(fake, x, rtol=0.35, atol=0)  # within fp4's step (and the fp8 block scale's)
    assert torch.equal(qstats.dequantize(qstats.quantize(x, qp, spec), qp, spec), fake)


def _ct_group_minmax(x, group_size):
    view = x.reshape(x.shape[0], -1, group_size)
    return view.amin(-1), view.amax(-1)


@pytest.mark.parametrize("scheme", ("NVFP4", "MXFP4", "MXFP8"))
@pytest.mark.parametrize("name", list(TENSORS))
def test_compressed_tensors_low_bit_schemes(scheme, name):
    x = TENSORS[name]
    args = {"NVFP4": NVFP4, "MXFP4": MXFP4, "MXFP8": MXFP8}[scheme]["weights"].model_copy(deep=True)
    spec = qstats.QuantSpec.from_compressed_tensors(args)
    qp = _observe(spec, x)
    min_vals, max_vals = _ct_group_minmax(x, args.group_size)
    global_scale = generate_gparam(x.amin(), x.amax()) if scheme == "NVFP4" else None
    scale, zero_point = calculate_qparams(min_vals, max_vals, args, global_scale=global_scale)
    assert torch.equal(qp.scale, scale)
    if global_scale is not None:
        assert torch.equal(qp.global_scale.reshape(1), global_scale)
    reference = ct_fake_quantize(x, scale, zero_point, args, global_scale=global_scale)
    assert torch.equal(_bits(qstats.fake_quantize(x, qp, spec)), _bits(reference))


def _ct_args(**fields):
    return QuantizationArgs(num_bits=8, type="float", symmetric=True, **fields)


@pytest.mark.parametrize("name", list(TENSORS))
def test_compressed_tensors_fp8_block_group_token_channel(name):
    x = TENSORS[name].reshape(8, 32)
    cases = {
        "block": (_ct_args(strategy="block", block_structure=[4, 16]), lambda t: _block_minmax(t, 4, 16)),
        "group": (_ct_args(strategy="group", group_size=16), lambda t: _ct_group_minmax(t, 16)),
        "token": (_ct_args(strategy="token", dynamic=True), lambda t: (t.amin(-1), t.amax(-1))),
        "channel": (_ct_args(strategy="channel"), lambda t: (t.amin(-1), t.amax(-1))),
    }
    for kind, (args, minmax_fn) in cases.items():
        spec = qstats.QuantSpec.from_compressed_tensors(args)
        qp = _observe(spec, x)
        scale, zero_point = calculate_qparams(*minmax_fn(x), args)
        assert torch.equal(qp.scale.reshape(scale.shape), scale), kind
        if kind in ("token", "channel"):  # compressed-tensors keeps a trailing unit dimension
            scale, zero_point = scale.unsqueeze(-1), zero_point.unsqueeze(-1)
        reference = ct_fake_quantize(x, scale, zero_point, args)
        assert torch.equal(_bits(qstats.fake_quantize(x, qp, spec)), _bits(reference)), kind


def _block_minmax(x, rows, cols):
    blocks = x.reshape(x.shape[0] // rows, rows, x.shape[1] // cols, cols).transpose(1, 2)
    return blocks.amin((-2, -1)), blocks.amax((-2, -1))


def test_fp8_block_that_does_not_divide_takes_partial_edge_blocks_as_compressed_tensors():
    """compressed-tensors pads a weight to whole blocks (its ``_process_block``); its block specs take
    the edge blocks' own values (``PerBlock(partial=True)``), scales ``ceil(200 / 128) x 2``."""
    args = _ct_args(strategy="block", block_structure=[128, 128])
    spec = qstats.QuantSpec.from_compressed_tensors(args)
    x = torch.randn(200, 256, generator=torch.Generator().manual_seed(2))
    qp = _observe(spec, x)
    amax = torch.stack([torch.stack([x[r:r + 128, c:c + 128].abs().amax() for c in (0, 128)]) for r in (0, 128)])
    assert torch.equal(qp.scale, amax / 448.0)
    reference = ct_fake_quantize(x, qp.scale, torch.zeros_like(qp.scale), args)
    assert torch.equal(_bits(qstats.fake_quantize(x, qp, spec)), _bits(reference))


def test_deepseek_fp8_presets_against_per_block_amax():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(256, 384, generator=g)
    spec = qstats.preset("fp8_block")
    qp = _observe(spec, w)
    expected = w.reshape(2, 128, 3, 128).abs().amax((1, 3)) / 448.0
    assert torch.equal(qp.scale, torch.clamp(expected, min=spec.eps))
    act = torch.randn(3, 5, 256, generator=g)
    qp = _observe(qstats.preset("fp8_group"), act)
    assert torch.equal(qp.scale, act.reshape(3, 5, 2, 128).abs().amax(-1) / 448.0)


def test_per_head_fp8_attention_state_against_per_head_amax():
    g = torch.Generator().manual_seed(5)
    k = torch.randn(2, 4, 6, 8, generator=g) * torch.tensor([1.0, 10.0, 0.1, 3.0]).view(1, 4, 1, 1)
    spec = qstats.QuantSpec(dtype="fp8_e4m3fn", granularity=qstats.PerHead(1), zero_point_domain="none")
    qp = _observe(spec, k)
    expected = k.abs().amax((0, 2, 3)) / 448.0
    assert torch.equal(qp.scale, expected)
    out = qstats.fake_quantize(k, qp, spec)
    scale = expected.view(1, 4, 1, 1)
    assert torch.equal(out, (k / scale).to(torch.float8_e4m3fn).float() * scale)


@pytest.mark.parametrize("elem", MX_ELEMENTS, ids=str)
def test_bf16_inputs_match_torchao(elem):
    x = TENSORS["outlier"].bfloat16()
    for mode in (ScaleCalculationMode.EVEN, ScaleCalculationMode.RCEIL):
        spec = qstats.QuantSpec.from_torchao(elem_dtype=elem, block_size=32, scaling_mode=mode)
        scale_e8m0, data_lp = torchao_mx.to_mx(x, elem, 32, mode)
        reference = torchao_mx.to_dtype(data_lp, scale_e8m0, elem, 32, torch.bfloat16)
        out = qstats.fake_quantize(x, _observe(spec, x), spec)
        assert out.dtype == torch.bfloat16 and torch.equal(out, reference)
    spec = qstats.QuantSpec.from_torchao(nvfp4=True)
    per_tensor_scale = per_tensor_amax_to_scale(torch.amax(torch.abs(x)))
    reference = NVFP4Tensor.to_nvfp4(x, per_tensor_scale=per_tensor_scale).dequantize(torch.bfloat16)
    assert torch.equal(qstats.fake_quantize(x, _observe(spec, x), spec), reference)


def test_two_level_scales_need_a_float_element_format():
    """Integer codes ignored the global scale (every code 0 under fp8 block scales): refused."""
    with pytest.raises(ValueError, match="TensorGroup.*float element format"):
        qstats.QuantSpec(dtype="int8", granularity=qstats.TensorGroup(16), scale_dtype="float8_e4m3fn",
                         zero_point_domain="none")
    with pytest.raises(ValueError, match="TensorGroup"):
        qstats.QuantSpec(dtype="int4", granularity=qstats.TensorGroup(16))


def test_nvfp4_tiny_tensor_small_blocks_match_float64_where_torchao_overflows():
    """A tiny tensor's global scale (floored at the smallest normal float32) under a block scale
    floored at e4m3's minimum 2**-6: torchao's reciprocal ``(1 / global) / scale`` overflows to Inf
    (zeros became NaN, every small value fp4's maximum). Block scales equal torchao's, codes equal
    torchao's fp4 rounding of the float64 quotient ``x / (global * scale)``."""
    from torchao.prototype.mx_formats.kernels import f32_to_f4_unpacked

    x = torch.tensor([[1e-37, -4e-38] * 8 + [1e-40, -3e-40, 0.0, 2e-40] * 4])
    spec = qstats.QuantSpec.from_torchao(nvfp4=True)
    qp = _observe(spec, x)
    tiny = torch.tensor(torch.finfo(torch.float32).tiny)
    assert torch.equal(qp.global_scale, tiny)
    block_scales, _ = nvfp4_quantize(x, 16, tiny)
    assert torch.equal(qp.scale, block_scales.float())
    assert torch.isinf((1.0 / tiny) / qp.scale[0, 1])  # torchao's reciprocal for the small block
    step = (qp.global_scale.double() * qp.scale.double()).repeat_interleave(16, dim=-1)
    expected_codes = f32_to_f4_unpacked((x.double() / step).float().clamp(-6.0, 6.0))
    codes = qstats.quantize(x, qp, spec)
    assert torch.equal(codes, expected_codes)
    fake = qstats.fake_quantize(x, qp, spec)
    assert torch.isfinite(fake).all() and torch.equal(fake == 0, x == 0)
    assert torch.equal(fake, qstats.dequantize(codes, qp, spec))


def test_nvfp4_reciprocal_overflow_without_the_global_floor():
    """amax 1e-34 (global 3.7e-38, above the floor) with an all-zero block: ``(1 / global) / 2**-6``
    overflows; the zeros stay zeros and the other block equals torchao."""
    x = torch.cat([torch.linspace(-1e-34, 1e-34, 16), torch.zeros(16)]).reshape(1, 32)
    spec = qstats.QuantSpec.from_torchao(nvfp4=True)
    qp = _observe(spec, x)
    per_tensor_scale = per_tensor_amax_to_scale(torch.amax(torch.abs(x)))
    assert torch.equal(qp.global_scale, per_tensor_scale)
    block_scales, packed = nvfp4_quantize(x, 16, per_tensor_scale)
    assert torch.equal(qp.scale, block_scales.float())
    reference = NVFP4Tensor.to_nvfp4(x, per_tensor_scale=per_tensor_scale).dequantize(torch.float32)
    assert (reference[0, 16:] != 0).all()  # torchao: 0 * Inf, a NaN that fp4 encodes as -6
    fake = qstats.fake_quantize(x, qp, spec)
    assert torch.equal(_bits(fake[0, :16]), _bits(reference[0, :16]))
    assert torch.equal(fake[0, 16:], x[0, 16:])
    codes = qstats.quantize(x, qp, spec)
    assert torch.equal(codes[0, :16], unpack_uint4(packed).reshape(x.shape)[0, :16])
    assert torch.equal(codes[0, 16:], torch.zeros(16, dtype=torch.uint8))


@pytest.mark.parametrize("elem", (torch.float8_e4m3fn, torch.float4_e2m1fn_x2), ids=str)
def test_mx_nonfinite_values_stay_out_of_the_block_scale(elem):
    """One Inf in a block: torchao's block scale comes from the Inf (every other value flushes to
    0; a NaN makes the block NaN). qstats' observers leave NaN/Inf out (docs/observers.md): the
    block scale and the other codes equal torchao's on the block with the Inf replaced by 0, and
    the Inf saturates to the element maximum."""
    g = torch.Generator().manual_seed(6)
    finite = torch.randn(2, 64, generator=g)
    x = finite.clone()
    x[1, 40] = float("inf")
    finite[1, 40] = 0.0
    spec = qstats.QuantSpec.from_torchao(elem_dtype=elem, block_size=32, scaling_mode=ScaleCalculationMode.FLOOR)
    qp = _observe(spec, x)
    scale_e8m0, data = torchao_mx.to_mx(finite, elem, 32, ScaleCalculationMode.FLOOR)
    assert torch.equal(qp.scale, torch.pow(2.0, scale_e8m0.view(torch.uint8).float() - 127))
    reference = torchao_mx.to_dtype(data, scale_e8m0, elem, 32, torch.float32)
    fake = qstats.fake_quantize(x, qp, spec)
    inf = torch.isinf(x)
    assert torch.equal(fake[~inf], reference[~inf])
    assert fake[inf] == spec.float_format.max * qp.scale[1, 1]


@pytest.mark.parametrize("preset", ("mxfp8", "nvfp4"))
def test_block_maxima_past_half_the_float32_range_match_torchao(preset):
    x = torch.full((1, 32), 2e38)
    spec = qstats.preset(preset)
    qp = _observe(spec, x)
    if preset == "mxfp8":
        scale_e8m0, data = torchao_mx.to_mx(x, torch.float8_e4m3fn, 32, ScaleCalculationMode.FLOOR)
        assert torch.equal(qp.scale, torch.pow(2.0, scale_e8m0.view(torch.uint8).float() - 127))
        reference = torchao_mx.to_dtype(data, scale_e8m0, torch.float8_e4m3fn, 32, torch.float32)
    else:
        per_tensor_scale = per_tensor_amax_to_scale(torch.amax(torch.abs(x)))
        assert torch.equal(qp.global_scale, per_tensor_scale)
        reference = NVFP4Tensor.to_nvfp4(x, per_tensor_scale=per_tensor_scale).dequantize(torch.float32)
    assert torch.equal(qstats.fake_quantize(x, qp, spec), reference)
