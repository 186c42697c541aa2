"""Extreme inputs (zeros, one element, constants, denormals, tiny and huge values, fp16/bf16 edges,
NaN/Inf mixed in) through the public observers and formats, table-driven.

Every observer x spec x input dtype gives finite, positive scales and dequantizes every finite input
to a finite value; where a reference library maps the same range (torch.ao, compressed-tensors
0.19, torchao) the qparams and fake-quantized values are its own, bit for bit. Deliberate
differences (docs/differences.md): symmetric integer peaks whose farthest code would dequantize
past float32 (int8: above 3.39e38) and asymmetric spans that overflow float32 are clipped; those
inputs are only checked for finiteness.
"""

import math
import warnings

import pytest
import torch

import qstats

warnings.filterwarnings("ignore")

F32_MAX = torch.finfo(torch.float32).max


def _rows(*rows):
    """A (len(rows), 32) float32 tensor whose row i holds the values rows[i], repeated."""
    return torch.stack([torch.tensor(list(r) * (32 // len(r)), dtype=torch.float32) for r in rows])


def _inputs(dtype):
    fi = torch.finfo(dtype)
    g = torch.Generator().manual_seed(0)
    signs = torch.randn(4, 32, generator=g).sign()
    cases = {
        "zeros": torch.zeros(4, 32),
        "constant": torch.full((4, 32), 3.0),
        "negative_constant": torch.full((4, 32), -3.0),
        "denormal_1e-40": torch.full((4, 32), 1e-40),
        "denormal_1e-45": torch.full((4, 32), 1e-45),
        "dtype_tiny": torch.full((4, 32), fi.tiny),
        "tiny": torch.randn(4, 32, generator=g) * 1e-30,
        "one_sided": torch.rand(4, 32, generator=g) + 1.0,
        "dtype_max": signs * min(fi.max, F32_MAX),
        "dtype_max_positive": torch.full((4, 32), min(fi.max, F32_MAX)),
        "fp16_max": signs * 65504.0,
        "nonfinite_mixed": _rows(*[(float("inf"), float("-inf"), float("nan"), 1.0)] * 4),
    }
    return {name: x.to(dtype) for name, x in cases.items()}


SPECS = {
    "int8_sym_tensor": qstats.QuantSpec(dtype="int8"),
    "uint8_asym_channel": qstats.QuantSpec(dtype="uint8", mapping="asymmetric", granularity=qstats.PerAxis(0)),
    "int4_asym_group_ct": qstats.QuantSpec(dtype="int4", mapping="asymmetric", granularity=qstats.PerGroup(16),
                                           convention="compressed_tensors"),
    "int4_sym_group_torchao": qstats.QuantSpec(dtype="int4", granularity=qstats.PerGroup(16), convention="torchao"),
    "uint8_float_zero_point": qstats.QuantSpec.from_torch_ao(torch.quint8, torch.per_channel_affine_float_qparams),
    "fp8_tensor_ct": qstats.QuantSpec(dtype="fp8_e4m3fn", zero_point_domain="none", convention="compressed_tensors"),
    "fp8_block_torchao": qstats.QuantSpec(dtype="fp8_e4m3fn", zero_point_domain="none",
                                          granularity=qstats.PerBlock((2, 16)), convention="torchao"),
    "mxfp8": qstats.preset("mxfp8"),
    "mxfp4_torchao": qstats.preset("mxfp4", convention="torchao"),
    "nvfp4": qstats.preset("nvfp4"),
    "nvfp4_ct": qstats.preset("nvfp4", convention="compressed_tensors", global_scale_formula="range_over_amax"),
}
OBSERVERS = {
    "minmax": qstats.minmax,
    "moving_average_minmax": qstats.moving_average_minmax,
    "moments": qstats.moments,
    "histogram": lambda spec: qstats.histogram(spec, buckets_per_octave=16),  # coarse: fast l2 searches
    "mse": lambda spec: qstats.mse(spec, grid=20),
}
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def _spec_for(spec, dtype):
    spec = spec.replace(on_uncalibrated="fallback")
    if spec.convention.computes_in_observed_dtype and dtype in (torch.float16, torch.bfloat16):
        spec = spec.replace(compute_dtype=str(dtype).removeprefix("torch."))
    return spec


def _qparams(make, spec, x):
    obs = make(spec)
    state = obs.update(obs.init(x), x)
    return qstats.compute_qparams(obs.update(state, x), spec)


def _check_finite(qp, spec, x, where):
    assert torch.isfinite(qp.scale).all() and (qp.scale > 0).all(), (where, qp.scale)
    assert torch.isfinite(qp.global_scale).all() and (qp.global_scale > 0).all(), (where, qp.global_scale)
    if torch.isfinite(x).all():
        assert qp.calibrated.all(), where
    fq = qstats.fake_quantize(x, qp, spec)
    finite = torch.isfinite(x)
    assert torch.isfinite(fq[finite]).all(), (where, fq[finite].flatten()[:4])
    assert torch.equal(fq[x == 0].float(), torch.zeros_like(fq[x == 0].float())), where


def _table():
    for (spec_name, spec), dtype in ((s, d) for s in SPECS.items() for d in DTYPES):
        for obs_name in OBSERVERS:
            if obs_name == "mse" and isinstance(spec.granularity, qstats.TensorGroup):
                continue  # mse refuses two-level specs (docs/differences.md)
            if obs_name in ("histogram", "mse") and dtype != (torch.float32 if obs_name == "mse" else torch.bfloat16):
                continue  # the slow searches: one dtype each keeps the file fast
            yield pytest.param(spec_name, obs_name, dtype, id=f"{spec_name}-{obs_name}-{str(dtype)[6:]}")


@pytest.mark.parametrize("spec_name, obs_name, dtype", list(_table()))
def test_extreme_inputs_give_finite_positive_scales(spec_name, obs_name, dtype):
    spec = _spec_for(SPECS[spec_name], dtype)
    for name, x in _inputs(dtype).items():
        if not torch.isfinite(x.float()).all() and name != "nonfinite_mixed":
            continue  # fp16 past its range: the input itself holds Inf
        _check_finite(_qparams(OBSERVERS[obs_name], spec, x), spec, x, (name, spec_name, obs_name, dtype))


@pytest.mark.parametrize("obs_name", ["minmax", "moving_average_minmax", "moments", "histogram"])
def test_single_element_and_empty_batches(obs_name):
    """One element calibrates; an empty batch leaves the state uncalibrated and compute_qparams
    says so (on_uncalibrated='raise')."""
    spec = qstats.QuantSpec(dtype="int8", mapping="asymmetric")
    one = torch.tensor([-2.5])
    qp = _qparams(OBSERVERS[obs_name], spec, one)
    _check_finite(qp, spec, one, obs_name)
    obs = OBSERVERS[obs_name](spec)
    empty = torch.empty(0)
    with pytest.raises(ValueError, match="(?i)calibrat|no data|saw no"):
        qstats.compute_qparams(obs.update(obs.init(empty), empty), spec)


# ------------------------------------------------------------------------------------------------
# against torch.ao
WIDE_ONE_SIDED = _rows((-3e38, -3e38), (-3e38, -2e38), (2e38, 3e38), (-1.0, -1.0))
TORCH_AO_INPUTS = {
    "zeros": torch.zeros(4, 32),
    "constant": torch.full((4, 32), -7.0),
    "denormal": _rows((1e-40, -1e-45), (1e-45, 1e-45), (-1e-40, 0.0), (1e-38, 2e-38)),
    "tiny": _rows((1e-30, -2e-30), (3e-30, 3e-30), (-1e-30, 0.0), (1e-20, 1.0)),
    "one_sided_huge": WIDE_ONE_SIDED,
    "fp16_edges": _rows((-65504.0, 65504.0), (65504.0, 1.0), (-65504.0, -1.0), (6e-8, 6e-5)),
}


@pytest.mark.parametrize("x_name", list(TORCH_AO_INPUTS))
@pytest.mark.parametrize("dtype, qscheme", [
    (torch.quint8, torch.per_tensor_affine),
    (torch.qint8, torch.per_tensor_symmetric),
    (torch.quint8, torch.per_channel_affine),
    (torch.qint8, torch.per_channel_symmetric),
    (torch.quint8, torch.per_channel_affine_float_qparams),
])
def test_minmax_matches_torch_ao_on_extreme_ranges(x_name, dtype, qscheme):
    """Scales, zero points and fake-quantized values equal torch.ao's: one-sided ranges past half
    the float32 range included (they were clipped to 1.7e38, and float zero points inverted the
    range into scale 1, so every value of a row of -3e38 came back as -1.7e38), symmetric peaks
    of 3e38 too (clipped to 1.7e38 before)."""
    from torch.ao.quantization import MinMaxObserver, PerChannelMinMaxObserver

    x = TORCH_AO_INPUTS[x_name]
    per_channel = qscheme in (torch.per_channel_affine, torch.per_channel_symmetric,
                              torch.per_channel_affine_float_qparams)
    if x_name == "one_sided_huge" and not per_channel:
        x = x[:1]  # per tensor: one row's sign, as the mixed rows' span overflows
    reference = (PerChannelMinMaxObserver(ch_axis=0, dtype=dtype, qscheme=qscheme) if per_channel
                 else MinMaxObserver(dtype=dtype, qscheme=qscheme))
    reference(x)
    scale, zero_point = reference.calculate_qparams()
    spec = qstats.QuantSpec.from_torch_ao(dtype, qscheme)
    qp = _qparams(qstats.minmax, spec, x)
    assert torch.equal(qp.scale.reshape(scale.shape), scale)
    assert torch.equal(qp.zero_point.reshape(zero_point.shape).to(zero_point.dtype), zero_point)
    qmin, qmax = spec.qrange
    ours = qstats.fake_quantize(x, qp, spec)
    if zero_point.dtype.is_floating_point:
        # torch's kernel refuses its own observer's float zero point of a one-sided wide row
        # (3e38 > quant_max): every value within half a step, as an independent bound
        assert torch.isfinite(ours).all() and ((ours - x).abs() <= 0.5001 * scale[:, None]).all()
        return
    if per_channel:
        expected = torch.fake_quantize_per_channel_affine(x, scale, zero_point.to(torch.int32), 0, qmin, qmax)
    else:
        expected = torch.fake_quantize_per_tensor_affine(x, float(scale), int(zero_point), qmin, qmax)
    assert torch.equal(ours, expected)


# ------------------------------------------------------------------------------------------------
# against compressed-tensors
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["fp8", "int8_asym", "int4_sym"])
@pytest.mark.parametrize("x_name", ["zeros", "denormal", "tiny", "one_sided_huge", "fp16_edges", "constant"])
def test_minmax_matches_compressed_tensors_on_extreme_ranges(x_name, kind, dtype):
    """``calculate_qparams`` and ``fake_quantize`` of compressed-tensors on the same extremes, in
    the weight's dtype: float8 peaks up to float32's (and bf16's) largest values keep their scale
    (they were clipped at 1.7e38), one-sided asymmetric ranges too."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize as ct_fake_quantize
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    args = {
        "fp8": QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="channel"),
        "int8_asym": QuantizationArgs(num_bits=8, type="int", symmetric=False, strategy="channel"),
        "int4_sym": QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="channel"),
    }[kind]
    x = TORCH_AO_INPUTS[x_name].to(dtype)
    if not torch.isfinite(x).all():
        pytest.skip("the input itself overflows this dtype")
    scale, zero_point = calculate_qparams(x.amin(-1, keepdim=True), x.amax(-1, keepdim=True), args)
    if not torch.isfinite(scale).all():
        pytest.skip("compressed-tensors' scale overflows")
    spec = qstats.QuantSpec.from_compressed_tensors(args, observed_dtype=dtype)
    qp = _qparams(qstats.minmax, spec, x)
    assert torch.equal(qp.scale.reshape(scale.shape), scale.float())
    if kind != "fp8":
        assert torch.equal(qp.zero_point.reshape(zero_point.shape), zero_point.to(torch.int32))
    expected = ct_fake_quantize(x, scale, zero_point, args)
    ours = qstats.fake_quantize(x, qp, spec)
    # fp16 codes past 65504 (-65504 under int4's code -8): compressed-tensors gives -Inf, qstats
    # saturates (docs/differences.md)
    finite = torch.isfinite(expected)
    assert torch.isfinite(ours).all() and torch.equal(ours[finite], expected[finite])
    limit = torch.finfo(dtype).max
    assert torch.equal(ours[~finite], expected[~finite].clamp(-limit, limit))


# ------------------------------------------------------------------------------------------------
# against torchao
@pytest.mark.parametrize("mapping", ["ASYMMETRIC", "SYMMETRIC"])
@pytest.mark.parametrize("x_name", ["zeros", "denormal", "tiny", "one_sided_huge", "fp16_edges", "constant"])
def test_minmax_matches_torchao_choose_qparams_affine(x_name, mapping):
    """torchao's ``choose_qparams_affine`` per row (uint8 asymmetric, int8 symmetric)."""
    qp_lib = pytest.importorskip("torchao.quantization.quant_primitives")
    x = TORCH_AO_INPUTS[x_name]
    target = torch.uint8 if mapping == "ASYMMETRIC" else torch.int8
    scale, zero_point = qp_lib.choose_qparams_affine(x, getattr(qp_lib.MappingType, mapping), (1, 32), target)
    spec = qstats.QuantSpec.from_torchao(target, mapping_type=getattr(qp_lib.MappingType, mapping),
                                         block_size=(1, 32), shape=tuple(x.shape))
    qp = _qparams(qstats.minmax, spec, x)
    assert torch.equal(qp.scale.reshape(scale.shape), scale.float())
    assert torch.equal(qp.zero_point.reshape(zero_point.shape).to(zero_point.dtype), zero_point)
    codes = qp_lib.quantize_affine(x, (1, 32), scale, zero_point, target)
    expected = qp_lib.dequantize_affine(codes, (1, 32), scale, zero_point, target)
    assert torch.equal(qstats.fake_quantize(x, qp, spec), expected)


# ------------------------------------------------------------------------------------------------
# MX scales of denormal and tiny blocks: an independent computation of the OCP floor rule
@pytest.mark.parametrize("amax", [1e-45, 1e-40, 1e-38, 1e-30, 1.0, 3e38])
@pytest.mark.parametrize("preset", ["mxfp8", "mxfp4"])
def test_mx_scales_of_extreme_blocks_follow_the_ocp_floor(amax, preset):
    """``2 ** (floor(log2(amax)) - emax_elem)`` clamped to e8m0's [2**-127, 2**127], codes finite."""
    spec = qstats.preset(preset)
    x = torch.zeros(2, 32)
    x[0, 5], x[1, 7] = amax, -amax
    amax32 = float(x.abs().max())
    emax = {"mxfp8": 8, "mxfp4": 2}[preset]
    expected = 2.0 ** min(max(math.floor(math.log2(amax32)) - emax, -127), 127)
    qp = _qparams(qstats.minmax, spec, x)
    assert torch.equal(qp.scale, torch.full((2, 1), expected))
    assert torch.isfinite(qstats.fake_quantize(x, qp, spec)).all()
