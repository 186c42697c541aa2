"""compute_qparams: observer state + spec -> QParams, as a pure function.

Each state type registers a *range rule* that turns the state into a ``(min_val, max_val)`` range
(or directly into QParams), and one function, `qparams_from_minmax`, maps a range onto the spec's
format: with the spec's convention's arithmetic (`Convention.qparams`), or the MX / NVFP4 scale
arithmetic of qstats/_formats.py. Range rules take keyword options (``method=``,
``percentile=``, ...), so ``compute_qparams(state, spec, method="entropy")`` works for
distribution observers.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

from . import _formats
from ._checks import require_calibrated
from ._spec import QuantSpec

__all__ = [
    "QParams",
    "compute_qparams",
    "qparams_from_minmax",
    "register_range_rule",
    "Range",
]


class QParams(NamedTuple):
    """Quantization parameters; every field is a tensor (vmap- and checkpoint-friendly).

    Attributes:
      scale: float32 (rounded to ``spec.scale_dtype``), shape ``qparam_shape``.
      zero_point: int32 for the int zero-point domain, float32 for the float domain, zeros for
        ``"none"``; shape ``qparam_shape``.
      global_scale: float32 scalar; 1 unless the spec uses two-level scales.
      calibrated: bool, shape ``qparam_shape``: False where the state saw no finite data (those
        entries hold the fallback scale 1 and zero point 0).
    """

    scale: torch.Tensor
    zero_point: torch.Tensor
    global_scale: torch.Tensor
    calibrated: torch.Tensor


class Range(NamedTuple):
    """What a range rule returns: the range to map, and which entries saw data (a bool mask, or
    integer counts: calibrated where positive; `calibrated_mask` reads either)."""

    min_val: torch.Tensor
    max_val: torch.Tensor
    calibrated: torch.Tensor


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


def register_range_rule(state_cls: type):
    """Decorator: ``rule(state, spec, **options) -> Range | QParams`` for ``state_cls``."""

    def decorate(rule):
        _RANGE_RULES[state_cls] = rule
        return rule

    return decorate


def _rule_for(state) -> Callable[..., Any]:
    for cls in type(state).__mro__:
        rule = _RANGE_RULES.get(cls)
        if rule is not None:
            return rule
    raise TypeError(
        f"compute_qparams: no range rule for {type(state).__name__}; register one with "
        "qstats.register_range_rule"
    )


def compute_qparams(state, spec: QuantSpec, **options) -> QParams:
    """Quantization parameters of ``state`` for ``spec``. Pure; vmappable; no host sync under
    vmap or compile.

    Args:
      state: an observer state (MinMaxState, HistogramState, ...).
      spec: the QuantSpec to map the observed range onto.
      **options: passed to the state's range rule (e.g. ``method="l2"`` for histograms).

    Raises:
      ValueError: in eager mode, when ``spec.on_uncalibrated == "raise"`` and some parameter saw no
        data (names how many). Under vmap/compile the fallback is used and reported in
        ``QParams.calibrated``.

    >>> import torch, qstats
    >>> spec = qstats.QuantSpec(dtype="int8")
    >>> obs = qstats.minmax(spec)
    >>> x = torch.tensor([-1.0, 2.0])
    >>> qstats.compute_qparams(obs.update(obs.init(x), x), spec).scale
    tensor(0.0157)
    """
    if not isinstance(spec, QuantSpec):
        raise TypeError(f"compute_qparams: spec must be a QuantSpec, got {type(spec).__name__}")
    global_scale = options.pop("global_scale", None)  # a fused group's (qstats.fused)
    result = _rule_for(state)(state, spec, **options)
    if isinstance(result, QParams):
        return result
    return qparams_from_minmax(
        result.min_val, result.max_val, spec, calibrated=result.calibrated, global_scale=global_scale
    )


def check_calibrated(calibrated: torch.Tensor, spec: QuantSpec, where: str = "compute_qparams") -> torch.Tensor:
    """``calibrated``, after ValueError when ``spec.on_uncalibrated == 'raise'`` and some entries
    are False (outside ``vmap``, where slices report rather than raise)."""
    if spec.on_uncalibrated != "raise":
        return calibrated
    return require_calibrated(calibrated, where)


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
    min_val, max_val = min_val.float(), max_val.float()
    # min <= max with both finite: given min <= max, half the span is finite exactly when both
    # are (halving keeps finite extremes from overflowing); NaN fails every compare
    half_span = max_val * 0.5 - min_val * 0.5
    valid = (min_val <= max_val) & (half_span >= 0) & (half_span < torch.inf)
    calibrated = valid if calibrated is None else (calibrated_mask(calibrated) & valid)
    if check_uncalibrated:
        calibrated = check_calibrated(calibrated, spec)
    # an uncalibrated entry maps a zero range (its scale and zero point are replaced below; a
    # two-level scale reduces over every entry, so they must not take part); ranges near the
    # float32 limit are clipped to half of it, so that max - min cannot overflow
    half_float32_max = torch.finfo(torch.float32).max / 2
    min_val = torch.where(calibrated, min_val, 0.0).clamp(min=-half_float32_max)
    max_val = torch.where(calibrated, max_val, 0.0).clamp(max=half_float32_max)
    if _formats.handles_qparams(spec):
        scale, zero_point, global_scale = _formats.qparams(min_val, max_val, spec, global_scale)
    else:
        scale, zero_point = spec.convention.qparams(min_val, max_val, spec)
        global_scale = torch.ones((), dtype=torch.float32, device=scale.device)
    scale = torch.where(calibrated, scale, torch.ones_like(scale))
    zero_point = torch.where(calibrated, zero_point, torch.zeros_like(zero_point))
    return QParams(scale, zero_point, global_scale, calibrated)

