"""Min/max observers: running (exact), memoryless (latest batch) and moving-average.

All three reduce the canonical view ``(observations, *qparam_shape, group)`` of the input with
`finite_aminmax`, so every granularity, the per-observation ``weight`` mask and the non-finite
policy behave the same way. States hold float32 extremes and int64 counts whatever the input
dtype.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .. import _native
from .._granularity import (
    PerAxis,
    PerHead,
    PerTensor,
    canonical_view,
    check_observable,
    check_shape,
    checked_view,
    qparam_shape,
    stacked_view,
    weight_view,
)
from .._qparams import Range, native_scales, register_range_rule
from .._reductions import finite_aminmax
from .._spec import QuantSpec
from ._base import (
    Observer,
    batch_weighted_mean,
    check_same_shapes,
    check_state,
    register_stacked_init,
    register_stacked_update,
    register_state,
)

__all__ = [
    "MinMaxState",
    "MemorylessMinMaxState",
    "MovingAverageMinMaxState",
    "minmax",
    "memoryless_minmax",
    "moving_average_minmax",
    "observe_extremes",
    "observe_extremes_stacked",
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


def _check_spec(spec) -> QuantSpec:
    if not isinstance(spec, QuantSpec):
        raise TypeError(f"expected a QuantSpec, got {type(spec).__name__}")
    return spec


def _check_extremes_state(state, cls, where: str) -> None:
    """`check_state`, then the fields: floating-point extremes and integer counts (init gives
    float32 and int64), all of one shape (a count of another shape would broadcast through an
    update and change the state's shape). One boolean test on the common path; the loop that
    names the field only on failure."""
    check_state(state, cls, where)
    try:
        lo, hi = state[0], state[1]
        shape = lo.shape
        if hi.shape == shape and lo.dtype.is_floating_point and hi.dtype.is_floating_point:
            for count in tuple(state)[2:]:  # (dynamo of torch 2.6-2.8 cannot slice a NamedTuple)
                if count.shape != shape or count.dtype not in _COUNT_DTYPES:
                    break
            else:
                return
    except AttributeError:
        pass
    for name, value in zip(cls._fields, state):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{where}: field {name!r} of the {cls.__name__} is a {type(value).__name__}, not a tensor")
        if value.shape != state.min_val.shape:
            raise ValueError(
                f"{where}: field {name!r} of the {cls.__name__} has shape {tuple(value.shape)}, "
                f"but min_val has shape {tuple(state.min_val.shape)}"
            )
        extremes = name in ("min_val", "max_val")
        if not (value.dtype.is_floating_point if extremes else value.dtype in _COUNT_DTYPES):
            want = "a floating-point dtype" if extremes else "an integer dtype"
            raise ValueError(f"{where}: field {name!r} of the {cls.__name__} has dtype {value.dtype}, expected {want}")


_COUNT_DTYPES = frozenset((torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8))


def _initializer(cls, spec: QuantSpec):
    """``init(x)`` for a min/max state class (``min_val`` +inf, ``max_val`` -inf, every other
    field an int64 zero count), with its stacked form attached (`register_stacked_init`): the
    ``[E, ...]`` state of a stack built directly, four ops instead of one slice's state copied E
    times. Every field comes from one kind of op (``torch.full``): where caches are cold (after a
    large update, in a loop), each new kind of op call costs tens of microseconds."""
    counters = len(cls._fields) - 2

    def build(shape, device):
        return cls(
            torch.full(shape, torch.inf, dtype=torch.float32, device=device),
            torch.full(shape, -torch.inf, dtype=torch.float32, device=device),
            *(torch.full(shape, 0, dtype=torch.int64, device=device) for _ in range(counters)),
        )

    def init_fn(x: torch.Tensor):
        return build(qparam_shape(x.shape, spec.granularity), x.device)

    def stacked_init_fn(x: torch.Tensor):
        return build((x.shape[0], *qparam_shape(x.shape[1:], spec.granularity)), x.device)

    register_stacked_init(init_fn, stacked_init_fn)
    return init_fn


def _row_granularity(x: torch.Tensor, weight: torch.Tensor, granularity):
    """The granularity of one observation row (``x[i]`` for an index ``i`` of ``weight``) when
    ``x``'s quantization parameters do not depend on the rows (per-tensor, or per-axis along a
    trailing axis); None otherwise."""
    if isinstance(granularity, PerTensor):
        return granularity
    if type(granularity) in (PerAxis, PerHead) and x.ndim > 0:
        axis = granularity.axis % x.ndim
        if axis >= weight.ndim:
            return PerAxis(axis - weight.ndim)
    return None


def _combine_rows(per_row, keep: torch.Tensor):
    """Extremes and counts over the rows that ``keep`` keeps, from per-row results: each of
    ``per_row`` has shape ``[rows, *params]`` and ``keep`` (bool) ``[rows, ...]``, broadcastable to
    it once trailing dimensions are added; dim 0 (the rows) is reduced. Counts may be Python
    ints (every row finite, every row and parameter with that count): the result's count is then
    the kept rows times it, and its non-finite count 0."""
    row_min, row_max, row_count, row_nonfinite = per_row
    keep = keep.reshape(tuple(keep.shape) + (1,) * (row_min.ndim - keep.ndim))
    # Excluded rows contribute +inf to the min, -inf to the max and 0 to the counts, by
    # arithmetic rather than selects (cheaper on CPU; exact: row extremes are never NaN).
    kept = keep.to(torch.float32)
    block = (1.0 - 2.0 * kept) * torch.inf  # -inf kept, +inf excluded
    lo = torch.maximum(row_min, block).amin(dim=0)
    hi = torch.minimum(row_max, -block).amax(dim=0)
    if isinstance(row_count, int):  # every row finite, with the same count: count the kept rows
        # (a float sum of 0/1 is exact below 2**24 rows and faster than a bool one)
        rows = kept.sum(dim=0).to(torch.int64) if keep.shape[0] < 2**24 else keep.sum(dim=0)
        return lo, hi, (rows * row_count).expand(lo.shape), 0
    keep = keep.to(torch.int64)
    return lo, hi, (row_count * keep).sum(dim=0), (row_nonfinite * keep).sum(dim=0)


def _row_extremes(x: torch.Tensor, weight_ndim: int, row_granularity):
    """Per-row ``finite_aminmax`` of ``x``'s rows (its first ``weight_ndim`` dims flattened):
    every row's canonical view at once (for these granularities a plain reshape of the row),
    rows along dim 1 (parameter dims): one reduction."""
    rows = x.reshape(-1, *x.shape[weight_ndim:])
    rows = rows.reshape(rows.shape[0], *canonical_view(rows[0], row_granularity).shape)
    return finite_aminmax(rows.movedim(0, 1), int_counts=True)


def observe_extremes(x: torch.Tensor, weight, spec: QuantSpec, expected_shape, where: str):
    """Batch extremes of ``x`` for ``spec``: ``(min, max, count, nonfinite)`` over the canonical
    view, with ``weight == 0`` excluding values. Checks the parameter shape against the state's.
    Counts the same for every parameter may be Python ints (`finite_aminmax`'s ``int_counts``).

    With a per-observation ``weight`` and parameters that do not depend on the observation rows,
    each row is reduced once and the rows are then combined under the mask (exact for extremes
    and counts). Under ``vmap`` over experts with one shared ``x`` and a routing mask per expert,
    the rows are reduced once for all experts instead of once per expert.
    """
    view = checked_view(x, spec.granularity, expected_shape, where)
    row_granularity = None
    if weight is not None and spec.nonfinite == "ignore":
        if isinstance(weight, torch.Tensor) and tuple(weight.shape) == tuple(x.shape[: weight.ndim]):
            row_granularity = _row_granularity(x, weight, spec.granularity)
    if row_granularity is not None and weight.ndim > 0 and weight.numel() > 0:
        per_row = _row_extremes(x, weight.ndim, row_granularity)
        return _combine_rows(per_row, weight.bool().reshape(-1))  # bool(): != 0, in a faster kernel
    mask = weight_view(x, weight, spec.granularity)
    if mask is not None:
        mask = mask != 0
    return finite_aminmax(view, mask, spec.nonfinite, int_counts=True)


def _check_stack(x: torch.Tensor, spec: QuantSpec, expected_shape, where: str) -> None:
    """A stack ``x`` (``[E, ...]``) that a state of ``expected_shape`` can observe (errors name
    one slice's shapes)."""
    check_observable(x, where)
    check_shape(x.shape[1:], spec.granularity, tuple(expected_shape[1:]), where)


def observe_extremes_stacked(x: torch.Tensor, weight, spec: QuantSpec, expected_shape, where: str):
    """`observe_extremes` of every slice of a stack ``x`` (``[E, ...]``, each slice with its
    ``weight[e]``) at once, without ``vmap``: results of shape ``[E, *qparam_shape]``, equal to
    ``torch.vmap(observe_extremes)`` bit for bit. A stride-0 stack (``t.expand(E, ...)``: the
    tokens every expert sees, under a routing mask) has its rows reduced once for all slices."""
    _check_stack(x, spec, expected_shape, where)
    num = x.shape[0]
    shape = tuple(expected_shape[1:])
    if weight is not None:
        if not isinstance(weight, torch.Tensor):
            raise TypeError(f"weight must be a tensor or None, got {type(weight).__name__}")
        if weight.ndim < 1 or weight.shape[0] != num:
            raise ValueError(
                f"{where}: weight of shape {tuple(weight.shape)} does not have the leading stack dimension {num}"
            )
        if weight.ndim > x.ndim or tuple(weight.shape) != tuple(x.shape[: weight.ndim]):
            raise ValueError(
                f"weight of shape {tuple(weight.shape[1:])} does not match the leading dimensions of the "
                f"observed tensor of shape {tuple(x.shape[1:])}"
            )
        if spec.nonfinite == "ignore" and weight.ndim > 1 and weight[0].numel() > 0:
            row_granularity = _row_granularity(x[0], weight[0], spec.granularity)
            if row_granularity is not None:
                if x.stride(0) == 0:  # shared rows: reduce them once for every slice
                    per_row = _row_extremes(x[0], weight.ndim - 1, row_granularity)
                    # [rows, 1, *shape] (counts may be ints, the same for every row)
                    per_row = tuple(t.unsqueeze(1) if isinstance(t, torch.Tensor) else t for t in per_row)
                else:
                    per_row = _row_extremes(x, weight.ndim, row_granularity)
                    per_row = tuple(
                        t.reshape(num, -1, *shape).movedim(0, 1) if isinstance(t, torch.Tensor) else t
                        for t in per_row
                    )
                return _combine_rows(per_row, weight.bool().reshape(num, -1).t())
        # Other masks (values, not rows; nonfinite="raise"): vmap of the one-slice reduction,
        # whose masks are laid out as the expert-by-expert path lays them out (the order in which
        # amin/amax meet +0.0 and -0.0 follows that layout).
        if x.stride(0) == 0:
            return torch.vmap(
                lambda w: observe_extremes(x[0], w, spec, shape, where),
            )(weight)
        return torch.vmap(lambda t, w: observe_extremes(t, w, spec, shape, where))(x, weight)
    return finite_aminmax(stacked_view(x, spec.granularity), None, spec.nonfinite, int_counts=True)


def _native_update(observe, state, x: torch.Tensor, spec: QuantSpec, where: str, scales=None, forget=False):
    """The whole update of a min/max state by an unweighted batch in one native pass
    (`qstats._native.update_extremes`: the reduction, the merge with the state and the counts;
    per tensor, per channel, group or token, plain or stacked), for plain eager CPU tensors and
    under a single ``vmap``; None where it does not apply or the batch holds a value that is not
    finite (the caller then takes the full path, which also applies ``nonfinite="raise"``).
    ``scales``: `native_scales` of the spec (the pass then computes the scales that
    ``compute_qparams``, or ``stacked_qparams`` for a stack, takes from it), or None.
    ``forget``: the batch's own extremes and counts, the state's values unread (``memoryless_minmax``;
    per channel, group or token only), where its fields are float32 extremes and int64 counts."""
    if type(x) is torch.nn.Parameter:
        x = x.detach()  # a module's weight observed directly: its values, as the full path reads them
    if (
        # cheap refusals first (under vmap the size that counts is every slice's together: the
        # native pass checks it)
        (x.numel() < _native._MIN_NUMEL and not torch._C._functorch.is_batchedtensor(x))
        or x.dtype not in _native._KINDS
        or torch.compiler.is_compiling()
        or not x.is_cpu
        or not _native._built()
    ):
        return None
    plain = type(x) is torch.Tensor and not torch._C._functorch.is_functorch_wrapped_tensor(x)
    if not plain and (spec.nonfinite != "ignore" or x.requires_grad or any(t.requires_grad for t in state)):
        return None
    ones = ()  # the global scale's shape (a stack's: one per slice)
    if observe is observe_extremes:
        if not plain:
            return _vmapped_update(state, x, spec, where, scales and (scales, ones, spec), forget)
        view = checked_view(x, spec.granularity, state.min_val.shape, where)
    elif observe is observe_extremes_stacked:
        _check_stack(x, spec, state.min_val.shape, where)
        view = stacked_view(x, spec.granularity)
        ones = (x.shape[0],)
    else:
        return None
    if plain:
        return _native.update_extremes(view, *state, scales=scales and (scales, ones, spec), forget=forget)
    # a stacked observer under vmap: the batch of the view inside its parameter dims (the slices
    # side by side), the state's fields dense
    if not torch._C._functorch.is_batchedtensor(view):
        return None
    slices = _native.vmap_slices((view, *state), batch_dims=(1, 0, 0, 0, 0), repeat_shared=False)
    return _update_slices(slices, lambda stack: stack, forget=forget)


def _vmapped_update(state, x: torch.Tensor, spec: QuantSpec, where: str, scales=None, forget=False):
    """`_native_update` under a single ``vmap``: every slice in one pass. ``x`` is unwrapped
    first and its slices viewed as a stack (`stacked_view`, which equals the batched
    `canonical_view`), so that no view op runs through a batching rule; a state shared by every
    slice (init under vmap) is read as it is, not repeated."""
    if not torch._C._functorch.is_batchedtensor(x):
        return None  # one batch for states of every slice: ATen's per-slice merge
    check_observable(x, where)
    check_shape(x.shape, spec.granularity, state.min_val.shape, where)
    slices = _native.vmap_slices((x, *state), repeat_shared=False)
    return _update_slices(slices, lambda stack: stacked_view(stack, spec.granularity), scales, forget)


def _update_slices(slices, view_of, scales=None, forget=False):
    """`_native.update_extremes` of every slice from `_native.vmap_slices`' ``(level, (stack,
    *fields))``, ``view_of(stack)`` the stacked canonical view (copied where not contiguous, as
    one slice's view would be under vmap), rebatched (before the pass); None where it does not
    apply."""
    if slices is None:
        return None
    level, (stack, *fields) = slices
    if len({tuple(t.shape) for t in fields}) != 1:
        return None  # some fields per slice, some shared
    return _native.update_extremes(
        view_of(stack).contiguous(), *fields, wrap=lambda out: _native.rebatch(out, level), scales=scales,
        forget=forget,
    )


def _add_count(total: torch.Tensor, count):
    """``total + count`` for a count tensor or a Python int (the same count for every parameter),
    as an int64 tensor of ``total``'s shape that shares no memory with ``total``."""
    if isinstance(count, int):
        if total.dtype != torch.int64:
            count = torch.full(total.shape, count, dtype=torch.int64, device=total.device)
        elif count == 0:
            return total.clone()
    return total + count


def minmax(spec: QuantSpec) -> Observer:
    """Running min/max (torch.ao MinMaxObserver / PerChannelMinMaxObserver, llm-compressor
    ``static_minmax``).

    Laws: identity, associativity, commutativity and homomorphism all hold bit for bit (exact).
    Inputs of any float dtype are reduced in their own dtype and stored as float32.

    >>> import torch, qstats
    >>> obs = qstats.minmax(qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0)))
    >>> w = torch.tensor([[1.0, -2.0], [3.0, 0.5]])
    >>> obs.update(obs.init(w), w).max_val
    tensor([1., 3.])
    """
    spec = _check_spec(spec)

    init_fn = _initializer(MinMaxState, spec)
    scales = native_scales(spec)  # the new state is a range: its pass can map it too

    def updater(observe):
        def update_fn(state: MinMaxState, x: torch.Tensor, weight: Optional[torch.Tensor] = None) -> MinMaxState:
            _check_extremes_state(state, MinMaxState, "minmax.update")
            if x.numel() == 0:
                return state
            if weight is None:
                fused = _native_update(observe, state, x, spec, "minmax.update", scales)
                if fused is not None:
                    return MinMaxState(*fused)
            lo, hi, count, nonfinite = observe(x, weight, spec, state.min_val.shape, "minmax.update")
            return MinMaxState(
                torch.minimum(state.min_val, lo),
                torch.maximum(state.max_val, hi),
                _add_count(state.count, count),
                _add_count(state.nonfinite, nonfinite),
            )

        return update_fn

    update_fn = updater(observe_extremes)
    register_stacked_update(update_fn, updater(observe_extremes_stacked))

    def merge_fn(a: MinMaxState, b: MinMaxState) -> MinMaxState:
        _check_extremes_state(a, MinMaxState, "minmax.merge")
        _check_extremes_state(b, MinMaxState, "minmax.merge")
        check_same_shapes(a, b, "minmax.merge")
        return MinMaxState(
            torch.minimum(a.min_val, b.min_val),
            torch.maximum(a.max_val, b.max_val),
            a.count + b.count,
            a.nonfinite + b.nonfinite,
        )

    return Observer(init_fn, update_fn, merge_fn, exact=True, spec=spec, name="minmax")


def memoryless_minmax(spec: QuantSpec) -> Observer:
    """Min/max of the latest batch only (llm-compressor ``memoryless_minmax``; dynamic
    quantization).

    ``update(state, x)`` forgets the state and keeps the extremes of ``x`` (an empty ``x`` keeps the
    state, and so does every parameter whose values ``weight`` masks out entirely). ``merge``
    combines *shards of the same batch* (the halves of a batch split across ranks): elementwise
    min/max. With that meaning every law holds exactly, homomorphism included:
    ``update(s, cat(a, b)) == merge(update(s, a), update(init, b))`` where shard ``a`` reaches
    every parameter. A shard that is empty or masked out where ``b`` is not keeps what ``s``
    saw there (the rule above), and the merge then mixes that earlier batch into this one: a
    rank whose shard is all padding should contribute ``init`` (or its ``update(init, a)``)
    instead of its stale state.
    """
    spec = _check_spec(spec)

    init_fn = _initializer(MemorylessMinMaxState, spec)
    scales = native_scales(spec)

    def updater(observe):
        def update_fn(state, x: torch.Tensor, weight: Optional[torch.Tensor] = None) -> MemorylessMinMaxState:
            _check_extremes_state(state, MemorylessMinMaxState, "memoryless_minmax.update")
            if x.numel() == 0:
                return state
            if weight is None:  # every parameter reached: the batch's own statistics, in one pass
                fused = _native_update(observe, state, x, spec, "memoryless_minmax.update", scales, forget=True)
                if fused is not None:
                    return MemorylessMinMaxState(*fused)
            lo, hi, count, nonfinite = observe(x, weight, spec, state.min_val.shape, "memoryless_minmax.update")
            every = isinstance(count, int)  # finite and unmasked: every parameter is reached
            count, nonfinite = (
                torch.full(lo.shape, n, dtype=torch.int64, device=lo.device) if isinstance(n, int) else n
                for n in (count, nonfinite)
            )
            if every and state.min_val.dtype == state.max_val.dtype == torch.float32:
                return MemorylessMinMaxState(lo, hi, count, nonfinite)
            # A parameter the batch does not reach (every value masked out by ``weight``) keeps its
            # state, as an empty tensor does.
            reached = (count + nonfinite) > 0
            return MemorylessMinMaxState(
                torch.where(reached, lo, state.min_val),
                torch.where(reached, hi, state.max_val),
                torch.where(reached, count, state.count),
                torch.where(reached, nonfinite, state.nonfinite),
            )

        return update_fn

    update_fn = updater(observe_extremes)
    register_stacked_update(update_fn, updater(observe_extremes_stacked))

    def merge_fn(a, b) -> MemorylessMinMaxState:
        _check_extremes_state(a, MemorylessMinMaxState, "memoryless_minmax.merge")
        _check_extremes_state(b, MemorylessMinMaxState, "memoryless_minmax.merge")
        check_same_shapes(a, b, "memoryless_minmax.merge")
        return MemorylessMinMaxState(
            torch.minimum(a.min_val, b.min_val),
            torch.maximum(a.max_val, b.max_val),
            a.count + b.count,
            a.nonfinite + b.nonfinite,
        )

    return Observer(init_fn, update_fn, merge_fn, exact=True, spec=spec, name="memoryless_minmax")


def _moved(average: torch.Tensor, batch: torch.Tensor, constant: float) -> torch.Tensor:
    """``average + constant * (batch - average)``, torch.ao's arithmetic bit for bit, except
    where ``batch - average`` overflows (finite extremes of opposite signs near the float32
    limit): there ``(1 - constant) * average + constant * batch``, which stays finite."""
    moved = average + constant * (batch - average)
    return torch.where(moved.isfinite(), moved, (1.0 - constant) * average + constant * batch)


def moving_average_minmax(spec: QuantSpec, averaging_constant: float = 0.01) -> Observer:
    """Moving average of per-batch extremes (torch.ao MovingAverageMinMaxObserver and
    MovingAveragePerChannelMinMaxObserver).

    The first batch that reaches a parameter initialises it; later ones move it by
    ``min + c * (batch_min - min)`` (torch.ao's arithmetic, bit for bit). A parameter that a batch
    does not reach (masked out) keeps its value.

    ``merge`` is the batch-count-weighted mean of the two averages: commutative, with ``init`` as
    identity, associative up to float rounding. The result depends on batch order, so
    ``exact=False``.
    """
    spec = _check_spec(spec)
    if not (isinstance(averaging_constant, (int, float)) and 0.0 < averaging_constant <= 1.0):
        raise ValueError(f"averaging_constant must be in (0, 1], got {averaging_constant!r}")
    constant = float(averaging_constant)

    init_fn = _initializer(MovingAverageMinMaxState, spec)

    def updater(observe):
        def update_fn(state, x: torch.Tensor, weight: Optional[torch.Tensor] = None) -> MovingAverageMinMaxState:
            _check_extremes_state(state, MovingAverageMinMaxState, "moving_average_minmax.update")
            if x.numel() == 0:
                return state
            lo, hi, count, nonfinite = observe(x, weight, spec, state.min_val.shape, "moving_average_minmax.update")
            first = state.batches == 0
            moved_min = _moved(state.min_val, lo, constant)
            moved_max = _moved(state.max_val, hi, constant)
            min_val = torch.where(first, lo, moved_min)
            max_val = torch.where(first, hi, moved_max)
            if isinstance(count, int):  # finite and unmasked: every parameter saw values
                batches = _add_count(state.batches, 1)
            else:
                seen = count > 0
                min_val = torch.where(seen, min_val, state.min_val)
                max_val = torch.where(seen, max_val, state.max_val)
                batches = state.batches + seen.to(torch.int64)
            return MovingAverageMinMaxState(
                min_val,
                max_val,
                batches,
                _add_count(state.count, count),
                _add_count(state.nonfinite, nonfinite),
            )

        return update_fn

    update_fn = updater(observe_extremes)
    register_stacked_update(update_fn, updater(observe_extremes_stacked))

    def merge_fn(a, b) -> MovingAverageMinMaxState:
        _check_extremes_state(a, MovingAverageMinMaxState, "moving_average_minmax.merge")
        _check_extremes_state(b, MovingAverageMinMaxState, "moving_average_minmax.merge")
        check_same_shapes(a, b, "moving_average_minmax.merge")
        def mean(u, v):
            return batch_weighted_mean(u, v, a.batches, b.batches)

        return MovingAverageMinMaxState(
            mean(a.min_val, b.min_val),
            mean(a.max_val, b.max_val),
            a.batches + b.batches,
            a.count + b.count,
            a.nonfinite + b.nonfinite,
        )

    return Observer(init_fn, update_fn, merge_fn, exact=False, spec=spec, name="moving_average_minmax")


def _extremes_rule(state, spec: QuantSpec, **options) -> Range:
    if options:
        raise TypeError(f"compute_qparams: {type(state).__name__} takes no options, got {sorted(options)}")
    # fields of one shape and kind: a 0-dim max_val beside per-channel min_vals broadcast to
    # scales nobody observed, and an integer max_val gave integer arithmetic
    _check_extremes_state(state, type(state), "compute_qparams")
    # the counts themselves (calibrated where positive): the native pass of compute_qparams reads
    # them, and no op computes the mask it does not need
    return Range(state.min_val, state.max_val, state.count)


# its Range is the state's own min_val, max_val and count: compute_qparams may take the scales an
# update computed for them (`qstats._native.recall`)
_extremes_rule._qstats_extremes = True
for _cls in (MinMaxState, MemorylessMinMaxState, MovingAverageMinMaxState):
    register_range_rule(_cls, elementwise=True)(_extremes_rule)
