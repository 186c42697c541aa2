"""The coreai_opt convention (``"coreai_opt"``) and `QuantSpec.from_coreai_opt`: a coreai_opt
``QuantizationSpec`` (or its fields) as a QuantSpec.

coreai_opt computes qparams with torchao's ``choose_qparams_affine_with_min_max`` (float32 eps,
int32 zero points, in the input's dtype) or OCP MX floor e8m0 scales; the spec is the torchao
convention's with those arguments, under `CoreaiOptConvention` (coreai_opt's fake quantization).
coreai_opt is not imported: its specs and granularities are read by attribute (or dict key). See
``qstats/coreai_opt.py`` for its calculators' observers.
"""

from __future__ import annotations

import numbers
import re
from typing import Any

import torch

from .._checks import check_float_range
from .._formats import compute_dtype_name, rounded_in
from .._granularity import PerAxis, PerTensor
from .default import Convention, saturate
from .torchao import TorchaoConvention, _block_size_granularity

__all__ = ["CoreaiOptConvention", "spec_from_coreai_opt", "block_size", "block_sizes"]

_FLOAT32_EPS = float(torch.finfo(torch.float32).eps)
_FLOAT_TARGETS = {"float8_e4m3fn": "fp8_e4m3fn", "float8_e5m2": "fp8_e5m2", "float4_e2m1fn_x2": "fp4_e2m1"}
# coreai_opt's QuantizationSpec fields (all but scale_dtype refuse None), then those its model_dump
# derives from them (a dict or keywords naming others is a typo)
_NOT_NONE_FIELDS = ("dtype", "qscheme", "qformulation", "granularity", "fake_quantize_cls", "qparam_calculator_cls",
                    "range_calculator_cls", "float_range")
_SPEC_FIELDS = (*_NOT_NONE_FIELDS, "scale_dtype", "n_bits", "target_dtype", "_quant_range", "quant_min", "quant_max")
# coreai_opt's presets leave the axis None: its Quantizer.prepare resolves it per module type
_AXIS_NONE = " (coreai_opt resolves axis None per module type in Quantizer.prepare: give it, e.g. 0 for a Linear weight)"
# coreai_opt's QuantizationSpec.SUPPORTED_DTYPES (its validator refuses every other dtype)
_INT_TARGETS = ("int2", "int4", "int6", "int8", "uint2", "uint4", "uint6", "uint8")
_ALIASES = {"float4_e2m1fn": "float4_e2m1fn_x2", "float8_e4m3": "float8_e4m3fn", "float8_e8m0": "float8_e8m0fnu"}
# coreai_opt's granularity kinds (registry keys, by class name too) and the keys of their dicts
_GRANULARITY_KINDS = {"PerTensorGranularity": "per_tensor", "PerChannelGranularity": "per_channel",
                      "PerBlockGranularity": "per_block"}
_GRANULARITY_KEYS = {"per_tensor": ("type", "axis"), "per_channel": ("type", "axis"),
                     "per_block": ("type", "axis", "block_size")}
# coreai_opt's own components, by registry key and class name (a user's registered ones compute otherwise)
_COMPONENTS = {
    "qparam_calculator_cls": ({"default", "static", "moving_average", "global_minmax", "dynamic"},
                              {"_DefaultQParamsCalculator", "StaticQParamsCalculator", "MovingAverageQParamsCalculator",
                               "GlobalMinMaxQParamsCalculator", "DynamicQParamsCalculator"}),
    "range_calculator_cls": ({"minmax"}, {"MinMaxRangeCalculator"}),
    "fake_quantize_cls": ({"default"}, {"_DefaultFakeQuantizeImpl"}),
}


class CoreaiOptConvention(TorchaoConvention):
    """torchao's qparams (``choose_qparams_affine_with_min_max``, in the input's dtype), and
    coreai_opt's own fake quantization of integer targets: float32 codes
    ``clamp(round(x / scale) + zero_point, quant_min, quant_max)``, dequantized as
    ``(q - zero_point) * scale`` in float32 (torchao multiplies by ``1 / scale``, in the input's
    dtype: codes a step apart at ties and for bf16/fp16 inputs). Float targets are torchao's."""

    name = "coreai_opt"

    def validate(self, spec) -> None:
        super().validate(spec)
        if spec.zero_point_domain == "float":
            # its codes add the zero point in code units; torchao's float zero point is in input units
            raise ValueError("QuantSpec.zero_point_domain 'float' with convention='coreai_opt': coreai_opt's zero "
                             "points are integer codes; use zero_point_domain='int'")

    def qparams(self, min_val, max_val, spec):
        # coreai_opt casts the range to the input's dtype (a pinned float_range end rounds to it)
        # before torchao's arithmetic; torchao's integer path does so itself, not its float targets'
        return super().qparams(*_in_input_dtype(spec, min_val, max_val), spec)

    def e8m0_scale(self, amax, spec):
        # coreai_opt takes max(|min|, |max|) in the input's dtype, then the float32 exponent
        return super().e8m0_scale(*_in_input_dtype(spec, amax), spec)

    def codes(self, view, scale, zero_point, spec):
        if spec.is_float:
            return super().codes(view, scale, zero_point, spec)
        unclamped = torch.round(view.float() / scale) + zero_point.float()
        return unclamped, unclamped.clamp(*spec.qrange)

    def dequantize(self, codes, scale, zero_point, spec):
        if spec.is_float:
            return super().dequantize(codes, scale, zero_point, spec)
        return Convention.dequantize(self, codes.float(), scale.float(), zero_point, spec)


def _in_input_dtype(spec, *tensors):
    """``tensors`` rounded to ``spec.compute_dtype`` (the input's; saturated at its largest
    value, where coreai_opt's would be Inf), as float32."""
    compute = getattr(torch, spec.compute_dtype)
    return tuple(rounded_in(saturate(t.float(), compute), compute) for t in tensors)


def _field(source, name: str, default=None):
    return source.get(name, default) if isinstance(source, dict) else getattr(source, name, default)


def _dtype_name(dtype) -> str:
    name = str(dtype).replace("torch.", "") if isinstance(dtype, torch.dtype) else str(dtype)
    return _ALIASES.get(name, name)


def _check_components(source: dict) -> None:
    """ValueError for a calculator or fake quantizer that is not coreai_opt's own (a class a user
    registered, or an unknown key): qstats reproduces coreai_opt's min/max components only."""
    for field, (keys, classes) in _COMPONENTS.items():
        value = source.get(field)
        if value is None:
            continue
        own = value in keys if isinstance(value, str) else (
            isinstance(value, type) and value.__name__ in classes
            and str(getattr(value, "__module__", "")).startswith("coreai_opt."))
        if not own:
            name = value if isinstance(value, str) else getattr(value, "__name__", repr(value))
            raise ValueError(
                f"from_coreai_opt: {field} {name!r} is not coreai_opt's own ({', '.join(sorted(keys))}): qstats "
                f"reproduces those only; leave it out and pick the qstats observer or function that computes yours")


def _target(target) -> str:
    """``"weight"`` or ``"activation"``, from that string or coreai_opt's ``CompressionTargetTensor``
    (a plain Enum: its members do not compare equal to their values)."""
    value = getattr(target, "value", target)
    if value not in ("weight", "activation"):
        raise ValueError(f"from_coreai_opt: target must be 'weight' or 'activation' (or coreai_opt's "
                         f"CompressionTargetTensor.WEIGHT / ACTIVATION), got {target!r}")
    return value


def block_size(granularity, shape, target="weight") -> tuple:
    """coreai_opt's ``granularity.get_block_size(shape, target)``: per-tensor is the whole shape,
    per-channel 1 on ``axis``; per-block a tuple (``-1``: the whole axis) or an int along ``axis``,
    where weights keep dimensions past the first two whole and activations reduce every other
    dimension to 1. ``granularity``: a coreai_opt granularity or its dict (``{"type": ...}``);
    ``target``: ``"weight"``, ``"activation"`` or a ``CompressionTargetTensor``."""
    shape = [int(s) for s in shape]
    sizes = block_sizes(granularity, shape, _target(target))
    if any(b < 1 or s % b for b, s in zip(sizes, shape)):
        raise ValueError(f"from_coreai_opt: block size {sizes} does not divide the shape {tuple(shape)}")
    return sizes


def _kind(granularity) -> str:
    """``"per_tensor"``, ``"per_channel"`` or ``"per_block"``: the kind of a coreai_opt granularity or
    its dict, after ValueError for what coreai_opt's models refuse (an unknown type, a key its kind
    does not take, a per-tensor axis, a per-block granularity without ``block_size``)."""
    name = _field(granularity, "type") or type(granularity).__name__
    kind = _GRANULARITY_KINDS.get(name, name)
    if kind not in _GRANULARITY_KEYS:
        raise ValueError(f"from_coreai_opt: unknown granularity {granularity!r}")
    extra = sorted(set(granularity) - set(_GRANULARITY_KEYS[kind])) if isinstance(granularity, dict) else []
    if extra:
        raise ValueError(f"from_coreai_opt: granularity {granularity!r} has key(s) {extra} that coreai_opt's {kind} "
                         f"granularity does not take (its keys: {', '.join(_GRANULARITY_KEYS[kind])})")
    if kind == "per_tensor" and _field(granularity, "axis") is not None:
        raise ValueError(f"from_coreai_opt: a per_tensor granularity takes no axis, got {granularity!r}")
    if kind == "per_block" and _field(granularity, "block_size") is None:
        raise ValueError(f"from_coreai_opt: a per_block granularity needs block_size (an int along axis, or one "
                         f"entry per dimension), got {granularity!r}")
    return kind


def block_sizes(granularity, shape: list, target: str) -> tuple:
    """`block_size` before its divisibility check (``target``: ``"weight"`` or ``"activation"``)."""
    kind = _kind(granularity)
    axis, size = _axis_and_block_size(granularity)
    if kind == "per_tensor":
        return tuple(shape)
    if isinstance(size, (tuple, list)):
        if axis is not None or len(size) != len(shape):
            raise ValueError(f"from_coreai_opt: per-block block_size {size} needs axis None and one entry per dim of {shape}")
        return tuple(s if b == -1 else b for b, s in zip(size, shape))
    if axis is None or not -len(shape) <= axis < len(shape):
        raise ValueError(f"from_coreai_opt: granularity {granularity!r} needs an axis within the shape {tuple(shape)}"
                         + (_AXIS_NONE if axis is None else ""))
    axis %= len(shape)
    if size is None:  # per channel
        return tuple(1 if i == axis else s for i, s in enumerate(shape))
    if target == "weight":
        return tuple(size if i == axis else (1 if i < 2 else s) for i, s in enumerate(shape))
    return tuple(size if i == axis else 1 for i in range(len(shape)))


def _axis_and_block_size(granularity) -> tuple:
    """A granularity's ``axis`` and ``block_size`` (an int or a tuple of them; None where absent) as
    coreai_opt's integer fields read them: ints, whole floats (``8.0``) and strings of an int
    (``"8"``); ValueError naming the field for anything else (``4.5`` is no block size)."""
    def integer(value, name):
        if value is None or isinstance(value, numbers.Integral):
            return None if value is None else int(value)
        if isinstance(value, numbers.Real) and float(value).is_integer():
            return int(value)
        if isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d+\s*", value):
            return int(value)
        raise ValueError(f"from_coreai_opt: granularity {name} must be an integer, got {value!r}")

    size = _field(granularity, "block_size")
    sizes = tuple(integer(b, "block_size") for b in size) if isinstance(size, (tuple, list)) else integer(size, "block_size")
    return integer(_field(granularity, "axis"), "axis"), sizes


def _granularity(granularity, shape, target):
    kind = "per_tensor" if granularity is None else _kind(granularity)
    if kind == "per_tensor":
        return PerTensor()
    if kind == "per_channel":
        axis, _ = _axis_and_block_size(granularity)
        if axis is None:
            raise ValueError("from_coreai_opt: per-channel granularity needs an int axis, got None" + _AXIS_NONE)
        if shape is not None:
            block_size(granularity, shape, target)  # checks the axis against the shape
            axis %= len(shape)
        return PerAxis(axis)
    if shape is None:
        raise ValueError("from_coreai_opt: a per-block granularity needs the tensor shape (shape=...)")
    shape = tuple(int(s) for s in shape)
    sizes = block_size(granularity, shape, target)  # checked against the shape given
    if target == "activation":
        # an activation's shape changes between calls (coreai_opt's "dynamic" calculator): read the
        # blocks at a shape whose size-1 dimensions are 2, where a whole dimension (-1) and one
        # block per index (1) differ, so that one token or batch 1 does not read as per tensor
        shape = tuple(max(s, 2) for s in shape)
        sizes = block_size(granularity, shape, target)
    return _block_size_granularity(sizes, shape)


def _check_formulation_and_calculator(source: dict, target: str, float_target: bool, qscheme: str) -> None:
    """ValueError for what coreai_opt's QuantizationSpec and factory refuse: a qformulation other
    than "zp" or "minval", "minval" for float targets or e8m0 scales, and a "dynamic" calculator
    for weights, with ``symmetric_with_clipping`` or with a pinned ``float_range``."""
    formulation = str(getattr(source.get("qformulation"), "value", source.get("qformulation") or "zp"))
    if formulation not in ("zp", "minval") or (formulation == "minval" and float_target):
        raise ValueError(f"from_coreai_opt: qformulation must be 'zp' or 'minval' ('zp' for float targets and e8m0 "
                         f"scales), got {formulation!r}")
    calculator = source.get("qparam_calculator_cls")
    if getattr(calculator, "__name__", calculator) not in ("dynamic", "DynamicQParamsCalculator"):
        return
    float_range = source.get("float_range") or (None, None)
    if target != "activation" or qscheme == "symmetric_with_clipping" or any(end is not None for end in float_range):
        raise ValueError(f"from_coreai_opt: coreai_opt's 'dynamic' calculator takes activations only, without "
                         f"symmetric_with_clipping or a float_range; got target {target!r}, qscheme {qscheme!r}, "
                         f"float_range {list(float_range)}")


def _quant_range(cls, dtype: str, qscheme: str) -> tuple:
    """coreai_opt's ``(quant_min, quant_max)`` of a target (``cls``: QuantSpec): the integer dtype's
    range (a signed one clipped to ``-quant_max`` under ``symmetric_with_clipping``), a float
    target's largest values (fp4: 6)."""
    if dtype in _FLOAT_TARGETS:
        return cls(dtype=_FLOAT_TARGETS[dtype]).qrange
    qmin, qmax = cls(dtype=dtype).dtype_range
    return (-qmax if qscheme == "symmetric_with_clipping" and qmin < 0 else qmin), qmax


def _check_derived_fields(cls, source: dict, dtype: str, qscheme: str) -> None:
    """ValueError for a field coreai_opt derives from ``dtype`` and ``qscheme`` (``n_bits``,
    ``target_dtype``, ``quant_min``, ...: its ``model_dump`` writes them, its constructor drops them
    and derives them again) that a dict gives another value."""
    qmin, qmax = _quant_range(cls, dtype, qscheme)
    bits = cls(dtype=_FLOAT_TARGETS.get(dtype, dtype)).bits
    if dtype in _FLOAT_TARGETS:  # fp4 is held in fp8 e4m3
        target_dtype = "float8_e4m3fn" if dtype == "float4_e2m1fn_x2" else dtype
    else:  # sub-byte integers are held in int8 / uint8
        target_dtype = "uint8" if dtype.startswith("u") else "int8"
    derived = {"n_bits": bits, "target_dtype": getattr(torch, target_dtype), "_quant_range": (qmin, qmax),
               "quant_min": qmin, "quant_max": qmax}
    for name, value in derived.items():
        given = source.get(name, value)
        if name == "target_dtype":
            given, value = _dtype_name(given), _dtype_name(value)
        if (tuple(given) if isinstance(given, list) else given) != value:
            raise ValueError(f"from_coreai_opt: {name} {source[name]!r} is not the {derived[name]!r} coreai_opt derives from "
                             f"dtype {dtype} and qscheme {qscheme!r} (it drops the field and derives it again)")


def _check_subclass_fields(spec) -> None:
    """ValueError for the fields of a ``QuantizationSpec`` subclass (its ``get_extra_args``, which
    coreai_opt's factory passes to the components it builds) other than ``averaging_constant``, the
    moving average's (`qstats.coreai_opt.moving_average_minmax` takes it, as its calculator)."""
    extra = dict(spec.get_extra_args()) if hasattr(spec, "get_extra_args") else {}
    extra.pop("averaging_constant", None)
    if extra:
        raise ValueError(f"from_coreai_opt: spec field(s) {sorted(extra)} of {type(spec).__name__} are not coreai_opt's "
                         "own; qstats cannot know what they compute")


def _source(spec, fields: dict) -> dict:
    """The fields of ``spec`` (a QuantizationSpec or a dict of its fields) updated by ``fields``,
    checked: ValueError for a name coreai_opt does not have, or a component not its own."""
    if spec is not None and not isinstance(spec, dict):
        _check_subclass_fields(spec)
    given = {**(spec if isinstance(spec, dict) else {}), **fields}
    for name, value in given.items():
        if value is None and name in _NOT_NONE_FIELDS:
            raise ValueError(f"from_coreai_opt: {name} None, which coreai_opt's QuantizationSpec refuses; leave the "
                             "field out for its default")
    read = ("dtype", "qscheme", "qformulation", "granularity", "scale_dtype", "float_range", *_COMPONENTS)
    source = {**({} if spec is None or isinstance(spec, dict) else {name: _field(spec, name) for name in read}), **given}
    unknown = sorted(set(source) - set(_SPEC_FIELDS))
    if unknown:
        raise ValueError(f"from_coreai_opt: unknown QuantizationSpec field(s) {unknown}; known: {', '.join(_SPEC_FIELDS)}")
    _check_components(source)
    return source


def spec_from_coreai_opt(
    cls, spec: Any = None, *, shape=None, target="weight", input_dtype: torch.dtype = torch.float32, **fields
):
    """The ``cls`` (QuantSpec) whose `compute_qparams` (and `qstats.compute_minval`) equal coreai_opt's
    qparams calculators for ``spec``: a ``coreai_opt.quantization.QuantizationSpec``, a dict of its
    fields, or the fields as keywords (``dtype``, ``qscheme``, ``granularity``, ``scale_dtype``).

    ``shape`` (the tensor's) is needed for per-block granularities, ``target`` (``"weight"``,
    ``"activation"`` or coreai_opt's ``CompressionTargetTensor``) decides their single-axis block
    as in coreai_opt; ``input_dtype`` is the observed tensor's dtype, which coreai_opt takes the
    range (a pinned float_range end included) and minval in, and computes integer and fp8 scales in,
    unless ``spec``'s ``float_range`` pins both ends (coreai_opt computes those in float32).
    """
    target = _target(target)
    input_compute = compute_dtype_name(input_dtype, "from_coreai_opt: input_dtype")  # float64 has no qstats path
    source = _source(spec, fields)
    # coreai_opt's QuantizationSpec validates a dict's or keywords' float_range as compute_qparams does
    float_range = source.get("float_range")
    float_range = (None, None) if float_range is None else check_float_range(float_range, "from_coreai_opt")
    if None not in float_range:
        # both ends pinned: coreai_opt builds the range as float32 tensors and computes its
        # qparams in float32, whatever the input's dtype
        input_dtype, input_compute = torch.float32, "float32"
    dtype = _dtype_name(source.get("dtype") or torch.int8)
    if dtype not in _INT_TARGETS and dtype not in _FLOAT_TARGETS:
        raise ValueError(f"from_coreai_opt: dtype {dtype!r} is not one of coreai_opt's: "
                         f"{', '.join(_INT_TARGETS + tuple(_FLOAT_TARGETS))}")
    qscheme = str(getattr(source.get("qscheme"), "value", source.get("qscheme") or "symmetric"))
    scale_dtype = source.get("scale_dtype")
    e8m0 = scale_dtype is not None and _dtype_name(scale_dtype) == "float8_e8m0fnu"
    if scale_dtype is not None and not e8m0:
        raise ValueError(f"from_coreai_opt: scale_dtype must be None or torch.float8_e8m0fnu, got {scale_dtype!r}")
    if dtype == "float4_e2m1fn_x2":
        e8m0 = True  # coreai_opt's default for FP4
    if e8m0 and dtype not in _FLOAT_TARGETS and dtype != "int8":
        raise ValueError(f"from_coreai_opt: an e8m0 scale_dtype needs dtype int8 or a float target, got {dtype}")
    if (dtype in _FLOAT_TARGETS or e8m0) and qscheme != "symmetric":
        raise ValueError(f"from_coreai_opt: {dtype} (or an e8m0 scale) needs qscheme 'symmetric', got {qscheme!r}")
    if qscheme not in ("symmetric", "asymmetric", "symmetric_with_clipping"):
        raise ValueError(f"from_coreai_opt: unknown qscheme {qscheme!r}")
    _check_derived_fields(cls, source, dtype, qscheme)
    _check_formulation_and_calculator(source, target, float_target=dtype in _FLOAT_TARGETS or e8m0, qscheme=qscheme)
    granularity = _granularity(source.get("granularity"), shape, target)
    if dtype in _FLOAT_TARGETS or e8m0:
        float_target = dtype in _FLOAT_TARGETS
        # coreai_opt takes the range (and minval) in the input's dtype; without e8m0, torchao's
        # fp8 scale is computed in (and held as) it too
        return cls(
            dtype=_FLOAT_TARGETS.get(dtype, dtype), granularity=granularity, eps=_FLOAT32_EPS, convention="coreai_opt",
            zero_point_domain="none" if float_target else "int", scale_dtype="e8m0" if e8m0 else input_compute,
            compute_dtype=input_compute, on_uncalibrated="fallback",
        )
    qmin, qmax = _quant_range(cls, dtype, qscheme)
    return cls.from_torchao(
        dtype, mapping_type="ASYMMETRIC" if qscheme == "asymmetric" else "SYMMETRIC", granularity=granularity,
        quant_min=qmin, quant_max=qmax, eps=_FLOAT32_EPS, input_dtype=input_dtype, zero_point_dtype=torch.int32,
    ).replace(convention="coreai_opt")
