"""``"mse"``: the range of least expected squared error among shrink factors of the observed range.

Candidates are ``2**(-k / per_octave)`` times the observed range, each scored by the exact integral
of the squared error of the spec's grid over the buckets (values spread evenly inside each):
``O(buckets x candidates)``. Floating-point targets use their own grid at bucket centres. Also the
``"l2"`` search of floating-point specs.
"""

from __future__ import annotations

import math

import torch

from ..._qparams import Range
from ..._quant import _codes_float
from ..._spec import QuantSpec
from ._geometry import (check_int, config, cumulative, grid, in_chunks, inside_extremes, is_symmetric, moments,
                        search_octaves, window, within_extremes)

__all__ = ["mse_search", "exact_error", "float_grid_error"]


def _sawtooth_integral(u, scale):
    """Integral of ``(x - scale * round(x / scale))**2`` from ``-scale / 2`` to ``u``."""
    k = torch.floor(u / scale + 0.5)
    v = u - k * scale
    cube = scale * scale * scale
    return k * cube / 12 + (v * v * v + cube / 8) / 3


def _cube(x):
    return x * x * x / 3


def exact_error(edges, counts, lo, hi, spec: QuantSpec) -> torch.Tensor:
    """Expected squared error of candidates ``(lo, hi)`` ``(*P, C)`` on an integer grid, exact
    under the piecewise-uniform model of the buckets ``edges`` ``(*P, B + 1)``, ``counts``
    ``(*P, B)``: inside the clipping points a sawtooth, outside them a cube. ``(*P, C)``."""
    scale, zero_point, clip_lo, clip_hi = grid(lo, hi, spec)
    a = edges[..., :-1].unsqueeze(-2)  # (*P, 1, B)
    b = edges[..., 1:].unsqueeze(-2)
    s = scale.unsqueeze(-1)
    offset = (zero_point * scale).unsqueeze(-1)  # grid points at k * s - offset
    cl, ch = clip_lo.unsqueeze(-1), clip_hi.unsqueeze(-1)
    width = b - a
    safe = torch.where(width > 0, width, torch.ones_like(width))
    ia, ib = torch.clamp(a, cl, ch), torch.clamp(b, cl, ch)
    inside = _sawtooth_integral(ib + offset, s) - _sawtooth_integral(ia + offset, s)
    la, lb = torch.minimum(a, cl), torch.minimum(b, cl)
    below = _cube(cl - la) - _cube(cl - lb)
    ua, ub = torch.maximum(a, ch), torch.maximum(b, ch)
    above = _cube(ub - ch) - _cube(ua - ch)
    per_value = (inside.clamp(min=0) + below + above) / safe
    qmin, qmax = spec.qrange
    q = torch.clamp(torch.floor((a + offset) / s + 0.5), qmin, qmax) * s - offset  # zero width: a point mass
    per_value = torch.where(width > 0, per_value, (a - q) ** 2)
    return (counts.unsqueeze(-2) * per_value).sum(-1)


def _clipping_error(mom, clip_lo, clip_hi) -> torch.Tensor:
    """Squared distance of the values beyond the clipping points ``(clip_lo, clip_hi)`` ``(*P, C)`` to
    them, exact under the piecewise-uniform model of the buckets' ``moments``: ``(*P, C)``."""
    below = cumulative(mom, clip_lo)  # count, sum and sum of squares of the values <= clip_lo
    at_hi = cumulative(mom, clip_hi)
    above = [total[..., -1:] - part for total, part in zip((mom.c0, mom.c1, mom.c2), at_hi)]
    error = 0
    for (count, first, second), clip in ((below, clip_lo), (above, clip_hi)):
        # sum (x - c)**2 = sum x**2 - 2 c sum x + c**2 count
        error = error + torch.addcmul(second, clip, torch.addcmul(first * -2, clip, count)).clamp(min=0)
    return error


def float_grid_error(edges, counts, lo, hi, spec: QuantSpec, points: int = 1, mom=None) -> torch.Tensor:
    """Squared error of floating-point targets (fp8, fp4), ``(*P, C)``: the rounding error at ``points``
    evenly spaced points of each bucket (its centre for 1) between the candidate's clipping points,
    each holding ``1 / points`` of its count, and the clipping error beyond them exactly
    (`_clipping_error`: at the points alone, a wide bucket's mass sat at its centre and clipping above
    it was free, so data past the histogram's resolved octaves clipped fp8 ranges to 2.4 times the full
    range's squared error); with the candidate's zero point (compressed-tensors' asymmetric fp8: the
    error of a grid without it ranked every shrunk candidate of skewed data below the full range).
    ``mom``: the buckets' `moments`, computed once by a caller scoring candidates in chunks."""
    scale, zero_point, clip_lo, clip_hi = grid(lo, hi, spec)
    a, b = edges[..., :-1], edges[..., 1:]
    offsets = (torch.arange(points, dtype=edges.dtype, device=edges.device) + 0.5) / points
    at = (a.unsqueeze(-1) + (b - a).unsqueeze(-1) * offsets).flatten(-2).unsqueeze(-2)  # (*P, 1, B * points)
    s = scale.unsqueeze(-1).float()
    zp = zero_point.unsqueeze(-1).float()
    # ``s`` is the element step (`grid`): a two-level spec's global scale is already in it
    _, codes = _codes_float(at.float(), s, zp, spec, global_scale=torch.ones_like(s))
    inside = (at >= clip_lo.unsqueeze(-1)) & (at <= clip_hi.unsqueeze(-1))
    error = torch.where(inside, ((codes - zp) * s - at.float()).double() ** 2, 0.0)
    rounding = (counts.repeat_interleave(points, -1).unsqueeze(-2) * error).sum(-1) / points
    return rounding + _clipping_error(moments(edges, counts) if mom is None else mom, clip_lo, clip_hi)


def _scored(edges, counts, lo, hi, spec: QuantSpec, points: int) -> torch.Tensor:
    """Expected squared error of the candidates ``(lo, hi)`` ``(*P, C)`` (`float_grid_error` at
    ``points`` per bucket or `exact_error`), infinite for an empty range; in chunks of candidates."""
    mom = moments(edges, counts) if spec.is_float else None  # once, not per chunk of candidates

    def error_fn(lo, hi):
        if spec.is_float:
            return float_grid_error(edges, counts, lo, hi, spec, points, mom)
        return exact_error(edges, counts, lo, hi, spec)

    error = in_chunks(error_fn, (lo, hi), counts[..., :1].numel() * counts.shape[-1] * points)
    return torch.where(hi - lo > 0, error, torch.full_like(error, math.inf))


def mse_search(state, spec: QuantSpec, candidates: int = 128, per_octave: int = 32) -> Range:
    """The shrink factor ``2**(-k / per_octave)``, ``k < candidates``, of the observed range with
    the least expected squared error on ``spec``'s grid."""
    candidates = check_int("candidates", candidates, 1, 1 << 16)
    per_octave = check_int("per_octave", per_octave, 1, 1 << 16)
    bins, low, _ = config(state)
    edges, counts = window(state, bins, low, search_octaves(spec))
    steps = torch.arange(candidates, dtype=torch.float64, device=edges.device)
    factors = torch.pow(2.0, -steps / per_octave)
    lo = state.min_val.double().clamp(max=0).unsqueeze(-1) * factors
    hi = state.max_val.double().clamp(min=0).unsqueeze(-1) * factors
    if is_symmetric(spec) and spec.mapping != "symmetric_no_clipping_err":  # that one scales by the binding side
        absmax = torch.maximum(-lo, hi)
        lo, hi = -absmax, absmax
    lo, hi = inside_extremes(state, lo, hi, spec)  # ranges that need not hold zero: from one-signed data's own end
    error = _scored(edges, counts, lo, hi, spec, 1)
    # floating-point grids: the best 8 and the full range scored again at 64 points per octave of
    # the buckets (the centres of 8 buckets per octave, as wide as fp8 e4m3's steps, alias its grid:
    # the search chose ranges up to 1.5 dB worse than the full range)
    points = max(1, 64 // bins) if spec.is_float else 1
    if points > 1:
        finalists = torch.cat([torch.topk(error, min(8, candidates), -1, largest=False).indices,
                               torch.zeros_like(error[..., :1], dtype=torch.int64)], -1)
        lo, hi = torch.gather(lo, -1, finalists), torch.gather(hi, -1, finalists)
        error = _scored(edges, counts, lo, hi, spec, points)
    best = torch.argmin(error, -1, keepdim=True)
    return within_extremes(state, torch.gather(lo, -1, best).squeeze(-1), torch.gather(hi, -1, best).squeeze(-1),
                           spec)
