"""Low-bit float element formats, power-of-two (e8m0) scales and two-level (NVFP4) scales.

Float formats without a torch dtype (fp6, fp4) are emulated exactly in float32 and stored as
torchao's unpacked bit codes; every cast rounds to nearest even and saturates. The e8m0 rounding
modes and the two global-scale conventions are tabled in docs/formats.md. Every function is
elementwise or reduces with fixed shapes: vmappable, and compiled without graph breaks.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

from ._checks import require
from ._granularity import TensorGroup
from ._torch_features import bitcast, rounded_to, torch_dtype

__all__ = [
    "round_to_format",
    "encode",
    "decode",
    "e8m0_exponent",
    "e8m0_scale",
    "SCALE_ROUNDINGS",
    "GLOBAL_SCALE_FORMULAS",
]

SCALE_ROUNDINGS = ("floor", "ceil", "even", "rceil", "round_then_floor", "round")
GLOBAL_SCALE_FORMULAS = ("amax_over_range", "range_over_amax")
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
COMPUTE_DTYPE_NAMES = {getattr(torch, name): name for name in COMPUTE_DTYPES}  # torch dtype -> compute_dtype


@dataclasses.dataclass(frozen=True)
class FloatFormat:
    """A low-bit floating-point element format (finite maximum, smallest normal, mantissa bits)."""

    name: str
    exponent_bits: int
    mantissa_bits: int
    max: float
    min_normal: float
    torch_dtype: Optional[torch.dtype]


_FLOAT_FORMATS = {
    "fp8_e4m3fn": FloatFormat("fp8_e4m3fn", 4, 3, 448.0, 2.0**-6, torch.float8_e4m3fn),
    "fp8_e5m2": FloatFormat("fp8_e5m2", 5, 2, 57344.0, 2.0**-14, torch.float8_e5m2),
    # low-bit formats (qstats/_formats.py rounds, encodes and decodes them)
    "fp8_e4m3fnuz": FloatFormat("fp8_e4m3fnuz", 4, 3, 240.0, 2.0**-7, torch.float8_e4m3fnuz),
    "fp8_e5m2fnuz": FloatFormat("fp8_e5m2fnuz", 5, 2, 57344.0, 2.0**-15, torch.float8_e5m2fnuz),
    "fp6_e2m3": FloatFormat("fp6_e2m3", 2, 3, 7.5, 1.0, None),
    "fp6_e3m2": FloatFormat("fp6_e3m2", 3, 2, 28.0, 0.25, None),
    "fp4_e2m1": FloatFormat("fp4_e2m1", 2, 1, 6.0, 1.0, None),
}


def float_format(name: str) -> FloatFormat:
    """The FloatFormat named ``name`` (ValueError for an unknown one)."""
    try:
        return _FLOAT_FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown float format {name!r}; known: {sorted(_FLOAT_FORMATS)}") from None


def rounded_in(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Float ``t`` rounded to ``dtype``'s values where ``dtype`` is narrower, in ``t``'s dtype: the
    result of one torch op in ``dtype`` (computed wider, then rounded), eagerly and under
    ``torch.compile``, whose fused kernels keep the wider values between ops (`rounded_to`)."""
    return rounded_to(t, dtype) if torch.finfo(dtype).bits < torch.finfo(t.dtype).bits else t


def compute_dtype_name(dtype, what: str) -> str:
    """The ``compute_dtype`` name of a torch dtype qstats computes in (float32, bfloat16, float16);
    ValueError naming ``what`` (the argument) otherwise."""
    if dtype not in COMPUTE_DTYPE_NAMES:
        raise ValueError(f"{what} must be torch.float32, torch.bfloat16 or torch.float16, got {dtype!r}")
    return COMPUTE_DTYPE_NAMES[dtype]

_F32_MANTISSA = 23
_F32_BIAS = 127
_F16_MIN_NORMAL = 2.0**-14
E8M0_MIN = 2.0**-127  # the smallest e8m0 scale (biased exponent 0)


# --------------------------------------------------------------------------------------------
# element formats
def _exponent_of(a: torch.Tensor) -> torch.Tensor:
    """Unbiased float32 exponent field of ``a >= 0`` (int32; -127 for zero and subnormals)."""
    bits = bitcast(a.float().contiguous(), torch.int32)
    return torch.bitwise_and(torch.bitwise_right_shift(bits, _F32_MANTISSA), 0xFF) - _F32_BIAS


def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    """Exactly ``2.0 ** exponent`` as float32 for integer exponents in [-126, 127]."""
    biased = (exponent.to(torch.int32) + _F32_BIAS).clamp(1, 254)
    return bitcast(torch.bitwise_left_shift(biased, _F32_MANTISSA), torch.float32)


def _min_normal_exponent(fmt) -> int:
    return int(math.log2(fmt.min_normal))


def _format_of(fmt, where: str) -> FloatFormat:
    """``fmt`` as a FloatFormat: one already, a format name (``"fp4_e2m1"``, the names
    ``QuantSpec.dtype`` takes), a torch float8 dtype or ``torch.float4_e2m1fn_x2`` (fp4, as
    ``QuantSpec.dtype`` reads it); ValueError for an unknown name or dtype,
    TypeError for anything else."""
    if isinstance(fmt, FloatFormat):
        return fmt
    if isinstance(fmt, torch.dtype):
        named = [name for name, known in _FLOAT_FORMATS.items() if known.torch_dtype == fmt]
        if fmt == torch_dtype("float4_e2m1fn_x2"):  # torch >= 2.8's packed fp4, read as QuantSpec.dtype reads it
            named = ["fp4_e2m1"]
        if not named:
            raise ValueError(f"{where}: torch dtype {fmt} is not a float element format; known: {sorted(_FLOAT_FORMATS)}")
        return _FLOAT_FORMATS[named[0]]
    if isinstance(fmt, str):
        return float_format(fmt)
    raise TypeError(f"{where}: the format must be a name such as 'fp8_e4m3fn', a torch float8 dtype or a "
                    f"FloatFormat, got {type(fmt).__name__}")


def round_to_format(x: torch.Tensor, fmt) -> torch.Tensor:
    """``x`` (float32, or float64) saturated to ``[-fmt.max, fmt.max]`` and rounded to nearest even on
    the format's grid, subnormals included. Returns float32 values on the grid (NaN stays NaN).
    ``fmt`` is a format name (``"fp4_e2m1"``), a torch float8 dtype (or ``torch.float4_e2m1fn_x2``) or a
    FloatFormat.
    Emulated formats (fp6, fp4) round float64 ``x`` once, in float64, as compressed-tensors'
    ``cast_to_fp4`` (rounding it to float32 first moved values just past a tie onto it, then to even);
    fp8 formats cast as torch does."""
    fmt = _format_of(fmt, "round_to_format")
    x = x if x.dtype == torch.float64 and fmt.torch_dtype is None else x.float()
    if fmt.torch_dtype is not None:
        return x.clamp(-fmt.max, fmt.max).to(fmt.torch_dtype).float()
    magnitude = x.abs().clamp(max=fmt.max)
    # The grid step of each value's binade, 2 ** (max(exponent, min normal exponent) - mantissa
    # bits), built directly in the float32 exponent field (three passes instead of seven); a float64
    # magnitude rounded up to the next binade's power of two lies on both binades' grids
    exponent_bits = torch.bitwise_and(bitcast(magnitude.float(), torch.int32), 0x7F800000)
    min_normal_bits = (_min_normal_exponent(fmt) + _F32_BIAS) << _F32_MANTISSA
    quantum_bits = torch.clamp(exponent_bits, min=min_normal_bits) - (fmt.mantissa_bits << _F32_MANTISSA)
    quantum = bitcast(quantum_bits, torch.float32).to(x.dtype)
    rounded = torch.round(magnitude / quantum) * quantum
    return torch.copysign(rounded, x).float()


def encode(x: torch.Tensor, fmt) -> torch.Tensor:
    """Bit codes of ``x`` in ``fmt``: the torch fp8 dtype where one exists, else unpacked uint8
    codes (sign bit at position ``exponent_bits + mantissa_bits``), as torchao's
    ``f32_to_f4_unpacked`` / ``f32_to_f6_*_unpacked``. Rounds to nearest even and saturates;
    fp6/fp4 have no NaN code (NaN inputs give an unspecified code). ``fmt`` as `round_to_format` takes it."""
    fmt = _format_of(fmt, "encode")
    values = round_to_format(x, fmt)
    if fmt.torch_dtype is not None:
        return values.to(fmt.torch_dtype)
    magnitude = values.abs()
    min_exponent = _min_normal_exponent(fmt)
    exponent = torch.clamp(_exponent_of(magnitude), min=min_exponent)
    mantissa_steps = magnitude / _pow2(exponent - fmt.mantissa_bits)
    code = (exponent - min_exponent) * (1 << fmt.mantissa_bits) + mantissa_steps.to(torch.int32)
    sign = torch.signbit(values).to(torch.int32) << (fmt.exponent_bits + fmt.mantissa_bits)
    return (code + sign).to(torch.uint8)


def decode(codes: torch.Tensor, fmt) -> torch.Tensor:
    """float32 values of codes made by `encode` (inverse of `encode` on the format's grid); ``fmt`` as
    `round_to_format` takes it.

    Raises:
      ValueError: a code outside ``[0, 2**bits)`` (packed bytes, or signed bytes), whose bits past
        the format's width would otherwise be dropped (torchao's decoders read them as exponent bits).
    """
    fmt = _format_of(fmt, "decode")
    if fmt.torch_dtype is not None and codes.dtype == fmt.torch_dtype:
        return codes.float()
    codes = codes.to(torch.int32)
    mbits, ebits = fmt.mantissa_bits, fmt.exponent_bits
    top = 1 << (1 + ebits + mbits)
    inside = require(
        (codes >= 0) & (codes < top),
        f"dequantize: {fmt.name} bit codes lie in [0, {top - 1}] (one unpacked code per element); got codes "
        "outside it: unpack packed bytes (two fp4 codes per byte) first",
    )
    codes = torch.where(inside, codes, torch.zeros_like(codes))  # threads the check
    sign = torch.bitwise_and(torch.bitwise_right_shift(codes, ebits + mbits), 1)
    exponent_field = torch.bitwise_and(torch.bitwise_right_shift(codes, mbits), (1 << ebits) - 1)
    mantissa = torch.bitwise_and(codes, (1 << mbits) - 1)
    min_exponent = _min_normal_exponent(fmt)
    normal = exponent_field > 0
    significand = torch.where(normal, mantissa + (1 << mbits), mantissa).float()
    exponent = torch.where(normal, exponent_field - 1, torch.zeros_like(exponent_field)) + min_exponent
    value = significand * _pow2(exponent - mbits)
    return torch.where(sign.bool(), -value, value)


def is_emulated(spec) -> bool:
    """True when ``spec``'s element format has no torch dtype (codes are uint8 bit codes)."""
    return spec.is_float and spec.float_format.torch_dtype is None


def code_dtype(spec) -> torch.dtype:
    """The torch dtype that holds ``spec``'s codes (smallest integer type, or the fp8 dtype)."""
    if spec.is_float:
        return spec.float_format.torch_dtype or torch.uint8  # uint8 bit codes for fp6/fp4
    return next((dtype for dtype in (torch.int8, torch.uint8, torch.int16, torch.int32)
                 if integer_dtype_holds(dtype, spec.qrange)), torch.int64)


def integer_dtype_holds(dtype, qrange) -> bool:
    """True for a plain (not quantized, not sub-byte) torch integer dtype whose range holds ``qrange``."""
    if not isinstance(dtype, torch.dtype) or dtype.is_floating_point or dtype.is_complex or dtype == torch.bool \
            or dtype in (torch.quint8, torch.qint8, torch.qint32, torch.quint4x2, torch.quint2x4):
        return False
    try:
        info = torch.iinfo(dtype)
    except TypeError:  # torch.int1-int7 / uint1-uint7: no iinfo, no storage of their own
        return False
    return info.min <= qrange[0] and qrange[1] <= info.max


def store_codes(values: torch.Tensor, spec) -> torch.Tensor:
    """Grid values (float32) -> the codes `quantize` returns for ``spec``."""
    if is_emulated(spec):
        return encode(values, spec.float_format)
    dtype = code_dtype(spec)
    if not dtype.is_floating_point:
        # codes clamped in a narrower dtype may lie past the range: float32 has no 2**31 - 1 (its
        # clamp gave 2**31, which int32 would wrap to -2**31), bfloat16/float16 no 32767 (int16
        # wrapped 32768 to -32768) nor 2**(b-1) - 1 for wide targets
        if spec.qrange[1] > 1 << 24:
            values = values.double()
        values = values.clamp(*spec.qrange)
    return values.to(dtype)


def load_codes(codes: torch.Tensor, spec) -> torch.Tensor:
    """Codes -> float32 grid values: bit codes of emulated formats in any integer dtype are
    decoded, floating-point tensors are grid values."""
    if is_emulated(spec) and not codes.is_floating_point():
        return decode(codes, spec.float_format)
    # grid values, or an integer format's codes (integer fp8 codes are refused by `dequantize`)
    return codes.float()


# --------------------------------------------------------------------------------------------
# e8m0 scales
def element_max(spec) -> float:
    """Largest magnitude of ``spec``'s element format; for integer targets the largest code
    distance from the symmetric zero point that fits on both sides (127 for int8 and uint8)."""
    return _code_distance(spec, min)


def _code_distance(spec, pick) -> float:
    """``fmt.max`` of a float format; ``pick`` (min or max) of an integer target's code distances
    on either side of its symmetric zero point."""
    if spec.is_float:
        return float(spec.float_format.max)
    lo, hi = spec.qrange
    zero_point = spec.zero_point_of_symmetric
    return float(pick(hi - zero_point, zero_point - lo))


def e8m0_exponent(amax: torch.Tensor, spec) -> torch.Tensor:
    """Biased e8m0 exponent ``b`` in ``[0, 254]`` (int32) for blocks of absolute maximum ``amax``
    under ``spec.scale_rounding`` (see the module docs)."""
    amax = amax.float()
    rounding = spec.scale_rounding
    target = element_max(spec)
    if rounding in ("rceil", "round"):
        to_integer = torch.ceil if rounding == "rceil" else torch.round
        return biased_exponent(to_integer(torch.log2(amax / target)), spec)
    target_pow2 = int(math.floor(math.log2(target)))
    if rounding == "round_then_floor" and spec.compute_dtype == "float16":
        # compressed-tensors rounds a float16 amax's own bits: a subnormal one (below 2**-14)
        # carries into the smallest normal exponent from 0.75 * 2**-14 up, and is 0 below
        subnormal = amax < _F16_MIN_NORMAL
        carried = torch.where(amax >= 0.75 * _F16_MIN_NORMAL, _F16_MIN_NORMAL, 0.0)
        amax = torch.where(subnormal, carried, amax)
    bits = bitcast(amax.contiguous(), torch.int32)
    if rounding in ("even", "round_then_floor"):
        even_bits = spec.float_format.mantissa_bits if spec.is_float else max(target_pow2, 1)
        mbits = even_bits if rounding == "even" else 1
        bits = torch.bitwise_and(bits + (1 << (_F32_MANTISSA - mbits - 1)), 0x7F800000)
    exponent_field = torch.bitwise_and(torch.bitwise_right_shift(bits, _F32_MANTISSA), 0xFF)
    if rounding == "ceil":
        exponent_field = exponent_field + (torch.bitwise_and(bits, 0x7FFFFF) > 0).to(torch.int32)
    return torch.clamp(exponent_field - target_pow2, 0, _largest_finite_exponent(spec)).to(torch.int32)


def biased_exponent(exponent: torch.Tensor, spec) -> torch.Tensor:
    """Integer-valued float ``exponent`` (NaN, from an all-zero block's ``log2(0 / 0)``, reads as 0) as
    a biased e8m0 exponent (int32), saturated at the e8m0 range and `_largest_finite_exponent`."""
    exponent = exponent.float().clamp(-_F32_BIAS, _F32_BIAS).nan_to_num(0.0)
    return (exponent.to(torch.int32) + _F32_BIAS).clamp(max=_largest_finite_exponent(spec))


def _largest_finite_exponent(spec) -> int:
    """The largest biased exponent (at most 254) whose scale keeps every code of ``spec`` finite
    when dequantized: rounding a range near half the float32 range up to a power of two could
    otherwise put the farthest code (-128 for int8, beyond ``element_max``'s 127) past it."""
    farthest = _code_distance(spec, max)
    return next((biased for biased in range(254, 0, -1)
                 if not farthest * 2.0 ** (biased - _F32_BIAS) > torch.finfo(torch.float32).max), 0)


def e8m0_to_float(biased: torch.Tensor) -> torch.Tensor:
    """``2.0 ** (b - 127)`` as float32 (``b = 0`` gives the subnormal ``2**-127``)."""
    biased = biased.to(torch.int32)
    normal = bitcast(torch.bitwise_left_shift(biased.clamp(1, 254), _F32_MANTISSA), torch.float32)
    return torch.where(biased == 0, torch.full_like(normal, E8M0_MIN), normal)


def e8m0_scale(amax: torch.Tensor, spec) -> torch.Tensor:
    """The e8m0 scale (float32 power of two) for blocks of absolute maximum ``amax``."""
    return e8m0_to_float(e8m0_exponent(amax, spec))


# --------------------------------------------------------------------------------------------
# qparams
def handles_qparams(spec) -> bool:
    """True when `qparams` (not the convention's range arithmetic) computes ``spec``'s scales."""
    return spec.scale_dtype == "e8m0" or isinstance(spec.granularity, TensorGroup)


def global_scale_from_amax(amax_t: torch.Tensor, spec) -> torch.Tensor:
    """The global (per-tensor) scale for a tensor of absolute maximum ``amax_t`` (float32)."""
    amax_t = amax_t.float()
    # compressed-tensors' generate_gparam takes the float8 maximum also for unrounded float32 group scales
    fp8_range = spec.scale_dtype == "float8_e4m3fn" or spec.global_scale_formula == "range_over_amax"
    scale_max = float(torch.finfo(torch.float8_e4m3fn).max) if fp8_range else 1.0
    full_range = scale_max * element_max(spec)
    if spec.global_scale_formula == "range_over_amax":
        # compressed-tensors divides in the observed dtype (``compute_dtype``; the extremes of a
        # bf16/fp16 tensor convert to it exactly), then stores the global scale as float32
        compute = getattr(torch, spec.compute_dtype)
        clamped = torch.clamp(_in_compute_dtype(amax_t, compute), min=torch.finfo(compute).tiny)
        return torch.nan_to_num((full_range / clamped).float(), nan=1.0, posinf=1.0, neginf=1.0)
    scale = amax_t / full_range  # floored at the smallest normal float32, so that 1 / scale is finite
    return torch.where(scale > 0, scale.clamp(min=torch.finfo(torch.float32).tiny), torch.ones_like(scale))


def _in_compute_dtype(amax: torch.Tensor, compute: torch.dtype) -> torch.Tensor:
    """A float32 ``amax`` in ``compute``, saturated at its largest value (a range rule's estimate,
    such as moments' mean + 3 std of an fp16 tensor, may lie past it: Inf there made NaN scales)."""
    return amax.clamp(max=torch.finfo(compute).max).to(compute)


def _two_level_local(amax: torch.Tensor, global_scale: torch.Tensor, spec) -> torch.Tensor:
    dtype = getattr(torch, spec.scale_dtype)
    finfo = torch.finfo(dtype)
    if spec.global_scale_formula == "range_over_amax":
        half_range = float(spec.qrange[1] - spec.qrange[0]) / 2
        local = _in_compute_dtype(amax, getattr(torch, spec.compute_dtype)) / half_range  # in the observed dtype
        # in float32, as compressed-tensors' (1,)-shaped float32 global scale promotes the product
        # (a 0-dim one would keep a bfloat16/float16 local's dtype)
        local = global_scale * local.float()
        if dtype != torch.float32:
            local = torch.clamp(local, finfo.min, finfo.max).to(dtype).float()
        return torch.where(local == 0, torch.full_like(local, finfo.eps), local)
    local = amax / element_max(spec) / global_scale
    if dtype == torch.float32:
        return torch.clamp(local, min=spec.eps)
    return torch.clamp(local, min=finfo.tiny, max=finfo.max).to(dtype).float()


def qparams(min_val: torch.Tensor, max_val: torch.Tensor, spec, global_scale=None):
    """``(scale, zero_point, global_scale)`` for e8m0 and two-level specs (see module docs).

    ``global_scale``: a given global scale (a fused group's, `qstats.fused`); by default it is
    computed from the absolute maximum over all of ``min_val``/``max_val`` (the whole tensor).
    """
    amax = torch.max(min_val.clamp(max=0.0).abs(), max_val.clamp(min=0.0).abs())
    zero_point = torch.full_like(amax, 0 if (spec.is_float or spec.zero_point_domain == "none")
                                 else spec.zero_point_of_symmetric, dtype=torch.int32)
    if isinstance(spec.granularity, TensorGroup):
        if global_scale is None:
            global_scale = global_scale_from_amax(amax.amax() if amax.numel() else amax.new_zeros(()), spec)
        global_scale = global_scale.float().reshape(())
        return _two_level_local(amax, global_scale, spec), zero_point, global_scale
    scale = spec.convention.e8m0_scale(amax, spec)
    return scale, zero_point, torch.ones((), dtype=torch.float32, device=amax.device)


# --------------------------------------------------------------------------------------------
# quantize / dequantize
def handles_codes(spec) -> bool:
    """True when `codes` computes ``spec``'s quantization (float targets with two-level or e8m0
    scales, and emulated element formats)."""
    return spec.is_float and (handles_qparams(spec) or is_emulated(spec))


def _block_input(view: torch.Tensor) -> torch.Tensor:
    """``view`` in its own dtype where float32 holds it exactly and promotes it (bf16, fp16,
    float32), so that a convention dividing in a narrower compute dtype divides in the promotion of
    the input's dtype with it (compressed-tensors: float32 inputs by a bf16 scale in float32), while
    one dividing by float32 scales gets the same float32 arithmetic as before; float64 stays float64
    (compressed-tensors divides it in float64); float32 otherwise."""
    return view if torch.promote_types(view.dtype, torch.float32) in (torch.float32, torch.float64) else view.float()


def working(t: torch.Tensor) -> torch.Tensor:
    """``t`` in the dtype codes are computed in: float64 where it is float64 (rounded once, from
    float64), else float32."""
    return t if t.dtype == torch.float64 else t.float()


def codes(view: torch.Tensor, scale: torch.Tensor, global_scale, spec):
    """``(unclamped, grid_values)`` of ``view`` (any float dtype) under broadcast float32 ``scale``:
    the scaled values before saturation (float32; float64 for float64 ``view``), and the saturated
    values rounded to the element grid (float32). One level of scales divides as the spec's
    convention divides (`Convention.block_scaled`, given the input in its own dtype: `_block_input`)."""
    fmax = spec.float_format.max
    if not isinstance(spec.granularity, TensorGroup):
        scaled = working(spec.convention.block_scaled(_block_input(view), scale, spec))
    elif spec.global_scale_formula == "range_over_amax":
        view = working(view)
        # + 0: compressed-tensors adds its zero point (0), which makes -0.0 +0
        scaled = view / (scale / global_scale) + 0.0
    else:
        scaled = _two_level_scaled(working(view), scale, global_scale)
    return scaled, round_to_format(scaled.clamp(-fmax, fmax), spec.float_format)


def _two_level_scaled(view: torch.Tensor, scale: torch.Tensor, global_scale) -> torch.Tensor:
    """``view * ((1 / global) / scale)``, torchao's (and the MSLK kernel's) reciprocal product;
    where that reciprocal overflows (a tiny tensor's global scale under a block scale floored at
    the e4m3 minimum: zeros became NaN, small values the format's maximum), ``view * (1 / global)``
    divided by the block scale instead, which stays finite for values up to ``2688 * global``."""
    inverse_global = 1.0 / global_scale
    reciprocal = inverse_global / scale
    return torch.where(torch.isfinite(reciprocal), view * reciprocal, (view * inverse_global) / scale)


def effective_scale(scale: torch.Tensor, global_scale, spec) -> torch.Tensor:
    """The element step: a two-level (`TensorGroup`) block scale under its global scale, in the
    convention's order of operations; ``scale`` itself for other granularities."""
    if isinstance(spec.granularity, TensorGroup):
        if spec.global_scale_formula == "range_over_amax":
            return scale / global_scale
        return global_scale * scale
    return scale


def dequantize_values(values: torch.Tensor, scale: torch.Tensor, global_scale, spec) -> torch.Tensor:
    """Grid values times the effective scale (in the convention's order of operations), saturated
    at float32's largest value (the element maximum times the scale of a block holding float32's
    largest value rounds past it)."""
    limit = torch.finfo(torch.float32).max
    return (values * effective_scale(scale, global_scale, spec)).clamp(-limit, limit)


# --------------------------------------------------------------------------------------------
# validation
def validate(spec) -> None:
    """Checks the low-bit fields of a QuantSpec against each other (ValueError naming the field)."""
    if spec.mapping == "symmetric_no_clipping_err" and not spec.is_float and spec.qrange[1] <= 0:
        raise ValueError(
            f"QuantSpec.mapping 'symmetric_no_clipping_err' needs quant_max > 0 (max / quant_max is its "
            f"scale); {spec.dtype!r} has the range {spec.qrange}"
        )
    if spec.scale_dtype == "e8m0":
        if element_max(spec) <= 0:
            # no code on one side of the zero point: the exponent of amax / 0 (math domain error for
            # floor, the largest scale and every value 0 for rceil and round)
            raise ValueError(
                f"QuantSpec.scale_dtype 'e8m0' needs codes on both sides of the symmetric zero point; "
                f"{spec.dtype!r} (codes {tuple(spec.qrange)}, zero point {spec.zero_point_of_symmetric}) has none "
                "on one side; use two or more bits"
            )
        if spec.mapping == "asymmetric":
            raise ValueError("QuantSpec.scale_dtype 'e8m0' (power-of-two scales) needs a symmetric mapping")
        if isinstance(spec.granularity, TensorGroup):
            raise ValueError("QuantSpec.scale_dtype 'e8m0' cannot be a TensorGroup block scale; use PerGroup")
    if isinstance(spec.granularity, TensorGroup) and spec.mapping == "asymmetric":
        raise ValueError("QuantSpec.granularity TensorGroup (two-level scales) needs a symmetric mapping")
    if isinstance(spec.granularity, TensorGroup) and spec.scale_dtype == "float64":
        raise ValueError("QuantSpec.scale_dtype 'float64' cannot be a TensorGroup block scale")
    if isinstance(spec.granularity, TensorGroup) and not spec.is_float:
        # the codes of integer targets would ignore the global scale (all zeros under fp8 block scales)
        raise ValueError(
            f"QuantSpec.granularity TensorGroup (two-level scales) needs a float element format "
            f"(fp4_e2m1, fp6, fp8), got {spec.dtype!r}; integer targets take PerGroup"
        )
