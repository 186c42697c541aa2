"""compute_qparams: observer state + spec -> QParams, as a pure function.

Each state type registers a *range rule* that turns the state into a ``(min_val, max_val)`` range
(or directly into QParams), and one function, `qparams_from_minmax`, maps a range onto the spec's
format. Range rules take keyword options (``method=``, ``percentile=``, ...), so
``compute_qparams(state, spec, method="entropy")`` works for distribution observers.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, NamedTuple

import torch

from . import _compat_torchao, _formats, _native
from ._spec import QuantSpec

__all__ = [
    "QParams",
    "compute_qparams",
    "qparams_from_minmax",
    "register_range_rule",
    "Range",
    "stacked_compute_qparams",
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


def register_range_rule(state_cls: type, elementwise: bool = False):
    """Decorator: ``rule(state, spec, **options) -> Range | QParams`` for ``state_cls``.

    ``elementwise=True`` declares that the rule's Range is computed entry by entry from the state's
    fields (as the min/max family's is), so that `stacked_compute_qparams` may apply it to a
    stacked state directly instead of through ``torch.vmap``.
    """

    def decorate(rule):
        _RANGE_RULES[state_cls] = rule
        if elementwise:
            rule._qstats_elementwise = True
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
    if not options and global_scale is None:
        recalled = _recalled(state, spec, ())
        if recalled is not None:
            return recalled
    result = _rule_for(state)(state, spec, **options)
    if isinstance(result, QParams):
        return result
    return qparams_from_minmax(
        result.min_val, result.max_val, spec, calibrated=result.calibrated, global_scale=global_scale
    )


def stacked_compute_qparams(state, spec: QuantSpec, **options) -> QParams:
    """``torch.vmap(lambda s: compute_qparams(s, spec, **options))(state)`` for a state whose fields
    have a leading stack dimension (stacked experts), bit for bit.

    Where the state's range rule is elementwise and the spec's format maps each entry on its own
    (no two-level scale reducing over a slice), the vmap is skipped: the same ops run on the
    stacked tensors, without the batching overhead of each small op. As under vmap, entries that
    saw no data get the fallback and are reported in ``QParams.calibrated``; the caller applies
    ``spec.on_uncalibrated`` (`check_calibrated`).
    """
    if not isinstance(spec, QuantSpec):
        raise TypeError(f"compute_qparams: spec must be a QuantSpec, got {type(spec).__name__}")
    fields = [t for t in state if isinstance(t, torch.Tensor)] if isinstance(state, tuple) else []
    if not fields or any(t.ndim < 1 or t.shape[0] != fields[0].shape[0] for t in fields):
        shapes = [tuple(t.shape) for t in fields]
        raise ValueError(
            f"stacked_qparams: expected a stacked state (every field with the same leading dimension), "
            f"got {type(state).__name__} with field shapes {shapes}"
        )
    if not options:
        recalled = _recalled(state, spec, (fields[0].shape[0],))
        if recalled is not None:
            return recalled
    rule = _rule_for(state)
    if getattr(rule, "_qstats_elementwise", False) and not options and not _formats.handles_qparams(spec):
        result = rule(state, spec)
        min_val, max_val = result.min_val, result.max_val
        if min_val.ndim >= 1:
            stack = (min_val.shape[0],)
            plan = _plan_for(spec, min_val) if min_val.dtype == max_val.dtype == torch.float32 else None
            if plan:  # the stack's global scales (ones) from the same pass where it is native
                return _symmetric_qparams(min_val, max_val, spec, result.calibrated, False, plan, ones_shape=stack)
            qparams = qparams_from_minmax(
                min_val, max_val, spec, calibrated=result.calibrated, check_uncalibrated=False
            )
            # an elementwise format's global scale is 1 (qparams_from_minmax)
            ones = torch.ones(stack, dtype=torch.float32, device=qparams.scale.device)
            return qparams._replace(global_scale=ones)
    return torch.vmap(lambda one: compute_qparams(one, spec, **options))(state)


def _recalled(state, spec: QuantSpec, ones_shape) -> QParams | None:
    """The QParams of ``state`` for ``spec`` that the update which returned it computed in its
    own pass for this very spec (`qstats._native.recall`): the range rule of its type reads the
    extremes and counts as they are (``_qstats_extremes``: the min/max states'), and where the
    update kept the scales, every entry was valid. None otherwise: the caller maps the state."""
    if not getattr(_RANGE_RULES.get(type(state)), "_qstats_extremes", False):
        return None
    recalled = _native.recall(state.min_val, state.max_val, state.count, ones_shape, spec=spec)
    if recalled is None:
        return None
    scale, zero_point, calibrated, ones = recalled
    return QParams(scale, zero_point, ones, calibrated)


def _is_traced(t: torch.Tensor) -> bool:
    if torch.compiler.is_compiling():
        return True
    return bool(torch._C._functorch.is_functorch_wrapped_tensor(t))


def check_calibrated(calibrated: torch.Tensor, spec: QuantSpec, where: str = "compute_qparams") -> None:
    """Raises ValueError (eager only) when ``spec.on_uncalibrated == 'raise'`` and some entries
    of ``calibrated`` are False."""
    if spec.on_uncalibrated != "raise" or _is_traced(calibrated):
        return
    missing = int((~calibrated).sum())
    if missing:
        total = calibrated.numel()
        raise ValueError(
            f"{where}: {missing} of {total} quantization parameter(s) saw no finite data (uncalibrated); "
            "observe more data or use QuantSpec(on_uncalibrated='fallback') to get scale 1 and zero point 0 "
            "with a coverage mask in QParams.calibrated"
        )


def _round_scale(scale: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    if spec.scale_dtype == "float32":
        return scale
    dtype = getattr(torch, spec.scale_dtype)
    if spec.scale_dtype in ("float8_e4m3fn", "float16"):
        # narrow exponent ranges: the largest finite scale instead of an overflow to Inf or NaN,
        # and the smallest positive one (a subnormal) instead of an underflow to zero (the eps
        # floor, applied in float32, lies below it for float8: 2**-9)
        finfo = torch.finfo(dtype)
        return scale.clamp(finfo.tiny * finfo.eps, finfo.max).to(dtype).float()
    return scale.to(dtype).float()


def _torch_ao(min_val, max_val, spec: QuantSpec):
    qmin, qmax = spec.qrange
    # torch.ao's max(scale, eps) against its float32 eps buffer: clamp_min casts eps to float32
    eps = spec.eps
    min_val_neg = min_val.clamp(max=0.0)
    max_val_pos = max_val.clamp(min=0.0)
    if spec.mapping in ("symmetric", "narrow"):
        max_val_pos = torch.max(-min_val_neg, max_val_pos)
        scale = max_val_pos / (float(qmax - qmin) / 2)
        scale = scale.clamp_min(eps)
        zero_point = torch.full_like(scale, spec.zero_point_of_symmetric, dtype=torch.int32)
    elif spec.mapping == "symmetric_no_clipping_err":
        scale_from_min = min_val_neg / float(qmin)
        scale_from_max = max_val_pos / float(qmax)
        scale = torch.where(scale_from_min > scale_from_max, scale_from_min, scale_from_max)
        scale = scale.clamp_min(eps)
        zero_point = torch.full_like(scale, spec.zero_point_of_symmetric, dtype=torch.int32)
    elif spec.zero_point_domain == "float":
        scale = (max_val - min_val) / float(qmax - qmin)
        scale = torch.where(scale > eps, scale, torch.ones_like(scale))
        zero_point = -1 * min_val / scale
    else:
        scale = (max_val_pos - min_val_neg) / float(qmax - qmin)
        scale = scale.clamp_min(eps)
        zero_point = qmin - torch.round(min_val_neg / scale).to(torch.int32)
        zero_point = torch.clamp(zero_point, qmin, qmax)
    if spec.zero_point_domain == "none":
        zero_point = torch.zeros_like(scale, dtype=torch.int32)
    return _round_scale(scale, spec), zero_point


def _compressed_tensors(min_val, max_val, spec: QuantSpec):
    from ._compat_compressed_tensors import compressed_tensors_qparams

    return compressed_tensors_qparams(min_val, max_val, spec)


class _SymmetricPlan(NamedTuple):
    """What `_symmetric_qparams` needs of a spec, worked out once per spec."""

    half_range: float  # the divisor of the peak
    eps: float
    floor_at_eps: bool  # torch.ao: max(scale, eps); compressed-tensors: eps where the scale is 0
    zero_point: int
    zero_point_dtype: torch.dtype
    any_device: bool  # False: CPU only (the general path divides by a tensor there)
    # float32(half float32 max) / half_range in float32 arithmetic: the largest scale, and None
    # where the float32 eps exceeds it (then the floor must come after the cap, in two ops)
    scale_cap: float | None = None
    # (half_range, eps, scale_cap, zero_point, zero_point_dtype, floor_at_eps, round_to), the numbers of
    # the native pass (`qstats._native.symmetric_scales`, or an update's own: `native_scales`) where
    # it computes this spec's scales; None where it does not
    native: tuple | None = None
    # True: the native pass or the general path (compressed-tensors computing in bfloat16/float16:
    # the ATen ops below compute in float32)
    native_only: bool = False


@functools.lru_cache(maxsize=1024)
def _symmetric_plan(spec: QuantSpec):
    """The `_SymmetricPlan` of specs that `_symmetric_qparams` computes: torch.ao's symmetric and
    narrow mappings, and compressed-tensors' symmetric one with float32 scales (its arithmetic in
    float32, or in bfloat16/float16 through the native pass only), onto an elementwise format;
    None for other specs."""
    if _formats.handles_qparams(spec):
        return None
    if spec.convention == "torch_ao" and spec.mapping in ("symmetric", "narrow") and math.isfinite(spec.eps):
        qmin, qmax = spec.qrange
        zero_point = 0 if spec.zero_point_domain == "none" else spec.zero_point_of_symmetric
        half_range = float(qmax - qmin) / 2
        cap = _scale_cap(half_range, spec.eps)
        native = _native_numbers(half_range, spec.eps, cap, zero_point, torch.int32, True, spec.scale_dtype)
        return _SymmetricPlan(half_range, spec.eps, True, zero_point, torch.int32, True, cap, native)
    if spec.convention == "compressed_tensors" and spec.mapping == "symmetric" and spec.scale_dtype == "float32":
        from ._compat_compressed_tensors import _bit_range, _scale_eps, peak_limit

        compute = getattr(torch, spec.compute_dtype)
        low, high = _bit_range(spec, "cpu")
        half_range = float((high - low).to(compute) / 2)
        zero_point_dtype = torch.float32 if spec.is_float else torch.int32
        eps = _scale_eps(spec, compute)
        if compute != torch.float32:
            # the pass rounds as ATen computes in that dtype; the general path where it does not apply
            round_to = 1 if compute == torch.bfloat16 else 2
            native = (half_range, eps, peak_limit(compute, half_range), 0, zero_point_dtype, False, round_to)
            return _SymmetricPlan(half_range, eps, False, 0, zero_point_dtype, False, None, native, native_only=True)
        # the cap: only for the native pass (the general path clamps the peak, the same number)
        native = _native_numbers(half_range, eps, _scale_cap(half_range, eps), 0, zero_point_dtype, False, "float32")
        return _SymmetricPlan(half_range, eps, False, 0, zero_point_dtype, False, None, native)
    return None


def _native_numbers(half_range, eps, cap, zero_point, zero_point_dtype, floor_at_eps, scale_dtype):
    """`_SymmetricPlan.native` of a float32 computation, or None where the pass cannot compute the
    spec's scales: it caps, then floors at (or replaces a zero by) an eps above 0 in float32, in
    float32 scales."""
    if cap is None or scale_dtype != "float32" or not eps > 2.0**-150:
        return None
    return (half_range, eps, cap, zero_point, zero_point_dtype, floor_at_eps, 0)


def _scale_cap(half_range: float, eps: float) -> float | None:
    """``float32(half float32 max) / half_range`` as the float32 division computes it (the scale
    of a peak clipped to half the float32 range), or None where ``eps`` in float32 exceeds it."""
    cap = float(torch.tensor(torch.finfo(torch.float32).max / 2, dtype=torch.float32) / half_range)
    return cap if float(torch.tensor(eps, dtype=torch.float32)) <= cap else None


def _every_entry_valid(min_val: torch.Tensor, max_val: torch.Tensor, calibrated) -> bool:
    """True when every entry is calibrated with finite ``min <= max``, found with three small
    reductions and scalar reads (eager, CPU tensors outside transforms only). ``max - min``
    lies in ``[0, inf)`` exactly when ``min <= max`` with both finite, unless the range overflows
    (then False, and the caller takes the general test)."""
    if calibrated is not None and not bool(calibrated.all()):
        return False
    low, high = torch.aminmax(max_val - min_val)
    return float(low) >= 0.0 and math.isfinite(float(high))


def _host_checkable(*tensors: torch.Tensor) -> bool:
    """Plain CPU tensors in eager mode outside every transform: a scalar read costs nothing."""
    if torch.compiler.is_compiling():
        return False
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    return all(
        type(t) is torch.Tensor and t.device.type == "cpu" and not wrapped(t) for t in tensors if t is not None
    )


def _symmetric_qparams(
    min_val, max_val, spec: QuantSpec, calibrated, check_uncalibrated: bool, plan=None, ones_shape=()
) -> QParams:
    """`qparams_from_minmax` for the specs of `_symmetric_plan` in eager mode, bit for bit, in
    a third to half the ops (each op on a [64, 512] state costs microseconds on CPU, and compares
    and selects several times more than arithmetic).

    The general path clamps the extremes to +-half the float32 range and maps
    ``max(-min(lo, 0), max(hi, 0))`` (compressed-tensors: ``max(|min(lo, 0)|, |max(hi, 0)|)``,
    the same number) divided by the half range. Min and max commute with that clamp, and every
    candidate at or below zero ends at ``eps`` (torch.ao floors the scale at ``eps > 0``;
    compressed-tensors replaces a zero scale by ``eps``, and a negative peak needs ``lo > hi``,
    an invalid range), so ``clamp(max(-lo, hi), max=half_float32_max) / half_range``, then the
    same floor, is the same number, by the same division (compressed-tensors divides by a 0-dim
    tensor, the same IEEE division on CPU; the plan keeps other devices on the general path).
    Given ``lo <= hi``, ``max(-lo, hi)`` is finite exactly when both extremes are, which is the
    general path's validity test in one compare fewer. On plain CPU tensors in eager mode, where
    one host check finds every entry valid (`_every_entry_valid`: the ranges observers produce),
    the mask, the fallback select and one clamp go too. ``plan``: `_symmetric_plan`'s for
    ``spec``; ``ones_shape``: the global scale's (ones), ``(E,)`` for a stack
    (`stacked_compute_qparams`).
    """
    plan = plan or _symmetric_plan(spec)
    if plan.native is not None and not torch.compiler.is_compiling() and min_val.device.type == "cpu":
        # the same numbers in one native pass (`qstats._native.symmetric_scales`) where every
        # entry is valid: after a large update has evicted the caches, each of the ops below
        # costs tens of microseconds. Under vmap alone, one such pass over every slice at once
        # (the ops below where some entry is not valid). Where the update that produced these
        # very fields computed them in its own pass (`minmax`), they are taken from there.
        numbers = plan.native
        recalled = _native.recall(min_val, max_val, calibrated, ones_shape, numbers)
        if recalled is not None:
            scale, zero_point, calibrated, ones = recalled
            return QParams(scale, zero_point, ones, calibrated)
        native = level = None
        mask = calibrated is None or isinstance(calibrated, torch.Tensor)  # not a Python bool
        if mask and _host_checkable(min_val, max_val, calibrated):
            native = _native.symmetric_scales(min_val, max_val, calibrated, *numbers, ones_shape=ones_shape)
        elif (
            mask
            and min_val.shape == max_val.shape
            and (calibrated is None or calibrated.shape == min_val.shape)
            and not (min_val.requires_grad or max_val.requires_grad)
            and _native._built()
        ):
            # under vmap: every slice in one pass (the masked path below where some is not valid)
            tensors = (min_val, max_val) if calibrated is None else (min_val, max_val, calibrated)
            slices = _native.vmap_slices(tensors)
            if slices is not None:
                level, dense = slices
                fields = (*dense, *([None] if calibrated is None else []))
                native = _native.symmetric_scales(*fields, *numbers, ones_shape=ones_shape)
        if native is not None:
            scale, zero_point, calibrated, ones = native
            if level is not None:  # the global scale (ones) stays unbatched, as on the ATen path
                scale, zero_point, calibrated = _native.rebatch((scale, zero_point, calibrated), level)
            return QParams(scale, zero_point, ones, calibrated)
    if plan.native_only:
        qparams = _general_qparams(min_val, max_val, spec, calibrated, None, check_uncalibrated)
        if tuple(ones_shape) == ():
            return qparams
        return qparams._replace(global_scale=torch.ones(ones_shape, dtype=torch.float32, device=qparams.scale.device))
    calibrated = calibrated_mask(calibrated)
    peak = torch.maximum(-min_val, max_val)
    if (
        plan.scale_cap is not None
        and min_val.shape == max_val.shape
        and (calibrated is None or (isinstance(calibrated, torch.Tensor) and calibrated.shape == min_val.shape))
        and _host_checkable(min_val, max_val, calibrated)
        and _every_entry_valid(min_val, max_val, calibrated)
    ):
        # every entry valid (the common case on CPU): no validity mask, no fallback select, and
        # the cap and the eps floor in one clamp: dividing is monotonic, so capping the quotient
        # at the cap's quotient is capping the peak, and the floor (at most the cap) commutes
        scale = _round_scale(peak.div(plan.half_range).clamp(plan.eps, plan.scale_cap), spec)
        if plan.zero_point == 0:
            zero_point = torch.zeros_like(scale, dtype=plan.zero_point_dtype)
        else:
            zero_point = torch.full_like(scale, plan.zero_point, dtype=plan.zero_point_dtype)
        calibrated = torch.ones_like(scale, dtype=torch.bool)  # fresh, as the general test's mask is
        return QParams(scale, zero_point, torch.ones(ones_shape, dtype=torch.float32, device=scale.device), calibrated)
    valid = (min_val <= max_val) & (peak < torch.inf)
    calibrated = valid if calibrated is None else (calibrated & valid)
    if check_uncalibrated:
        check_calibrated(calibrated, spec)
    scale = peak.clamp(max=torch.finfo(torch.float32).max / 2).div(plan.half_range)
    if plan.floor_at_eps:
        scale = scale.clamp_min(plan.eps)
    else:
        scale = torch.where(scale == 0, plan.eps, scale)
    scale = torch.where(calibrated, _round_scale(scale, spec), 1.0)
    if plan.zero_point == 0:
        zero_point = torch.zeros_like(scale, dtype=plan.zero_point_dtype)  # batched as scale is, under vmap
    else:
        zero_point = torch.where(calibrated, plan.zero_point, 0).to(plan.zero_point_dtype)
    global_scale = torch.ones(ones_shape, dtype=torch.float32, device=scale.device)
    return QParams(scale, zero_point, global_scale, calibrated)


def native_scales(spec: QuantSpec):
    """The numbers ``(half_range, eps, cap, zero_point, zero_point_dtype, floor_at_eps, round_to)`` with which
    `_symmetric_qparams` maps ranges onto ``spec``'s scales in a native pass
    (`qstats._native.symmetric_scales`), for an update pass to compute them too
    (`qstats._native.update_extremes`); None for specs it maps otherwise."""
    plan = _symmetric_plan(spec)
    return plan.native if plan else None


def _plan_for(spec: QuantSpec, min_val: torch.Tensor):
    """`_symmetric_plan`'s plan where it applies to these tensors (eager; CPU unless the plan
    holds on every device), else None."""
    if torch.compiler.is_compiling():
        return None
    plan = _symmetric_plan(spec)
    if not plan or not (plan.any_device or min_val.device.type == "cpu"):
        return None
    return plan


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
    min_val = min_val if min_val.dtype == torch.float32 else min_val.float()
    max_val = max_val if max_val.dtype == torch.float32 else max_val.float()
    plan = _plan_for(spec, min_val)
    if plan:
        return _symmetric_qparams(min_val, max_val, spec, calibrated, check_uncalibrated, plan=plan)
    return _general_qparams(min_val, max_val, spec, calibrated, global_scale, check_uncalibrated)


def _general_qparams(min_val, max_val, spec: QuantSpec, calibrated, global_scale, check_uncalibrated: bool) -> QParams:
    """`qparams_from_minmax` of float32 ranges by the general formulas (no short cut)."""
    calibrated = calibrated_mask(calibrated)
    compiling = torch.compiler.is_compiling()
    # min <= max with both finite, without isfinite (slow on CPU): given min <= max, half the
    # span is finite exactly when both are (halving keeps finite extremes from overflowing).
    half_span = max_val * 0.5 - min_val * 0.5
    if compiling:
        # the same test in compares the compiler vectorises (it loops over nan_to_num's isnan)
        valid = (min_val <= max_val) & (half_span >= 0) & (half_span < torch.inf)
    else:
        valid = (min_val <= max_val) & (torch.nan_to_num(half_span, nan=-1.0, posinf=-1.0) >= 0)
    calibrated = valid if calibrated is None else (calibrated & valid)
    if check_uncalibrated:
        check_calibrated(calibrated, spec)
    formats = _formats.handles_qparams(spec)
    if formats:
        # Two-level scales reduce over all entries: uncalibrated ones must not take part.
        zero = torch.zeros_like(min_val)
        min_val = torch.where(calibrated, min_val, zero)
        max_val = torch.where(calibrated, max_val, zero)
    else:
        # Elementwise formulas: an uncalibrated entry only needs a finite range (its scale and
        # zero point are replaced below), so skip the slower select.
        if compiling:  # a select the compiler vectorises
            min_val = torch.where(calibrated, min_val, 0.0)
            max_val = torch.where(calibrated, max_val, 0.0)
        else:
            min_val = torch.nan_to_num(min_val, nan=0.0, posinf=0.0, neginf=0.0)
            max_val = torch.nan_to_num(max_val, nan=0.0, posinf=0.0, neginf=0.0)
    # Ranges near the float32 limit would overflow ``max - min`` to an infinite scale: clip them
    # to half the float32 range (a no-op for every range below 1.7e38).
    half_float32_max = torch.finfo(torch.float32).max / 2
    min_val = min_val.clamp(min=-half_float32_max)
    max_val = max_val.clamp(max=half_float32_max)
    if formats:
        scale, zero_point, global_scale = _formats.qparams(min_val, max_val, spec, global_scale)
    elif spec.convention == "compressed_tensors":
        scale, zero_point = _compressed_tensors(min_val, max_val, spec)
    elif spec.convention == "torchao":
        scale, zero_point = _compat_torchao.torchao_qparams(min_val, max_val, spec)
    else:
        scale, zero_point = _torch_ao(min_val, max_val, spec)
    if formats:
        scale = torch.where(calibrated, scale, torch.ones_like(scale))
        zero_point = torch.where(calibrated, zero_point, torch.zeros_like(zero_point))
    else:
        # Scale 1 and zero point 0 where uncalibrated (masked_fill: exact whatever the formula gave
        # there, and cheaper than a select on CPU).
        uncalibrated = ~calibrated
        scale = scale.masked_fill(uncalibrated, 1.0)
        zero_point = zero_point.masked_fill(uncalibrated, 0)
        global_scale = torch.ones((), dtype=torch.float32, device=scale.device)
    return QParams(scale, zero_point, global_scale, calibrated)
