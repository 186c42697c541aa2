"""quantize / dequantize / fake_quantize through the canonical view.

The arithmetic is the spec's convention's (`Convention.codes` and `Convention.dequantize`: torch.ao
multiplies by ``1 / scale`` and rounds half to even, as ``torch.fake_quantize_per_tensor_affine``
and ``per_channel_affine``, which it equals bit for bit; compressed-tensors divides by the scale in
the observed dtype; float targets divide, saturate and round to nearest even through the torch
dtype), except for float elements under e8m0 (MX) or two-level (NVFP4) scales and emulated fp6/fp4
elements, which qstats/_formats.py computes.

`fake_quantize` has a straight-through gradient: 1 where the value falls inside the quantized range,
0 where it was clipped (as torch's fake-quant ops).
"""

from __future__ import annotations

from typing import Optional

import torch

from . import _formats
from ._checks import check_floating, require
from ._formats import COMPUTE_DTYPE_NAMES, code_dtype
from ._granularity import TensorGroup, broadcast_to_view, canonical_view, from_canonical_view, in_layout_of
from ._qparams import QParams, rounds_in_half_precision
from ._spec import QuantSpec

__all__ = ["quantize", "dequantize", "fake_quantize", "code_dtype"]


def _checked_spec(spec, where: str) -> QuantSpec:
    """``spec``, after TypeError where it is no QuantSpec (None, or a preset's name: it failed as
    "'NoneType' object has no attribute 'granularity'"), as `compute_qparams` refuses it."""
    if not isinstance(spec, QuantSpec):
        hint = f" (qstats.preset({spec!r}) for a preset)" if isinstance(spec, str) else ""
        raise TypeError(f"{where}: spec must be a QuantSpec{hint}, got {type(spec).__name__}")
    return spec


def _params(qparams: QParams, view: torch.Tensor, spec: QuantSpec, where: str, **checks):
    """Scale and zero point broadcast against ``view``, after TypeError for qparams without scale and
    zero point tensors, and ValueError for a scale of another shape than this tensor's parameters,
    a zero point that does not broadcast to it (it would broadcast the result to another shape), a
    two-level spec's global scale of more than one value, or bad values (`_checked`, given ``checks``)."""
    for name in ("scale", "zero_point"):
        if not isinstance(getattr(qparams, name, None), torch.Tensor):
            got = (f"{type(getattr(qparams, name)).__name__} for its {name}" if hasattr(qparams, name)
                   else type(qparams).__name__)
            raise TypeError(f"{where}: qparams must be a QParams with scale and zero_point tensors "
                            f"(qstats.compute_qparams), got {got}")
    shape = tuple(view.shape[1:-1])
    if qparams.scale.shape != shape:
        raise ValueError(
            f"qparams of shape {tuple(qparams.scale.shape)} do not match the quantization "
            f"parameter shape {shape} of this tensor and granularity"
        )
    zero_point_shape = tuple(qparams.zero_point.shape)
    if len(zero_point_shape) > len(shape) or any(a not in (1, b) for a, b in zip(zero_point_shape[::-1], shape[::-1])):
        raise ValueError(f"{where}: a zero point of shape {zero_point_shape} does not fit scales of shape {shape}")
    global_scale = getattr(qparams, "global_scale", None)
    if isinstance(spec.granularity, TensorGroup) and not (isinstance(global_scale, torch.Tensor)
                                                          and global_scale.numel() == 1):
        got = tuple(global_scale.shape) if isinstance(global_scale, torch.Tensor) else type(global_scale).__name__
        raise ValueError(f"{where}: a two-level spec (TensorGroup) needs one global scale, got {got}")
    return _checked(qparams.scale.float(), qparams.zero_point, global_scale, spec, where, **checks)


def _checked(scale: torch.Tensor, zero_point: torch.Tensor, global_scale, spec: QuantSpec, where: str, *,
             finite: bool = False, own_read: bool = True):
    """Scale and zero point broadcast against the view, after one ValueError (eagerly, compiled and
    under vmap; one host read) naming the rules where any is broken: scales zero or negative (``finite``:
    NaN or Inf too, which `quantize`'s codes hide), a two-level spec's global scale that is not positive
    and finite, an integer zero point outside the spec's range or not whole. Hand-made or corrupt qparams
    (`compute_qparams` never gives them) gave numbers silently, as torch's fake-quant ops and
    compressed-tensors take them: a zero scale gave NaN at 0, a negative one codes of the other sign.
    ``own_read=False`` (`fake_quantize`, in every QAT step): the scales are checked only within the
    zero-point check's host read, so a spec without one (float formats) adds no device sync."""
    zero_point_valid = _zero_point_valid(zero_point, spec)
    if zero_point_valid is None and not own_read:
        return broadcast_to_view(scale), broadcast_to_view(zero_point)
    valid = ~(scale <= 0)
    rules = ["qparams scales must not be zero or negative"]
    if finite:
        valid = valid & scale.isfinite()
        rules = ["qparams scales must be positive and finite (codes hide a NaN or Inf one)"]
    valid = valid.all()
    if isinstance(spec.granularity, TensorGroup):
        valid = valid & ((global_scale > 0) & global_scale.isfinite()).all()
        rules.append("a two-level spec's global scale must be positive and finite")
    if zero_point_valid is not None:
        valid = valid & zero_point_valid.all()
        rules.append(_ZERO_POINT_RULE.format(*spec.qrange))
    ok = require(valid, f"{where}: " + "; ".join(rules) + " (hand-made or corrupt qparams: no qstats.compute_qparams "
                 "gives them)")
    scale = torch.where(ok, scale, torch.ones_like(scale))  # threads the check
    if zero_point_valid is not None:
        zero_point = torch.where(ok, zero_point, torch.full_like(zero_point, spec.qrange[0]))
    return broadcast_to_view(scale), broadcast_to_view(zero_point)


_ZERO_POINT_RULE = "integer zero points must lie in the spec's range [quant_min, quant_max] = [{}, {}] and be whole numbers"


def _zero_point_valid(zero_point: torch.Tensor, spec: QuantSpec) -> Optional[torch.Tensor]:
    """Where an integer zero point lies in the spec's range and is whole (torch's fake-quant ops refuse
    the former, truncate the latter); None for specs without integer zero points. Compared as int64:
    a narrower dtype wraps a bound it lacks (int8 3 <= 255 reads False)."""
    if spec.is_float or spec.zero_point_domain != "int":
        return None
    qmin, qmax = spec.qrange
    wide = zero_point if zero_point.is_floating_point() else zero_point.to(torch.int64)
    valid = (wide >= qmin) & (wide <= qmax)
    return valid & (wide == torch.round(wide)) if zero_point.is_floating_point() else valid


def _checked_zero_point(zero_point: torch.Tensor, spec: QuantSpec, where: str) -> torch.Tensor:
    """``zero_point``, after ValueError (eagerly, compiled and under vmap) where `_zero_point_valid` is not."""
    valid = _zero_point_valid(zero_point, spec)
    if valid is None:
        return zero_point
    inside = require(valid, f"{where}: " + _ZERO_POINT_RULE.format(*spec.qrange))
    return torch.where(inside, zero_point, torch.full_like(zero_point, spec.qrange[0]))  # threads the check


_UNSIGNED_WITHOUT_EXTREMES = (torch.uint16, torch.uint32, torch.uint64)


def _codes_inside(codes: torch.Tensor, spec: QuantSpec):
    """True (a bool tensor to thread into the result; None where nothing is checked), after
    ValueError (eagerly, compiled and under vmap) where integer-target codes lie outside
    ``spec.qrange`` or are not whole numbers: packed bytes, another spec's codes, or signed codes read
    as unsigned (int8 -56 viewed as uint8 is 200) dequantized to values off the grid (torchao's
    ``dequantize_affine`` refuses codes of another dtype). Reads only the extremes (and, for float
    codes, whether they are whole), compared as int64 or float64."""
    if spec.is_float or codes.numel() == 0:
        return None
    qmin, qmax = spec.qrange
    # torch has no min/max of uint16/32/64: their extremes are read in float64, where every code up
    # to 2**53 is exact and larger ones stay past any range (int64 would wrap uint64 codes past 2**63)
    extremes = codes.to(torch.float64) if codes.dtype in _UNSIGNED_WITHOUT_EXTREMES else codes
    wide = torch.float64 if extremes.is_floating_point() else torch.int64
    valid = (extremes.min().to(wide) >= qmin) & (extremes.max().to(wide) <= qmax)
    if codes.is_floating_point():
        valid = valid & (codes == torch.round(codes)).all()
    return require(valid, f"dequantize: codes of {spec.dtype!r} must be whole numbers in the spec's range "
                          f"[quant_min, quant_max] = [{qmin}, {qmax}]; got codes outside it (packed codes, another "
                          f"spec's codes, or signed codes read as unsigned): unpack them or view them in their own dtype")


def _codes_float(view, scale, zero_point, spec: QuantSpec, global_scale=None):
    """Unclamped and clamped codes as float tensors (integer-valued for int targets)."""
    if _formats.handles_codes(spec):  # fp6/fp4, e8m0 (MX) and two-level (NVFP4) scales
        return _formats.codes(view, scale, global_scale, spec)
    return spec.convention.codes(view, scale, zero_point, spec)


def _dequantize_view(codes, scale, zero_point, spec, global_scale=None):
    """float32 values of ``codes`` (stored codes, or those of `_codes_float`)."""
    if _formats.handles_codes(spec):
        return _formats.dequantize_values(_formats.load_codes(codes, spec), scale, global_scale, spec)
    return spec.convention.dequantize(codes, scale, zero_point, spec)


def _cap(values: torch.Tensor, dtype: torch.dtype, spec: QuantSpec) -> torch.Tensor:
    """``values`` saturated where torch's fake-quant ops give +-Inf: at an fp16/bf16 output's largest
    value, and at float32's where a bf16/fp16 scale or compute dtype may round a code's value up past
    it (torchao's int4 code -8 of a one-sided range at -3.4025e38 under a bfloat16 scale). Other
    float32 results are left as they are (an Inf scale a caller passed stays visible)."""
    limit = min(torch.finfo(dtype).max, torch.finfo(values.dtype).max)
    if limit == torch.finfo(values.dtype).max and not rounds_in_half_precision(spec):
        return values
    return values.clamp(-limit, limit)


def _to_output(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Values (float32, or float64 where the convention computed in float64) in ``dtype``: float64
    outputs keep a float64 computation, others are rounded to float32 first (once)."""
    return values.to(dtype) if dtype == torch.float64 else values.float().to(dtype)


def quantize(x: torch.Tensor, qparams: QParams, spec: QuantSpec) -> torch.Tensor:
    """Codes of ``x``: integers in ``[qmin, qmax]`` (dtype `code_dtype(spec)`) or fp8 values.

    Raises:
      ValueError: an integer zero point outside ``spec.qrange``, or a scale that is not positive and
        finite (under a NaN or Inf scale every code was 0).
    """
    spec = _checked_spec(spec, "quantize")
    view = canonical_view(check_floating(x, "quantize"), spec.granularity)
    scale, zero_point = _params(qparams, view, spec, "quantize", finite=True)
    _, codes = _codes_float(view, scale, zero_point, spec, qparams.global_scale)
    return _formats.store_codes(from_canonical_view(codes, spec.granularity, x.shape), spec)


def dequantize(codes: torch.Tensor, qparams: QParams, spec: QuantSpec, dtype=None) -> torch.Tensor:
    """Values of ``codes``: ``(codes - zero_point) * scale`` (``codes * scale`` for floats), in
    ``dtype`` (float32 by default, holding the values `fake_quantize` computes), in float64
    arithmetic for a float64 ``dtype`` where `fake_quantize` of float64 inputs computes in it
    (torch.ao's per-channel integer targets). A torchao spec's integer codes given a ``dtype`` are
    computed in it, as ``dequantize_affine(output_dtype=dtype)``, whatever the input's dtype.

    Raises:
      ValueError: codes of an integer target outside ``spec.qrange`` or not whole (packed codes,
        signed codes read as unsigned), or a zero or negative scale.
      TypeError: integer codes of an fp8 format (its codes are the torch float8 dtype) or codes of
        another 8-bit float format, or a
        ``dtype`` that is not a floating-point torch dtype (values cast to an integer dtype would be
        truncated; torchao's ``dequantize_affine`` refuses them too).
    """
    spec = _checked_spec(spec, "dequantize")
    if not isinstance(codes, torch.Tensor):
        raise TypeError(f"dequantize: codes must be a tensor (qstats.quantize's), got {type(codes).__name__}")
    given, dtype = dtype is not None, torch.float32 if dtype is None else dtype
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dequantize: dtype must be a floating-point torch dtype (torch.float32, ...), got {dtype!r}")
    own = spec.float_format.torch_dtype if spec.is_float else None
    if own is not None and not codes.is_floating_point():
        raise TypeError(
            f"dequantize: codes of {spec.dtype!r} must be {own} (or its float values), "
            f"got {codes.dtype}; view fp8 bytes with codes.view({own})"
        )
    if own is not None and codes.element_size() == 1 and codes.dtype != own:
        # another 8-bit float format's codes (e4m3fnuz read as e4m3fn is off by a factor of 2)
        raise TypeError(
            f"dequantize: codes of {spec.dtype!r} must be {own} (or its float values), got codes of another "
            f"format, {codes.dtype}; pass codes.float() where they are meant as values"
        )
    if given and spec.convention.dequantizes_in_output_dtype and not spec.is_float and dtype in COMPUTE_DTYPE_NAMES:
        # torchao's dequantize_affine computes in its output_dtype: bf16-observed codes asked for in
        # float32 are formed in float32 (not rounded to bf16), float32-observed ones asked for in
        # bf16 round each step to bf16 as its tinygemm dequantization does
        spec = spec.replace(compute_dtype=COMPUTE_DTYPE_NAMES[dtype])
    inside = _codes_inside(codes, spec)
    view = canonical_view(codes, spec.granularity)
    if dtype == torch.float64 and not spec.is_float:
        view = view.double()
    scale, zero_point = _params(qparams, view, spec, "dequantize")
    if inside is not None:
        scale = torch.where(inside, scale, torch.ones_like(scale))  # threads the check (a few scales)
    out = _cap(_dequantize_view(view, scale, zero_point, spec, qparams.global_scale), dtype, spec)
    return _to_output(from_canonical_view(out, spec.granularity, codes.shape), dtype)


def fake_quantize(x: torch.Tensor, qparams: QParams, spec: QuantSpec) -> torch.Tensor:
    """``dequantize(quantize(x))`` in ``x``'s dtype, with a straight-through gradient.

    The gradient with respect to ``x`` is 1 inside the representable range (the convention's
    `gradient_range`) and 0 where the value was clipped. Composes with ``torch.func.grad``,
    ``vmap`` and ``torch.compile``. Values past ``x``'s dtype (fp16/bf16 edges) saturate at its
    largest finite value, where torch's fake-quant ops return +-Inf (docs/differences.md). The
    result has ``x``'s memory layout (channels_last, transposed), as torch's fake-quant ops give.

    Raises:
      ValueError: an integer zero point outside ``spec.qrange`` (as torch's fake-quant ops), or, with
        integer zero points, a zero or negative scale (torch's ops take it).
      TypeError: ``x`` is not a floating-point tensor, or ``spec`` no QuantSpec.
    """
    spec = _checked_spec(spec, "fake_quantize")
    view = canonical_view(check_floating(x, "fake_quantize"), spec.granularity)
    scale, zero_point = _params(qparams, view, spec, "fake_quantize", own_read=False)
    unclamped, codes = _codes_float(view.detach(), scale, zero_point, spec, qparams.global_scale)
    out = _cap(_dequantize_view(codes, scale, zero_point, spec, qparams.global_scale), x.dtype, spec)
    # the straight-through term, +0 with derivative 1 inside the range, in every mode (requires_grad
    # reads False inside vmap, so it is always added); subtracted as (detached - x) so that a -0.0
    # output keeps its sign, in float64 for float64 input (a float32 copy of 1e39 is Inf: Inf - Inf)
    lo, hi = spec.convention.gradient_range(spec)
    inside = (unclamped >= lo) & (unclamped <= hi)
    exact = _formats.working(view)
    out = torch.where(inside, out - (exact.detach() - exact), out)
    return in_layout_of(x, _to_output(from_canonical_view(out, spec.granularity, x.shape), x.dtype))
