"""QuantSpec: the static, hashable description of a quantization target.

Invalid specs raise ValueError naming the field, at construction. `preset` names the deployment
formats (NVFP4, MX, DeepSeek fp8). Fields: docs/observers.md.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Optional, Union

import torch

from . import conventions
from ._checks import is_integer, is_real_number
from ._formats import COMPUTE_DTYPES, GLOBAL_SCALE_FORMULAS, SCALE_ROUNDINGS, validate as validate_formats
# the element formats' table lives in _formats (its round_to_format reads names); kept importable from here
from ._formats import _FLOAT_FORMATS, FloatFormat, float_format
from ._granularity import Granularity, PerAxis, PerBlock, PerGroup, PerTensor, PerToken, TensorGroup
from ._torch_features import torch_dtype
from .conventions import Convention, compressed_tensors, coreai_opt, torch_ao, torchao

__all__ = ["QuantSpec", "FloatFormat", "float_format", "preset", "PRESETS"]

_FLOAT32_EPS = float(torch.finfo(torch.float32).eps)
_FLOAT32_TINY = float(torch.finfo(torch.float32).tiny)
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)

MAPPINGS = ("symmetric", "asymmetric", "symmetric_no_clipping_err", "narrow")
ZERO_POINT_DOMAINS = ("int", "float", "none")
NONFINITE_POLICIES = ("ignore", "raise")
UNCALIBRATED_POLICIES = ("raise", "fallback")
SCALE_DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn", "e8m0", "float64")
_CHOICES = {
    "mapping": MAPPINGS,
    "zero_point_domain": ZERO_POINT_DOMAINS,
    "nonfinite": NONFINITE_POLICIES,
    "on_uncalibrated": UNCALIBRATED_POLICIES,
    "scale_dtype": SCALE_DTYPES,
    "scale_rounding": SCALE_ROUNDINGS,
    "global_scale_formula": GLOBAL_SCALE_FORMULAS,
    "compute_dtype": COMPUTE_DTYPES,
}


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
    **{fmt.torch_dtype: name for name, fmt in _FLOAT_FORMATS.items() if fmt.torch_dtype is not None},
}
if torch_dtype("float4_e2m1fn_x2") is not None:  # torch >= 2.8; the name "fp4_e2m1" works on any torch
    _TORCH_DTYPE_NAMES[torch_dtype("float4_e2m1fn_x2")] = "fp4_e2m1"
# torch's sub-byte integer dtypes (torch.int4, torch.uint4, ...: torchao's and coreai_opt's targets)
_TORCH_DTYPE_NAMES.update(
    {torch_dtype(name): name for bits in range(1, 8) for name in (f"int{bits}", f"uint{bits}") if torch_dtype(name)}
)

_INT_RE = re.compile(r"^(u?)int([1-9][0-9]*)$")  # ASCII digits, no leading zero: one name per target


def _parse_int_dtype(name: str) -> Optional[tuple[bool, int]]:
    match = _INT_RE.match(name)
    if match is None:
        return None
    return match.group(1) == "", int(match.group(2))


def _dtype_name(dtype) -> str:
    """``QuantSpec.dtype`` as a target name (a torch dtype is normalised), checked."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _TORCH_DTYPE_NAMES:
            raise ValueError(f"QuantSpec.dtype: torch dtype {dtype} is not a quantization target")
        dtype = _TORCH_DTYPE_NAMES[dtype]
    if not isinstance(dtype, str):
        raise ValueError(f"QuantSpec.dtype must be a string or torch dtype, got {dtype!r}")
    parsed = _parse_int_dtype(dtype)
    if parsed is None and dtype not in _FLOAT_FORMATS:
        raise ValueError(
            f"QuantSpec.dtype: unknown target {dtype!r}; use 'int<bits>', 'uint<bits>' or one of "
            f"{sorted(_FLOAT_FORMATS)}"
        )
    if parsed is not None:
        signed, bits = parsed
        if not (1 <= bits <= 16 or (bits == 32 and signed)):
            raise ValueError(f"QuantSpec.dtype: integer targets have 1 to 16 bits (or are int32), got {dtype!r}")
    return dtype


_SCALE_DTYPE_ALIASES = {"float8_e8m0fnu": "e8m0"}  # torch's name of the e8m0 dtype


def _scale_dtype_name(scale_dtype):
    """``QuantSpec.scale_dtype`` as its name: a torch dtype (``torch.float8_e8m0fnu`` is ``"e8m0"``)
    or torch's name of it normalised, so that specs compare equal whichever form was given."""
    if isinstance(scale_dtype, torch.dtype):
        name = str(scale_dtype).replace("torch.", "")
        name = _SCALE_DTYPE_ALIASES.get(name, name)
        if name not in SCALE_DTYPES:
            raise ValueError(f"QuantSpec.scale_dtype: torch dtype {scale_dtype} is not a scale format; use one of {SCALE_DTYPES}")
        return name
    return _SCALE_DTYPE_ALIASES.get(scale_dtype, scale_dtype) if isinstance(scale_dtype, str) else scale_dtype


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class QuantSpec:
    """A quantization target. Frozen and hashable: it is static configuration, never state.

    Args:
      dtype: ``"int1"`` ... ``"int16"``, ``"int32"``, ``"uint1"`` ... ``"uint16"`` or a float format
        (``"fp8_e4m3fn"``, ``"fp4_e2m1"``, ...: docs/formats.md); torch dtypes are normalised.
      mapping: ``"symmetric"``, ``"asymmetric"``, ``"symmetric_no_clipping_err"`` (torchao: the
        scale covers both ends without clipping either) or ``"narrow"`` (symmetric with
        ``qmin = -qmax``).
      granularity: a `Granularity` (default `PerTensor()`).
      zero_point_domain: ``"int"``, ``"float"`` (torch.ao ``per_channel_affine_float_qparams``:
        ``zero_point = -min / scale``) or ``"none"``.
      quant_min, quant_max: override the integer range (both or neither).
      reduce_range: halve the range (torch.ao's x86 ``reduce_range``).
      eps: smallest scale (float32-rounded).
      scale_dtype: dtype the scale is rounded to: ``"float32"``, ``"bfloat16"``, ``"float16"``,
        ``"float8_e4m3fn"``, ``"e8m0"`` or ``"float64"`` (float32 values that torchao's convention
        divides by in float64); torch dtypes are normalised to these names.
      convention: whose arithmetic the spec reproduces: ``"torch_ao"``, ``"compressed_tensors"``,
        ``"torchao"``, ``"coreai_opt"`` or a `qstats.conventions.Convention` (held as one; equal to
        its name).
      nonfinite: ``"ignore"`` (default: NaN/Inf are left out of statistics and counted) or
        ``"raise"`` (ValueError on a non-finite value; reads the value on the host).
      on_uncalibrated: ``"raise"`` (default: `compute_qparams` raises when a parameter saw no
        data) or ``"fallback"`` (scale 1, zero point 0, reported in ``QParams.calibrated``).
      symmetric_zero_point: zero point of symmetric mappings onto unsigned ranges; default is the
        upper midpoint ``(qmin + qmax + 1) // 2`` (128 for uint8, as torch.ao).
      scale_rounding: rounding of ``"e8m0"`` scales: ``"floor"`` (default, OCP MX), ``"ceil"``,
        ``"even"``, ``"rceil"``, ``"round_then_floor"`` or ``"round"`` (docs/formats.md).
      global_scale_formula: two-level (`TensorGroup`) global scale: ``"amax_over_range"``
        (default, torchao/ModelOpt: effective scale ``scale * global``) or ``"range_over_amax"``
        (compressed-tensors: ``scale / global``).
      compute_dtype: ``"float32"`` (default), ``"bfloat16"`` or ``"float16"``: the dtype the
        torchao and compressed-tensors conventions compute qparams and codes in.
      preserve_zero: ``True`` (default) makes every range contain zero; ``False`` maps the
        observed range as it is (``convention="torchao"``, asymmetric mapping, integer zero point).

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
    convention: Union[str, Convention] = "torch_ao"
    nonfinite: str = "ignore"
    on_uncalibrated: str = "raise"
    symmetric_zero_point: Optional[int] = None
    scale_rounding: str = "floor"
    global_scale_formula: str = "amax_over_range"
    compute_dtype: str = "float32"
    preserve_zero: bool = True

    def __post_init__(self) -> None:
        for name in ("quant_min", "quant_max", "symmetric_zero_point"):
            # a numpy integer (a range read from an array or a config) as the Python int it holds, as
            # torch.ao's observers take it; it was refused as "must be an int, got np.int64(-8)"
            if is_integer(getattr(self, name)):
                object.__setattr__(self, name, int(getattr(self, name)))
        object.__setattr__(self, "dtype", _dtype_name(self.dtype))
        object.__setattr__(self, "scale_dtype", _scale_dtype_name(self.scale_dtype))
        try:
            object.__setattr__(self, "convention", conventions.lookup(self.convention))
        except ValueError as error:
            raise ValueError(f"QuantSpec.{error}") from None
        self._check_choices()
        self._check_eps()
        self._check_custom_range()
        self._check_target()
        self.convention.validate(self)
        validate_formats(self)

    def _check_choices(self) -> None:
        for name, choices in _CHOICES.items():
            value = getattr(self, name)
            if value not in choices:
                raise ValueError(f"QuantSpec.{name} must be one of {choices}, got {value!r}")
        if not isinstance(self.granularity, Granularity):
            raise ValueError(f"QuantSpec.granularity must be a Granularity, got {self.granularity!r}")
        for name in ("reduce_range", "preserve_zero"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"QuantSpec.{name} must be a bool, got {getattr(self, name)!r}")

    def _check_eps(self) -> None:
        eps = self.eps
        # the comparison also rules out NaN and inf
        if not (is_real_number(eps) and 0 < eps <= _FLOAT32_MAX):
            raise ValueError(f"QuantSpec.eps must be a positive, finite float32 value, got {eps!r}")
        if eps < _FLOAT32_TINY:
            raise ValueError(
                f"QuantSpec.eps must be at least {_FLOAT32_TINY:.4g} (the smallest normal float32, so that "
                f"1 / scale stays finite), got {eps!r}"
            )

    def _check_custom_range(self) -> None:
        if (self.quant_min is None) != (self.quant_max is None):
            raise ValueError("QuantSpec.quant_min and QuantSpec.quant_max must be given together")
        if self.quant_min is None:
            return
        for name in ("quant_min", "quant_max"):
            if not _is_int(getattr(self, name)):
                raise ValueError(f"QuantSpec.{name} must be an int, got {getattr(self, name)!r}")
        if not self.quant_min <= 0 <= self.quant_max:
            raise ValueError(
                f"QuantSpec.quant_min/quant_max: the range [{self.quant_min}, {self.quant_max}] must contain 0"
            )
        if self.quant_min >= self.quant_max:
            raise ValueError(
                f"QuantSpec.quant_min ({self.quant_min}) must be smaller than quant_max ({self.quant_max})"
            )

    def _check_target(self) -> None:
        """The mapping, zero point and range against the element format."""
        dtype, zero = self.dtype, self.symmetric_zero_point
        if zero is not None and not _is_int(zero):
            raise ValueError(f"QuantSpec.symmetric_zero_point must be an int, got {zero!r}")
        if self.is_float:
            if self.zero_point_domain == "float":
                raise ValueError(f"QuantSpec.zero_point_domain: float target {dtype!r} has no float zero point")
            if zero is not None:
                raise ValueError(f"QuantSpec.symmetric_zero_point {zero}: float target {dtype!r} has no zero point")
            if self.quant_min is not None or self.reduce_range:
                # the scales, codes and gradients of float targets span the format's largest value: a
                # custom range changed only some scales (codes past it were not clipped), reduce_range none
                raise ValueError(
                    f"QuantSpec.quant_min/quant_max and reduce_range: float target {dtype!r} has no integer "
                    f"range to override (its codes span +-{_FLOAT_FORMATS[dtype].max}), got quant_min="
                    f"{self.quant_min}, quant_max={self.quant_max}, reduce_range={self.reduce_range}"
                )
            return
        if self.mapping in ("symmetric_no_clipping_err", "narrow") and not self.is_signed:
            raise ValueError(f"QuantSpec.mapping {self.mapping!r} needs a signed target, got {dtype!r}")
        if self.reduce_range and self.quant_min is None and self.bits < 2:
            raise ValueError(f"QuantSpec.reduce_range: {dtype!r} has one bit, nothing to halve")
        qmin, qmax = self.qrange
        if not qmin < qmax:
            raise ValueError(
                f"QuantSpec: dtype {dtype!r}, mapping {self.mapping!r}, reduce_range {self.reduce_range}"
                f" and quant_min/quant_max ({self.quant_min}, {self.quant_max}) leave the range "
                f"[{qmin}, {qmax}], which holds fewer than two values"
            )

    # ----------------------------------------------------------------------------------------
    @property
    def is_float(self) -> bool:
        """True for floating-point element formats (fp8, ...)."""
        return self.dtype in _FLOAT_FORMATS

    @property
    def is_signed(self) -> bool:
        return self.is_float or _parse_int_dtype(self.dtype)[0]

    @property
    def bits(self) -> int:
        if self.is_float:
            fmt = _FLOAT_FORMATS[self.dtype]
            return 1 + fmt.exponent_bits + fmt.mantissa_bits
        return _parse_int_dtype(self.dtype)[1]

    @property
    def float_format(self) -> Optional[FloatFormat]:
        return _FLOAT_FORMATS.get(self.dtype)

    @property
    def dtype_range(self) -> tuple[int, int]:
        """The integer dtype's own range ``(lo, hi)``, before overrides and ``reduce_range``."""
        signed, bits = _parse_int_dtype(self.dtype)
        if signed:
            return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
        return 0, 2**bits - 1

    @property
    def qrange(self) -> tuple:
        """``(qmin, qmax)`` after overrides, ``reduce_range`` and the mapping (numbers)."""
        if self.is_float:
            fmax = _FLOAT_FORMATS[self.dtype].max
            return -fmax, fmax
        lo, hi = self.dtype_range if self.quant_min is None else (self.quant_min, self.quant_max)
        if self.reduce_range:  # the dtype's own range halved is one bit fewer (one-bit dtypes are refused)
            lo, hi = lo // 2, hi // 2
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
        return (sum(self.qrange) + 1) // 2

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

        Accepts exactly what torch.ao's MinMax/MovingAverage/Histogram/PerChannel observers accept
        (what any of them accepts) and raises ValueError for every combination they all refuse
        (``qstats/conventions/torch_ao.py``); ``factory_kwargs`` and ``is_dynamic=False`` are ignored,
        and the observers' own settings (``averaging_constant``, ``bins``, ``upsample_rate``) are refused: they go to
        qstats' observer factories.
        """
        return torch_ao.from_torch_ao(cls, dtype, qscheme, reduce_range, quant_min, quant_max, eps, ch_axis, overrides)

    @classmethod
    def from_compressed_tensors(cls, args, **overrides) -> "QuantSpec":
        """The spec whose `compute_qparams` equals compressed-tensors' ``calculate_qparams``.

        ``args`` is a ``compressed_tensors.quantization.QuantizationArgs`` (or a dict of its fields).
        Pass ``observed_dtype=weight.dtype`` for bfloat16/float16 weights: compressed-tensors
        computes their qparams (and stores their scales) in that dtype.
        """
        return compressed_tensors.from_compressed_tensors(cls, args, overrides)

    @classmethod
    def from_torchao(cls, target_dtype=None, **kwargs) -> "QuantSpec":
        """The spec whose `compute_qparams` and `quantize` equal torchao's.

        Affine integer targets take ``choose_qparams_affine``'s arguments (``mapping_type``,
        ``granularity`` or ``block_size`` with ``shape``, ``zero_point_domain``, ``quant_min``,
        ``quant_max``, ``eps``, ``scale_dtype``, ``zero_point_dtype``, ``preserve_zero``,
        ``input_dtype``; ``keepdim`` is accepted and ignored); float8 targets take ``granularity``,
        ``scale_dtype`` and ``input_dtype`` (scales in the input's dtype, as torchao computes them); MX
        takes ``to_mx``'s (``elem_dtype``, ``block_size``, ``scaling_mode``); NVFP4 takes ``nvfp4=True``
        (and ``per_tensor_scale=True``); a weight-only ``quantize_`` config (``Int8WeightOnlyConfig``,
        ``Float8WeightOnlyConfig``, ``NVFP4WeightOnlyConfig``, ``IntxWeightOnlyConfig`` with ``shape=``)
        gives its weights' spec. Targets torchao refuses raise ValueError. See
        ``qstats/conventions/torchao.py``.
        """
        return torchao.from_torchao(cls, target_dtype, kwargs)

    @classmethod
    def from_coreai_opt(cls, spec=None, **kwargs) -> "QuantSpec":
        """The spec whose `compute_qparams` (and `qstats.compute_minval`) equal Apple coreai_opt's
        qparams calculators: ``spec`` is a coreai_opt ``QuantizationSpec`` or a dict of its fields
        (``dtype``, ``qscheme``, ``granularity``, ``scale_dtype``); ``shape=`` for per-block
        granularities, ``target="activation"`` for activations. See ``qstats/coreai_opt.py``."""
        return coreai_opt.spec_from_coreai_opt(cls, spec, **kwargs)


def preset(name: str, **overrides) -> QuantSpec:
    """A QuantSpec for a named deployment format.

    ``"nvfp4"``, ``"mxfp8"``, ``"mxfp8_e5m2"``, ``"mxfp6_e2m3"``, ``"mxfp6_e3m2"``, ``"mxfp4"``,
    ``"fp8_block"``, ``"fp8_group"``, ``"fp8_token"`` (docs/formats.md). Keyword overrides
    replace fields (``scale_rounding="rceil"``, ...).

    >>> preset("mxfp4").granularity
    PerGroup(group_size=32)
    """
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
    return QuantSpec(**{**PRESETS[name], **overrides})


_MX = dict(granularity=PerGroup(32), scale_dtype="e8m0", zero_point_domain="none")
_FP8 = dict(dtype="fp8_e4m3fn", zero_point_domain="none")
PRESETS = {
    "nvfp4": dict(dtype="fp4_e2m1", granularity=TensorGroup(16), scale_dtype="float8_e4m3fn", zero_point_domain="none"),
    "mxfp8": dict(dtype="fp8_e4m3fn", **_MX),
    "mxfp8_e5m2": dict(dtype="fp8_e5m2", **_MX),
    "mxfp6_e2m3": dict(dtype="fp6_e2m3", **_MX),
    "mxfp6_e3m2": dict(dtype="fp6_e3m2", **_MX),
    "mxfp4": dict(dtype="fp4_e2m1", **_MX),
    "fp8_block": dict(granularity=PerBlock((128, 128)), **_FP8),
    "fp8_group": dict(granularity=PerGroup(128), **_FP8),
    "fp8_token": dict(granularity=PerToken(), **_FP8),
}
