"""``"percentile"``: that percentile of ``|x|`` (symmetric mappings), or the lower and upper
percentiles of ``x`` (asymmetric), interpolated inside buckets (values spread evenly in each)."""

from __future__ import annotations

import torch

from ..._checks import is_real_number
from ..._qparams import Range
from ..._spec import QuantSpec
from ._geometry import Moments, config, cumulative, is_symmetric, moments, window, within_extremes

__all__ = ["percentile_search"]


def _snapped(target: torch.Tensor) -> torch.Tensor:
    """``q * total`` can land a rounding error past a whole count (``0.999 * 40000`` is
    ``39960.000000000004``) and skip to the next non-empty bucket: targets within a few ulps of a
    count are snapped onto it."""
    nearest = torch.round(target)
    return torch.where((target - nearest).abs() <= 8 * torch.finfo(target.dtype).eps * target, nearest, target)


def _quantile(mom: Moments, q: torch.Tensor) -> torch.Tensor:
    """Value at cumulative fraction ``q`` (broadcastable to ``(*P, k)``), uniform in buckets."""
    target = _snapped(q * mom.c0[..., -1:])
    nb = mom.counts.shape[-1]
    i = torch.searchsorted(mom.c0[..., 1:].contiguous(), target.contiguous(), right=False).clamp(0, nb - 1)
    before = torch.gather(mom.c0, -1, i)
    n = torch.gather(mom.counts, -1, i)
    a = torch.gather(mom.edges, -1, i)
    b = torch.gather(mom.edges, -1, i + 1)
    frac = torch.where(n > 0, ((target - before) / torch.where(n > 0, n, torch.ones_like(n))).clamp(0, 1), torch.zeros_like(n))
    return a + frac * (b - a)


def _abs_quantile(state, p: float) -> torch.Tensor:
    """The value below which a fraction ``p`` of the ``|x|`` lie: ``F(t) - F(-t)`` is linear between
    bucket-edge magnitudes, so it is inverted there, at the buckets' own resolution.
    """
    bins, low, high = config(state)
    # every resolved octave (24 below the largest |x| folded a 99.9th percentile 2**27 below an
    # outlier into one bucket at zero: 15 times too large)
    edges, counts = window(state, bins, low, high - low)
    mom = moments(edges, counts)
    absmax = torch.maximum(-state.min_val, state.max_val).double().clamp(min=0).unsqueeze(-1)
    points = torch.cat([torch.zeros_like(edges[..., :1]), torch.minimum(edges.abs(), absmax), absmax], -1)
    points = points.sort(-1).values  # (*P, K): the breakpoints of |x|'s distribution function
    total = mom.c0[..., -1:]
    cdf = (cumulative(mom, points)[0] - cumulative(mom, -points)[0]).clamp(min=0)
    cdf = torch.cummax(torch.cat([cdf[..., :-1], total], -1), -1).values  # all of it at absmax
    target = _snapped(p * total)
    i = torch.searchsorted(cdf.contiguous(), target.contiguous(), right=False).clamp(1, points.shape[-1] - 1)
    below, above = torch.gather(cdf, -1, i - 1), torch.gather(cdf, -1, i)
    start, end = torch.gather(points, -1, i - 1), torch.gather(points, -1, i)
    step = above - below
    frac = torch.where(step > 0, (target - below) / torch.where(step > 0, step, torch.ones_like(step)), torch.ones_like(step))
    return (start + frac.clamp(0, 1) * (end - start)).squeeze(-1)


def percentile_search(state, spec: QuantSpec, percentile: float = 99.99) -> Range:
    """The ``percentile`` (in ``(0, 100]``) of ``|x|`` for symmetric mappings; the ``100 -
    percentile`` and ``percentile`` percentiles of ``x`` for asymmetric ones (``percentile`` in
    ``(50, 100]``)."""
    # numpy scalars are real numbers; a bool is not a percentile (True was the 1st)
    if not (is_real_number(percentile) and 0 < percentile <= 100):
        raise ValueError(f"compute_qparams: percentile must be a number in (0, 100], got {percentile!r}")
    p = float(percentile) / 100
    if is_symmetric(spec):
        amax = _abs_quantile(state, p)
        return within_extremes(state, -amax, amax)
    if percentile <= 50:  # the upper percentile would fall below the lower one: an empty range, in silence
        raise ValueError(f"compute_qparams: an asymmetric mapping takes the {100 - percentile} and {percentile} "
                         f"percentiles of x: percentile must be in (50, 100], got {percentile!r}")
    bins, low, high = config(state)
    edges, counts = window(state, bins, low, high - low)  # every resolved octave, as above
    q = torch.tensor([1 - p, p], dtype=torch.float64, device=edges.device).expand(*counts.shape[:-1], 2)
    both = _quantile(moments(edges, counts), q.contiguous())
    return within_extremes(state, both[..., 0], both[..., 1], spec)
