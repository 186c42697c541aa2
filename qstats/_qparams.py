"""compute_qparams: observer state + spec -> QParams, as a pure function.

Each state type registers a *range rule* (state -> ``(min_val, max_val)``, taking options such as
``method=``), and one function, `qparams_from_minmax`, maps a range onto the spec's format with the
spec's convention's arithmetic or the MX / NVFP4 scale arithmetic of qstats/_formats.py.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Callable, NamedTuple, Optional

import torch

from . import _formats
from ._checks import check_float_range, check_real_tensor, require, require_calibrated
from ._granularity import PerAxis, PerTensor, TensorGroup
from ._spec import QuantSpec

__all__ = [
    "QParams",
    "compute_qparams",
    "compute_minval",
    "qparams_from_minmax",
    "register_range_rule",
    "Range",
]

_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


class QParams(NamedTuple):
    """Quantization parameters; every field is a tensor (vmap- and checkpoint-friendly).

    Attributes:
      scale: float32 (rounded to ``spec.scale_dtype``), shape ``qparam_shape``.
      zero_point: int32 for the int zero-point domain, float32 for the float domain, zeros for
        ``"none"``; shape ``qparam_shape``.
      global_scale: float32 scalar; 1 unless the spec uses two-level scales.
      calibrated: bool, shape ``qparam_shape``: False where the state saw no finite data (those
        entries hold the fallback scale 1 and zero point 0).
      minval: float32, shape ``qparam_shape``: coreai_opt's ``minval`` of the mapped range
        (docs/migrating_coreai_opt.md); ``quant_min`` where uncalibrated. None only in QParams
        built with four fields (older code and checkpoints).
    """

    scale: torch.Tensor
    zero_point: torch.Tensor
    global_scale: torch.Tensor
    calibrated: torch.Tensor
    minval: Optional[torch.Tensor] = None


class Range(NamedTuple):
    """What a range rule returns: the range to map, and which entries saw data (a bool mask, or
    integer counts: calibrated where positive; `calibrated_mask` reads either)."""

    min_val: torch.Tensor
    max_val: torch.Tensor
    calibrated: torch.Tensor


def experts_qparams(qp: Optional[QParams], index) -> Optional[QParams]:
    """The QParams of the experts ``index`` (an int, or a tensor of expert ids: one set per id)
    of a stacked site's ``qp``, whose fields lead with the expert dimension (None stays None); a
    global scale shared by the experts is every expert's (`per_expert_qparams`)."""
    if qp is None:
        return None
    if qp.scale.dim() < 1:
        raise ValueError("experts_qparams: the qparams have no leading expert dimension (scale of shape ())")
    qp = per_expert_qparams(qp, qp.scale.shape[0])
    return type(qp)(*(None if field is None else field[index] for field in qp))


def per_expert_qparams(qp: Optional[QParams], num_experts: int) -> Optional[QParams]:
    """A stacked site's ``qp`` with one global scale per expert: a single one (compressed-tensors' shape
    ``(1,)``, or a scalar, as `qstats.fused_global_scale` gives over the experts) is shared by every
    expert; ValueError naming the shapes for a scale or global scale without ``num_experts`` entries."""
    if qp is None:
        return None
    if qp.scale.dim() < 1 or qp.scale.shape[0] != num_experts:
        raise ValueError(f"stacked qparams need a leading expert dimension {num_experts}, got scale of shape "
                         f"{tuple(qp.scale.shape)}")
    global_scale = qp.global_scale
    if global_scale is None or (global_scale.dim() >= 1 and global_scale.shape[0] == num_experts):
        return qp
    if global_scale.numel() != 1:
        raise ValueError(f"stacked qparams: global_scale of shape {tuple(global_scale.shape)} is neither one value "
                         f"shared by the experts nor one per expert ([{num_experts}])")
    return qp._replace(global_scale=global_scale.reshape(1).expand(num_experts))


def calibrated_mask(calibrated):
    """A `Range`'s ``calibrated`` as a bool mask (counts: calibrated where positive)."""
    if not isinstance(calibrated, torch.Tensor) or calibrated.dtype == torch.bool:
        return calibrated
    if calibrated.is_floating_point() or calibrated.is_complex():
        raise TypeError(
            f"calibrated must be a bool mask or integer counts, got a tensor of dtype {calibrated.dtype}"
        )
    return calibrated > 0


_RANGE_RULES: dict[type, Callable[..., Any]] = {}


def register_range_rule(state_cls: type, *, replace: bool = False):
    """Decorator: ``rule(state, spec, **options) -> Range | QParams`` for ``state_cls`` (a
    NamedTuple state class; TypeError naming what it got otherwise, or for a rule that is not callable).
    Another rule for a class that has one is a ValueError unless ``replace`` (as `observers.register`)."""
    if not (isinstance(state_cls, type) and issubclass(state_cls, tuple) and hasattr(state_cls, "_fields")):
        raise TypeError(f"register_range_rule expects a NamedTuple state class, got {state_cls!r}")

    def decorate(rule):
        if not callable(rule):
            raise TypeError(f"register_range_rule({state_cls.__name__}): the rule must be callable, got {rule!r}")
        if _RANGE_RULES.get(state_cls, rule) is not rule and not replace:
            raise ValueError(f"register_range_rule: {state_cls.__name__} has a range rule already "
                             f"({_RANGE_RULES[state_cls].__qualname__}); pass replace=True to replace it")
        _RANGE_RULES[state_cls] = rule
        return rule

    return decorate


class NoStatistics(TypeError):
    """``compute_qparams`` of a state that holds no quantization statistic: no range rule is
    registered for its type, or its rule refuses (placeholder, noop and recording observers)."""


def range_rule_for(state) -> Callable[..., Any]:
    """The range rule registered for ``state``'s class (or its nearest base); TypeError without one."""
    rule = next((_RANGE_RULES[cls] for cls in type(state).__mro__ if cls in _RANGE_RULES), None)
    if rule is None and isinstance(state, QParams):
        raise TypeError("compute_qparams: got QParams (quantization parameters), where an observer's state "
                        "(what calibrate or observer.update returns) is expected")
    if rule is None and isinstance(state, Mapping):  # calibrate's {path: {site: state}}
        raise NoStatistics("compute_qparams: got a mapping (a states tree, as calibrate returns), where one observer's "
                           "state is expected: use qstats.compute_qparams_tree(states, recipe, model) for a tree")
    if rule is None:
        raise NoStatistics(
            f"compute_qparams: no range rule for {type(state).__name__}; register one with "
            "qstats.register_range_rule"
        )
    return rule


def compute_qparams(state, spec: QuantSpec, **options) -> QParams:
    """Quantization parameters of ``state`` for ``spec``. Pure; vmappable; compilable. With
    ``on_uncalibrated="raise"`` (the default) it reads on the host whether every parameter saw data.

    Args:
      state: an observer state (MinMaxState, HistogramState, ...).
      spec: the QuantSpec to map the observed range onto.
      **options: passed to the state's range rule (e.g. ``method="l2"`` for histograms), except
        ``float_range=(lo, hi)``: pins the range's ends, as coreai_opt's ``float_range`` (see
        `pin_range`), whatever the rule; and ``global_scale=`` (a one-value tensor): the global scale
        of a two-level spec, imposed (torchao's ``per_tensor_scale``, a fused group's).

    Raises:
      ValueError: in eager mode, when ``spec.on_uncalibrated == "raise"`` and some parameter saw no
        data (names how many). Under vmap/compile the fallback is used and reported in
        ``QParams.calibrated``. Also for a state whose ranges do not fit the spec (several for a
        per-tensor spec), a bad ``float_range``, and a ``global_scale`` that is NaN, Inf, zero,
        negative or subnormal, or given to a spec without two-level scales.

    >>> import torch, qstats
    >>> spec = qstats.QuantSpec(dtype="int8")
    >>> obs = qstats.minmax(spec)
    >>> x = torch.tensor([-1.0, 2.0])
    >>> qstats.compute_qparams(obs.update(obs.init(x), x), spec).scale
    tensor(0.0157)
    >>> qstats.compute_qparams(obs.update(obs.init(x), x), spec, float_range=(None, 1.0)).scale
    tensor(0.0078)
    """
    global_scale = options.pop("global_scale", None)  # a fused group's (qstats.fused)
    result = range_of(state, spec, options, "compute_qparams")
    global_scale = _checked_global_scale(global_scale, spec)
    if isinstance(result, QParams):
        return result if result.minval is not None else _with_minval_of_codes(result, spec)
    return qparams_from_minmax(
        result.min_val, result.max_val, spec, calibrated=result.calibrated, global_scale=global_scale
    )


def _checked_global_scale(global_scale, spec: QuantSpec) -> Optional[torch.Tensor]:
    """A given two-level global scale (a fused group's, torchao's ``per_tensor_scale``), after
    TypeError where it is no real tensor, ValueError where it is not one value, the spec has no
    two-level scales (it would be ignored) or it is NaN, Inf, zero, negative or subnormal (every scale
    NaN, or every value dequantized to 0 or NaN: torchao's ``to_nvfp4`` does that)."""
    if global_scale is None:
        return None
    check_real_tensor(global_scale, "compute_qparams: global_scale must be a real tensor of one value")
    if global_scale.numel() != 1:
        raise ValueError(f"compute_qparams: global_scale must be one value (a fused group's), got shape "
                         f"{tuple(global_scale.shape)}; stacked experts take one per expert in qstats.stacked_qparams")
    if not isinstance(spec.granularity, TensorGroup):
        raise ValueError(f"compute_qparams: global_scale applies to two-level specs (TensorGroup, NVFP4); a spec of "
                         f"granularity {spec.granularity!r} would ignore it")
    # a subnormal one too: its reciprocal (torchao's product) or the block scale over it (compressed-tensors')
    # overflows, so zeros came back NaN (torchao's own to_nvfp4 gives them nonzero values)
    tiny = torch.finfo(torch.float32).tiny
    positive = require(torch.isfinite(global_scale) & (global_scale >= tiny),
                       "compute_qparams: global_scale must be finite and positive, at least the smallest normal "
                       f"float32 ({tiny:.4g}); a NaN, Inf, zero, negative or subnormal one makes every scale NaN "
                       "or every value dequantize to 0 or NaN")
    return torch.where(positive, global_scale, torch.ones_like(global_scale))  # threads the check


def compute_minval(state, spec: QuantSpec, **options) -> torch.Tensor:
    """``compute_qparams(state, spec, **options).minval``, refusing float targets (coreai_opt's
    minval is None there). Kept for code written before `QParams` carried ``minval``.

    Raises:
      ValueError: for float targets, and as `compute_qparams`.
    """
    if isinstance(spec, QuantSpec) and spec.is_float:
        raise ValueError(f"compute_minval: float target {spec.dtype!r} has no minval (coreai_opt returns None)")
    return compute_qparams(state, spec, **options).minval


def range_of(state, spec: QuantSpec, options: dict, where: str):
    """The state's rule result (Range or QParams), with ``float_range`` applied to a Range."""
    if not isinstance(spec, QuantSpec):
        raise TypeError(f"{where}: spec must be a QuantSpec, got {type(spec).__name__}")
    float_range = options.pop("float_range", None)
    float_range = None if float_range is None else check_float_range(float_range, where)
    result = range_rule_for(state)(state, spec, **options)
    if not isinstance(result, (Range, QParams)):
        raise TypeError(f"{where}: the range rule of {type(state).__name__} returned a {type(result).__name__}; a "
                        "rule returns qstats.observers.kit.Range(min_val, max_val, calibrated) or QParams")
    _check_fits(result, spec, where)
    if float_range is None:
        return result
    if isinstance(result, QParams):
        raise TypeError(f"{where}: float_range needs a range, but the rule of {type(state).__name__} gives qparams")
    return pin_range(result, float_range)


def _check_fits(result, spec: QuantSpec, where: str) -> None:
    """ValueError where the state's ranges cannot be the spec's: more than one range for a per-tensor
    spec, or other than one axis of them for a per-axis one (a state of another spec's observer)."""
    dims = {PerTensor: 0, PerAxis: 1}.get(type(spec.granularity))
    shape = tuple((result.min_val if isinstance(result, Range) else result.scale).shape)
    if dims is not None and len(shape) != dims:
        raise ValueError(f"{where}: a state of ranges of shape {shape} does not fit a spec of granularity "
                         f"{spec.granularity!r}, which has {'one range' if dims == 0 else 'one axis of ranges'}; "
                         "compute the qparams with the spec the observer was built with")


def pin_range(observed: Range, float_range: tuple) -> Range:
    """coreai_opt's ``_get_min_and_max_val``: the range with ``min = clamp(lo, max=0)`` and
    ``max = clamp(hi, min=0)`` where ``float_range`` gives them, the observed ends clamped the same
    way otherwise. Both ends pinned: calibrated everywhere (the data are not read)."""
    lo, hi = float_range
    min_val = observed.min_val.float()
    max_val = observed.max_val.float()
    min_val = (min_val if lo is None else torch.full_like(min_val, lo)).clamp(max=0.0)
    max_val = (max_val if hi is None else torch.full_like(max_val, hi)).clamp(min=0.0)
    calibrated = (torch.ones_like(min_val, dtype=torch.bool) if lo is not None and hi is not None
                  else observed.calibrated)  # both ends pinned: calibrated everywhere
    return Range(min_val, max_val, calibrated)


def check_calibrated(calibrated: torch.Tensor, spec: QuantSpec, where: str = "compute_qparams") -> torch.Tensor:
    """``calibrated``, after ValueError when ``spec.on_uncalibrated == 'raise'`` and some entries
    are False (outside ``vmap``, where slices report rather than raise)."""
    return calibrated if spec.on_uncalibrated != "raise" else require_calibrated(calibrated, where)


def qparams_from_minmax(
    min_val: torch.Tensor,
    max_val: torch.Tensor,
    spec: QuantSpec,
    calibrated: torch.Tensor | None = None,
    global_scale: torch.Tensor | None = None,
    check_uncalibrated: bool = True,
) -> QParams:
    """Maps an observed range onto ``spec``'s format. Pure, elementwise, vmappable.

    Two-level specs (`TensorGroup`) take their global scale from the absolute maximum over all
    entries, or use ``global_scale`` when given (a fused group's, `qstats.fused`).

    Entries that saw no data (``calibrated`` False, or a non-finite range) get scale 1 and zero
    point 0, and `check_calibrated` applies the spec's ``on_uncalibrated`` policy (unless
    ``check_uncalibrated`` is False: the caller applies it, as for stacked experts).
    ``calibrated`` may also be integer counts (calibrated where positive).
    """
    _check_range_tensors(min_val, max_val, calibrated)
    min_val, max_val = min_val.float(), max_val.float()
    # min <= max with both finite: given min <= max, half the span is finite exactly when both
    # are (halving keeps finite extremes from overflowing); NaN fails every compare
    half_span = max_val * 0.5 - min_val * 0.5
    valid = (min_val <= max_val) & (half_span >= 0) & (half_span < torch.inf)
    calibrated = valid if calibrated is None else (calibrated_mask(calibrated) & valid)
    if check_uncalibrated:
        calibrated = check_calibrated(calibrated, spec)
    minval = _minval(min_val, max_val, spec, calibrated)
    # an uncalibrated entry maps a zero range (its scale and zero point are replaced below; a
    # two-level scale reduces over every entry, so they must not take part); ranges near the
    # float32 limit are clipped (`_clipped`; MX and NVFP4 scales take only the absolute maximum:
    # theirs are not clipped)
    min_val, max_val = torch.where(calibrated, min_val, 0.0), torch.where(calibrated, max_val, 0.0)
    if _formats.handles_qparams(spec):
        scale, zero_point, global_scale = _formats.qparams(min_val, max_val, spec, global_scale)
    else:
        scale, zero_point = spec.convention.qparams(*_clipped(min_val, max_val, spec), spec)
        global_scale = torch.ones((), dtype=torch.float32, device=scale.device)
    scale = torch.where(calibrated, scale, torch.ones_like(scale))
    zero_point = torch.where(calibrated, zero_point, torch.zeros_like(zero_point))
    return QParams(scale, zero_point, global_scale, calibrated, minval)


def _check_range_tensors(min_val, max_val, calibrated=None) -> None:
    """TypeError unless both ends are real (not bool or complex) tensors (a Python float failed
    with an AttributeError); ValueError naming the shapes where the ends do not broadcast together,
    or a ``calibrated`` mask would broadcast the qparams to a larger shape."""
    for name, value in (("min_val", min_val), ("max_val", max_val)):
        check_real_tensor(value, f"qparams_from_minmax: {name} must be a real tensor")
    same_mask = not isinstance(calibrated, torch.Tensor) or calibrated.shape == min_val.shape
    if min_val.shape == max_val.shape and same_mask:
        return  # the usual case, without torch.broadcast_shapes' cost (tens of microseconds a call)
    try:
        shape = torch.broadcast_shapes(min_val.shape, max_val.shape)
        grown = isinstance(calibrated, torch.Tensor) and torch.broadcast_shapes(shape, calibrated.shape) != shape
    except RuntimeError:
        grown = True
    if grown:
        mask = f" and calibrated {tuple(calibrated.shape)}" if isinstance(calibrated, torch.Tensor) else ""
        raise ValueError(f"qparams_from_minmax: min_val of shape {tuple(min_val.shape)}, max_val {tuple(max_val.shape)}"
                         f"{mask} do not give one shape of quantization parameters")


def _clipped(min_val: torch.Tensor, max_val: torch.Tensor, spec: QuantSpec):
    """The finite float32 range clipped only where some code would dequantize past float32:
    symmetric integer peaks where the farthest code (int8: -128, 128 steps of ``amax / 127.5``)
    would, and asymmetric ranges whose span ``max(max, 0) - min(min, 0)`` overflows (clipped to
    half of float32's range; compressed-tensors' asymmetric float8 too, whose scale
    ``span / 896`` was Inf there and every value NaN); one-sided wide asymmetric ranges and
    symmetric float targets (codes at most ``amax``) keep their ends, as torch.ao, torchao and compressed-tensors map them, up to a
    margin of 2**-20 at the limit (2**-7 more for a bf16/fp16 scale or compute dtype, which may round up)."""
    limit = _FLOAT32_MAX * (1.0 - 2.0**-20)
    min_val, max_val = min_val.clamp(min=-limit), max_val.clamp(max=limit)
    if spec.mapping == "asymmetric":  # integer targets, and compressed-tensors' asymmetric float8
        half = _FLOAT32_MAX / 2
        wide = ~(max_val.clamp(min=0.0) - min_val.clamp(max=0.0) <= limit)
        return torch.where(wide, min_val.clamp(min=-half), min_val), torch.where(wide, max_val.clamp(max=half), max_val)
    if spec.is_float:
        return min_val, max_val
    # a bf16/fp16 scale, or a peak and scale computed in bf16/fp16 (torchao's input dtype), may round up
    limit = limit * (1.0 - (2.0**-7 if rounds_in_half_precision(spec) else 0.0))
    if spec.mapping == "symmetric_no_clipping_err":  # scale max(-min / -qmin, max / qmax): each end
        farthest = max(spec.qmax, -spec.qmin)  # the scale's farthest code
        return min_val.clamp(min=-limit * -spec.qmin / farthest), max_val.clamp(max=limit * spec.qmax / farthest)
    steps = (spec.qmax - spec.qmin) / 2  # the scale's divisor; the farthest code lies ceil(steps) away
    peak = limit * steps / math.ceil(steps)
    return min_val.clamp(min=-peak), max_val.clamp(max=peak)


def rounds_in_half_precision(spec: QuantSpec) -> bool:
    """Whether ``spec``'s scale or compute dtype is bf16/fp16, which may round a scale, and a code's
    value under it, up past float32's largest value (`_clipped`, `qstats._quant`'s saturation)."""
    return bool({spec.scale_dtype, spec.compute_dtype} & {"bfloat16", "float16"})


def _minval(min_val: torch.Tensor, max_val: torch.Tensor, spec: QuantSpec, calibrated: torch.Tensor) -> torch.Tensor:
    """coreai_opt's ``minval`` of a float32 range (see `QParams`): entries that saw no data take
    ``quant_min``, i.e. ``(quant_min - 0) * 1`` under the fallback scale 1 and zero point 0, so
    both formulations dequantize alike there."""
    minval = (torch.min(min_val, torch.zeros_like(min_val)) if spec.mapping == "asymmetric"
              else -torch.max(min_val.abs(), max_val.abs()))
    # coreai_opt's minval is in the input's dtype (spec.compute_dtype): a pinned end rounds to it,
    # saturating where it is past that dtype's range (as the scale does)
    compute = getattr(torch, spec.compute_dtype)
    minval = _formats.rounded_in(minval.clamp(min=torch.finfo(compute).min).float(), compute)  # compiled too
    return torch.where(calibrated, minval, torch.full_like(minval, float(spec.qmin)))


def _with_minval_of_codes(qparams: QParams, spec: QuantSpec) -> QParams:
    """``qparams`` from a rule that gives them directly (fixed qparams, no range), with ``minval`` the
    value of code ``quant_min``, ``(quant_min - zero_point) * scale``: what makes the MINVAL
    formulation dequantize as the zero-point one."""
    return qparams._replace(
        minval=(float(spec.qmin) - qparams.zero_point.float()) * qparams.scale.float())
