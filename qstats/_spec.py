"""QuantSpec: the static, hashable description of a quantization target.

A spec names the element format (``dtype``), how the range maps onto it (``mapping``), where the
zero point lives (``zero_point_domain``), the granularity, range overrides and the numerical
convention. Invalid specs raise ValueError naming the field, at construction.

Conventions select bit-exact formulas where libraries differ:

- ``"torch_ao"`` (default): ``torch.ao.quantization`` observers' ``_calculate_qparams``: the range
  always contains zero, ``scale = max(range / (qmax - qmin), eps)``, integer zero points are
  ``qmin - round(min / scale)`` clamped to the range.
- ``"compressed_tensors"``: compressed-tensors' ``calculate_qparams``: no eps floor before the
  zero point, zero scales replaced by the scale dtype's eps afterwards, zero points rounded last.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Optional

import torch

from ._granularity import Granularity, PerAxis, PerBlock, PerGroup, PerTensor, PerToken, TensorGroup
from ._torch_features import torch_dtype

__all__ = ["QuantSpec", "FloatFormat", "float_format"]

_FLOAT32_EPS = float(torch.finfo(torch.float32).eps)
_FLOAT32_TINY = float(torch.finfo(torch.float32).tiny)
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)

MAPPINGS = ("symmetric", "asymmetric", "symmetric_no_clipping_err", "narrow")
ZERO_POINT_DOMAINS = ("int", "float", "none")
CONVENTIONS = ("torch_ao", "compressed_tensors", "torchao")
NONFINITE_POLICIES = ("ignore", "raise")
UNCALIBRATED_POLICIES = ("raise", "fallback")
SCALE_DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn", "e8m0")


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


_TORCH_DTYPE_NAMES = {
    torch.int8: "int8",
    torch.qint8: "int8",
    torch.uint8: "uint8",
    torch.quint8: "uint8",
    torch.quint4x2: "uint4",
    torch.int16: "int16",
    torch.uint16: "uint16",
    torch.int32: "int32",
    torch.qint32: "int32",
    torch.float8_e4m3fn: "fp8_e4m3fn",
    torch.float8_e5m2: "fp8_e5m2",
    torch.float8_e4m3fnuz: "fp8_e4m3fnuz",
    torch.float8_e5m2fnuz: "fp8_e5m2fnuz",
}
if torch_dtype("float4_e2m1fn_x2") is not None:  # torch >= 2.8; the name "fp4_e2m1" works on any torch
    _TORCH_DTYPE_NAMES[torch_dtype("float4_e2m1fn_x2")] = "fp4_e2m1"

_INT_RE = re.compile(r"^(u?)int(\d+)$")


def _parse_int_dtype(name: str) -> Optional[tuple[bool, int]]:
    match = _INT_RE.match(name)
    if match is None:
        return None
    return match.group(1) == "", int(match.group(2))


@dataclasses.dataclass(frozen=True)
class QuantSpec:
    """A quantization target. Frozen and hashable: it is static configuration, never state.

    Args:
      dtype: ``"int1"`` ... ``"int16"`` (and ``"int32"``), ``"uint1"`` ... ``"uint16"``,
        ``"fp8_e4m3fn"``, ``"fp8_e5m2"``; a torch dtype is accepted and normalised.
      mapping: ``"symmetric"``, ``"asymmetric"``, ``"symmetric_no_clipping_err"`` (torchao: the
        scale covers both ends without clipping either) or ``"narrow"`` (symmetric with
        ``qmin = -qmax``).
      granularity: a `Granularity` (default `PerTensor()`).
      zero_point_domain: ``"int"`` (integer zero point), ``"float"`` (float zero point, torch.ao
        ``per_channel_affine_float_qparams``: ``zero_point = -min / scale``), or ``"none"``.
      quant_min, quant_max: override the integer range (both or neither).
      reduce_range: halve the range (torch.ao's x86 ``reduce_range``).
      eps: smallest scale (float32-rounded).
      scale_dtype: dtype the scale is rounded to (``"float32"``, ``"bfloat16"``, ``"float16"``,
        ``"float8_e4m3fn"``).
      convention: ``"torch_ao"``, ``"compressed_tensors"`` or ``"torchao"`` (see module docs).
      nonfinite: ``"ignore"`` (default: NaN/Inf are left out of statistics and counted) or
        ``"raise"`` (ValueError on a non-finite value; reads the value on the host).
      on_uncalibrated: ``"raise"`` (default: `compute_qparams` raises when a parameter saw no
        data) or ``"fallback"`` (scale 1, zero point 0, reported in ``QParams.calibrated``).
      symmetric_zero_point: zero point of symmetric mappings onto unsigned ranges; default is the
        upper midpoint ``(qmin + qmax + 1) // 2`` (128 for uint8, as torch.ao).
      scale_rounding: how ``scale_dtype="e8m0"`` (power-of-two, MX) scales are rounded:
        ``"floor"`` (default, OCP MX), ``"ceil"``, ``"even"``, ``"rceil"`` (torchao's modes) or
        ``"round_then_floor"`` (compressed-tensors) or ``"round"`` (torchao float8 e8m0 scales);
        see ``qstats/_formats.py``.
      global_scale_formula: two-level (`TensorGroup`, NVFP4) global scale: ``"amax_over_range"``
        (default; torchao/ModelOpt ``amax / (448 * 6)``, effective scale ``scale * global``) or
        ``"range_over_amax"`` (compressed-tensors ``448 * 6 / amax``, effective ``scale / global``).
      compute_dtype: ``"float32"`` (default), ``"bfloat16"`` or ``"float16"``: with
        ``convention="torchao"``, integer qparams and codes are computed in this dtype, as torchao
        computes in the input's dtype (``from_torchao(input_dtype=torch.bfloat16)``); with
        ``convention="compressed_tensors"`` qparams and codes are computed in it as
        compressed-tensors does for weights of that dtype
        (``from_compressed_tensors(args, observed_dtype=torch.bfloat16)``).

    >>> spec = QuantSpec(dtype="int8", mapping="symmetric", granularity=PerAxis(0))
    >>> spec.qmin, spec.qmax
    (-128, 127)
    """

    dtype: Any = "int8"
    mapping: str = "symmetric"
    granularity: Granularity = PerTensor()
    zero_point_domain: str = "int"
    quant_min: Optional[int] = None
    quant_max: Optional[int] = None
    reduce_range: bool = False
    eps: float = _FLOAT32_EPS
    scale_dtype: str = "float32"
    convention: str = "torch_ao"
    nonfinite: str = "ignore"
    on_uncalibrated: str = "raise"
    symmetric_zero_point: Optional[int] = None
    scale_rounding: str = "floor"
    global_scale_formula: str = "amax_over_range"
    compute_dtype: str = "float32"

    def __post_init__(self) -> None:
        dtype = self.dtype
        if isinstance(dtype, torch.dtype):
            if dtype not in _TORCH_DTYPE_NAMES:
                raise ValueError(f"QuantSpec.dtype: torch dtype {dtype} is not a quantization target")
            dtype = _TORCH_DTYPE_NAMES[dtype]
            object.__setattr__(self, "dtype", dtype)
        if not isinstance(dtype, str):
            raise ValueError(f"QuantSpec.dtype must be a string or torch dtype, got {dtype!r}")
        parsed = _parse_int_dtype(dtype)
        if parsed is not None:
            signed, bits = parsed
            if not (1 <= bits <= 16 or (bits == 32 and signed)):
                raise ValueError(
                    f"QuantSpec.dtype: integer targets have 1 to 16 bits (or are int32), got {dtype!r}"
                )
        elif dtype not in _FLOAT_FORMATS:
            raise ValueError(
                f"QuantSpec.dtype: unknown target {dtype!r}; use 'int<bits>', 'uint<bits>' or one of "
                f"{sorted(_FLOAT_FORMATS)}"
            )
        if self.mapping not in MAPPINGS:
            raise ValueError(f"QuantSpec.mapping must be one of {MAPPINGS}, got {self.mapping!r}")
        if self.zero_point_domain not in ZERO_POINT_DOMAINS:
            raise ValueError(
                f"QuantSpec.zero_point_domain must be one of {ZERO_POINT_DOMAINS}, got {self.zero_point_domain!r}"
            )
        if not isinstance(self.granularity, Granularity):
            raise ValueError(f"QuantSpec.granularity must be a Granularity, got {self.granularity!r}")
        self.granularity.validate()
        if self.convention not in CONVENTIONS:
            raise ValueError(f"QuantSpec.convention must be one of {CONVENTIONS}, got {self.convention!r}")
        if self.nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"QuantSpec.nonfinite must be one of {NONFINITE_POLICIES}, got {self.nonfinite!r}")
        if self.on_uncalibrated not in UNCALIBRATED_POLICIES:
            raise ValueError(
                f"QuantSpec.on_uncalibrated must be one of {UNCALIBRATED_POLICIES}, got {self.on_uncalibrated!r}"
            )
        if self.scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"QuantSpec.scale_dtype must be one of {SCALE_DTYPES}, got {self.scale_dtype!r}")
        if not isinstance(self.reduce_range, bool):
            raise ValueError(f"QuantSpec.reduce_range must be a bool, got {self.reduce_range!r}")
        if not (
            isinstance(self.eps, (int, float))
            and not isinstance(self.eps, bool)
            and 0 < self.eps <= _FLOAT32_MAX  # also rules out NaN and inf
        ):
            raise ValueError(f"QuantSpec.eps must be a positive, finite float32 value, got {self.eps!r}")
        if self.eps < _FLOAT32_TINY:
            raise ValueError(
                f"QuantSpec.eps must be at least {_FLOAT32_TINY:.4g} (the smallest normal float32, so that "
                f"1 / scale stays finite), got {self.eps!r}"
            )
        if (self.quant_min is None) != (self.quant_max is None):
            raise ValueError("QuantSpec.quant_min and QuantSpec.quant_max must be given together")
        if self.quant_min is not None:
            for name in ("quant_min", "quant_max"):
                value = getattr(self, name)
                if not isinstance(value, int) or isinstance(value, bool):
                    raise ValueError(f"QuantSpec.{name} must be an int, got {value!r}")
            if not self.quant_min <= 0 <= self.quant_max:
                raise ValueError(
                    f"QuantSpec.quant_min/quant_max: the range [{self.quant_min}, {self.quant_max}] must contain 0"
                )
            if self.quant_min >= self.quant_max:
                raise ValueError(
                    f"QuantSpec.quant_min ({self.quant_min}) must be smaller than quant_max ({self.quant_max})"
                )
        if self.is_float:
            if self.mapping == "asymmetric" and self.convention != "compressed_tensors":
                raise ValueError(f"QuantSpec.mapping: float target {dtype!r} supports symmetric mappings only")
            if self.zero_point_domain == "float":
                raise ValueError(f"QuantSpec.zero_point_domain: float target {dtype!r} has no float zero point")
        else:
            lo, hi = self._native_range()
            if self.quant_min is not None and self.convention != "torch_ao":
                if self.quant_min < lo or self.quant_max > hi:
                    raise ValueError(
                        f"QuantSpec.quant_min/quant_max: [{self.quant_min}, {self.quant_max}] exceeds the "
                        f"range [{lo}, {hi}] of {dtype!r}"
                    )
        if self.mapping in ("symmetric_no_clipping_err", "narrow") and not self.is_float and not self.is_signed:
            raise ValueError(f"QuantSpec.mapping {self.mapping!r} needs a signed target, got {dtype!r}")
        if not self.is_float:
            if self.reduce_range and self.quant_min is None and self.bits < 2:
                raise ValueError(f"QuantSpec.reduce_range: {dtype!r} has one bit, nothing to halve")
            qmin, qmax = self.qrange
            if not qmin < qmax:
                raise ValueError(
                    f"QuantSpec: dtype {dtype!r}, mapping {self.mapping!r}, reduce_range {self.reduce_range}"
                    f" and quant_min/quant_max ({self.quant_min}, {self.quant_max}) leave the range "
                    f"[{qmin}, {qmax}], which holds fewer than two values"
                )
            float_zero = self.zero_point_domain == "float" and self.mapping == "asymmetric"
            if float_zero and self.convention in ("torch_ao", "torchao") and qmin != 0:
                raise ValueError(
                    f"QuantSpec.zero_point_domain: the {self.convention} float zero point puts the observed "
                    f"minimum at code 0, so the range [{qmin}, {qmax}] of {dtype!r} would clip the data above "
                    f"min + {qmax} steps; use an unsigned target or quant_min=0 (torch.ao and torchao take float "
                    "zero points with unsigned targets), or convention='compressed_tensors'"
                )
        if self.symmetric_zero_point is not None:
            zero = self.symmetric_zero_point
            if not isinstance(zero, int) or isinstance(zero, bool):
                raise ValueError(f"QuantSpec.symmetric_zero_point must be an int, got {zero!r}")
            if self.is_float:
                raise ValueError(f"QuantSpec.symmetric_zero_point {zero}: float target {dtype!r} has no zero point")
            lo, hi = self.qrange
            # torch.ao's fixed zero points (128 for uint8, 2**15 for uint16) stay when reduce_range
            # or a custom range leaves them outside the range: from_torch_ao reproduces that
            torch_ao_fixed = self.convention == "torch_ao" and zero in (128, 2**15)
            if not (lo <= zero <= hi or torch_ao_fixed):
                raise ValueError(f"QuantSpec.symmetric_zero_point {zero} lies outside the range [{lo}, {hi}]")
        from . import _formats

        _formats.validate(self)

    # ----------------------------------------------------------------------------------------
    @property
    def is_float(self) -> bool:
        """True for floating-point element formats (fp8, ...)."""
        return self.dtype in _FLOAT_FORMATS

    @property
    def is_signed(self) -> bool:
        if self.is_float:
            return True
        return _parse_int_dtype(self.dtype)[0]

    @property
    def bits(self) -> int:
        if self.is_float:
            fmt = _FLOAT_FORMATS[self.dtype]
            return 1 + fmt.exponent_bits + fmt.mantissa_bits
        return _parse_int_dtype(self.dtype)[1]

    @property
    def float_format(self) -> Optional[FloatFormat]:
        return _FLOAT_FORMATS.get(self.dtype)

    def _native_range(self) -> tuple[int, int]:
        signed, bits = _parse_int_dtype(self.dtype)
        if signed:
            return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
        return 0, 2**bits - 1

    @property
    def qrange(self) -> tuple:
        """``(qmin, qmax)`` after overrides, ``reduce_range`` and the mapping (numbers)."""
        if self.is_float and self.quant_min is None:
            fmax = _FLOAT_FORMATS[self.dtype].max
            return -fmax, fmax
        if self.quant_min is not None:
            lo, hi = self.quant_min, self.quant_max
        else:
            lo, hi = self._native_range()
        if self.reduce_range:
            if self.quant_min is not None:
                lo, hi = lo // 2, hi // 2
            else:
                signed, bits = _parse_int_dtype(self.dtype)
                lo, hi = (-(2 ** (bits - 2)), 2 ** (bits - 2) - 1) if signed else (0, 2 ** (bits - 1) - 1)
        if self.mapping == "narrow":
            lo = -hi
        return lo, hi

    @property
    def qmin(self):
        return self.qrange[0]

    @property
    def qmax(self):
        return self.qrange[1]

    @property
    def zero_point_of_symmetric(self) -> int:
        """Zero point used by symmetric mappings (0 for signed targets)."""
        if self.symmetric_zero_point is not None:
            return self.symmetric_zero_point
        if self.is_signed:
            return 0
        lo, hi = self.qrange
        return (lo + hi + 1) // 2

    def replace(self, **changes) -> "QuantSpec":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    # ----------------------------------------------------------------------------------------
    @classmethod
    def from_torch_ao(
        cls,
        dtype=torch.quint8,
        qscheme=torch.per_tensor_affine,
        reduce_range: bool = False,
        quant_min: Optional[int] = None,
        quant_max: Optional[int] = None,
        eps: float = _FLOAT32_EPS,
        ch_axis: int = 0,
        **overrides,
    ) -> "QuantSpec":
        """The spec whose `compute_qparams` equals torch.ao's observers' ``calculate_qparams``.

        Accepts exactly what torch.ao's MinMax/MovingAverage/PerChannel observers accept and
        raises ValueError for every combination they refuse.
        """
        from . import _compat_torch_ao

        return _compat_torch_ao.spec_from_torch_ao(
            cls, dtype, qscheme, reduce_range, quant_min, quant_max, eps, ch_axis, overrides
        )

    @classmethod
    def from_compressed_tensors(cls, args, **overrides) -> "QuantSpec":
        """The spec whose `compute_qparams` equals compressed-tensors' ``calculate_qparams``.

        ``args`` is a ``compressed_tensors.quantization.QuantizationArgs`` (or a dict of its fields).
        Pass ``observed_dtype=weight.dtype`` for bfloat16/float16 weights: compressed-tensors
        computes their qparams (and stores their scales) in that dtype.
        """
        from . import _compat_compressed_tensors

        return _compat_compressed_tensors.spec_from_compressed_tensors(cls, args, overrides)

    @classmethod
    def from_torchao(cls, target_dtype=None, **kwargs) -> "QuantSpec":
        """The spec whose `compute_qparams` and `quantize` equal torchao's.

        Affine integer targets take ``choose_qparams_affine``'s arguments (``mapping_type``,
        ``granularity`` or ``block_size`` with ``shape``, ``zero_point_domain``, ``quant_min``,
        ``quant_max``, ``eps``, ``scale_dtype``, ``input_dtype``); MX takes ``to_mx``'s
        (``elem_dtype``, ``block_size``, ``scaling_mode``); NVFP4 takes ``nvfp4=True`` (and
        ``per_tensor_scale=True``). See ``qstats/_compat_torchao.py``.
        """
        from . import _compat_torchao

        return _compat_torchao.spec_from_torchao(cls, target_dtype, kwargs)


# Granularities re-exported here for convenience in type checks.
_GRANULARITIES = (PerTensor, PerAxis, PerGroup, PerBlock, PerToken, TensorGroup)
