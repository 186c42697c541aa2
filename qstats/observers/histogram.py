"""Histogram observer with an exact merge: integer counts over float-exponent buckets.

Each finite value goes to a bucket taken from its float32 bits (sign, exponent, top mantissa bits),
so buckets have a fixed relative width, no range is needed up front and merging is adding int64
counts: bit-identical for every split, order, rank and ``vmap``. Magnitudes outside the resolved
octaves fall into under- and overflow buckets; the exact extremes are kept too. Range searches
(``compute_qparams(state, spec, method=...)``) live in `qstats.observers.search`. See docs/observers.md.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from .._ops import op, register_fake, register_vmap
from .._checks import is_integer
from .._granularity import check_observable, qparam_shape
from .._qparams import Range, register_range_rule
from .._reductions import batch_inside, finite_aminmax
from .._spec import QuantSpec
from .._torch_features import bitcast
from ._base import Observer, check_merge_states, check_state, kept_dtypes, register_state
from .kit import check_spec, masked_view
from .search import check_options, entropy_amax, register_search, search
from .search._geometry import check_int, histogram_edges
from .._warn import warn

__all__ = [
    "HistogramState",
    "histogram",
    "histogram_edges",
    "bucket_counts",
    "entropy_amax",
]

@register_state
class HistogramState(NamedTuple):
    """Exponent/mantissa histogram. ``counts``: int64 ``(*qparam_shape, 2, octaves, bins)``;
    ``underflow``/``overflow``: int64 ``(*qparam_shape, 2)`` (magnitudes below / above the
    resolved octaves, per sign); ``min_val``, ``max_val``: exact float32 extremes; ``nonfinite``:
    NaN/Inf values left out."""

    counts: torch.Tensor
    underflow: torch.Tensor
    overflow: torch.Tensor
    min_val: torch.Tensor
    max_val: torch.Tensor
    nonfinite: torch.Tensor


# ---------------------------------------------------------------------------------------------
# Bucketing


def _bucket_table(mantissa_bits: int, low: int, high: int, device) -> torch.Tensor:
    """The slot of every float32 bit prefix ``(bits >> (23 - m)) + 2**(8 + m)`` and of a masked-out value
    (prefix ``2**(9 + m)``), int32 ``(2**(9 + m) + 1,)``. A finite value's slot is ``sign * K + bucket``
    (``K`` buckets per sign); NaN and Inf go to slot ``2K``, masked-out values to ``2K + 1``.
    """
    m = mantissa_bits
    num_buckets = (high - low) * (1 << m) + 2
    half = 1 << (8 + m)
    prefix = torch.arange(2 * half + 1, dtype=torch.int32, device=device)
    positive = (prefix >= half).to(torch.int32)
    magnitude = prefix - half * positive
    bucket = (magnitude - (((low + 127) << m) - 1)).clamp(0, num_buckets - 1)
    slot = torch.where(magnitude >= (255 << m), 2 * num_buckets, bucket + num_buckets * positive)
    return torch.where(prefix == 2 * half, 2 * num_buckets + 1, slot)


@op("bucket_counts")
def _count_keys(
    bits: torch.Tensor, mask: Optional[torch.Tensor], shift: int, offset: int, size: int
) -> torch.Tensor:
    """Per parameter of an integer view, how many keys ``(bits >> shift) + offset`` equal each of
    ``0 .. size - 1`` (``size - 1`` where ``mask`` is False): int64 ``(*params, size)``. One op of its
    own, because ``bincount`` has no vmap rule and a value-dependent output shape.
    """
    params = bits.shape[1:-1]
    total = math.prod(params) * size
    dtype = torch.int32 if total < 1 << 31 else torch.int64
    keys = bits.to(dtype) >> shift  # this op's own tensor: the writes below touch nothing else
    if mask is not None:
        keys.masked_fill_(mask.logical_not(), size - 1 - offset)
    keys += torch.arange(offset, total + offset, size, dtype=dtype, device=bits.device).reshape(1, *params, 1)
    return torch.bincount(keys.reshape(-1), minlength=total).reshape(*params, size)


@register_fake(_count_keys)
def _(bits, mask, shift, offset, size):
    return bits.new_empty((*bits.shape[1:-1], size), dtype=torch.int64)


def _count_keys_vmap(info, in_dims, bits, mask, shift, offset, size):
    """Every slice in one call, as `finite_aminmax`'s rule does it."""
    bits, mask = batch_inside(info.batch_size, bits, in_dims[0], mask, in_dims[1])
    return _count_keys(bits, mask, shift, offset, size), 0


register_vmap(_count_keys, _count_keys_vmap)


def _check_bins(bins, where: str, hint: str = "") -> None:
    """ValueError unless ``bins`` (buckets per octave) is a power of two in [1, 4096] (100 was
    bucketed as 64: the counts' shape was not the documented one)."""
    if not (is_integer(bins) and 1 <= bins <= 1 << 12 and not bins & (bins - 1)):
        raise ValueError(f"{where} (buckets per power of two) must be a power of two in [1, 4096], got {bins!r}{hint}")


def _check_bucketing(bins, exponent_range) -> None:
    """`_check_bins`, and ValueError naming an ``exponent_range`` that is no pair of ints
    ``-126 <= low < high <= 128`` (float32's octaves; a reversed one failed deep inside torch)."""
    _check_bins(bins, "bucket_counts: bins")
    pair = tuple(exponent_range) if isinstance(exponent_range, (tuple, list)) else ()
    if not (len(pair) == 2 and all(is_integer(e) for e in pair) and -126 <= pair[0] < pair[1] <= 128):
        raise ValueError("bucket_counts: exponent_range must be two ints (low, high) with -126 <= low < high <= 128 "
                         f"(float32's octaves), got {exponent_range!r}")


def bucket_counts(view, mask=None, bins: int = 128, exponent_range=(-24, 24)):
    """Bucket counts of a canonical view ``(observations, *qparam_shape, group)``.

    Returns ``(counts, nonfinite)``: int64 ``(*qparam_shape, 2, K)`` and ``(*qparam_shape,)``, with
    ``K = (high - low) * bins + 2`` magnitude buckets per sign (underflow first, overflow last) for
    ``exponent_range = (low, high)``. ``mask`` False leaves a value out; any float dtype is bucketed as
    float32.
    """
    _check_bucketing(bins, exponent_range)
    m = int(bins).bit_length() - 1
    low, high = int(exponent_range[0]), int(exponent_range[1])
    num_buckets = (high - low) * (1 << m) + 2
    slots = 2 * num_buckets + 2  # per parameter: negative buckets, positive buckets, NaN/Inf, masked out
    half = 1 << (8 + m)
    prefixes = 2 * half + 1  # per parameter: every bit prefix, masked out
    params = view.shape[1:-1]
    num_params = math.prod(params)
    bits = bitcast(view.detach().to(torch.float32), torch.int32)
    if mask is not None:
        mask = mask.to(torch.bool).expand(view.shape)
    table = _bucket_table(m, low, high, view.device)
    if num_params * prefixes <= view.numel():
        by_prefix = _count_keys(bits, mask, 23 - m, half, prefixes).reshape(num_params, prefixes)
        counts = by_prefix.new_zeros(num_params, slots).index_add(1, table.to(torch.int64), by_prefix)
    else:
        slot = table.index_select(0, ((bits >> (23 - m)) + half).reshape(-1)).reshape(bits.shape)
        counts = _count_keys(slot, mask, 0, 0, slots)
    counts = counts.reshape(*params, slots)
    return counts[..., : 2 * num_buckets].unflatten(-1, (2, num_buckets)), counts[..., 2 * num_buckets]


# ---------------------------------------------------------------------------------------------
# The observer


def _check_config(spec, bins, octaves, max_state_bytes):
    check_spec(spec, "histogram")
    # a float NaN bound refused nothing, None or a string failed only in init, inside a comparison
    if not (is_integer(max_state_bytes) and max_state_bytes > 0):
        raise ValueError(f"histogram: max_state_bytes must be a positive int (bytes), got {max_state_bytes!r}")
    _check_bins(bins, "histogram: buckets_per_octave",
                " (for torch.ao's number of linear bins: qstats.torch_ao.buckets_per_octave_for_bins(bins))")
    octaves = check_int("octaves", octaves, 1, 252, "histogram")
    low = -(octaves // 2)
    return low, low + octaves


def _buckets_per_octave(buckets_per_octave: Optional[int], bins: Optional[int]) -> int:
    """``buckets_per_octave`` (128 where None), or the value of its former name ``bins`` (with a
    FutureWarning); TypeError naming both where both are given (``buckets_per_octave=128, bins=64``
    used 64 in silence: 128 was taken for the default)."""
    if bins is None:
        return 128 if buckets_per_octave is None else buckets_per_octave
    if buckets_per_octave is not None:
        raise TypeError(f"histogram: pass buckets_per_octave or its former name bins, not both (got "
                        f"buckets_per_octave={buckets_per_octave!r} and bins={bins!r})")
    warn(
        "histogram(bins=...) is now histogram(buckets_per_octave=...): buckets per power of two, not "
        "torch.ao HistogramObserver's total number of bins",
        FutureWarning,
    )
    return bins


def _check_counts(state: HistogramState, bins: int, octaves: int) -> None:
    """ValueError naming both shapes for a state of a histogram observer with other settings."""
    expected = (*state.min_val.shape, 2, octaves, bins)
    if tuple(state.counts.shape) != expected:
        raise ValueError(
            f"histogram.update: the state's counts have shape {tuple(state.counts.shape)}, but this observer "
            f"(buckets_per_octave={bins}, octaves={octaves}) keeps counts of shape {expected}; the state comes "
            "from a histogram observer with other buckets_per_octave/octaves"
        )


def _check_state_size(shape: tuple, bins: int, octaves: int, max_state_bytes: int) -> None:
    """ValueError saying how much memory the counts of ``shape``'s histograms would take, past the bound."""
    size = math.prod(shape) * 2 * octaves * bins * 8
    if size > max_state_bytes:
        raise ValueError(
            f"histogram: {math.prod(shape)} histograms of 2 x {octaves} octaves x {bins} buckets per octave would "
            f"take {size / 2**30:.2f} GiB (max_state_bytes={max_state_bytes}, per expert of a stacked observer); "
            "use fewer buckets_per_octave "
            "(buckets per power of two, not torch.ao's total bins) or octaves, a coarser granularity, or raise "
            "max_state_bytes"
        )


def _combine(a: HistogramState, b: HistogramState) -> HistogramState:
    """Counts added, extremes widened: the merge, and an update with a batch's own state."""
    return HistogramState(
        a.counts + b.counts,
        a.underflow + b.underflow,
        a.overflow + b.overflow,
        torch.minimum(a.min_val, b.min_val),
        torch.maximum(a.max_val, b.max_val),
        a.nonfinite + b.nonfinite,
    )


def histogram(
    spec: QuantSpec,
    buckets_per_octave: Optional[int] = None,
    octaves: int = 48,
    max_state_bytes: int = 1 << 28,
    *,
    bins: Optional[int] = None,
) -> Observer:
    """Running histogram with an exact merge (integer counts over float-exponent buckets).

    Args:
      spec: the QuantSpec; its granularity gives one histogram per quantization parameter.
      buckets_per_octave: buckets per power of two (a power of two, at most 4096; None: 128); not
        torch.ao's ``bins``.
      octaves: powers of two resolved, centred on 1; smaller and larger magnitudes share end buckets.
      max_state_bytes: the largest counts ``init`` builds for one tensor (default 256 MiB); larger ones
        are refused. Under `qstats.stacked_observer` (a recipe's fused experts too) it bounds each
        expert's counts, so a stack of ``E`` experts may take ``E`` times as much: pass the whole
        stack's budget divided by ``E``.
      bins: deprecated alias of ``buckets_per_octave`` (FutureWarning); both at once are a TypeError.

    Laws: identity, associativity, commutativity and homomorphism hold bit for bit, under ``vmap`` too;
    ``update`` has fixed shapes, no host sync and compiles without graph breaks. Inputs are bucketed
    as float32; NaN/Inf follow ``spec.nonfinite``.

    >>> import torch, qstats
    >>> spec = qstats.QuantSpec(dtype="int8")
    >>> obs = qstats.histogram(spec)
    >>> x = torch.randn(1000)
    >>> state = obs.update(obs.init(x), x)
    >>> int(state.counts.sum() + state.underflow.sum() + state.overflow.sum())
    1000
    >>> qp = qstats.compute_qparams(state, spec, method="l2")
    """
    bins = _buckets_per_octave(buckets_per_octave, bins)
    low, high = _check_config(spec, bins, octaves, max_state_bytes)
    bins, octaves, max_state_bytes = int(bins), high - low, int(max_state_bytes)  # numpy ints as Python ints

    def init_fn(x: torch.Tensor) -> HistogramState:
        check_observable(x, "histogram.init")
        shape = qparam_shape(x.shape, spec.granularity)
        _check_state_size(shape, bins, octaves, max_state_bytes)
        zeros = torch.zeros((*shape, 2), dtype=torch.int64, device=x.device)
        inf = torch.full(shape, torch.inf, dtype=torch.float32, device=x.device)
        counts = torch.zeros((*shape, 2, octaves, bins), dtype=torch.int64, device=x.device)
        return HistogramState(counts, zeros, zeros.clone(), inf, -inf, zeros.new_zeros(shape))

    def update_fn(state: HistogramState, x: torch.Tensor, weight: Optional[torch.Tensor] = None) -> HistogramState:
        check_state(state, HistogramState, "histogram.update")
        _check_counts(state, bins, octaves)
        check_observable(x, "histogram.update")  # before x.numel(): None was an AttributeError
        if x.numel() == 0:
            return state
        # bucketed and reduced as float32 (`bucket_counts`, `finite_aminmax`): a float64 value past
        # its range is a non-finite value for both
        view, mask = masked_view(x, weight, spec, state.min_val.shape, "histogram.update")
        lo, hi, _, nonfinite = finite_aminmax(view, mask, spec.nonfinite)
        counts, _ = bucket_counts(view, mask, bins, (low, high))
        resolved = counts[..., 1:-1].unflatten(-1, (octaves, bins))
        updated = _combine(state, HistogramState(resolved, counts[..., 0], counts[..., -1], lo, hi, nonfinite))
        return kept_dtypes(state, updated, "histogram.update")

    def merge_fn(a: HistogramState, b: HistogramState) -> HistogramState:
        check_merge_states(a, b, HistogramState, "histogram.merge")
        return _combine(a, b)

    return Observer(init_fn, update_fn, merge_fn, exact=True, spec=spec, name="histogram", state_type=HistogramState)


# ---------------------------------------------------------------------------------------------
# Range rule: the method's search, by name


def minmax_search(state: HistogramState, spec: QuantSpec) -> Range:
    """``"minmax"``: the exact observed extremes."""
    return Range(state.min_val, state.max_val, state.min_val <= state.max_val)


register_search("minmax", minmax_search)


@register_range_rule(HistogramState)
def _histogram_range(state: HistogramState, spec: QuantSpec, method: str = "l2", **options) -> Range:
    """The range of ``method`` (a search registered for ``"histogram"``), with its options; the
    extremes in float32, the dtype of the bucket keys (a float64 state, cast by a user, made
    ``"l2"`` give the eps scale)."""
    state = state._replace(min_val=state.min_val.float(), max_val=state.max_val.float())
    found = search(method, "histogram")
    check_options(found, method, options)
    return found(state, spec, **options)
