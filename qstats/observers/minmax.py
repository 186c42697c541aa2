"""Min/max observers: running (exact), memoryless (latest batch) and moving-average.

All three reduce the canonical view ``(observations, *qparam_shape, group)`` of the input with
`observe_extremes` (the shared `finite_aminmax`), so every granularity, the per-observation
``weight`` mask and the non-finite policy behave the same way. States hold float32 extremes and
int64 counts whatever the input dtype.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch

from .._checks import is_real_number
from .._qparams import Range, register_range_rule
from .._spec import QuantSpec
from ._base import (Observer, batch_weighted_mean, check_merge_states, check_state, kept_dtypes,
                    register_state)
from .kit import check_observable, check_spec, extremes_init, observe_extremes

__all__ = [
    "MinMaxState",
    "MemorylessMinMaxState",
    "MovingAverageMinMaxState",
    "minmax",
    "memoryless_minmax",
    "moving_average_minmax",
]


@register_state
class MinMaxState(NamedTuple):
    """Running extremes. ``count``: finite values seen per parameter; ``nonfinite``: NaN/Inf
    values left out per parameter."""

    min_val: torch.Tensor
    max_val: torch.Tensor
    count: torch.Tensor
    nonfinite: torch.Tensor


@register_state
class MemorylessMinMaxState(NamedTuple):
    """Extremes of the latest batch only (same fields as MinMaxState)."""

    min_val: torch.Tensor
    max_val: torch.Tensor
    count: torch.Tensor
    nonfinite: torch.Tensor


@register_state
class MovingAverageMinMaxState(NamedTuple):
    """Exponential moving average of per-batch extremes. ``batches``: batches averaged per
    parameter (the merge weight); ``count``/``nonfinite`` as in MinMaxState."""

    min_val: torch.Tensor
    max_val: torch.Tensor
    batches: torch.Tensor
    count: torch.Tensor
    nonfinite: torch.Tensor


def check_extremes_state(state, cls, where: str) -> None:
    """`check_state`, then the fields: floating-point extremes and integer counts, all of one
    shape (a count of another shape would broadcast through an update and change the state)."""
    check_state(state, cls, where)
    for name, value in zip(cls._fields, state):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{where}: field {name!r} of the {cls.__name__} is a {type(value).__name__}, not a tensor")
        if value.shape != state.min_val.shape:
            raise ValueError(
                f"{where}: field {name!r} of the {cls.__name__} has shape {tuple(value.shape)}, "
                f"but min_val has shape {tuple(state.min_val.shape)}"
            )
        extremes = name in ("min_val", "max_val")
        if extremes != value.dtype.is_floating_point or value.dtype == torch.bool:
            want = "a floating-point dtype" if extremes else "an integer dtype"
            raise ValueError(f"{where}: field {name!r} of the {cls.__name__} has dtype {value.dtype}, expected {want}")


def _merge_extremes(cls, name: str):
    def merge_fn(a, b):
        check_merge_states(a, b, cls, f"{name}.merge", check_extremes_state)
        return cls(torch.minimum(a.min_val, b.min_val), torch.maximum(a.max_val, b.max_val),
                   a.count + b.count, a.nonfinite + b.nonfinite)

    return merge_fn


def minmax(spec: QuantSpec) -> Observer:
    """Running min/max (torch.ao MinMaxObserver / PerChannelMinMaxObserver, llm-compressor
    ``static_minmax``).

    Laws: identity, associativity, commutativity and homomorphism all hold bit for bit (exact).
    Inputs of any float dtype are reduced in their own dtype (float64 as float32: values past its
    range count as non-finite) and stored as float32.

    >>> import torch, qstats
    >>> obs = qstats.minmax(qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0)))
    >>> w = torch.tensor([[1.0, -2.0], [3.0, 0.5]])
    >>> obs.update(obs.init(w), w).max_val
    tensor([1., 3.])
    """
    spec = check_spec(spec)

    def update_fn(state: MinMaxState, x: torch.Tensor, weight: Optional[torch.Tensor] = None) -> MinMaxState:
        check_extremes_state(state, MinMaxState, "minmax.update")
        check_observable(x, "minmax.update")
        if x.numel() == 0:
            return state
        lo, hi, count, nonfinite = observe_extremes(x, weight, spec, state.min_val.shape, "minmax.update")
        return kept_dtypes(state, MinMaxState(torch.minimum(state.min_val, lo), torch.maximum(state.max_val, hi),
                                              state.count + count, state.nonfinite + nonfinite), "minmax.update")

    return Observer(extremes_init(MinMaxState, spec, "minmax"), update_fn, _merge_extremes(MinMaxState, "minmax"),
                    exact=True, spec=spec, name="minmax", shared_rows=True, state_type=MinMaxState)


def memoryless_minmax(spec: QuantSpec) -> Observer:
    """Min/max of the latest batch only (llm-compressor ``memoryless_minmax``; dynamic
    quantization).

    ``update`` keeps the extremes of ``x`` only (an empty or fully masked parameter keeps its
    state). ``merge`` combines shards of the same batch (elementwise min/max), so every law holds
    exactly (docs/observers.md).
    """
    spec = check_spec(spec)

    def update_fn(state, x: torch.Tensor, weight: Optional[torch.Tensor] = None) -> MemorylessMinMaxState:
        check_extremes_state(state, MemorylessMinMaxState, "memoryless_minmax.update")
        check_observable(x, "memoryless_minmax.update")
        if x.numel() == 0:
            return state
        batch = observe_extremes(x, weight, spec, state.min_val.shape, "memoryless_minmax.update")
        reached = (batch[2] + batch[3]) > 0  # a parameter the batch does not reach keeps its state
        updated = MemorylessMinMaxState(*(torch.where(reached, new, old) for new, old in zip(batch, state)))
        return kept_dtypes(state, updated, "memoryless_minmax.update")

    merge_fn = _merge_extremes(MemorylessMinMaxState, "memoryless_minmax")
    return Observer(extremes_init(MemorylessMinMaxState, spec, "memoryless_minmax"), update_fn, merge_fn,
                    exact=True, spec=spec, name="memoryless_minmax", shared_rows=True,
                    state_type=MemorylessMinMaxState)


def moving_extremes_update(spec: QuantSpec, step: Callable, where: str, batch_range: Optional[Callable] = None):
    """The update of a moving average of per-batch extremes (`MovingAverageMinMaxState`): the
    first batch that reaches a parameter initialises it, later ones move it by
    ``step(average, batch, observed_dtype)``; ``batch_range(lo, hi)`` may transform a batch's
    extremes first. A parameter that a batch does not reach (masked out) keeps its value."""

    def update_fn(state, x: torch.Tensor, weight: Optional[torch.Tensor] = None) -> MovingAverageMinMaxState:
        check_extremes_state(state, MovingAverageMinMaxState, where)
        check_observable(x, where)
        if x.numel() == 0:
            return state
        lo, hi, count, nonfinite = observe_extremes(x, weight, spec, state.min_val.shape, where)
        if batch_range is not None:
            lo, hi = batch_range(lo, hi)
        first, seen = state.batches == 0, count > 0
        min_val = torch.where(first, lo, step(state.min_val, lo, x.dtype))
        max_val = torch.where(first, hi, step(state.max_val, hi, x.dtype))
        return kept_dtypes(state, MovingAverageMinMaxState(
            torch.where(seen, min_val, state.min_val),
            torch.where(seen, max_val, state.max_val),
            state.batches + seen.to(torch.int64),
            state.count + count,
            state.nonfinite + nonfinite,
        ), where)

    return update_fn


def merge_moving_extremes(a, b):
    """The merge of two moving averages of extremes (fields ``min_val, max_val, batches, count,
    nonfinite``, as `MovingAverageMinMaxState`): the extremes' batch-weighted means
    (`batch_weighted_mean`), the batches and counts added. The caller checks the states; states of
    other dtypes than init's are refused as `kept_dtypes` refuses them in ``update``."""

    def mean(u, v):
        return batch_weighted_mean(u, v, a.batches, b.batches)

    return kept_dtypes(a, type(a)(mean(a.min_val, b.min_val), mean(a.max_val, b.max_val), a.batches + b.batches,
                                  a.count + b.count, a.nonfinite + b.nonfinite), f"merge of {type(a).__name__}s")


def check_averaging_constant(averaging_constant, where: str) -> float:
    """``averaging_constant`` as a float in [0, 1] (0 keeps the first batch's range, as torch.ao's
    and llm-compressor's moving averages); ValueError naming it otherwise (bools, NaN included)."""
    if not (is_real_number(averaging_constant) and 0.0 <= averaging_constant <= 1.0):
        raise ValueError(f"{where}: averaging_constant must be a number in [0, 1], got {averaging_constant!r}")
    return float(averaging_constant)


def moving_average_minmax(spec: QuantSpec, averaging_constant: float = 0.01) -> Observer:
    """Moving average of per-batch extremes (torch.ao MovingAverageMinMaxObserver and
    MovingAveragePerChannelMinMaxObserver; llm-compressor ``minmax``).

    The first batch reaching a parameter initialises it; later ones move it in the arithmetic of
    ``spec.convention``, bit for bit (``averaging_constant=0`` keeps the first batch's range, 1 the
    latest batch's); masked-out parameters keep their value. ``merge`` is the
    batch-count-weighted mean: commutative, ``init`` as identity, associative up to rounding;
    order-dependent, so ``exact=False``.
    """
    spec = check_spec(spec)
    constant = check_averaging_constant(averaging_constant, "moving_average_minmax")

    def step(average, batch, observed_dtype):
        # in the convention's arithmetic (`Convention.moving_average`): torch.ao's
        # ``average + c * (batch - average)``, llm-compressor's ``average * (1 - c) + batch * c``
        return spec.convention.moving_average(average, batch, constant, spec, observed_dtype)

    update_fn = moving_extremes_update(spec, step, "moving_average_minmax.update")

    def merge_fn(a, b) -> MovingAverageMinMaxState:
        check_merge_states(a, b, MovingAverageMinMaxState, "moving_average_minmax.merge",
                           check_extremes_state)
        return merge_moving_extremes(a, b)

    return Observer(extremes_init(MovingAverageMinMaxState, spec, "moving_average_minmax"), update_fn, merge_fn,
                    exact=False, spec=spec, name="moving_average_minmax", shared_rows=True,
                    state_type=MovingAverageMinMaxState, options=(("averaging_constant", constant),))


def _extremes_rule(state, spec: QuantSpec, **options) -> Range:
    if options:
        raise TypeError(f"compute_qparams: {type(state).__name__} takes no options, got {sorted(options)}")
    # fields of one shape and kind: a 0-dim max_val beside per-channel min_vals broadcast to
    # scales nobody observed, and an integer max_val gave integer arithmetic
    check_extremes_state(state, type(state), "compute_qparams")
    return Range(state.min_val, state.max_val, state.count)


for _cls in (MinMaxState, MemorylessMinMaxState, MovingAverageMinMaxState):
    register_range_rule(_cls)(_extremes_rule)
