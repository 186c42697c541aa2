"""``"l2"``: torch.ao ``HistogramObserver``'s objective, the L2 norm of the quantization error.

It is minimised over every candidate clipping point on the bucket edges below each sign's extreme
(`sign_windows`), instead of torch.ao's greedy walk: an analytic model ranks them (the clipping
error plus ``scale**2 / 12`` per value inside, ``x**2`` for values rounding to zero; asymmetric
mappings search the 2-D grid coarse to fine), then the finalists are ranked by the exact error
integral of the spec's grid (`sawtooth_error`). Floating-point targets take the ``"mse"`` search.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ..._qparams import Range
from ..._spec import QuantSpec
from ..._torch_features import bitcast
from ._geometry import (bucket_edges, config, flat_counts, grid, in_chunks, inside_extremes, is_symmetric, may_exclude_zero,
                        search_octaves, within_extremes)
from .mse import mse_search

__all__ = ["l2_search", "sign_windows", "sawtooth_error"]


class Windows(NamedTuple):
    edges: torch.Tensor  # (*P, 2, W + 1) magnitude edges, clamped to the sign's extreme
    counts: torch.Tensor  # (*P, 2, W) float64
    cand: torch.Tensor  # (*P, 2, W + 1) candidate clipping magnitudes at the edges; (*P, 1, W + 1) when symmetric
    tails: torch.Tensor  # (*P, 3, 2, W + 1) count, twice the sum, sum of squares of the window's values above each edge
    below: torch.Tensor  # (*P, 3, 2, W + 1) the same of the window's values below each edge
    total: torch.Tensor  # (*P,) float64 count of every value counted
    offset: torch.Tensor  # (*P, 2) or (*P, 1): float32 bit code (``>> 23 - m``) of each window's first bucket


def sign_windows(state, spec: QuantSpec, octaves: int) -> Windows:
    """Per sign (0: negative, as magnitudes), the ``W = octaves * bins`` magnitude buckets up to the anchor
    extreme (the sign's own, or the larger one for symmetric mappings), found from its float32 bits;
    candidates are the window's edges. Fixed shapes, a few gathers.
    """
    bins, low, high = config(state)
    m = bins.bit_length() - 1
    width = octaves * bins
    device = state.counts.device
    extent = torch.stack([-state.min_val, state.max_val], -1).clamp(min=0)  # float32 (*P, 2)
    anchor = extent.amax(-1, keepdim=True) if is_symmetric(spec) else extent
    # flat bucket id of the anchor (0: underflow, K - 1: overflow); a value that rounds up to a
    # bucket edge lands in the bucket above
    top = ((bitcast(anchor, torch.int32) >> (23 - m)) - (((low + 127) << m) - 1)).clamp(0, (high - low) * bins + 1)
    index = top.unsqueeze(-1) + torch.arange(1, width + 2, device=device)  # padded edge index (*P, 2 or 1, W + 1)
    lead = state.counts.shape[:-2]  # (*P, 2)
    flat = torch.nn.functional.pad(flat_counts(state), (width, 0))  # `width` empty buckets in front
    counts = torch.gather(flat, -1, index[..., :-1].expand(*lead, width)).double()
    table = torch.nn.functional.pad(bucket_edges(state, device), (width, 0))  # their lower edges
    lower = torch.gather(table.expand(*index.shape[:-1], table.shape[0]), -1, index)
    edges = torch.minimum(lower, extent.double().unsqueeze(-1))
    cand = torch.minimum(lower, anchor.double().unsqueeze(-1)) if is_symmetric(spec) else edges
    a, b = edges[..., :-1], edges[..., 1:]
    ab = a + b
    # count, twice the sum and the sum of squares of values spread uniformly over each bucket
    # (b * b + a * (a + b): exact products of short mantissas, like a * a + a * b + b * b)
    sums = torch.stack([counts, counts * ab, counts * torch.addcmul(b * b, a, ab) * (1.0 / 3)], -3)
    prefix = torch.cumsum(sums, -1)
    below = torch.nn.functional.pad(prefix, (1, 0))
    tails = prefix[..., -1:] - below
    offset = top + (((low + 127) << m) - width)
    return Windows(edges, counts, cand, tails, below, flat.sum((-2, -1)).double(), offset)


def sawtooth_error(edges, density, lo, hi, spec: QuantSpec, straddles_zero: bool = False, qrange=None, points=None):
    """Expected squared error of candidates ``(lo, hi)`` ``(*P, C)`` with the spec's own grid, exact
    under the piecewise-uniform model (the error's antiderivative at every edge, weighted by bucket
    densities). ``straddles_zero``: ``lo <= 0 <= hi`` is known. ``points``: optional
    ``(positions, masses)`` of point masses, each adding ``mass * squared error`` at its position.
    """
    scale, zero_point, clip_lo, clip_hi = grid(lo, hi, spec, straddles_zero, qrange)
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


class _Model(NamedTuple):
    """The analytic model's terms at every candidate edge (per sign, ``(*P, 2, W + 1)``)."""

    clip: torch.Tensor  # squared distance of the window's values beyond the edge to it
    rest: torch.Tensor  # count of the window's values below the edge, times half_scale**2 / 3
    half_scale: float  # half a grid step per unit of the candidate's span
    shift: int  # 23 - mantissa bits: the float32 bit code of a bucket is ``bits >> shift``


def _model(win: Windows, spec: QuantSpec, bins: int) -> _Model:
    qmin, qmax = spec.qrange
    if spec.mapping == "symmetric_no_clipping_err":
        half_scale = 0.5 / (2 * min(-qmin, qmax))  # scale = amax / qmax (on 2 * amax = the span)
    else:
        half_scale = 0.5 / float(qmax - qmin)
    s0, s1_twice, s2 = win.tails.unbind(-3)
    # squared distance of the values beyond each candidate to it: s2 - 2 c s1 + c**2 s0
    clip = torch.addcmul(s2, win.cand, torch.addcmul(s1_twice, win.cand, s0, value=-1), value=-1).clamp(min=0)
    rest = win.below[..., 0, :, :] * (half_scale * half_scale / 3)
    return _Model(clip, rest, half_scale, 23 - (bins.bit_length() - 1))


def _dead_zone(error, span, limit, win: Windows, model: _Model):
    """``error`` of candidates with ``x**2`` instead of ``scale**2 / 12`` for the values that round to
    zero (``|x| < scale / 2``), located from the float32 bits of ``scale / 2``, per sign.
    """
    half = span * model.half_scale
    code = (bitcast(half.float(), torch.int32) >> model.shift).unsqueeze(-2)
    edge = torch.minimum((code - win.offset.unsqueeze(-1)).clamp(min=0), limit)  # (*P, 2, n)
    lead = error.shape[:-1]
    gathered = torch.gather(win.below, -1, edge.unsqueeze(-3).expand(*lead, 3, *edge.shape[-2:]))
    gathered = gathered[..., 0, :] + gathered[..., 1, :]  # (*P, 3, n): summed over the signs
    return error + torch.addcmul(gathered[..., 2, :], gathered[..., 0, :], half * half, value=-1 / 3)


def _symmetric_finalists(win: Windows, model: _Model, spec: QuantSpec, bins: int):
    """Every edge as the amax, ranked by the model; the finalists are the best's neighbours
    (+-3/16 octave for grids of 4 bits or less, where the model is rough: most values sit within
    a few steps of zero; +-1/16 octave otherwise) and the full range. ``(lo, hi)`` ``(*P, n)``."""
    width = win.edges.shape[-1] - 1
    lead = win.edges.shape[:-2]
    device = win.edges.device
    qmin, qmax = spec.qrange
    # the grid clips at (zero_point - qmin) * scale below and (qmax - zero_point) * scale above:
    # per sign, the edge nearest that multiple of the candidate amax
    zero_point = 0 if spec.zero_point_domain == "none" else spec.zero_point_of_symmetric
    per_amax = 4 * model.half_scale  # scale / amax
    shifts = [round(bins * math.log2(multiple)) if multiple > 0 else -width
              for multiple in ((zero_point - qmin) * per_amax, (qmax - zero_point) * per_amax)]
    edge = torch.arange(width + 1, device=device)
    clip_index = torch.stack([(edge + s).clamp(0, width) for s in shifts])  # (2, W + 1)
    at = torch.gather(torch.stack([model.clip, model.rest], -3), -1, clip_index.expand(*lead, 2, 2, width + 1)).sum(-2)
    amaxes = win.cand[..., 0, :]  # (*P, W + 1)
    span = amaxes + amaxes
    error = at[..., 0, :] + at[..., 1, :] * (span * span)
    error = _dead_zone(error, span, clip_index, win, model)
    best = torch.argmin(error, -1, keepdim=True)
    # 8 bits and more: +-1/16 octave (+-2 buckets missed the best by 3 buckets on 1000 Gaussian values)
    reach, stride = (3 * (bins // 16 or 1), bins // 64 or 1) if spec.bits <= 4 else (8 * (bins // 128 or 1), bins // 128 or 1)
    near = torch.cat([torch.arange(-reach, reach + 1, stride, device=device),
                      torch.full((1,), 2 * width + 1, device=device)])
    amax = torch.gather(amaxes, -1, (best + near).clamp(0, width))
    return -amax, amax


def _refinements(bins: int, width: int, reach: int) -> list:
    """The rounds of the asymmetric search, ``(start, stop, step)`` of the edges tried per sign:
    every ``bins / 4``-th edge of the top octaves, then finer around the best (32 -> 2 with 128
    buckets per octave; the finalists cover +-2)."""
    step = max(1, bins // 4)
    rounds = [(width, width - reach - 1, -step)]
    while step > 2:
        rounds.append((-step, step + 1, max(1, step // 16)))
        step = max(1, step // 16)
    return rounds


def _asymmetric_finalists(win: Windows, model: _Model, spec: QuantSpec, bins: int, octaves: int):
    """(negative end, positive end) pairs ranked by the model, coarse to fine; the finalists are a
    neighbourhood of the best, the full range, and each side of the best with the other full.
    """
    width = win.edges.shape[-1] - 1
    lead = win.edges.shape[:-2]
    device = win.edges.device
    packed = torch.stack([model.clip, model.rest, win.cand], -3)  # (*P, 3, 2, W + 1)
    best = None
    for start, stop, step in _refinements(bins, width, (octaves - 4) * bins):
        offsets = torch.arange(start, stop, step, device=device)
        # pair p = i * k + j of the k offsets: the negative side's i-th, the positive side's j-th, (2, k * k)
        pair_offsets = torch.stack([offsets.repeat_interleave(offsets.shape[0]), offsets.repeat(offsets.shape[0])])
        limit = pair_offsets if best is None else (best.unsqueeze(-1) + pair_offsets).clamp(0, width)
        limit = limit.expand(*lead, 2, pair_offsets.shape[-1])
        sel = torch.gather(packed, -1, limit.unsqueeze(-3).expand(*lead, 3, *limit.shape[-2:]))
        # clipping errors, rest counts and spans of the pairs, (*P, k * k) each
        clipped, rest_count, span = (sel[..., 0, :] + sel[..., 1, :]).unbind(-2)
        error = clipped + rest_count * (span * span)
        if best is not None:
            error = _dead_zone(error, span, limit, win, model)
        flat_best = torch.argmin(error, -1, keepdim=True)  # (*P, 1)
        best = torch.take_along_dim(limit, flat_best.unsqueeze(-2), -1).squeeze(-1)  # (*P, 2)
    n, stride = (5, bins // 32 or 1) if spec.bits <= 4 else (3, bins // 64 or 1)
    near = torch.cat([torch.arange(-(n // 2), n // 2 + 1, device=device) * stride,
                      torch.full((1,), 2 * width + 1, device=device)])
    # (neg, pos) positions in the n + 1 values per sign (the last: the full range)
    which = torch.tensor([[i for i in range(n) for _ in range(n)] + [n, n // 2, n],
                          [j for _ in range(n) for j in range(n)] + [n, n, n // 2]], device=device)
    values = torch.gather(win.cand, -1, (best.unsqueeze(-1) + near).clamp(0, width))  # (*P, 2, n + 1)
    pairs = torch.gather(values, -1, which.expand(*lead, *which.shape))  # (*P, 2, n * n + 3)
    return -pairs[..., 0, :], pairs[..., 1, :]


def _exact_ranking(win: Windows, lo, hi, spec: QuantSpec, bins: int):
    """The finalist ``(lo, hi)`` ``(*P, n)`` of least exact squared error (`sawtooth_error`) over
    every bucket of the top three octaves of each sign (clipping points of light tails; 1/8-octave
    buckets there span only a few 8-bit grid steps and misranked finalists by 5%) and
    buckets of 1/8 octave below, signed and ascending; in chunks of candidates (memory)."""
    width = win.edges.shape[-1] - 1
    device = win.edges.device
    factor = max(1, bins // 8)
    split = max(0, width - 3 * bins)
    kept = torch.cat([torch.arange(0, split, factor, device=device), torch.arange(split, width + 1, device=device)])
    order = torch.cat([kept.flip(0), kept + (width + 1)])
    positive = torch.cat([torch.zeros_like(kept, dtype=torch.bool), torch.ones_like(kept, dtype=torch.bool)])
    signed_edges = win.edges.flatten(-2).index_select(-1, order) * torch.where(positive, 1.0, -1.0).double()
    # values below each signed edge (integers): the negative ones beyond it, all but the positive ones beyond it
    beyond = win.tails[..., 0, :, :].flatten(-2).index_select(-1, order)
    counts = torch.where(positive, win.total.unsqueeze(-1) - beyond, beyond).diff(dim=-1)
    widths = signed_edges.diff(dim=-1)
    # a bucket of zero width (an extreme exactly on a bucket edge, e.g. clipped data) holds its
    # values at one point: a point mass there instead of a density (count / 0 would swamp the
    # summation by parts); such buckets hold values only at the two ends (or at 0, exact on every
    # grid), so the masses are gathered onto the first and the last edge
    flat = widths <= 0
    ends = signed_edges[..., [0, -1]]
    point = torch.where(flat, counts, 0.0)
    masses = torch.stack([(point * (signed_edges[..., :-1] == ends[..., :1])).sum(-1),
                          (point * (signed_edges[..., 1:] == ends[..., 1:])).sum(-1)], -1)
    density = torch.where(flat, 0.0, counts / widths.clamp(min=1e-300))
    error = in_chunks(lambda lo, hi: sawtooth_error(signed_edges, density, lo, hi, spec, straddles_zero=True,
                                                    points=(ends, masses)), (lo, hi), density.numel())
    pick = torch.argmin(error, -1, keepdim=True)
    return torch.gather(lo, -1, pick).squeeze(-1), torch.gather(hi, -1, pick).squeeze(-1)


def l2_search(state, spec: QuantSpec) -> Range:
    """torch.ao HistogramObserver's objective: the range of least L2 quantization error, searched
    over the bucket edges below the extremes (no options)."""
    if spec.is_float:  # floating-point grids: the exact integral over shrink factors
        return mse_search(state, spec)
    bins, _, _ = config(state)
    octaves = search_octaves(spec)
    win = sign_windows(state, spec, octaves)
    model = _model(win, spec, bins)
    if is_symmetric(spec):
        lo, hi = _symmetric_finalists(win, model, spec, bins)
        # ranked as returned: clamped to the extremes (for symmetric_no_clipping_err the scale
        # follows the side that binds, so (-amax, amax) would rank another grid than the result's)
        lo = torch.maximum(lo, state.min_val.double().clamp(max=0).unsqueeze(-1))
        hi = torch.minimum(hi, state.max_val.double().clamp(min=0).unsqueeze(-1))
        return within_extremes(state, *_exact_ranking(win, lo, hi, spec, bins))
    # ranges that need not hold zero: one-signed data's finalists start at its own end
    lo, hi = inside_extremes(state, *_asymmetric_finalists(win, model, spec, bins, octaves), spec)
    lo, hi = _exact_ranking(win, lo, hi, spec, bins)
    if may_exclude_zero(spec):
        return within_extremes(state, lo, hi, spec)
    # edges clamped to each sign's extreme: inside [min(min_val, 0), 0] and [0, max(max_val, 0)]
    # already (zeros when nothing was counted)
    return Range(lo.float(), hi.float(), state.min_val <= state.max_val)
