"""What the range searches read from a histogram state: configuration, bucket edges, a full-resolution
window below the largest magnitude, prefix moments under the piecewise-uniform model, the grid of
candidate ranges and the final clamp to the observed extremes. Fixed shapes: vmappable, traceable.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, NamedTuple

import torch

from ..._checks import is_integer
from ..._formats import effective_scale
from ..._qparams import Range, qparams_from_minmax
from ..._spec import QuantSpec

_CHUNK_ELEMENTS = 1 << 22  # largest intermediate of a search over candidates (memory bound)


def config(state) -> tuple[int, int, int]:
    """``(bins, low exponent, high exponent)`` of a histogram state, read from its shape."""
    bins, octaves = state.counts.shape[-1], state.counts.shape[-2]
    low = -(octaves // 2)
    return bins, low, low + octaves


def flat_counts(state) -> torch.Tensor:
    """Counts as ``(*P, 2, K)`` per sign: underflow, the octaves' buckets, overflow."""
    return torch.cat([state.underflow.unsqueeze(-1), state.counts.flatten(-2), state.overflow.unsqueeze(-1)], -1)


def is_symmetric(spec: QuantSpec) -> bool:
    return spec.mapping != "asymmetric"


def search_octaves(spec: QuantSpec) -> int:
    """Octaves below the largest magnitude that the searches see at full resolution."""
    return min(spec.bits, 16) + 8


def check_int(name: str, value, low: int = 1, high: int = 1 << 20, where: str = "compute_qparams") -> int:
    """A method option that must be an int in ``[low, high]``, as a Python int (a numpy integer, as
    ``np.int64(8)``, too: it was refused as "must be an int, got np.int64(8)"); ValueError naming it
    otherwise."""
    if not (is_integer(value) and low <= value <= high):
        raise ValueError(f"{where}: {name} must be an int in [{low}, {high}], got {value!r}")
    return int(value)


def may_exclude_zero(spec: QuantSpec) -> bool:
    """Whether the spec's qparams may map a range without zero: an asymmetric integer target with a float
    zero point (torch.ao's ``per_channel_affine_float_qparams``, torchao's tinygemm: codes span the
    observed ``[min, max]``). A convention that puts zero in every range anyway (compressed-tensors)
    gives the same qparams for such a range as for it widened to zero. Not ``preserve_zero=False``:
    torchao clamps its integer zero point into the codes, so a range without zero loses the data
    (tests/test_search_ranges_without_zero.py)."""
    return spec.mapping == "asymmetric" and not spec.is_float and spec.zero_point_domain == "float"


def inside_extremes(state, lo: torch.Tensor, hi: torch.Tensor, spec: QuantSpec):
    """Candidate ranges ``(lo, hi)`` (``(*P, C)`` or ``(*P,)``) of a spec that `may_exclude_zero` clamped
    into ``[min_val, max_val]`` (``lo <= hi``), so that they are ranked as returned; others unchanged."""
    if not may_exclude_zero(spec):
        return lo, hi
    extra = lo.dim() - state.min_val.dim()
    low, high = (t.reshape(t.shape + (1,) * extra).to(lo.dtype) for t in (state.min_val, state.max_val))
    lo = torch.minimum(torch.maximum(lo, low), high)
    return lo, torch.minimum(torch.maximum(hi, lo), high)


def within_extremes(state, lo: torch.Tensor, hi: torch.Tensor, spec=None) -> Range:
    """The searched range clamped into ``[min(min_val, 0), 0]`` and ``[0, max(max_val, 0)]`` (float32);
    the extremes themselves where nothing was counted (they start at +-inf: uncalibrated). For a
    ``spec`` whose ranges need not hold zero (`may_exclude_zero`), into ``[min_val, max_val]``: data of
    one sign keeps its own end (the searches' ``[0, max]`` lost the float zero point's use: uint4 data
    in [2, 3] quantized with 8.7 times the squared error of its min/max range)."""
    calibrated = state.min_val <= state.max_val
    if spec is not None and may_exclude_zero(spec):
        lo, hi = inside_extremes(state, lo.float(), hi.float(), spec)
        return Range(torch.where(calibrated, lo, state.min_val), torch.where(calibrated, hi, state.max_val), calibrated)
    zero = torch.zeros_like(state.min_val)
    lo = torch.where(calibrated, torch.clamp(lo.float(), torch.minimum(state.min_val, zero), zero), state.min_val)
    hi = torch.where(calibrated, torch.clamp(hi.float(), zero, torch.maximum(state.max_val, zero)), state.max_val)
    return Range(lo, hi, calibrated)


def in_chunks(function: Callable, candidates: tuple, per_candidate: int) -> torch.Tensor:
    """``function(*candidates)`` over slices of the candidates (their last dimension), so that no
    intermediate of ``per_candidate`` elements per candidate grows past ``_CHUNK_ELEMENTS``
    (memory, for fine granularities with many parameters); results concatenated on the last dim."""
    size = max(1, _CHUNK_ELEMENTS // max(1, per_candidate))
    total = candidates[0].shape[-1]
    if total <= size:
        return function(*candidates)
    return torch.cat([function(*(c[..., i : i + size] for c in candidates)) for i in range(0, total, size)], -1)


# ---------------------------------------------------------------------------------------------
# Bucket edges


def bucket_edges(state, device) -> torch.Tensor:
    """Magnitude edges of a state's flat buckets (`flat_counts`), float64 ``(K + 1,)``: 0, the lower
    edge ``2**(low + j // bins) * (1 + j % bins / bins)`` of bucket ``j + 1`` for ``j < K - 1``, inf."""
    bins, low, high = config(state)
    j = torch.arange((high - low) * bins + 1, dtype=torch.float64, device=device)
    octave = torch.floor(j / bins)
    inner = torch.pow(2.0, octave + low) * (1.0 + (j - octave * bins) / bins)
    return torch.cat([inner.new_zeros(1), inner, inner.new_full((1,), math.inf)])


def histogram_edges(state):
    """Signed bucket edges and counts of a state, ascending by value.

    Returns ``(edges, counts)``: float64 ``(*qparam_shape, 2K + 1)`` and ``(*qparam_shape, 2K)``;
    the outermost edges are the exact extremes and inner edges are clamped to them.
    """
    flat = flat_counts(state)
    magnitude_edges = bucket_edges(state, flat.device)
    neg_edges = torch.minimum(magnitude_edges, (-state.min_val.double()).clamp(min=0).unsqueeze(-1))
    pos_edges = torch.minimum(magnitude_edges, state.max_val.double().clamp(min=0).unsqueeze(-1))
    edges = torch.cat([-neg_edges.flip(-1), pos_edges[..., 1:]], dim=-1)
    counts = torch.cat([flat[..., 0, :].flip(-1), flat[..., 1, :]], dim=-1)
    return edges, counts


def window(state, bins: int, low: int, octaves: int, from_both_extremes: bool = False):
    """Signed edges ``(*P, 2W + 2)`` and counts ``(*P, 2W + 1)`` (float64, ascending) of the ``octaves``
    octaves below the largest magnitude at full resolution, everything smaller in one bucket at zero.
    Edges are clamped to the extreme of their sign; ``from_both_extremes``: to the other extreme too
    where it has the same sign (``min_val > 0``: no value lies below it), so a constant's bucket is its
    one point (spread over its bucket, the entropy search clipped a constant by up to 1/128).
    """
    counts = flat_counts(state)
    num_buckets = counts.shape[-1]
    width = (octaves + 1) * bins  # magnitude buckets kept per sign
    absmax = torch.maximum(-state.min_val, state.max_val).double().clamp(min=0)
    # index of the largest magnitude's bucket (1..K-2 inside the resolved range)
    safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    exponent = torch.floor(torch.log2(safe)).clamp(low, low + (num_buckets - 2) // bins - 1)
    first = (1 + (exponent - low) * bins - octaves * bins).to(torch.int64)  # may be < 1
    padded = torch.nn.functional.pad(counts, (width, 0))  # zeros in front
    index = (first.unsqueeze(-1) + width) + torch.arange(width, device=counts.device)  # (*P, width)
    index = index.clamp(0, num_buckets + width - 1)
    kept = torch.gather(padded, -1, index.unsqueeze(-2).expand(*counts.shape[:-1], width))  # (*P, 2, width)
    # counts below the window, and the overflow bucket above it (when the max overflows)
    below_index = (first + width - 1).clamp(min=0).unsqueeze(-1).unsqueeze(-1).expand(*counts.shape[:-1], 1)
    below = torch.gather(torch.cumsum(padded, -1), -1, below_index).squeeze(-1)  # (*P, 2)
    above = padded.sum(-1) - below - kept.sum(-1)  # values beyond the window's last bucket (overflow)
    # fold "above" into the last kept bucket (it reaches the exact extreme below)
    kept = torch.cat([kept[..., :-1], (kept[..., -1] + above).unsqueeze(-1)], dim=-1)
    # magnitude edges of the window: the lower edge of each bucket, 0 for the empty padding in front
    table = torch.nn.functional.pad(bucket_edges(state, counts.device), (width, 0))
    lower = torch.gather(table.expand(*index.shape[:-1], table.shape[0]), -1, index)
    magnitude_edges = torch.cat([lower, torch.full_like(lower[..., :1], math.inf)], dim=-1)  # width + 1
    neg = torch.minimum(magnitude_edges, (-state.min_val.double()).clamp(min=0).unsqueeze(-1))
    pos = torch.minimum(magnitude_edges, state.max_val.double().clamp(min=0).unsqueeze(-1))
    if from_both_extremes:  # one-signed data starts at the other extreme
        neg = torch.maximum(neg, (-state.max_val.double()).clamp(min=0).unsqueeze(-1))
        pos = torch.maximum(pos, state.min_val.double().clamp(min=0).unsqueeze(-1))
    # the folded small values: one bucket [-floor_neg, floor_pos]
    edges = torch.cat([-neg.flip(-1), pos], dim=-1)  # (*P, 2 * (width + 1))
    small = (below[..., 0] + below[..., 1]).unsqueeze(-1)
    signed_counts = torch.cat([kept[..., 0, :].flip(-1), small, kept[..., 1, :]], dim=-1)
    return edges, signed_counts.double()


# ---------------------------------------------------------------------------------------------
# Prefix moments under the piecewise-uniform model


class Moments(NamedTuple):
    edges: torch.Tensor  # (*P, B + 1)
    counts: torch.Tensor  # (*P, B)
    c0: torch.Tensor  # (*P, B + 1) prefix counts
    c1: torch.Tensor  # prefix sums
    c2: torch.Tensor  # prefix sums of squares


def moments(edges, counts) -> Moments:
    a, b = edges[..., :-1], edges[..., 1:]
    s1 = counts * (a + b) / 2
    s2 = counts * (a * a + a * b + b * b) / 3
    zero = torch.zeros_like(counts[..., :1])
    prefixes = (torch.cat([zero, terms.cumsum(-1)], -1) for terms in (counts, s1, s2))
    return Moments(edges, counts, *prefixes)


def cumulative(mom: Moments, t: torch.Tensor):
    """Count, sum and sum of squares of the values ``<= t`` (t: (*P, C)), piecewise uniform."""
    nb = mom.counts.shape[-1]
    i = torch.searchsorted(mom.edges[..., 1:-1].contiguous(), t.contiguous(), right=True).clamp(0, nb - 1)
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


# ---------------------------------------------------------------------------------------------
# The quantization grid of candidate ranges


def _smallest_scale(spec: QuantSpec, device) -> torch.Tensor:
    """The scale the spec's own arithmetic gives the narrowest range (+-float32's tiny), in float32,
    float64 0-dim: torch.ao's ``max(scale, eps)`` floor is ``spec.eps``, compressed-tensors floors only
    a zero scale. (A fixed float32 eps floor made every candidate below it one grid, and the first,
    tiny, won: data of std 1e-8 quantized to zero under ``eps=1e-12`` or a compressed-tensors spec.)"""
    if spec.compute_dtype != "float32":  # in float16 that range's scale is 0, which takes float16's eps
        spec = dataclasses.replace(spec, compute_dtype="float32")
    tiny = torch.full((), torch.finfo(torch.float32).tiny, device=device)
    calibrated = torch.ones((), dtype=torch.bool, device=device)
    return qparams_from_minmax(-tiny, tiny, spec, calibrated=calibrated).scale.double()


def _lean_grid(lo, hi, spec: QuantSpec, straddles_zero: bool, qrange):
    """torch.ao / compressed-tensors scale and zero point of candidate ranges in float64 (the
    chosen range goes through the spec's exact arithmetic afterwards)."""
    qmin, qmax = qrange
    if not straddles_zero:
        lo = torch.minimum(lo, torch.zeros_like(lo))
        hi = torch.maximum(hi, torch.zeros_like(hi))
    tiny = _smallest_scale(spec, lo.device)
    if spec.mapping == "asymmetric":
        scale = ((hi - lo) / float(qmax - qmin)).clamp(min=tiny)
        zero_point = (qmin - torch.floor(lo / scale + 0.5)).clamp(qmin, qmax)  # ties: search only
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


def _float_zero_point_grid(qp, spec: QuantSpec, qrange):
    """Step, zero point in codes and clipping points of float zero points, read from the convention's
    own values of the end codes: torchao keeps its zero point in the input's units
    (``(q - mid) * scale + zero_point``), compressed-tensors rounds it to an integer, torch.ao keeps
    it fractional in codes (reading it as codes fits torch.ao's alone)."""
    qmin, qmax = qrange
    ends = torch.tensor([qmin, qmax], dtype=torch.float32, device=qp.scale.device).expand(*qp.scale.shape, 2)
    values = spec.convention.dequantize(ends, qp.scale.unsqueeze(-1), qp.zero_point.unsqueeze(-1), spec)
    clip_lo, clip_hi = values.double().unbind(-1)
    scale = (clip_hi - clip_lo) / float(qmax - qmin)
    scale = torch.where(scale > 0, scale, qp.scale.double())  # ends rounded together (bf16/fp16 compute)
    return scale, qmin - clip_lo / scale, clip_lo, clip_hi


def grid(lo, hi, spec: QuantSpec, straddles_zero: bool = False, qrange=None):
    """Element step, zero point and clipping points of candidate ranges ``(lo, hi)`` with the
    spec's own arithmetic. ``straddles_zero``: the caller knows ``lo <= 0 <= hi``; ``qrange``:
    ``spec.qrange`` if the caller has it."""
    qrange = spec.qrange if qrange is None else qrange
    # an asymmetric zero point of domain "none" is the convention's to keep (compressed-tensors
    # does) or drop: the spec's own qparams say which
    keeps_domain = spec.zero_point_domain != "none" or spec.mapping != "asymmetric"
    lean = spec.scale_dtype == "float32" and spec.convention.ranges_map_like_torch_ao and keeps_domain
    if not spec.is_float and spec.zero_point_domain != "float" and lean:
        return _lean_grid(lo, hi, spec, straddles_zero, qrange)
    calibrated = torch.ones(lo.shape, dtype=torch.bool, device=lo.device)
    # the candidates of a parameter that saw nothing are not finite: the search's Range reports it
    # (compute_qparams' check named how many of the candidates, "12 of 48" for 1 of 4 channels)
    qp = qparams_from_minmax(lo.float(), hi.float(), spec, calibrated=calibrated, check_uncalibrated=False)
    qmin, qmax = qrange
    if spec.zero_point_domain == "float" and not spec.is_float:
        return _float_zero_point_grid(qp, spec, qrange)
    # the element step: a two-level (NVFP4) block scale under its global scale
    scale = effective_scale(qp.scale.double(), qp.global_scale.double(), spec)
    zero_point = qp.zero_point.double()  # the one fake quantization uses
    return scale, zero_point, (qmin - zero_point) * scale, (qmax - zero_point) * scale
