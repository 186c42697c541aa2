"""Histogram observer with an exact merge, and the range searches that run on it.

Binning. Every finite value goes to a bucket taken from its float32 bit pattern: the sign, the
exponent and the top ``log2(bins)`` mantissa bits. A bucket is therefore an interval
``[2**e * (1 + t / bins), 2**e * (1 + (t + 1) / bins))`` of ``|x|``: its width is at most
``1 / bins`` of its lower edge (relative resolution ``2**-m`` with ``m = log2(bins)`` mantissa
bits; 0.78% for the default ``bins=128``), the same for every tensor, so no range is needed up
front. The resolved magnitudes are ``[2**-(octaves // 2), 2**(octaves - octaves // 2))``
(``[2**-24, 2**24)`` with the default 48 octaves); smaller magnitudes (zeros included) fall into
one *underflow* bucket per sign, larger ones into one *overflow* bucket that ends at the exact
extreme. Counts are int64, so merging two histograms is adding integers: bit-identical for every
split of the data, every merge order, across ranks and under ``vmap``. The update is a shift and
an add on the float's int32 view and one ``bincount`` over a flattened (parameter, bucket) index,
inside a custom op (batching rule for ``vmap``, opaque to ``torch.compile``). Unmasked eager
updates take the exact extremes in the same op, in one min/max pass when the counts show every
value finite.

State: ``counts`` of shape ``(*qparam_shape, 2, octaves, bins)`` (sign 0: negative, sign 1:
positive), ``underflow`` and ``overflow`` of shape ``(*qparam_shape, 2)``, the exact float32
``min_val``/``max_val`` and the ``nonfinite`` count; the shapes carry the configuration, so
``compute_qparams`` needs nothing but the state. Memory is ``16 * octaves * bins`` bytes per
quantization parameter (96 KiB with the defaults; use fewer ``bins`` or ``octaves`` for fine
granularities: ``bins=8, octaves=32`` is 4 KiB).

Range searches, ``qstats.compute_qparams(state, spec, method=...)``, all vectorised over
candidates and parameters (no Python loop over buckets). They model the values inside a bucket
as uniformly spread and see the ``spec.bits + 8`` octaves below the largest magnitude at full
resolution (smaller values are folded into one bucket around zero):

- ``"l2"`` (default): torch.ao ``HistogramObserver``'s objective, the L2 norm of the quantization
  error, minimised over candidate ranges on the bucket edges below each sign's extreme (the
  larger one for symmetric mappings; ``bits + 4`` octaves deep, 2-D and coarse to fine for
  asymmetric mappings) instead of torch.ao's greedy outside-in walk. The windows are located from the extremes' float bits and gathered with fixed shapes; the
  candidates are ranked in a few batched steps from suffix sums (clipping error exact,
  ``scale**2 / 12`` per rounded value, ``x**2`` for values that round to zero), no search in
  sorted arrays; the finalists are then ranked by the exact integral of the squared error of the
  spec's grid (zero point rounding included) over the buckets. About 200 small tensor ops; in
  eager mode the searches run under ``torch.inference_mode`` (single-threaded when they have few
  parameters) and return ordinary tensors.
- ``"mse"``: that exact integral for 128 shrink factors ``2**(-k / 32)`` of the observed range
  (``O(buckets x candidates)``; fp8 targets use the fp8 grid at bucket centres).
- ``"entropy"``: the KL-divergence calibration of TensorRT / ModelOpt on a 2048-bin linear
  histogram of ``|x|`` (a symmetric amax; asymmetric specs clip both ends at it).
- ``"percentile"`` (``percentile=99.99``): that percentile of ``|x|`` (symmetric mappings) or the
  lower and upper percentiles (asymmetric), interpolated inside buckets.
- ``"minmax"``: the exact observed extremes.
"""

from __future__ import annotations

import contextlib
import math
from typing import NamedTuple, Optional

import torch

from .. import _native
from .._granularity import checked_view, qparam_shape, weight_view
from .._formats import effective_scale, handles_qparams
from .._qparams import Range, _is_traced, qparams_from_minmax, register_range_rule
from .._reductions import _batched_arguments, finite_aminmax
from .._spec import QuantSpec
from .._torch_features import bitcast
from ._base import Observer, check_same_shapes, check_state, register_state

__all__ = [
    "HistogramState",
    "histogram",
    "histogram_edges",
    "bucket_counts",
    "entropy_amax",
]

_FULL_RESOLUTION_LIMIT = 1 << 22  # largest P * 2**(9 + m) bincount done at full resolution
_SEARCH_GRAIN = 200  # torch.searchsorted runs queries in parallel above this many


def _floor(x: torch.Tensor) -> torch.Tensor:
    """floor through trunc: torch.floor/round/ceil of float64 go parallel on tiny tensors on CPU,
    which stalls when the other cores are busy."""
    t = torch.trunc(x)
    return t - (t > x).to(x.dtype)


@contextlib.contextmanager
def _serial_when_small(num_params: int):
    """Runs a search single-threaded in eager mode when it has few parameters: its tensors are
    small, and waking the intra-op thread pool for each of its few hundred small ops costs more
    than the ops (milliseconds each when the other cores are busy). A no-op under compile."""
    if num_params > 16 or torch.compiler.is_compiling():  # before get_num_threads: not traceable
        yield
        return
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _searchsorted(sorted_sequence: torch.Tensor, values: torch.Tensor, right: bool) -> torch.Tensor:
    """torch.searchsorted over the last dimension, in single-threaded pieces when the search is
    small (its parallel grain is tiny); one call when there are many parameters to search."""
    params = max(1, values[..., :1].numel())
    per_piece = _SEARCH_GRAIN // params
    count = values.shape[-1]
    if per_piece < 1 or count <= per_piece:
        return torch.searchsorted(sorted_sequence, values, right=right)
    pieces = [torch.searchsorted(sorted_sequence, values[..., i : i + per_piece].contiguous(), right=right)
              for i in range(0, count, per_piece)]
    return torch.cat(pieces, -1)


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
# Bucketing: a custom op (one implementation for eager, vmap and compile).

def _bucket_count(view, mask, mantissa_bits: int, min_exponent: int, max_exponent: int, extremes: bool = False):
    """``(counts, nonfinite)`` of the float32 view's bucket codes (one bincount over int32
    codes), and the view's min and max (one more pass) when ``extremes``."""
    m = mantissa_bits
    params = view.shape[1:-1]
    num_params = math.prod(params)
    num_buckets = (max_exponent - min_exponent) * (1 << m) + 2
    param_index = None
    if num_params > 1:
        param_index = torch.arange(num_params, dtype=torch.int32, device=view.device).reshape(1, *params, 1)
    full_resolution = num_params * (1 << (9 + m)) <= _FULL_RESOLUTION_LIMIT
    stride = (1 << (9 + m)) if full_resolution else 2 * num_buckets + 1

    bits = view.view(torch.int32)
    if full_resolution:
        # every (sign, exponent, top mantissa) code; the window edges are folded afterwards
        code = bits >> (23 - m)
        code.add_(1 << (8 + m))  # in place on its own temporary: one pass and one buffer less
    else:
        magnitude = bits & 0x7FFFFFFF
        magnitude >>= 23 - m  # in place on its own temporaries from here on
        code = (magnitude - (((min_exponent + 127) << m) - 1)).clamp_(0, num_buckets - 1)
        code.add_((bits >= 0).to(torch.int32).mul_(num_buckets))
        code = torch.where(magnitude >= (255 << m), 2 * num_buckets, code)
    if param_index is not None:
        code.add_(param_index * stride)
    if mask is not None:
        code = torch.where(mask, code, num_params * stride)
    raw = torch.bincount(code.reshape(-1), minlength=num_params * stride + 1)[: num_params * stride]
    if full_resolution:
        raw = raw.reshape(*params, 2, 1 << (8 + m))
        low = (min_exponent + 127) << m
        high = (max_exponent + 127) << m
        finite_end = 255 << m
        counts = torch.cat(
            [raw[..., :low].sum(-1, keepdim=True), raw[..., low:high], raw[..., high:finite_end].sum(-1, keepdim=True)],
            dim=-1,
        )
        nonfinite = raw[..., finite_end:].sum((-2, -1))
    else:
        raw = raw.reshape(*params, stride)
        counts = raw[..., : 2 * num_buckets].reshape(*params, 2, num_buckets).contiguous()  # as the fake kernel
        nonfinite = raw[..., 2 * num_buckets].clone()  # outputs of a custom op must not alias each other
    if extremes:
        return (counts, nonfinite), *_aminmax(view, native=True)
    return counts, nonfinite


def _bucket_counts_impl(view, mask, mantissa_bits: int, min_exponent: int, max_exponent: int):
    x = view.to(torch.float32).contiguous()
    return _bucket_count(x, mask, mantissa_bits, min_exponent, max_exponent)


@torch.library.custom_op("qstats::float_bucket_counts", mutates_args=())
def _bucket_counts_op(
    view: torch.Tensor, mask: Optional[torch.Tensor], mantissa_bits: int, min_exponent: int, max_exponent: int
) -> tuple[torch.Tensor, torch.Tensor]:
    return _bucket_counts_impl(view, mask, mantissa_bits, min_exponent, max_exponent)


@_bucket_counts_op.register_fake
def _(view, mask, mantissa_bits, min_exponent, max_exponent):
    params = view.shape[1:-1]
    num_buckets = (max_exponent - min_exponent) * (1 << mantissa_bits) + 2
    counts = view.new_empty((*params, 2, num_buckets), dtype=torch.int64)
    return counts, view.new_empty(params, dtype=torch.int64)


def _bucket_vmap_rule(info, in_dims, view, mask, mantissa_bits, min_exponent, max_exponent):
    # the batch dim inside the parameter dims; an unbatched view (tokens shared by every expert,
    # a batched routing mask) is expanded to every slice
    view, mask = _batched_arguments(view, in_dims[0], mask, in_dims[1])
    outs = _bucket_counts_op(view, mask, mantissa_bits, min_exponent, max_exponent)
    return outs, (0, 0)


torch.library.register_vmap("qstats::float_bucket_counts", _bucket_vmap_rule)


def _aminmax(x: torch.Tensor, native: bool = False):
    """Min and max over dims (0, -1): one pass over a single parameter's values (torch.aminmax
    over all dims; its per-dim form is slow on CPU), else amin and amax group dim first. With
    ``native``, a single parameter's values take the kernel's whole pass where it reads them and
    they are all finite (`qstats._native.whole_extremes`: about half of aminmax's time)."""
    if x[0, ..., 0].numel() == 1:
        if native:
            out = _native.whole_extremes(x)
            if out is not None and out[2]:
                return out[0].reshape(x.shape[1:-1]), out[1].reshape(x.shape[1:-1])
        lo, hi = torch.aminmax(x)
        return lo.reshape(x.shape[1:-1]), hi.reshape(x.shape[1:-1])
    return x.amin(-1).amin(0), x.amax(-1).amax(0)


@torch.library.custom_op("qstats::float_bucket_counts_extremes", mutates_args=())
def _bucket_extremes_op(
    view: torch.Tensor, mantissa_bits: int, min_exponent: int, max_exponent: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The bucket counts, non-finite counts and the exact float32 extremes of the finite values
    of an unmasked canonical view: one min/max pass when every value is finite (known from the
    counts), else a pass that leaves the non-finite values out (``finite_aminmax``'s results)."""
    x = view.to(torch.float32).contiguous()
    (counts, nonfinite), lo, hi = _bucket_count(x, None, mantissa_bits, min_exponent, max_exponent, extremes=True)
    if int(nonfinite.sum()):  # a check on this op's own result (the op is opaque to compile and vmap)
        finite = torch.isfinite(x)
        lo, _ = _aminmax(torch.where(finite, x, torch.inf))
        _, hi = _aminmax(torch.where(finite, x, -torch.inf))
    return counts, nonfinite, lo, hi


@_bucket_extremes_op.register_fake
def _(view, mantissa_bits, min_exponent, max_exponent):
    counts, nonfinite = _bucket_counts_op(view, None, mantissa_bits, min_exponent, max_exponent)
    lo = view.new_empty(view.shape[1:-1], dtype=torch.float32)
    return counts, nonfinite, lo, torch.empty_like(lo)


def _bucket_extremes_vmap_rule(info, in_dims, view, mantissa_bits, min_exponent, max_exponent):
    outs = _bucket_extremes_op(view.movedim(in_dims[0], 1), mantissa_bits, min_exponent, max_exponent)
    return outs, (0, 0, 0, 0)


torch.library.register_vmap("qstats::float_bucket_counts_extremes", _bucket_extremes_vmap_rule)


def bucket_counts(view, mask=None, bins: int = 128, exponent_range=(-24, 24)):
    """Bucket counts of a canonical view ``(observations, *qparam_shape, group)``.

    Returns ``(counts, nonfinite)``: int64 ``(*qparam_shape, 2, K)`` and ``(*qparam_shape,)``,
    with ``K = (high - low) * bins + 2`` magnitude buckets per sign (underflow first, overflow
    last) for ``exponent_range = (low, high)``; the observer with ``octaves=O`` uses
    ``(-(O // 2), O - O // 2)``.
    ``mask`` (bool, broadcastable) False leaves a value out.
    """
    m = int(bins).bit_length() - 1
    if mask is not None:
        mask = mask.to(torch.bool).expand(view.shape)
    return _bucket_counts_op(view.detach(), mask, m, int(exponent_range[0]), int(exponent_range[1]))


# ---------------------------------------------------------------------------------------------
# The observer.


def _check_config(spec, bins, octaves):
    if not isinstance(spec, QuantSpec):
        raise TypeError(f"histogram: expected a QuantSpec, got {type(spec).__name__}")
    if not isinstance(bins, int) or isinstance(bins, bool) or bins < 1 or bins & (bins - 1) or bins > 1 << 12:
        raise ValueError(f"histogram: bins (buckets per power of two) must be a power of two in [1, 4096], got {bins!r}")
    if not isinstance(octaves, int) or isinstance(octaves, bool) or not 1 <= octaves <= 252:
        raise ValueError(f"histogram: octaves must be an int in [1, 252], got {octaves!r}")
    low = -(octaves // 2)
    return low, low + octaves


def _config(state) -> tuple[int, int, int]:
    """(bins, low exponent, high exponent) of a state, read from its shape."""
    bins, octaves = state.counts.shape[-1], state.counts.shape[-2]
    low = -(octaves // 2)
    return bins, low, low + octaves


def _flat(state) -> torch.Tensor:
    """Counts as (*P, 2, K): underflow, the octaves' buckets, overflow."""
    return torch.cat([state.underflow.unsqueeze(-1), state.counts.flatten(-2), state.overflow.unsqueeze(-1)], -1)


def histogram(spec: QuantSpec, bins: int = 128, octaves: int = 48) -> Observer:
    """Running histogram with an exact merge (integer counts over float-exponent buckets).

    Args:
      spec: the QuantSpec (its granularity decides the histograms: one per quantization
        parameter, any granularity).
      bins: buckets per power of two (a power of two, at most 4096): relative bucket width
        ``<= 1 / bins``.
      octaves: powers of two resolved, centred on 1: magnitudes in
        ``[2**-(octaves // 2), 2**(octaves - octaves // 2))``; smaller ones (and zeros) share an
        underflow bucket, larger ones an overflow bucket that ends at the exact extreme.

    Laws: identity, associativity, commutativity and homomorphism hold bit for bit (exact), under
    ``vmap`` too. ``update`` is a few fused tensor ops (no host sync, fixed shapes) and compiles
    without graph breaks. Inputs of any float dtype are bucketed as float32; NaN/Inf follow
    ``spec.nonfinite``.

    >>> import torch, qstats
    >>> spec = qstats.QuantSpec(dtype="int8")
    >>> obs = qstats.histogram(spec)
    >>> x = torch.randn(1000)
    >>> state = obs.update(obs.init(x), x)
    >>> int(state.counts.sum() + state.underflow.sum() + state.overflow.sum())
    1000
    >>> qp = qstats.compute_qparams(state, spec, method="l2")
    """
    low, high = _check_config(spec, bins, octaves)
    mantissa_bits = bins.bit_length() - 1

    def init_fn(x: torch.Tensor) -> HistogramState:
        shape = qparam_shape(x.shape, spec.granularity)
        device = x.device
        zeros = torch.zeros((*shape, 2), dtype=torch.int64, device=device)
        return HistogramState(
            torch.zeros((*shape, 2, octaves, bins), dtype=torch.int64, device=device),
            zeros,
            zeros.clone(),
            torch.full(shape, torch.inf, dtype=torch.float32, device=device),
            torch.full(shape, -torch.inf, dtype=torch.float32, device=device),
            torch.zeros(shape, dtype=torch.int64, device=device),
        )

    def update_fn(state: HistogramState, x: torch.Tensor, weight: Optional[torch.Tensor] = None) -> HistogramState:
        check_state(state, HistogramState, "histogram.update")
        if x.numel() == 0:
            return state
        view = checked_view(x, spec.granularity, state.min_val.shape, "histogram.update")
        mask = weight_view(x, weight, spec.granularity)
        if mask is not None:
            mask = (mask != 0).expand(view.shape)
        if mask is None and spec.nonfinite == "ignore" and view.device.type == "cpu" and not torch.compiler.is_compiling():
            # one op: counts and extremes (the extremes in one pass when every value is finite; it
            # reads the non-finite count on the host, so CPU only)
            counts, nonfinite, lo, hi = _bucket_extremes_op(view.detach(), mantissa_bits, low, high)
        else:  # compiled: finite_aminmax fuses into the graph
            lo, hi, _, nonfinite = finite_aminmax(view, mask, spec.nonfinite)
            counts, _ = _bucket_counts_op(view.detach(), mask, mantissa_bits, low, high)
        return HistogramState(
            state.counts + counts[..., 1:-1].unflatten(-1, (octaves, bins)),
            state.underflow + counts[..., 0],
            state.overflow + counts[..., -1],
            torch.minimum(state.min_val, lo),
            torch.maximum(state.max_val, hi),
            state.nonfinite + nonfinite,
        )

    def merge_fn(a: HistogramState, b: HistogramState) -> HistogramState:
        check_state(a, HistogramState, "histogram.merge")
        check_state(b, HistogramState, "histogram.merge")
        check_same_shapes(a, b, "histogram.merge")
        return HistogramState(
            a.counts + b.counts,
            a.underflow + b.underflow,
            a.overflow + b.overflow,
            torch.minimum(a.min_val, b.min_val),
            torch.maximum(a.max_val, b.max_val),
            a.nonfinite + b.nonfinite,
        )

    return Observer(init_fn, update_fn, merge_fn, exact=True, spec=spec, name="histogram")


# ---------------------------------------------------------------------------------------------
# Geometry of a state: bucket edges, a window at full resolution below the largest magnitude.


def _magnitude_edges(num_buckets: int, bins: int, low: int, device) -> torch.Tensor:
    """Lower edges of magnitude buckets 0..K-1 and the overflow's lower edge, float64 (K+1)."""
    j = torch.arange(num_buckets - 1, dtype=torch.float64, device=device)
    octave = _floor(j / bins)
    frac = j - octave * bins
    inner = torch.pow(2.0, octave + low) * (1.0 + frac / bins)
    zero = torch.zeros(1, dtype=torch.float64, device=device)
    return torch.cat([zero, inner])  # edges[0]=0, edges[j]=lower edge of bucket j (j>=1)


def histogram_edges(state: HistogramState):
    """Signed bucket edges and counts of a state, ascending by value.

    Returns ``(edges, counts)``: float64 ``(*qparam_shape, 2K + 1)`` and ``(*qparam_shape, 2K)``;
    the outermost edges are the exact extremes and inner edges are clamped to them.
    """
    bins, low, _ = _config(state)
    flat = _flat(state)
    num_buckets = flat.shape[-1]
    lower = _magnitude_edges(num_buckets, bins, low, flat.device)
    top = torch.full((1,), math.inf, dtype=torch.float64, device=lower.device)
    mag_edges = torch.cat([lower, top])  # K + 1
    neg_extent = (-state.min_val.double()).clamp(min=0).unsqueeze(-1)
    pos_extent = state.max_val.double().clamp(min=0).unsqueeze(-1)
    neg_edges = torch.minimum(mag_edges, neg_extent)
    pos_edges = torch.minimum(mag_edges, pos_extent)
    edges = torch.cat([-neg_edges.flip(-1), pos_edges[..., 1:]], dim=-1)
    counts = torch.cat([flat[..., 0, :].flip(-1), flat[..., 1, :]], dim=-1)
    return edges, counts


def _window(state: HistogramState, bins: int, low: int, octaves: int):
    """Signed edges and counts of the ``octaves`` octaves below the largest magnitude at full
    resolution; everything smaller in one bucket around zero. Fixed shapes, vmappable.

    Returns (edges (*P, 2W + 2) float64 ascending, counts (*P, 2W + 1) float64) where W is the
    number of magnitude buckets in the window per sign.
    """
    counts = _flat(state)
    num_buckets = counts.shape[-1]
    device = counts.device
    width = (octaves + 1) * bins  # magnitude buckets kept per sign
    absmax = torch.maximum(-state.min_val, state.max_val).double().clamp(min=0)
    # index of the largest magnitude's bucket (1..K-2 inside the resolved range)
    safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    exponent = _floor(torch.log2(safe)).clamp(low, low + (num_buckets - 2) // bins - 1)
    top_octave_start = 1 + (exponent - low) * bins  # first bucket of the top octave
    first = (top_octave_start - octaves * bins).to(torch.int64)  # may be < 1
    pad = width
    padded = torch.nn.functional.pad(counts, (pad, 0))  # zeros in front
    index = (first.unsqueeze(-1) + pad) + torch.arange(width, device=device)  # (*P, width)
    index = index.clamp(0, num_buckets + pad - 1)
    index2 = index.unsqueeze(-2).expand(*counts.shape[:-1], width)
    kept = torch.gather(padded, -1, index2)  # (*P, 2, width)
    # counts below the window, and the overflow bucket above it (when the max overflows)
    cumulative = torch.cumsum(padded, -1)
    below_index = (first + pad - 1).clamp(min=0).unsqueeze(-1).unsqueeze(-1).expand(*counts.shape[:-1], 1)
    below = torch.gather(cumulative, -1, below_index).squeeze(-1)  # (*P, 2)
    total = padded.sum(-1)
    above = total - below - kept.sum(-1)  # values beyond the window's last bucket (overflow)
    # fold "above" into the last kept bucket (it reaches the exact extreme below)
    kept = torch.cat([kept[..., :-1], (kept[..., -1] + above).unsqueeze(-1)], dim=-1)
    # magnitude edges of the window
    j = index - pad  # bucket ids, possibly < 1 (then empty padding)
    jf = j.double()
    octave = _floor((jf - 1) / bins)
    frac = (jf - 1) - octave * bins
    lower = torch.pow(2.0, octave + low) * (1.0 + frac / bins)
    lower = torch.where(j >= 1, lower, torch.zeros_like(lower))
    lower = lower.clamp(min=0)
    mag_edges = torch.cat([lower, torch.full_like(lower[..., :1], math.inf)], dim=-1)  # width + 1
    neg_extent = (-state.min_val.double()).clamp(min=0).unsqueeze(-1)
    pos_extent = state.max_val.double().clamp(min=0).unsqueeze(-1)
    neg = torch.minimum(mag_edges, neg_extent)
    pos = torch.minimum(mag_edges, pos_extent)
    # the folded small values: one bucket [-floor_neg, floor_pos]
    edges = torch.cat([-neg.flip(-1), pos], dim=-1)  # (*P, 2 * (width + 1))
    small = (below[..., 0] + below[..., 1]).unsqueeze(-1)
    signed_counts = torch.cat([kept[..., 0, :].flip(-1), small, kept[..., 1, :]], dim=-1)
    return edges, signed_counts.double()


# ---------------------------------------------------------------------------------------------
# Prefix moments under the piecewise-uniform model.


class _Moments(NamedTuple):
    edges: torch.Tensor  # (*P, B + 1)
    counts: torch.Tensor  # (*P, B)
    c0: torch.Tensor  # (*P, B + 1) prefix counts
    c1: torch.Tensor
    c2: torch.Tensor


def _moments(edges, counts) -> _Moments:
    a, b = edges[..., :-1], edges[..., 1:]
    s1 = counts * (a + b) / 2
    s2 = counts * (a * a + a * b + b * b) / 3
    zero = torch.zeros_like(counts[..., :1])
    c0 = torch.cat([zero, counts.cumsum(-1)], -1)
    c1 = torch.cat([zero, s1.cumsum(-1)], -1)
    c2 = torch.cat([zero, s2.cumsum(-1)], -1)
    return _Moments(edges, counts, c0, c1, c2)


def _cumulative(mom: _Moments, t: torch.Tensor):
    """Count, sum and sum of squares of the values ``<= t`` (t: (*P, C)), piecewise uniform."""
    nb = mom.counts.shape[-1]
    inner = mom.edges[..., 1:-1].contiguous()
    i = _searchsorted(inner, t.contiguous(), right=True).clamp(0, nb - 1)
    a = torch.gather(mom.edges, -1, i)
    b = torch.gather(mom.edges, -1, i + 1)
    n = torch.gather(mom.counts, -1, i)
    width = b - a
    tc = torch.minimum(torch.maximum(t, a), b)
    frac = torch.where(width > 0, (tc - a) / torch.where(width > 0, width, torch.ones_like(width)),
                       (t >= b).to(t.dtype))
    part = n * frac
    m0 = torch.gather(mom.c0, -1, i) + part
    m1 = torch.gather(mom.c1, -1, i) + part * (a + tc) / 2
    m2 = torch.gather(mom.c2, -1, i) + part * (a * a + a * tc + tc * tc) / 3
    return m0, m1, m2


def _lean_grid(lo, hi, spec: QuantSpec, straddles_zero: bool = False, qrange=None):
    """torch.ao / compressed-tensors scale and zero point of candidate ranges in float64, for the
    searches (the chosen range goes through the spec's exact arithmetic afterwards).
    ``straddles_zero``: the caller knows ``lo <= 0 <= hi``; ``qrange``: ``spec.qrange`` if known."""
    qmin, qmax = spec.qrange if qrange is None else qrange
    if not straddles_zero:
        lo = torch.minimum(lo, torch.zeros_like(lo))
        hi = torch.maximum(hi, torch.zeros_like(hi))
    tiny = torch.finfo(torch.float32).eps
    if spec.mapping == "asymmetric":
        scale = ((hi - lo) / float(qmax - qmin)).clamp(min=tiny)
        if spec.zero_point_domain == "float":
            zero_point = -lo / scale
        elif straddles_zero:  # a few candidates: torch.floor stays serial
            zero_point = (qmin - torch.floor(lo / scale + 0.5)).clamp(qmin, qmax)  # ties: search only
        else:
            zero_point = (qmin - _floor(lo / scale + 0.5)).clamp(qmin, qmax)  # ties: search only
    else:
        if spec.mapping == "symmetric_no_clipping_err":
            scale = torch.maximum(lo / float(qmin), hi / float(qmax))
        else:
            scale = torch.maximum(-lo, hi) / (float(qmax - qmin) / 2)
        scale = scale.clamp(min=tiny)
        zero_point = torch.full_like(scale, float(spec.zero_point_of_symmetric))
    if spec.zero_point_domain == "none":
        zero_point = torch.zeros_like(scale)
    return scale, zero_point, (qmin - zero_point) * scale, (qmax - zero_point) * scale


def _grid(lo, hi, spec: QuantSpec, straddles_zero: bool = False, qrange=None):
    """Scale and clipping points of candidate ranges (lo, hi): the spec's own arithmetic."""
    if not spec.is_float and spec.scale_dtype == "float32" and spec.convention in ("torch_ao", "compressed_tensors"):
        return _lean_grid(lo, hi, spec, straddles_zero, qrange)
    shape = lo.shape
    calibrated = torch.ones(shape, dtype=torch.bool, device=lo.device)
    qp = qparams_from_minmax(lo.float(), hi.float(), spec, calibrated=calibrated)
    qmin, qmax = spec.qrange
    # the element step: a two-level (NVFP4) block scale under its global scale
    scale = effective_scale(qp.scale.double(), qp.global_scale.double(), spec)
    zero_point = qp.zero_point.double()
    if spec.zero_point_domain == "none":
        zero_point = torch.zeros_like(scale)
    return scale, zero_point, (qmin - zero_point) * scale, (qmax - zero_point) * scale


def _is_symmetric(spec: QuantSpec) -> bool:
    return spec.mapping != "asymmetric"


def _search_octaves(spec: QuantSpec) -> int:
    return min(spec.bits, 16) + 8


_CONSTANTS: dict = {}


def _constant(key, device, make):
    """The constant tensor ``make(device)``, cached per key and device in eager mode (built in
    the graph under compile)."""
    full_key = (key, device)
    cached = _CONSTANTS.get(full_key)
    if cached is not None and not torch.compiler.is_compiling():
        return cached
    if torch.compiler.is_compiling():
        return make(device)
    with torch.inference_mode(False):  # usable inside and outside inference mode
        cached = _CONSTANTS[full_key] = make(device)
    return cached


def _padded_lower_edges(bins: int, low: int, high: int, pad: int, device) -> torch.Tensor:
    """Constant float64 ``(pad + K + 1,)``: ``pad`` zeros, then the lower edge of every flat
    magnitude bucket (underflow first: 0), then ``inf`` (the overflow's upper end)."""

    def make(device):
        j = torch.arange((high - low) * bins + 1, dtype=torch.float64, device=device)
        octave = torch.div(j, bins, rounding_mode="floor")
        inner = torch.pow(2.0, octave + low) * (1.0 + (j - octave * bins) / bins)
        zeros = torch.zeros(pad + 1, dtype=torch.float64, device=device)
        return torch.cat([zeros, inner, torch.full((1,), math.inf, dtype=torch.float64, device=device)])

    return _constant(("lower_edges", bins, low, high, pad), device, make)


def _arange(device, *args) -> torch.Tensor:
    """Cached ``torch.arange(*args)`` (int64)."""
    return _constant(("arange", *args), device, lambda d: torch.arange(*args, device=d))


class _Windows(NamedTuple):
    edges: torch.Tensor  # (*P, 2, W + 1) magnitude edges, clamped to the sign's extreme
    counts: torch.Tensor  # (*P, 2, W) float64
    cand: torch.Tensor  # (*P, 2, W + 1) candidate clipping magnitudes at the edges; (*P, 1, W + 1) when symmetric
    tails: torch.Tensor  # (*P, 3, 2, W + 1) count, twice the sum, sum of squares of the window's values above each edge
    below: torch.Tensor  # (*P, 3, 2, W + 1) the same of the window's values below each edge
    total: torch.Tensor  # (*P,) float64 count of every value counted
    offset: torch.Tensor  # (*P, 2) or (*P, 1): float32 bit code (``>> 23 - m``) of each window's first bucket


def _sign_windows(state, spec, octaves: int) -> _Windows:
    """Per sign (0: negative values, as magnitudes), the ``W = octaves * bins`` magnitude
    buckets up to an anchor: the sign's extreme (asymmetric mappings) or the larger extreme
    (symmetric, one anchor for both signs), found from the anchor's float32 bits; candidates
    are the window's edges up to the anchor. Fixed shapes, a few gathers: no search."""
    bins, low, high = _config(state)
    m = bins.bit_length() - 1
    width = octaves * bins
    device = state.counts.device
    extent = torch.stack([-state.min_val, state.max_val], -1).clamp(min=0)  # float32 (*P, 2)
    anchor = extent.amax(-1, keepdim=True) if _is_symmetric(spec) else extent
    # flat bucket id of the anchor (0: underflow, K - 1: overflow); a value that rounds up to a
    # bucket edge lands in the bucket above
    top = ((bitcast(anchor, torch.int32) >> (23 - m)) - (((low + 127) << m) - 1)).clamp(0, (high - low) * bins + 1)
    index = top.unsqueeze(-1) + _arange(device, 1, width + 2)  # padded edge index, int64 (*P, 2 or 1, W + 1)
    lead = state.counts.shape[:-2]  # (*P, 2)
    flat = torch.cat([state.counts.new_zeros((*lead, width)), state.underflow.unsqueeze(-1), state.counts.flatten(-2),
                      state.overflow.unsqueeze(-1)], -1)
    counts = torch.gather(flat, -1, index[..., :-1].expand(*lead, width)).double()
    table = _padded_lower_edges(bins, low, high, width, device)
    lower = torch.gather(table.expand(*index.shape[:-1], table.shape[0]), -1, index)
    edges = torch.minimum(lower, extent.double().unsqueeze(-1))
    cand = torch.minimum(lower, anchor.double().unsqueeze(-1)) if _is_symmetric(spec) else edges
    a, b = edges[..., :-1], edges[..., 1:]
    ab = a + b
    # count, twice the sum and the sum of squares of values spread uniformly over each bucket
    # (b * b + a * (a + b): exact products of short mantissas, like a * a + a * b + b * b)
    moments = torch.stack([counts, counts * ab, counts * torch.addcmul(b * b, a, ab) * (1.0 / 3)], -3)
    prefix = torch.cumsum(moments, -1)
    below = torch.nn.functional.pad(prefix, (1, 0))
    tails = prefix[..., -1:] - below
    offset = top + (((low + 127) << m) - width)
    return _Windows(edges, counts, cand, tails, below, flat.sum((-2, -1)).double(), offset)


def _sawtooth_error(edges, density, lo, hi, spec, straddles_zero: bool = False, qrange=None, points=None):
    """Expected squared error of candidates ``(lo, hi)`` ``(*P, C)`` with the spec's own grid
    (zero point rounding included), exact under the piecewise-uniform model: the antiderivative
    of the squared error (a sawtooth inside the clipping points, cubic outside) at every edge,
    differenced and weighted by each bucket's ``count / width`` (``density`` ``(*P, B)``): one
    product with the differenced densities. ``straddles_zero``: the caller knows ``lo <= 0 <= hi``.
    ``points``: optional ``(positions, masses)`` ``(*P, n)`` of point masses (values exactly at a
    position, as in a bucket of zero width), each adding ``mass * squared error at its position``.
    Two-operand broadcasts only (CPU kernels with broadcast scalars per row are slow)."""
    scale, zero_point, clip_lo, clip_hi = _grid(lo, hi, spec, straddles_zero, qrange)
    u = edges.unsqueeze(-2)  # (*P, 1, B + 1)
    inside = torch.minimum(torch.maximum(u, clip_lo.unsqueeze(-1)), clip_hi.unsqueeze(-1))  # (*P, C, B + 1)
    w = inside * scale.reciprocal().unsqueeze(-1) + zero_point.unsqueeze(-1)  # in grid steps
    k = torch.round(w)
    saw = torch.add(k, (w - k).pow(3), alpha=4.0) * (scale.pow(3) * (1 / 12)).unsqueeze(-1)
    antiderivative = torch.add(saw, (u - inside).pow(3), alpha=1 / 3)
    # sum_j density_j (A_{j+1} - A_j) = sum_i A_i (density_{i-1} - density_i), zero beyond the ends
    padded = torch.nn.functional.pad(density, (1, 1))
    weights = padded[..., :-1] - padded[..., 1:]  # (*P, B + 1)
    error = torch.matmul(antiderivative, weights.unsqueeze(-1)).squeeze(-1)
    if points is not None:
        positions, masses = points
        u = positions.unsqueeze(-2)  # (*P, 1, n)
        inside = torch.minimum(torch.maximum(u, clip_lo.unsqueeze(-1)), clip_hi.unsqueeze(-1))  # (*P, C, n)
        w = inside * scale.reciprocal().unsqueeze(-1) + zero_point.unsqueeze(-1)
        rounding = (w - torch.round(w)) * scale.unsqueeze(-1)
        squared = torch.addcmul((u - inside).pow(2), rounding, rounding)
        error = error + torch.matmul(squared, masses.unsqueeze(-1)).squeeze(-1)
    return error


def _dead_zone(error, span, limit, below, offset, shift: int, half_scale: float):
    """``error`` of candidates ``(*P, n)`` of span ``span`` with ``x**2`` instead of ``scale**2 / 12``
    for the values that round to zero (``|x| < scale / 2``, located to the bucket from the float32
    bits of ``scale / 2``, at most the candidate's edge ``limit`` ``(*P, 2, n)``, per sign).
    ``below``: the windows' ``(*P, 3, 2, W + 1)`` count, twice the sum and sum of squares below
    each edge; ``offset`` ``(*P, 2 or 1, 1)``: the bucket code of each window's first bucket."""
    half = span * half_scale
    code = (bitcast(half.float(), torch.int32) >> shift).unsqueeze(-2)
    edge = torch.minimum((code - offset).clamp(min=0), limit)  # (*P, 2, n)
    lead = error.shape[:-1]
    gathered = torch.gather(below, -1, edge.unsqueeze(-3).expand(*lead, 3, *edge.shape[-2:]))
    gathered = gathered[..., 0, :] + gathered[..., 1, :]  # (*P, 3, n): summed over the signs
    return error + torch.addcmul(gathered[..., 2, :], gathered[..., 0, :], half * half, value=-1 / 3)


def _l2_search(state, spec, bins, low):
    """Coarse-to-fine search over bucket edges with an analytic model (a few batched steps, no
    search in sorted arrays, no host synchronisation), the finalists ranked with the spec's own
    grid."""
    m = bins.bit_length() - 1
    bits = spec.bits  # parsed from the dtype name on each access
    octaves = min(bits, 16) + 8  # _search_octaves
    win = _sign_windows(state, spec, octaves)
    width = win.edges.shape[-1] - 1
    device = win.edges.device
    lead = win.edges.shape[:-2]
    qmin, qmax = spec.qrange
    if spec.mapping == "symmetric_no_clipping_err":
        half_scale = 0.5 / (2 * min(-qmin, qmax))  # scale = amax / qmax (on 2 * amax = the span)
    else:
        half_scale = 0.5 / float(qmax - qmin)
    s0, s1_twice, s2 = win.tails.unbind(-3)  # (*P, 2, W + 1)
    cand = win.cand
    # squared distance of the values beyond each candidate to it: s2 - 2 c s1 + c**2 s0
    clip = torch.addcmul(s2, cand, torch.addcmul(s1_twice, cand, s0, value=-1), value=-1).clamp(min=0)
    rest = win.below[..., 0, :, :] * (half_scale * half_scale / 3)  # the window's values below, times h**2 / 3
    shift = 23 - m
    if _is_symmetric(spec):
        # the grid clips at (zero_point - qmin) * scale below and (qmax - zero_point) * scale above:
        # per sign, the edge nearest that multiple of the candidate amax
        zero_point = 0 if spec.zero_point_domain == "none" else spec.zero_point_of_symmetric
        per_amax = 4 * half_scale  # scale / amax
        shifts = tuple(round(bins * math.log2(multiple)) if multiple > 0 else -width
                       for multiple in ((zero_point - qmin) * per_amax, (qmax - zero_point) * per_amax))
        clip_index = _constant(("clip_index", width, shifts), device, lambda d: torch.stack(
            [(torch.arange(width + 1, device=d) + s).clamp(0, width) for s in shifts]))  # (2, W + 1)
        at = torch.gather(torch.stack([clip, rest], -3), -1, clip_index.expand(*lead, 2, 2, width + 1)).sum(-2)
        amaxes = cand[..., 0, :]  # (*P, W + 1)
        span = amaxes + amaxes
        error = at[..., 0, :] + at[..., 1, :] * (span * span)
        error = _dead_zone(error, span, clip_index, win.below, win.offset.unsqueeze(-1), shift, half_scale)
        best = torch.argmin(error, -1, keepdim=True)
        # finalists: the best's neighbours (+-3/16 octave for grids of 4 bits or less, where the
        # model is rough: most values sit within a few steps of zero) and the full range
        reach, stride = (3 * (bins // 16 or 1), bins // 64 or 1) if bits <= 4 else (2, 1)
        near = _constant(("near", reach, stride, width), device,
                         lambda d: torch.cat([torch.arange(-reach, reach + 1, stride, device=d),
                                              torch.full((1,), 2 * width + 1, device=d)]))
        amax = torch.gather(amaxes, -1, (best + near).clamp(0, width))
        lo, hi = -amax, amax
    else:
        # 2-D: every (bins / 4)-th edge of the top (bits + 4) octaves, then finer around the best
        packed = torch.stack([clip, rest, cand], -3)  # (*P, 3, 2, W + 1)
        step = max(1, bins // 4)
        reach = (octaves - 4) * bins  # the candidates' reach: bits + 4 octaves
        span_args = (width, width - reach - 1, -step)
        best = None
        while True:
            # pair p = i * k + j of the k offsets: the negative side's i-th, the positive side's j-th, (2, k * k)
            pair_offsets = _constant(("pairs", span_args), device, lambda d: torch.stack(
                [_arange(d, *span_args).repeat_interleave(_arange(d, *span_args).shape[0]),
                 _arange(d, *span_args).repeat(_arange(d, *span_args).shape[0])]))
            pairs = pair_offsets.shape[-1]
            # the pairs' edges: absolute at first, then around the best, (*P, 2, k * k)
            limit = pair_offsets if best is None else (best.unsqueeze(-1) + pair_offsets).clamp(0, width)
            limit = limit.expand(*lead, 2, pairs)
            sel = torch.gather(packed, -1, limit.unsqueeze(-3).expand(*lead, 3, 2, pairs))
            # clipping errors, rest counts and spans of the pairs, (*P, k * k) each
            clipped, rest_count, span = (sel[..., 0, :] + sel[..., 1, :]).unbind(-2)
            error = clipped + rest_count * (span * span)
            if best is not None:
                error = _dead_zone(error, span, limit, win.below, win.offset.unsqueeze(-1), shift, half_scale)
            flat_best = torch.argmin(error, -1, keepdim=True)  # (*P, 1)
            best = torch.take_along_dim(limit, flat_best.unsqueeze(-2), -1).squeeze(-1)  # (*P, 2)
            if step <= 2:
                break
            new_step = max(1, step // 16)  # 32 -> 2 with 128 buckets per octave; the finalists cover +-2
            span_args = (-step, step + 1, new_step)
            step = new_step
        # finalists: a 3 x 3 neighbourhood of the best (+-2 edges; 5 x 5 over +-1/16 octave for grids
        # of 4 bits or less), the full range, each side of the best with the other full
        n, stride = (5, bins // 32 or 1) if bits <= 4 else (3, bins // 64 or 1)
        near = _constant(("near", n, stride, width), device, lambda d: torch.cat(
            [torch.arange(-(n // 2), n // 2 + 1, device=d) * stride, torch.full((1,), 2 * width + 1, device=d)]))
        # (neg, pos) positions in the n + 1 values per sign (the last: the full range)
        which = _constant(("finalists", n), device, lambda d: torch.tensor(
            [[i for i in range(n) for _ in range(n)] + [n, n // 2, n],
             [j for _ in range(n) for j in range(n)] + [n, n, n // 2]], device=d))
        values = torch.gather(cand, -1, (best.unsqueeze(-1) + near).clamp(0, width))  # (*P, 2, n + 1)
        pairs = torch.gather(values, -1, which.expand(*lead, *which.shape))  # (*P, 2, n * n + 3)
        lo, hi = -pairs[..., 0, :], pairs[..., 1, :]
    # exact ranking of the finalists: every bucket of the top octave of each sign (where the clipping
    # points of light tails sit), buckets of 1/8 octave below; signed, ascending
    factor = max(1, bins // 8)
    split = width - bins

    def signed_layout(d):
        kept = torch.cat([torch.arange(0, split, factor, device=d), torch.arange(split, width + 1, device=d)])
        order = torch.cat([kept.flip(0), kept + (width + 1)])
        positive = torch.cat([torch.zeros_like(kept, dtype=torch.bool), torch.ones_like(kept, dtype=torch.bool)])
        return order, positive, torch.where(positive, 1.0, -1.0).double()

    order, positive, sign = _constant(("signed", width, factor), device, signed_layout)
    signed_edges = win.edges.flatten(-2).index_select(-1, order) * sign
    # values below each signed edge (integers): the negative ones beyond it, all but the positive ones beyond it
    beyond = win.tails[..., 0, :, :].flatten(-2).index_select(-1, order)
    cumulative = torch.where(positive, win.total.unsqueeze(-1) - beyond, beyond)
    # a bucket of zero width (an extreme exactly on a bucket edge, e.g. clipped data) holds its
    # values at one point: a point mass there instead of a density (count / 0 would swamp the
    # summation by parts); such buckets hold values only at the two ends (or at 0, exact on every
    # grid), so the masses are gathered onto the first and the last edge
    counts = cumulative.diff(dim=-1)
    widths = signed_edges.diff(dim=-1)
    flat = widths <= 0
    points = None
    # (a plain CPU tensor skips the point masses when there are none: a cheap host check)
    if _is_traced(flat) or flat.device.type != "cpu" or bool(flat.any()):
        ends = signed_edges[..., [0, -1]]
        point = torch.where(flat, counts, 0.0)
        points = (ends, torch.stack([(point * (signed_edges[..., :-1] == ends[..., :1])).sum(-1),
                                     (point * (signed_edges[..., 1:] == ends[..., 1:])).sum(-1)], -1))
    density = torch.where(flat, 0.0, counts / widths.clamp(min=1e-300))
    error = _sawtooth_error(signed_edges, density, lo, hi, spec, straddles_zero=True, qrange=(qmin, qmax),
                            points=points)
    pick = torch.argmin(error, -1, keepdim=True)
    return torch.gather(lo, -1, pick).squeeze(-1), torch.gather(hi, -1, pick).squeeze(-1)


# ---------------------------------------------------------------------------------------------
# Exact integral of the squared error of a uniform grid over piecewise-uniform buckets.


def _sawtooth_integral(u, scale):
    """Integral of (x - scale * round(x / scale))**2 from -scale/2 to u."""
    k = _floor(u / scale + 0.5)
    v = u - k * scale
    cube = scale * scale * scale
    return k * cube / 12 + (v * v * v + cube / 8) / 3


_PIECE = 1 << 15  # elements per evaluation piece: below torch's parallel grain size


def _in_pieces(function, edges, counts, lo, hi, spec):
    """``function(edges, counts, lo, hi, spec)`` over slices of the candidates, so that every
    intermediate stays below ``_PIECE`` elements (small ops run single-threaded: no waiting on
    a busy second core, and less memory)."""
    per_piece = max(1, _PIECE // max(1, counts.shape[-1] * max(1, lo[..., :1].numel())))
    total = lo.shape[-1]
    if total <= per_piece:
        return function(edges, counts, lo, hi, spec)
    parts = [function(edges, counts, lo[..., i : i + per_piece], hi[..., i : i + per_piece], spec)
             for i in range(0, total, per_piece)]
    return torch.cat(parts, -1)


def _cube(x):
    return x * x * x / 3


def _exact_error(edges, counts, lo, hi, spec):
    """Expected squared error of candidates (lo, hi) of shape (*P, C), exact under the
    piecewise-uniform model, for integer grids. O(B x C)."""
    scale, zero_point, clip_lo, clip_hi = _grid(lo, hi, spec)
    a = edges[..., :-1].unsqueeze(-2)  # (*P, 1, B)
    b = edges[..., 1:].unsqueeze(-2)
    n = counts.unsqueeze(-2)
    s = scale.unsqueeze(-1)
    offset = (zero_point * scale).unsqueeze(-1)  # grid points at k * s - offset
    cl, ch = clip_lo.unsqueeze(-1), clip_hi.unsqueeze(-1)
    width = b - a
    safe = torch.where(width > 0, width, torch.ones_like(width))
    # inside part
    ia, ib = torch.clamp(a, cl, ch), torch.clamp(b, cl, ch)
    inside = _sawtooth_integral(ib + offset, s) - _sawtooth_integral(ia + offset, s)
    # clipped parts
    la, lb = torch.minimum(a, cl), torch.minimum(b, cl)
    below = _cube(cl - la) - _cube(cl - lb)
    ua, ub = torch.maximum(a, ch), torch.maximum(b, ch)
    above = _cube(ub - ch) - _cube(ua - ch)
    per_value = (inside.clamp(min=0) + below + above) / safe
    qmin, qmax = spec.qrange
    q = torch.clamp(_floor((a + offset) / s + 0.5), qmin, qmax) * s - offset  # zero-width: point mass
    point_error = (a - q) ** 2
    per_value = torch.where(width > 0, per_value, point_error)
    return (n * per_value).sum(-1)


def _float_grid_error(edges, counts, lo, hi, spec):
    """Squared error at bucket centres for floating-point targets (fp8)."""
    from .._quant import _codes_float

    scale, _, _, _ = _grid(lo, hi, spec)
    centres = ((edges[..., :-1] + edges[..., 1:]) / 2).unsqueeze(-2).float()
    s = scale.unsqueeze(-1).float()
    # ``s`` is the element step (`_grid`): a two-level spec's global scale is already in it
    _, codes = _codes_float(centres, s, torch.zeros_like(s), spec, global_scale=torch.ones_like(s))
    err = (codes * s - centres).double() ** 2
    return (counts.unsqueeze(-2) * err).sum(-1)


def _positive_int(name: str, value, low: int = 1, high: int = 1 << 20) -> None:
    """A method option that must be an int in ``[low, high]``: ValueError naming it otherwise."""
    if not (isinstance(value, int) and not isinstance(value, bool) and low <= value <= high):
        raise ValueError(f"compute_qparams: {name} must be an int in [{low}, {high}], got {value!r}")


def _mse_search(state, spec, bins, low, candidates=128, per_octave=32):
    _positive_int("candidates", candidates, 1, 1 << 16)
    _positive_int("per_octave", per_octave, 1, 1 << 16)
    edges, counts = _window(state, bins, low, _search_octaves(spec))
    steps = torch.arange(candidates, dtype=torch.float64, device=edges.device)
    factors = torch.pow(2.0, -steps / per_octave)
    lo = state.min_val.double().clamp(max=0).unsqueeze(-1) * factors
    hi = state.max_val.double().clamp(min=0).unsqueeze(-1) * factors
    if _is_symmetric(spec):
        absmax = torch.maximum(-lo, hi)
        lo, hi = -absmax, absmax
    error_fn = _float_grid_error if spec.is_float else _exact_error
    error = _in_pieces(error_fn, edges, counts, lo, hi, spec)
    error = torch.where(hi - lo > 0, error, torch.full_like(error, math.inf))
    best = torch.argmin(error, -1, keepdim=True)
    return torch.gather(lo, -1, best).squeeze(-1), torch.gather(hi, -1, best).squeeze(-1)


# ---------------------------------------------------------------------------------------------
# Entropy (KL) calibration, TensorRT / ModelOpt.


def entropy_amax(hist: torch.Tensor, bin_edges: torch.Tensor, num_bits: int = 8, unsigned: bool = False,
                 start_bin: int = 128, stride: int = 1) -> torch.Tensor:
    """The KL-divergence calibration of TensorRT / ModelOpt on a linear histogram of ``|x|``.

    For every candidate ``i`` (``start_bin..len(hist)`` by ``stride``) the reference
    distribution ``P`` is ``hist[:i]`` with the outliers added to its last bin, and ``Q`` is
    ``hist[:i]`` quantized to ``2**(num_bits - 1 + unsigned)`` levels (each level spreads its mass
    evenly over its non-empty bins); the chosen amax is ``bin_edges[i]`` of the last minimum of
    ``KL(P || Q)``. As ModelOpt, the first bin's count is replaced by the second's (zeros from
    ReLU would dominate; TensorRT's older pytorch-quantization took the third's). Vectorised over candidates and leading dimensions.

    Args:
      hist: counts, shape ``(*P, nbins)``.
      bin_edges: edges, shape ``(*P, nbins + 1)`` (or ``(nbins + 1,)``).
    """
    hist = hist.double()
    hist = torch.cat([hist[..., 1:2], hist[..., 1:]], -1)
    nbins_total = hist.shape[-1]
    levels = 1 << (num_bits - 1 + int(unsigned))
    device = hist.device
    cand = torch.arange(start_bin, nbins_total + 1, stride, device=device)  # (C,)
    total = hist.sum(-1, keepdim=True)
    zero = torch.zeros_like(hist[..., :1])
    c_count = torch.cat([zero, hist.cumsum(-1)], -1)  # prefix sums
    nonzero = (hist > 0).double()
    c_nonzero = torch.cat([zero, nonzero.cumsum(-1)], -1)
    plogp = torch.where(hist > 0, hist * torch.log(torch.where(hist > 0, hist, torch.ones_like(hist))), zero)
    c_plogp = torch.cat([zero, plogp.cumsum(-1)], -1)
    lead = hist.shape[:-1]
    k = torch.arange(levels + 1, device=device, dtype=torch.float64)

    def divergences(cand):
        # chunk boundaries: np.linspace(0, i, levels + 1) is k * (i / levels), the last point i;
        # np.digitize puts bin j in chunk c when space[c] <= j < space[c + 1]
        space = k.unsqueeze(0) * (cand.double() / levels).unsqueeze(-1)
        starts = torch.cat([(-_floor(-space[:, :-1])).to(torch.int64), cand.unsqueeze(-1)], -1)
        idx = starts.expand(*lead, *starts.shape)  # (*P, C, levels+1)
        gather = lambda c: torch.gather(c.unsqueeze(-2).expand(*lead, cand.shape[0], c.shape[-1]), -1, idx)  # noqa: E731
        chunk_sum = gather(c_count).diff(dim=-1)  # (*P, C, levels)
        chunk_nonzero = gather(c_nonzero).diff(dim=-1)
        q_level = torch.where(chunk_nonzero > 0, chunk_sum / chunk_nonzero.clamp(min=1), torch.zeros_like(chunk_sum))
        # sum_j p_j log q_{d(j)} over the bins of hist[:i] = sum_k S_k log(q_k)
        log_q = torch.log(torch.where(q_level > 0, q_level, torch.ones_like(q_level)))
        s_log_q = torch.where(chunk_sum > 0, chunk_sum * log_q, torch.zeros_like(chunk_sum)).sum(-1)  # (*P, C)
        ci = cand.expand(*lead, cand.shape[0])
        last = torch.gather(hist, -1, (ci - 1))  # p_{i-1}
        outliers = total - torch.gather(c_count, -1, ci)
        p_last = last + outliers
        p_log_p_last = torch.where(p_last > 0, p_last * torch.log(p_last.clamp(min=1e-300)), torch.zeros_like(p_last))
        sum_p_log_p = torch.gather(c_plogp, -1, ci - 1) + p_log_p_last
        q_last = q_level[..., -1]  # the last bin belongs to the last chunk
        # the outliers in P's last bin meet Q's value there (0 if that bin is empty: infinite KL)
        out_term = torch.where(outliers > 0, outliers * torch.log(q_last.clamp(min=1e-300)), torch.zeros_like(outliers))
        out_term = torch.where((outliers > 0) & ((last <= 0) | (q_last <= 0)), torch.full_like(out_term, -math.inf), out_term)
        n_q = torch.gather(c_count, -1, ci)
        kl = (sum_p_log_p - (s_log_q + out_term)) / total - torch.log(total) + torch.log(n_q)
        return torch.where(n_q > 0, kl, torch.full_like(kl, math.inf))

    # candidates in pieces that keep every intermediate below torch's parallel grain size
    per_piece = max(1, (1 << 15) // max(1, (levels + 1) * max(1, total.numel())))
    kl = torch.cat([divergences(cand[i : i + per_piece]) for i in range(0, cand.shape[0], per_piece)], -1)
    # last argmin
    flipped = kl.flip(-1)
    best = kl.shape[-1] - 1 - torch.argmin(flipped, -1)
    # index_select rather than indexing with a 0-dim tensor: traceable without a host read
    chosen = cand.index_select(0, best.reshape(-1)).reshape(best.shape)
    if bin_edges.dim() == 1:
        return bin_edges.index_select(0, chosen.reshape(-1)).reshape(chosen.shape)
    return torch.gather(bin_edges, -1, chosen.unsqueeze(-1)).squeeze(-1)


def _abs_linear_histogram(state, bins, low, num_linear=2048):
    """A linear histogram of |x| over [0, absmax] (piecewise-uniform re-binning)."""
    edges, counts = _window(state, bins, low, 24)
    mom = _moments(edges, counts)
    absmax = torch.maximum(-state.min_val, state.max_val).double().clamp(min=0).unsqueeze(-1)
    steps = torch.arange(num_linear + 1, dtype=torch.float64, device=edges.device) / num_linear
    lin = absmax * steps  # (*P, L+1)
    pos0, _, _ = _cumulative(mom, lin)
    neg0, _, _ = _cumulative(mom, -lin)
    total = mom.c0[..., -1:]
    # mass of |x| <= t = F(t) - F(-t) (+ the atom at -t, negligible under the uniform model)
    cdf = pos0 - neg0
    cdf = torch.cat([torch.zeros_like(cdf[..., :1]), cdf[..., 1:]], -1)
    cdf = torch.cat([cdf[..., :-1], total], -1)
    hist = cdf.diff(dim=-1).clamp(min=0)
    return hist, lin


def _entropy_search(state, spec, bins, low, num_bits=None, start_bin=128, stride=1, num_linear=2048):
    _positive_int("num_linear", num_linear, 2, 1 << 16)
    if num_bits is not None:
        _positive_int("num_bits", num_bits, 1, 16)
    _positive_int("start_bin", start_bin, 1, num_linear)
    _positive_int("stride", stride, 1, num_linear)
    hist, lin = _abs_linear_histogram(state, bins, low, num_linear)
    bits = spec.bits if num_bits is None else num_bits
    unsigned = (not spec.is_signed) and spec.mapping == "asymmetric"
    amax = entropy_amax(hist, lin, bits, unsigned, start_bin, stride)
    if spec.mapping == "asymmetric":
        lo = torch.maximum(state.min_val.double(), -amax)
        hi = torch.minimum(state.max_val.double(), amax)
        return lo, hi
    return -amax, amax


def _quantile(mom, q):
    """Value at cumulative fraction q (a tensor broadcastable to (*P, k)), uniform in buckets."""
    total = mom.c0[..., -1:]
    target = q * total
    # q * total can land a rounding error past a whole count (0.999 * 40000 = 39960.000000000004)
    # and skip to the next non-empty bucket: snap targets within a few ulps of a count onto it.
    nearest = torch.round(target)
    target = torch.where((target - nearest).abs() <= 8 * torch.finfo(target.dtype).eps * target, nearest, target)
    nb = mom.counts.shape[-1]
    i = _searchsorted(mom.c0[..., 1:].contiguous(), target.contiguous(), right=False).clamp(0, nb - 1)
    before = torch.gather(mom.c0, -1, i)
    n = torch.gather(mom.counts, -1, i)
    a = torch.gather(mom.edges, -1, i)
    b = torch.gather(mom.edges, -1, i + 1)
    frac = torch.where(n > 0, ((target - before) / torch.where(n > 0, n, torch.ones_like(n))).clamp(0, 1), torch.zeros_like(n))
    return a + frac * (b - a)


def _abs_quantile(state, bins, low, p: float) -> torch.Tensor:
    """The value below which a fraction ``p`` of the |x| lie, under the piecewise-uniform model of
    the buckets: the mass of |x| <= t, ``F(t) - F(-t)``, is linear between the magnitudes of
    the bucket edges, so it is evaluated there and inverted between two of them (inside a
    bucket, at the buckets' own resolution, however far an outlier stretches the range)."""
    edges, counts = _window(state, bins, low, 24)
    mom = _moments(edges, counts)
    absmax = torch.maximum(-state.min_val, state.max_val).double().clamp(min=0).unsqueeze(-1)
    points = torch.cat([torch.zeros_like(edges[..., :1]), torch.minimum(edges.abs(), absmax), absmax], -1)
    points = points.sort(-1).values  # (*P, K): the breakpoints of |x|'s distribution function
    total = mom.c0[..., -1:]
    cdf = (_cumulative(mom, points)[0] - _cumulative(mom, -points)[0]).clamp(min=0)
    cdf = torch.cummax(torch.cat([cdf[..., :-1], total], -1), -1).values  # all of it at absmax
    target = p * total
    nearest = torch.round(target)  # a target a rounding error past a whole count: that count (`_quantile`)
    target = torch.where((target - nearest).abs() <= 8 * torch.finfo(target.dtype).eps * target, nearest, target)
    i = _searchsorted(cdf.contiguous(), target.contiguous(), right=False).clamp(1, points.shape[-1] - 1)
    below, above = torch.gather(cdf, -1, i - 1), torch.gather(cdf, -1, i)
    start, end = torch.gather(points, -1, i - 1), torch.gather(points, -1, i)
    step = above - below
    frac = torch.where(step > 0, (target - below) / torch.where(step > 0, step, torch.ones_like(step)), torch.ones_like(step))
    return (start + frac.clamp(0, 1) * (end - start)).squeeze(-1)


def _percentile_search(state, spec, bins, low, percentile=99.99):
    if not (isinstance(percentile, (int, float)) and 0 < percentile <= 100):
        raise ValueError(f"compute_qparams: percentile must be in (0, 100], got {percentile!r}")
    p = float(percentile) / 100
    if _is_symmetric(spec):
        amax = _abs_quantile(state, bins, low, p)
        return -amax, amax
    edges, counts = _window(state, bins, low, _search_octaves(spec) + 8)
    mom = _moments(edges, counts)
    q = torch.tensor([1 - p, p], dtype=torch.float64, device=edges.device).expand(*counts.shape[:-1], 2)
    both = _quantile(mom, q.contiguous())
    return both[..., 0], both[..., 1]


_METHODS = ("l2", "mse", "entropy", "percentile", "minmax")


def _eager_inference(state) -> bool:
    """Whether a range rule may run its few hundred small ops under ``torch.inference_mode`` (no
    autograd bookkeeping): plain eager tensors only, none requiring grad; not under compile or
    a functorch transform (vmap, grad)."""
    if torch.compiler.is_compiling():
        return False
    return not any(t.requires_grad or torch._C._functorch.is_functorch_wrapped_tensor(t) for t in state)


def _histogram_rule_factory():
    def search(state, spec: QuantSpec, method: str, options) -> Range:
        bins, low, _ = _config(state)
        calibrated = state.min_val <= state.max_val  # some value counted (the extremes start at +-inf)
        if method == "l2" and not spec.is_float:
            lo, hi = _l2_search(state, spec, bins, low)
            if not _is_symmetric(spec):
                # edges clamped to each sign's extreme: inside [min(min_val, 0), 0] and [0, max(max_val, 0)]
                # already (zeros when nothing was counted)
                return Range(lo.float(), hi.float(), calibrated)
        elif method in ("l2", "mse"):  # l2 on floating-point grids: the exact integral
            lo, hi = _mse_search(state, spec, bins, low, **options)
        elif method == "entropy":
            lo, hi = _entropy_search(state, spec, bins, low, **options)
        else:
            lo, hi = _percentile_search(state, spec, bins, low, **options)
        # inside [min_val, max_val] and around zero; the extremes when nothing was counted
        zero = torch.zeros_like(state.min_val)
        lo = torch.where(calibrated, torch.clamp(lo.float(), torch.minimum(state.min_val, zero), zero), state.min_val)
        hi = torch.where(calibrated, torch.clamp(hi.float(), zero, torch.maximum(state.max_val, zero)), state.max_val)
        return Range(lo, hi, calibrated)

    def rule(state, spec: QuantSpec, method: str = "l2", **options) -> Range:
        if method not in _METHODS:
            raise ValueError(f"compute_qparams: histogram method must be one of {_METHODS}, got {method!r}")
        if method == "minmax":
            if options:
                raise TypeError(f"compute_qparams: method 'minmax' takes no options, got {sorted(options)}")
            return Range(state.min_val, state.max_val, state.min_val <= state.max_val)
        if method == "l2" and options:
            raise TypeError(f"compute_qparams: method 'l2' takes no options, got {sorted(options)}")
        if not _eager_inference(state):
            with _serial_when_small(state.min_val.numel()):
                return search(state, spec, method, options)
        # eager only: torch.get_num_threads() returns a non-tensor the compiler cannot trace
        threads = torch.get_num_threads()
        serial = threads > 1 and state.min_val.numel() <= 16  # see _serial_when_small
        if serial:
            torch.set_num_threads(1)
        try:
            with torch.inference_mode():
                found = search(state, spec, method, options)
                if not handles_qparams(spec):  # elementwise scales: no global scale to take
                    found = qparams_from_minmax(found.min_val, found.max_val, spec, calibrated=found.calibrated)
        finally:
            if serial:
                torch.set_num_threads(threads)
        return type(found)(*(t.clone() for t in found))  # ordinary tensors again

    return rule


register_range_rule(HistogramState)(_histogram_rule_factory())
