"""Moments observer: count, mean and variance (Chan's parallel merge), abs-mean, rms and an Lp norm.

The state stores float64 sums and int64 counts, so merging is exact up to float rounding. The Lp
sum is kept scaled by the running absmax (``sum |x / m|**p``, at most the count), so large ``p`` or
large values do not overflow it; the state records ``p``. The
range rules (``compute_qparams(state, spec, method=..., k=...)``: ``"mean_std"``, ``"rms"``,
``"abs_mean"``, ``"lp"``) are registered with `qstats.observers.search`; see docs/observers.md.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from .._checks import is_real_number, require
from .._granularity import check_observable, qparam_shape
from .._qparams import Range, register_range_rule
from .._reductions import finite_aminmax
from .._spec import QuantSpec
from ._base import Observer, check_field_dtype, check_same_shapes, check_state, register_state
from .kit import check_spec, masked_view
from .search import check_options, register_search, search
from .search._geometry import may_exclude_zero

__all__ = ["MomentsState", "moments"]


@register_state
class MomentsState(NamedTuple):
    """Sums of a moments observer, one entry per quantization parameter. The Lp norm's sum is
    scaled: ``lp_max`` is the largest ``|x|`` seen (``m``), ``lp_sum`` the sum of ``|x / m|**p``
    (rescaled when ``m`` grows) and ``lp_order`` the observer's ``p``, so
    ``sum |x|**p == lp_sum * lp_max**p`` without forming it."""

    approx_fields = ("total", "m2", "abs_total", "square_total", "lp_sum")  # float sums: laws compare them to tolerance

    count: torch.Tensor
    total: torch.Tensor
    m2: torch.Tensor
    abs_total: torch.Tensor
    square_total: torch.Tensor
    lp_max: torch.Tensor
    lp_sum: torch.Tensor
    lp_order: torch.Tensor
    nonfinite: torch.Tensor

    def _denominator(self):
        return self.count.clamp(min=1).to(torch.float64)

    @property
    def mean(self) -> torch.Tensor:
        """Mean (0 where nothing was seen)."""
        return self.total / self._denominator()

    @property
    def variance(self) -> torch.Tensor:
        """Population variance."""
        return (self.m2 / self._denominator()).clamp(min=0)

    @property
    def std(self) -> torch.Tensor:
        return self.variance.sqrt()

    @property
    def abs_mean(self) -> torch.Tensor:
        return self.abs_total / self._denominator()

    @property
    def rms(self) -> torch.Tensor:
        return (self.square_total / self._denominator()).sqrt()

    @property
    def lp_norm(self) -> torch.Tensor:
        """``(E|x|**p)**(1/p)``, as ``m * (lp_sum / count)**(1/p)`` (no overflow; 0 where nothing was seen)."""
        return self.lp_max * (self.lp_sum / self._denominator()).pow(1.0 / self.lp_order)


def _checked(state, where: str) -> MomentsState:
    """``state`` after the checks of a `MomentsState`: its type, int64 ``count`` and ``nonfinite``,
    float64 sums, every field of one shape. An update turned a float64 count into a float64 state and
    broadcast fields of other shapes, or failed inside torch (``compute_qparams`` too)."""
    check_state(state, MomentsState, where)
    for name, value in zip(MomentsState._fields, state):
        check_field_dtype(state, name, torch.int64 if name in ("count", "nonfinite") else torch.float64, where)
        if value.shape != state.count.shape:
            raise ValueError(f"{where}: MomentsState fields do not line up: {name} has shape {tuple(value.shape)}, "
                             f"count {tuple(state.count.shape)}")
    return state


def _batch_moments(x, weight, expected, spec: QuantSpec, power: float) -> MomentsState:
    """One batch's moments (a state of its own, for `_combine`)."""
    view, mask = masked_view(x.detach(), weight, spec, expected, "moments.update")
    v = view.to(torch.float64)
    finite = torch.isfinite(v)
    included = finite if mask is None else (finite & mask)
    if spec.nonfinite == "raise":
        # the min/max reduction's check (and the same count): it raises in eager mode, under
        # vmap (its batching rule reads the whole batch) and inside a compiled graph (an
        # opaque op, kept because its count is used), as minmax's does
        # on the non-finite values alone: float64 values past float32's range are finite here
        nonfinite = finite_aminmax(torch.where(finite, torch.zeros_like(v), v), mask, "raise")[3]
    else:
        nonfinite = ((~finite) if mask is None else ((~finite) & mask)).sum(dim=(0, -1))
    dims = (0, -1)
    v = torch.where(included, v, torch.zeros_like(v))
    count = included.sum(dim=dims)
    total = v.sum(dim=dims)
    mean = total / count.clamp(min=1).to(torch.float64)
    centred = (v - mean.unsqueeze(0).unsqueeze(-1)) * included.to(torch.float64)
    m2 = (centred * centred).sum(dim=dims)
    magnitude = v.abs()  # 0 where left out
    largest = magnitude.amax(dim=dims)
    unit = torch.where(largest > 0, largest, torch.ones_like(largest)).unsqueeze(0).unsqueeze(-1)
    return MomentsState(
        count,
        total,
        m2,
        magnitude.sum(dim=dims),
        (v * v).sum(dim=dims),
        largest,
        (magnitude / unit).pow(power).sum(dim=dims),
        torch.full_like(total, power),
        nonfinite,
    )


def _rescaled(lp_sum: torch.Tensor, lp_max: torch.Tensor, largest: torch.Tensor, order: torch.Tensor):
    """``lp_sum`` (a sum of ``|x / lp_max|**p``) as a sum of ``|x / largest|**p`` (``largest >= lp_max``)."""
    ratio = lp_max / torch.where(largest > 0, largest, torch.ones_like(largest))
    return lp_sum * ratio.pow(order)


def _combine(a: MomentsState, b: MomentsState, where: Optional[str]) -> MomentsState:
    """Two states as one: sums add, the centred sums of squares by Chan et al.'s update, the scaled
    Lp sums after rescaling both to the larger absmax. With ``where``, ValueError when their ``p``
    differ (a host read: ``update`` skips it, its batch has the observer's own ``p``)."""
    count = a.count + b.count
    na = a.count.to(torch.float64)
    nb = b.count.to(torch.float64)
    n = count.clamp(min=1).to(torch.float64)
    delta = b.total / nb.clamp(min=1) - a.total / na.clamp(min=1)
    # no correction where a side is empty: its delta (the other mean) may square past float64
    # (float64 inputs past 1e154), and inf * 0 was a NaN variance
    m2 = a.m2 + b.m2 + torch.where((na > 0) & (nb > 0), delta * delta * na * nb / n, torch.zeros_like(delta))
    # an Lp sum of another order cannot be added (states of two moments observers); the check's
    # result is threaded into the state so a compiled graph keeps it
    same = a.lp_order == b.lp_order
    mixed = torch.full_like(a.lp_order, math.nan)  # update: the order of a mixed sum is NaN, refused later
    if where is not None:
        same = require(same, f"{where}: the states hold Lp sums of different orders p: they come "
                       "from moments observers built with other p")
    largest = torch.maximum(a.lp_max, b.lp_max)
    lp_sum = _rescaled(a.lp_sum, a.lp_max, largest, a.lp_order) + _rescaled(b.lp_sum, b.lp_max, largest, b.lp_order)
    return MomentsState(
        count,
        a.total + b.total,
        m2,
        a.abs_total + b.abs_total,
        a.square_total + b.square_total,
        largest,
        lp_sum,
        torch.where(same, a.lp_order, mixed),
        a.nonfinite + b.nonfinite,
    )


def moments(spec: QuantSpec, p: float = 4.0) -> Observer:
    """Count, mean, variance, abs-mean, rms and the normalised Lp norm ``(E|x|**p)**(1/p)``.

    Args:
      spec: the QuantSpec (its granularity decides the groups).
      p: order of the Lp norm (default 4), recorded in the state (``lp_order``); its sum is kept
        scaled by the running absmax, so any ``p`` and any finite value are safe.

    Laws: identity exactly; associativity, commutativity and homomorphism up to float rounding.
    ``weight == 0`` leaves values out; NaN/Inf follow ``spec.nonfinite``.

    >>> import torch, qstats
    >>> spec = qstats.QuantSpec(dtype="int8")
    >>> obs = qstats.moments(spec)
    >>> x = torch.tensor([1.0, -1.0, 3.0, -3.0])
    >>> s = obs.update(obs.init(x), x)
    >>> float(s.mean), float(s.std)
    (0.0, 2.23606797749979)
    """
    check_spec(spec, "moments")
    power = float(_positive_finite(p, "p", "moments"))

    def init_fn(x: torch.Tensor) -> MomentsState:
        check_observable(x, "moments.init")
        shape = qparam_shape(x.shape, spec.granularity)
        zeros = torch.zeros(shape, dtype=torch.float64, device=x.device)
        count = torch.zeros(shape, dtype=torch.int64, device=x.device)
        return MomentsState(count, zeros, zeros.clone(), zeros.clone(), zeros.clone(), zeros.clone(), zeros.clone(),
                            torch.full(shape, power, dtype=torch.float64, device=x.device),
                            count.clone())

    def update_fn(state: MomentsState, x: torch.Tensor, weight: Optional[torch.Tensor] = None) -> MomentsState:
        state = _checked(state, "moments.update")
        check_observable(x, "moments.update")  # on an empty batch too: a list or bool tensor is a mistake
        if x.numel() == 0:
            return state
        return _combine(state, _batch_moments(x, weight, state.count.shape, spec, power), None)

    def merge_fn(a: MomentsState, b: MomentsState) -> MomentsState:
        a, b = _checked(a, "moments.merge"), _checked(b, "moments.merge")
        check_same_shapes(a, b, "moments.merge")
        return _combine(a, b, "moments.merge")

    return Observer(init_fn, update_fn, merge_fn, exact=True, spec=spec, name="moments", state_type=MomentsState)


def _as_float32_range(state: MomentsState, lo: torch.Tensor, hi: torch.Tensor, spec: Optional[QuantSpec] = None) -> Range:
    """``[min(lo, 0), max(hi, 0)]`` in float32 (``[lo, hi]`` for a ``spec`` whose ranges need not hold
    zero, a float zero point: `may_exclude_zero`); calibrated where the state counted values. ``k``
    standard deviations may reach past float32 (float64 moments): the largest float32 there, not
    an infinite range that would read as uncalibrated."""
    zero = torch.zeros_like(lo)
    largest = torch.finfo(torch.float32).max
    if spec is None or not may_exclude_zero(spec):
        lo, hi = torch.minimum(lo, zero), torch.maximum(hi, zero)
    lo = lo.clamp(min=-largest).float()
    hi = hi.clamp(max=largest).float()
    return Range(lo, hi, state.count > 0)


def _positive_finite(value, name: str, where: str = "compute_qparams"):
    """``value``, after ValueError naming ``name`` unless it is a positive finite real number."""
    if not (is_real_number(value) and 0 < value < math.inf):
        raise ValueError(f"{where}: {name} must be a positive finite number, got {value!r}")
    return value


def _multiple(k: Optional[float], default: float) -> float:
    """The method's ``k`` (``default`` when None): ValueError unless a positive finite number."""
    return _positive_finite(default if k is None else k, "k")


def mean_std_search(state: MomentsState, spec: QuantSpec, k: Optional[float] = None) -> Range:
    """``"mean_std"``: ``[mean - k * std, mean + k * std]`` (``k=3``; the population std of x, not Brevitas'
    ``MeanSigmaStd`` of |x|)."""
    k = _multiple(k, 3.0)
    return _as_float32_range(state, state.mean - k * state.std, state.mean + k * state.std, spec)


def rms_search(state: MomentsState, spec: QuantSpec, k: Optional[float] = None) -> Range:
    """``"rms"`` (qwix' ``rms,k``): ``[-k * rms, k * rms]`` (``k=3``)."""
    amax = _multiple(k, 3.0) * state.rms
    return _as_float32_range(state, -amax, amax)


def abs_mean_search(state: MomentsState, spec: QuantSpec, k: Optional[float] = None) -> Range:
    """``"abs_mean"``: ``[-k * E|x|, k * E|x|]`` (``k=1``)."""
    amax = _multiple(k, 1.0) * state.abs_mean
    return _as_float32_range(state, -amax, amax)


def lp_search(state: MomentsState, spec: QuantSpec, k: Optional[float] = None, p: Optional[float] = None) -> Range:
    """``"lp"`` (AQT's Lp calibration): ``[-k * (E|x|**p)**(1/p), ...]`` (``k=1``) of the state's
    ``p``; a ``p`` given must be that order (ValueError otherwise)."""
    k = _multiple(k, 1.0)
    if p is not None:
        _positive_finite(p, "p")
    # NaN orders: an update of this state by a moments observer of another p mixed two orders
    same = require(state.lp_order == (state.lp_order if p is None else float(p)),
                   f"compute_qparams: method 'lp' with p={p!r}, but the state holds the Lp sum of "
                   "another order, or of mixed orders (NaN; state.lp_order is the p its moments "
                   "observer was built with)")
    state = state._replace(lp_order=torch.where(same, state.lp_order, state.lp_order))
    amax = k * state.lp_norm
    return _as_float32_range(state, -amax, amax)


for _name, _search in (("mean_std", mean_std_search), ("rms", rms_search),
                       ("abs_mean", abs_mean_search), ("lp", lp_search)):
    register_search(_name, _search, observer="moments")


@register_range_rule(MomentsState)
def _moments_rule(state: MomentsState, spec: QuantSpec, method: str = "mean_std", **options) -> Range:
    """The range of ``method`` (a search registered for ``"moments"``), with its options."""
    found = search(method, "moments")
    check_options(found, method, options, "moments")
    return found(_checked(state, "compute_qparams"), spec, **options)
