"""The `Convention` protocol, with the arithmetic the library conventions share.

A convention is how one library maps an observed range onto qparams and values onto codes. The
default is torch.ao's range formulas, integer codes ``clamp(round(x * (1 / scale)) + zero_point,
qmin, qmax)`` and float codes saturated and rounded to nearest even. Conventions are stateless
and compare equal to their name.
"""

from __future__ import annotations

import torch

from .. import _formats

__all__ = [
    "Convention",
    "check_float_mapping",
    "check_float_zero_point",
    "check_preserve_zero",
    "check_range_within_dtype",
    "check_symmetric_zero_point",
    "check_zero_point_kept",
    "round_scale",
    "saturate",
]


class Convention:
    """How one library computes quantization parameters and codes (see the module docs).

    Attributes:
      name: what ``QuantSpec(convention=...)`` accepts for it.
      computes_in_observed_dtype: ``compute_dtype`` follows bf16/fp16 inputs (compressed-tensors).
      maps_ranges_without_zero: `qparams` honours ``QuantSpec.preserve_zero=False`` (torchao).
      ranges_map_like_torch_ao: integer ranges map by torch.ao's formulas up to float rounding, so
        range searches may rank candidates with them in float64.
      dequantizes_in_output_dtype: `qstats.dequantize` of integer codes computes in the ``dtype`` it
        returns, not in ``compute_dtype`` (torchao's ``dequantize_affine(output_dtype=...)``).
    """

    name: str = "default"
    computes_in_observed_dtype: bool = False
    maps_ranges_without_zero: bool = False
    ranges_map_like_torch_ao: bool = False
    dequantizes_in_output_dtype: bool = False

    def __eq__(self, other) -> bool:
        if isinstance(other, str):
            return other == self.name
        if isinstance(other, Convention):
            return type(other) is type(self)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.name)

    def __repr__(self) -> str:
        return repr(self.name)

    # ----------------------------------------------------------------------------------------
    # specs
    def validate(self, spec) -> None:
        """ValueError (naming the field) for a spec this convention does not compute."""
        check_float_mapping(spec)
        check_range_within_dtype(spec)
        check_float_zero_point(spec, self.name)
        check_symmetric_zero_point(spec)
        check_preserve_zero(spec, self)
        check_zero_point_kept(spec, self.name)

    def check_lsq(self, spec) -> None:
        """ValueError where learnable ranges (`qstats.lsq`: torch.ao's gradients, for codes
        ``clamp(round(x * (1 / scale)) + zero_point, *spec.qrange)``, the zero point in code units)
        would read this convention's qparams otherwise."""

    # ----------------------------------------------------------------------------------------
    # moving averages
    def moving_average(self, average: torch.Tensor, batch: torch.Tensor, constant: float, spec,
                       observed_dtype: torch.dtype) -> torch.Tensor:
        """One step of a moving average of float32 extremes: torch.ao's
        ``average + constant * (batch - average)`` bit for bit, or
        ``(1 - constant) * average + constant * batch`` where the difference overflows.
        """
        moved = average + constant * (batch - average)
        return torch.where(moved.isfinite(), moved, (1.0 - constant) * average + constant * batch)

    # ----------------------------------------------------------------------------------------
    # range -> qparams
    def qparams(self, min_val: torch.Tensor, max_val: torch.Tensor, spec):
        """``(scale, zero_point)`` of float32 ranges (calibrated, finite, within half the float32
        range): float32 scales rounded to ``spec.scale_dtype``; int32 zero points (float32 in the
        float zero-point domain)."""
        qmin, qmax = spec.qrange
        eps = spec.eps  # torch.ao's max(scale, eps) against its float32 eps buffer
        if spec.mapping == "asymmetric" and spec.zero_point_domain == "float":
            scale = (max_val - min_val) / float(qmax - qmin)
            scale = torch.where(scale > eps, scale, torch.ones_like(scale))
            return round_scale(scale, getattr(torch, spec.scale_dtype)), -1 * min_val / scale
        min_val_neg = min_val.clamp(max=0.0)
        max_val_pos = max_val.clamp(min=0.0)
        if spec.mapping == "asymmetric":
            scale = ((max_val_pos - min_val_neg) / float(qmax - qmin)).clamp_min(eps)
            # in int64: an int32 target's codes span 2**32, past what int32 holds (torch.ao wraps)
            zero_point = qmin - torch.round(min_val_neg / scale).to(torch.int64)
            zero_point = torch.clamp(zero_point, qmin, qmax).to(torch.int32)
        else:
            if spec.mapping == "symmetric_no_clipping_err":
                scale_from_min = min_val_neg / float(qmin)
                scale_from_max = max_val_pos / float(qmax)
                scale = torch.where(scale_from_min > scale_from_max, scale_from_min, scale_from_max)
            else:  # "symmetric", "narrow"
                scale = torch.max(-min_val_neg, max_val_pos) / (float(qmax - qmin) / 2)
            scale = scale.clamp_min(eps)
            zero_point = torch.full_like(scale, spec.zero_point_of_symmetric, dtype=torch.int32)
        if spec.zero_point_domain == "none":
            zero_point = torch.zeros_like(scale, dtype=torch.int32)
        return round_scale(scale, getattr(torch, spec.scale_dtype)), zero_point

    # ----------------------------------------------------------------------------------------
    # codes
    def codes(self, view: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, spec):
        """``(unclamped, codes)`` of ``view`` under broadcast qparams, as float tensors; integer codes of a
        float64 view in float64 (with the float32 reciprocal, as torch's kernels), others in float32.
        """
        if spec.is_float:
            fmax = spec.float_format.max
            scaled = view.float() / scale
            return scaled, scaled.clamp(-fmax, fmax).to(spec.float_format.torch_dtype).float()
        v = _formats.working(view)
        if spec.zero_point_domain == "float":
            unclamped = torch.round(v * (1.0 / scale) + zero_point)
        else:
            unclamped = torch.round(v * (1.0 / scale)) + zero_point.to(v.dtype)
        return unclamped, unclamped.clamp(*spec.qrange)

    def dequantize(self, codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, spec) -> torch.Tensor:
        """Values of ``codes`` (those `quantize` stores, or `codes`' float ones): float32, or
        float64 for float64 integer codes (as torch's per-channel fake-quant kernel). Float codes
        times their float32 scale, unsaturated, as torchao's ``_dequantize_affine_float8`` and
        compressed-tensors' ``dequantize``: an Inf scale, or one whose largest code overflows float32,
        gives +-Inf (NaN at code 0), as there (`qstats.dequantize` saturates only where a bf16/fp16
        scale rounded up past float32's largest value)."""
        if spec.is_float:
            return codes.float() * scale
        codes = _formats.working(codes)
        return (codes - zero_point.to(codes.dtype)) * scale

    def gradient_range(self, spec) -> tuple:
        """The bounds inside which `fake_quantize` passes the gradient (unclamped codes)."""
        return (-spec.float_format.max, spec.float_format.max) if spec.is_float else spec.qrange

    # ----------------------------------------------------------------------------------------
    # block formats (qstats/_formats.py)
    def block_scaled(self, view: torch.Tensor, scale: torch.Tensor, spec) -> torch.Tensor:
        """``view`` (bf16, fp16, float32 or float64) divided by its block scales (e8m0 or one level of
        fp8 scales; emulated fp6/fp4 elements), before saturation and rounding to the element format."""
        return view / scale

    def e8m0_scale(self, amax: torch.Tensor, spec) -> torch.Tensor:
        """Power-of-two (MX) scales of blocks of absolute maximum ``amax`` (float32)."""
        return _formats.e8m0_scale(amax, spec)


def saturate(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Float ``t`` clamped to ``dtype``'s finite range (unchanged where it lies within it)."""
    limit = torch.finfo(dtype).max
    return t if limit >= torch.finfo(t.dtype).max else t.clamp(-limit, limit)


def round_scale(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``scale`` rounded to the scale dtype ``dtype`` (held as float32)."""
    if dtype in (torch.float8_e4m3fn, torch.float16, torch.bfloat16):
        # narrow exponent ranges: the largest finite scale instead of an overflow to Inf or NaN,
        # and the smallest positive one (a subnormal) instead of an underflow to zero (the eps
        # floor, applied in float32, lies below it for float8: 2**-9); bfloat16 rounds float32
        # scales past its largest value (a one-bit target's peak / 0.5 near 3.4e38) to Inf
        finfo = torch.finfo(dtype)
        scale = scale.clamp(finfo.tiny * finfo.eps, finfo.max)
    return scale.to(dtype).float()


# --------------------------------------------------------------------------------------------
# checks conventions compose in `Convention.validate`
def check_float_mapping(spec) -> None:
    """Float targets take symmetric mappings only."""
    if spec.is_float and spec.mapping == "asymmetric":
        raise ValueError(f"QuantSpec.mapping: float target {spec.dtype!r} supports symmetric mappings only")


def check_range_within_dtype(spec) -> None:
    """A custom integer range lies within the dtype's own range."""
    if spec.is_float or spec.quant_min is None:
        return
    lo, hi = spec.dtype_range
    if spec.quant_min < lo or spec.quant_max > hi:
        raise ValueError(
            f"QuantSpec.quant_min/quant_max: [{spec.quant_min}, {spec.quant_max}] exceeds the "
            f"range [{lo}, {hi}] of {spec.dtype!r}"
        )


def check_float_zero_point(spec, name: str) -> None:
    """A float zero point (``zero_point = -min / scale``, torch.ao and torchao) puts the observed
    minimum at code 0: the range must start there."""
    if spec.is_float or spec.zero_point_domain != "float" or spec.mapping != "asymmetric":
        return
    qmin, qmax = spec.qrange
    if qmin != 0:
        raise ValueError(
            f"QuantSpec.zero_point_domain: the {name} float zero point puts the observed "
            f"minimum at code 0, so the range [{qmin}, {qmax}] of {spec.dtype!r} would clip the data above "
            f"min + {qmax} steps; use an unsigned target or quant_min=0 (torch.ao and torchao take float "
            "zero points with unsigned targets), or convention='compressed_tensors'"
        )


def check_zero_point_kept(spec, name: str, unsigned_symmetric: bool = False) -> None:
    """``zero_point_domain="none"`` (every zero point 0) only where the mapping's zero point is 0: an
    asymmetric integer scale spans ``max - min`` over ``qmax - qmin`` steps, so zero point 0 clips up to
    half the range (int8 over [0, 10]: everything above 5); with ``unsigned_symmetric``, also a symmetric
    mapping onto an unsigned range (uint8: zero point 128; 0 clips every negative value)."""
    if spec.is_float or spec.zero_point_domain != "none":
        return
    if spec.mapping == "asymmetric" or (unsigned_symmetric and spec.zero_point_of_symmetric != 0):
        needed = "an asymmetric mapping" if spec.mapping == "asymmetric" else (
            f"the symmetric mapping of {spec.dtype!r} (zero point {spec.zero_point_of_symmetric})")
        raise ValueError(
            f"QuantSpec.zero_point_domain 'none': {needed} needs its zero point, and the {name} convention "
            "would use 0, clipping part of the observed range; use zero_point_domain='int', or a symmetric "
            "mapping onto a signed target"
        )


def check_preserve_zero(spec, convention) -> None:
    """``preserve_zero=False`` only where the convention maps ranges without zero (torchao), with
    an integer target, an asymmetric mapping and an integer zero point."""
    if spec.preserve_zero:
        return
    if not convention.maps_ranges_without_zero:
        raise ValueError(
            f"QuantSpec.preserve_zero=False: the {convention.name} convention keeps zero in every range; "
            "use convention='torchao'"
        )
    if spec.is_float or spec.mapping != "asymmetric" or spec.zero_point_domain != "int":
        raise ValueError(
            "QuantSpec.preserve_zero=False needs an integer target, mapping 'asymmetric' and "
            f"zero_point_domain 'int' (got {spec.dtype!r}, {spec.mapping!r}, {spec.zero_point_domain!r})"
        )


def check_symmetric_zero_point(spec, fixed: tuple = ()) -> None:
    """``symmetric_zero_point`` lies in the range (or is one of ``fixed``)."""
    zero = spec.symmetric_zero_point
    if zero is None:
        return
    lo, hi = spec.qrange
    if not (lo <= zero <= hi or zero in fixed):
        raise ValueError(f"QuantSpec.symmetric_zero_point {zero} lies outside the range [{lo}, {hi}]")
