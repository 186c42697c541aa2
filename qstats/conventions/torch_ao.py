"""The torch.ao convention (``"torch_ao"``, the default) and `from_torch_ao`.

`from_torch_ao` mirrors the validation and range arithmetic of torch.ao's min/max and histogram
observers (torch/ao/quantization/observer.py, ``calculate_qmin_qmax``), accepting what any of them
accepts, so that `compute_qparams` reproduces their ``calculate_qparams`` bit for bit, quirks
included (docs/formats.md). Combinations torch.ao builds but cannot use (Inf/NaN/zero scales, zero
points outside int32) raise ValueError (docs/differences.md).
"""

from __future__ import annotations

import torch

from .._granularity import PerAxis, PerTensor
from .default import (
    Convention,
    check_float_mapping,
    check_float_zero_point,
    check_preserve_zero,
    check_symmetric_zero_point,
    check_zero_point_kept,
)

__all__ = ["PER_CHANNEL_QSCHEMES", "TorchAOConvention", "from_torch_ao"]

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_PER_TENSOR = (torch.per_tensor_affine, torch.per_tensor_symmetric)
PER_CHANNEL_QSCHEMES = (torch.per_channel_affine, torch.per_channel_symmetric, torch.per_channel_affine_float_qparams)
_SYMMETRIC = (torch.per_tensor_symmetric, torch.per_channel_symmetric)
# calculate_qmin_qmax without a custom range (other dtypes: (0, 15)); reduce_range halves 8-bit ones
_DEFAULT_RANGES = {
    **dict.fromkeys((torch.qint8, torch.int8), (-128, 127)),
    **dict.fromkeys((torch.quint8, torch.uint8), (0, 255)),
    **dict.fromkeys((torch.qint32, torch.int32), (_INT32_MIN, _INT32_MAX)),
    torch.uint16: (0, 2**16 - 1),
    torch.int16: (-(2**15), 2**15 - 1),
}
# what torch.ao's observers accept: the dtypes above, and those with the range (0, 15)
_ALLOWED_DTYPES = (*_DEFAULT_RANGES, torch.quint4x2, torch.float8_e5m2, torch.float8_e4m3fn)
_REDUCIBLE = (torch.qint8, torch.int8, torch.quint8, torch.uint8)


def _torch_ao_range(dtype, quant_min, quant_max, reduce_range):
    custom = quant_min is not None and quant_max is not None
    if custom:
        if not quant_min <= 0 <= quant_max:
            raise ValueError("from_torch_ao: user-specified quantization range must include 0")
        if quant_min >= quant_max:
            raise ValueError("from_torch_ao: quant_min must be strictly less than quant_max")
        qrange_len = quant_max - quant_min + 1
        if dtype in (torch.qint8, torch.int8) and not 0 < qrange_len <= 256:
            raise ValueError("from_torch_ao: quantization range exceeds the maximum bit range (=256) of int8")
        if dtype in (torch.qint32, torch.int32) and not 0 < qrange_len <= 2**32:
            raise ValueError("from_torch_ao: quantization range exceeds the maximum bit range of int32")
        lo, hi = quant_min, quant_max
    else:
        lo, hi = _DEFAULT_RANGES.get(dtype, (0, 15))
    if reduce_range and (custom or dtype in _REDUCIBLE):
        lo, hi = lo // 2, hi // 2
        if lo == hi:
            # torch.ao accepts it and returns an Inf or NaN scale.
            raise ValueError(
                f"from_torch_ao: reduce_range halves the range to the single value {lo}; "
                "use a range of at least 2 values per half"
            )
    return custom, lo, hi


# torch.ao observers' arguments that configure the observer, not the target (qstats' observer
# factories take them)
_OBSERVER_ARGUMENTS = ("averaging_constant", "bins", "upsample_rate")


def _drop_observer_arguments(overrides):
    """``overrides`` without torch.ao's observer-only arguments: ``factory_kwargs`` (its buffers'
    device) and ``is_dynamic=False`` are ignored; ``is_dynamic=True`` and the observers' own settings
    raise ValueError naming them and where they go (they read as unknown QuantSpec fields)."""
    overrides = dict(overrides)
    overrides.pop("factory_kwargs", None)
    if overrides.pop("is_dynamic", False) is not False:
        raise ValueError(
            "from_torch_ao: is_dynamic=True: a QuantSpec says how scales are computed, not when; declare "
            "the site dynamic with qstats.Rule(..., dynamic=True)"
        )
    given = sorted(set(overrides) & set(_OBSERVER_ARGUMENTS))
    if given:
        raise ValueError(
            f"from_torch_ao: {', '.join(given)}: arguments of torch.ao's observers, not of the quantization "
            "target; give them to qstats' observer (qstats.moving_average_minmax(spec, averaging_constant=...), "
            "qstats.histogram(spec, ...): docs/migrating_torch_ao.md)"
        )
    return overrides


def _float32_eps(eps):
    """``eps`` rounded to float32, as torch.ao keeps it; ValueError naming the ``eps`` given where the
    rounded value is 0, subnormal or Inf (torch.ao's scale of constant data is then 0, or its inverse
    Inf; QuantSpec named only the rounded value)."""
    try:
        rounded = float(torch.tensor(eps, dtype=torch.float32))
    except (TypeError, ValueError, RuntimeError):
        return eps  # not a number: QuantSpec names it
    tiny = torch.finfo(torch.float32).tiny
    if eps > 0 and not tiny <= rounded < float("inf"):
        raise ValueError(f"from_torch_ao: eps {eps!r} is {rounded} in float32, as torch.ao keeps it; give one from "
                         f"{tiny:.4g} (the smallest normal float32, so that 1 / scale stays finite) to "
                         f"{torch.finfo(torch.float32).max:.4g}")
    return rounded


def from_torch_ao(cls, dtype, qscheme, reduce_range, quant_min, quant_max, eps, ch_axis, overrides):
    """The ``cls`` (QuantSpec) whose `compute_qparams` equals torch.ao's observers'
    ``calculate_qparams`` (see `QuantSpec.from_torch_ao`)."""
    overrides = _drop_observer_arguments(overrides)
    if dtype not in _ALLOWED_DTYPES:
        raise ValueError(f"from_torch_ao: dtype {dtype} is not accepted by torch.ao observers ({_ALLOWED_DTYPES})")
    if qscheme not in _PER_TENSOR + PER_CHANNEL_QSCHEMES:
        raise ValueError(f"from_torch_ao: qscheme {qscheme} is not accepted by torch.ao observers")
    if reduce_range and dtype == torch.quint8 and qscheme == torch.per_channel_symmetric:
        # every per-channel observer refuses it; per tensor, MinMaxObserver refuses it but
        # HistogramObserver takes it (the range (0, 127) with torch.ao's fixed zero point 128)
        raise ValueError("from_torch_ao: torch.ao cannot reduce range for symmetric quantization of quint8 per channel")
    custom, lo, hi = _torch_ao_range(dtype, quant_min, quant_max, reduce_range)

    if dtype in (torch.quint8, torch.uint8):
        symmetric_zero_point = (lo + hi) // 2 if custom else 128
    elif dtype == torch.uint16:
        # torch.ao's fixed 2**15; its affine observers take a signed custom range too, where an affine
        # spec reads no symmetric zero point and 2**15 would lie outside the range (a ValueError before)
        symmetric_zero_point = 2**15 if lo >= 0 or qscheme in _SYMMETRIC else None
    else:
        symmetric_zero_point = 0

    if qscheme in (torch.per_tensor_affine, torch.per_channel_affine) and not _INT32_MIN <= lo < hi <= _INT32_MAX:
        # torch.ao constructs the observer, then its calculate_qparams fails clamping to the range.
        raise ValueError(f"from_torch_ao: affine quantization range [{lo}, {hi}] exceeds the int32 range")
    if qscheme in _SYMMETRIC and not _INT32_MIN <= symmetric_zero_point <= _INT32_MAX:
        # torch.ao returns this zero point in an int64 tensor; no quantized tensor can hold it.
        raise ValueError(
            f"from_torch_ao: the symmetric zero point {symmetric_zero_point} of the range [{lo}, {hi}] "
            "exceeds the int32 range"
        )

    # The integer target that holds [lo, hi]; float8/quint4x2 keep torch.ao's (0, 15) arithmetic.
    if lo < 0:
        bits = max(int(hi).bit_length(), int(-lo - 1).bit_length()) + 1
        target = f"int{bits if bits <= 16 else 32}"
    else:
        bits = max(int(hi).bit_length(), 1)
        target = f"uint{bits}" if bits <= 16 else "int32"

    fields = dict(
        dtype=target,
        mapping="symmetric" if qscheme in _SYMMETRIC else "asymmetric",
        granularity=PerTensor() if qscheme in _PER_TENSOR else PerAxis(ch_axis),
        zero_point_domain="float" if qscheme == torch.per_channel_affine_float_qparams else "int",
        quant_min=lo,
        quant_max=hi,
        reduce_range=False,
        eps=_float32_eps(eps),
        convention="torch_ao",
        symmetric_zero_point=symmetric_zero_point,
        on_uncalibrated="fallback",
    )
    return cls(**{**fields, **overrides})  # the overrides win


# --------------------------------------------------------------------------------------------
# Fake quantization where float32 arithmetic does not reproduce torch's kernels: float zero points
# and ranges wider than 2**24 (int32) take the exact kernel arithmetic below; integer zero points in
# narrower ranges equal `Convention`'s float32 formula. Values past 2**63: docs/differences.md.
_FLOAT32_EXACT_INTEGERS = 2**24


def _exact_kernel(spec) -> bool:
    """True for integer specs whose fake quantization needs the exact kernel arithmetic."""
    if spec.is_float:
        return False
    qmin, qmax = spec.qrange
    return spec.zero_point_domain == "float" or max(-qmin, qmax) > _FLOAT32_EXACT_INTEGERS


def _fixed_zero_points(spec) -> tuple:
    """torch.ao's fixed symmetric zero points that may lie outside the range: 128 of quint8 with
    ``reduce_range`` (codes 0-127), 2**15 of uint16 (whose custom range may be any unsigned one within
    16 bits; a signed range never takes it)."""
    if spec.is_float:
        return ()
    qmin, qmax = spec.qrange
    return ((128,) if (qmin, qmax) == (0, 127) else ()) + ((2**15,) if 0 <= qmin and qmax < 2**16 else ())


class TorchAOConvention(Convention):
    """torch.ao's observers and fake-quant kernels, bit for bit. Custom ranges may exceed the dtype's own,
    and torch.ao's fixed symmetric zero points (128 for uint8, 2**15 for uint16) may lie outside the range.
    """

    name = "torch_ao"
    ranges_map_like_torch_ao = True

    def validate(self, spec) -> None:
        check_float_mapping(spec)
        check_float_zero_point(spec, self.name)
        check_symmetric_zero_point(spec, fixed=_fixed_zero_points(spec))
        if spec.compute_dtype != "float32":
            raise ValueError(
                f"QuantSpec.compute_dtype {spec.compute_dtype!r}: the torch_ao convention computes in float32, "
                "as torch.ao's observers and kernels; compute_dtype applies to the torchao and compressed_tensors "
                "conventions"
            )
        check_preserve_zero(spec, self)
        check_zero_point_kept(spec, self.name, unsigned_symmetric=True)

    def codes(self, view, scale, zero_point, spec):
        """As `Convention.codes`; with the exact kernel arithmetic, float64 codes (exact for
        every int32 code)."""
        if not _exact_kernel(spec):
            return super().codes(view, scale, zero_point, spec)
        if spec.zero_point_domain == "float":
            # lrintf(zero_point + x * inv_scale): compilers contract it to one fused multiply-add
            # (x86 AVX2/AVX512 and aarch64 builds of torch), i.e. the exact value rounded once to
            # float32; float64 holds the exact product, and rounds the sum once more only where it
            # needs more than 53 bits.
            inv_scale = (1.0 / scale).double()
            unclamped = torch.round((view.double() * inv_scale + zero_point.double()).float())
        else:  # Convention's (float64 inputs: x * inv_scale in float64, as the kernels), unclamped
            unclamped = super().codes(view, scale, zero_point, spec)[0]
        unclamped = unclamped.double()
        return unclamped, unclamped.clamp(*spec.qrange)

    def dequantize(self, codes, scale, zero_point, spec):
        """As `Convention.dequantize`, rounded as torch's kernels: the per-tensor product is float32 whatever
        the input dtype, the per-channel one is in the input's dtype.
        """
        per_tensor = isinstance(spec.granularity, PerTensor) and spec.zero_point_domain != "float"
        exact = _exact_kernel(spec)
        if per_tensor and not spec.is_float and (exact or codes.dtype == torch.float64):
            return (codes.double() - zero_point.double()).float() * scale
        if not exact:
            return super().dequantize(codes, scale, zero_point, spec)
        # rounded once to the output dtype (qstats/_quant.py)
        return (codes.double() - zero_point.double()) * scale.double()

    def gradient_range(self, spec) -> tuple:
        """The range against which torch's fake-quant kernels test a code: the per-tensor kernel
        compares its float32 code with the bounds converted to float32 (2**31 - 1 becomes 2**31),
        the per-channel one compares int64 codes, exactly."""
        if _exact_kernel(spec) and isinstance(spec.granularity, PerTensor):
            return tuple(float(torch.tensor(float(b), dtype=torch.float32)) for b in spec.qrange)
        return super().gradient_range(spec)
