"""``"entropy"``: the KL-divergence calibration of TensorRT / ModelOpt.

The buckets are re-binned into a linear histogram of ``|x|`` over ``[0, absmax]`` and `entropy_amax`
picks the amax whose quantized distribution is closest to it; asymmetric specs clip both ends at it.
"""

from __future__ import annotations

import math

import torch

from ..._qparams import Range
from ..._spec import QuantSpec
from ._geometry import check_int, config, cumulative, in_chunks, moments, window, within_extremes

__all__ = ["entropy_search", "entropy_amax"]


def _divergences(hist, cand, levels: int):
    """``KL(P || Q)`` of each candidate end bin ``cand`` ``(C,)`` for the histogram ``hist``
    ``(*P, nbins)`` (float64, first-bin rule applied), ``(*P, C)``; infinite where ``P`` is empty."""
    lead = hist.shape[:-1]
    total = hist.sum(-1, keepdim=True)
    zero = torch.zeros_like(hist[..., :1])
    plogp = torch.where(hist > 0, hist * torch.log(torch.where(hist > 0, hist, torch.ones_like(hist))), zero)
    # prefix sums of the counts, of the non-empty bins and of p log p
    c_count, c_nonzero, c_plogp = (torch.cat([zero, terms.cumsum(-1)], -1)
                                   for terms in (hist, (hist > 0).double(), plogp))
    # chunk boundaries: np.linspace(0, i, levels + 1) is k * (i / levels), the last point i;
    # np.digitize puts bin j in chunk c when space[c] <= j < space[c + 1]
    k = torch.arange(levels + 1, device=hist.device, dtype=torch.float64)
    space = k.unsqueeze(0) * (cand.double() / levels).unsqueeze(-1)
    starts = torch.cat([torch.ceil(space[:, :-1]).to(torch.int64), cand.unsqueeze(-1)], -1)
    index = starts.expand(*lead, *starts.shape)  # (*P, C, levels + 1)

    def at_starts(prefix):
        return torch.gather(prefix.unsqueeze(-2).expand(*lead, cand.shape[0], prefix.shape[-1]), -1, index)

    chunk_sum = at_starts(c_count).diff(dim=-1)  # (*P, C, levels)
    chunk_nonzero = at_starts(c_nonzero).diff(dim=-1)
    q_level = torch.where(chunk_nonzero > 0, chunk_sum / chunk_nonzero.clamp(min=1), torch.zeros_like(chunk_sum))
    # sum_j p_j log q_{d(j)} over the bins of hist[:i] = sum_k S_k log(q_k)
    log_q = torch.log(torch.where(q_level > 0, q_level, torch.ones_like(q_level)))
    s_log_q = torch.where(chunk_sum > 0, chunk_sum * log_q, torch.zeros_like(chunk_sum)).sum(-1)  # (*P, C)
    ci = cand.expand(*lead, cand.shape[0])
    last = torch.gather(hist, -1, ci - 1)  # p_{i-1}
    outliers = total - torch.gather(c_count, -1, ci)
    p_last = last + outliers
    p_log_p_last = torch.where(p_last > 0, p_last * torch.log(p_last.clamp(min=1e-300)), torch.zeros_like(p_last))
    sum_p_log_p = torch.gather(c_plogp, -1, ci - 1) + p_log_p_last
    # Q at the last bin: the level of its chunk, the last one starting at or before it (with more
    # levels than bins, i < levels, the chunks after it are empty: the last chunk's 0 made KL infinite)
    last_chunk = (starts[:, :-1] <= (cand - 1).unsqueeze(-1)).sum(-1, keepdim=True) - 1  # (C, 1)
    q_last = torch.gather(q_level, -1, last_chunk.expand(*lead, cand.shape[0], 1)).squeeze(-1)
    # the outliers in P's last bin meet Q's value there (0 if that bin is empty: infinite KL)
    out_term = torch.where(outliers > 0, outliers * torch.log(q_last.clamp(min=1e-300)), torch.zeros_like(outliers))
    out_term = torch.where((outliers > 0) & ((last <= 0) | (q_last <= 0)), torch.full_like(out_term, -math.inf), out_term)
    n_q = torch.gather(c_count, -1, ci)
    kl = (sum_p_log_p - (s_log_q + out_term)) / total - torch.log(total) + torch.log(n_q)
    # Q is P (up to its total), KL exactly 0 as ModelOpt's, not rounding noise of the closed form (-4e-16 beat
    # a later exact 0, which the last minimum picks: amax 1.6 where ModelOpt's was 8.0): no outliers and a
    # level per bin (i <= levels), or outliers whose bin i - 1 holds the only count below i
    alone = (outliers > 0) & (last > 0) & (torch.gather(c_nonzero, -1, ci - 1) == 0)
    kl = torch.where(((outliers == 0) & (ci <= levels)) | alone, torch.zeros_like(kl), kl)
    # a divergence is never negative: the noise of other near-zero ones is not a smaller minimum either
    return torch.where(n_q > 0, kl.clamp(min=0), torch.full_like(kl, math.inf))


def _check_entropy_args(hist, bin_edges, num_bits, start_bin: int, stride: int) -> None:
    """ValueError naming a bad argument of `entropy_amax` (they failed deep inside torch: an empty
    candidate range, a zero stride, a negative shift, edges that do not fit the bins)."""
    nbins = hist.shape[-1] if hist.dim() else 0
    if nbins < 2:
        raise ValueError(f"entropy_amax: hist must hold at least 2 bins (the first bin's count is the second's), "
                         f"got shape {tuple(hist.shape)}")
    expected = [(nbins + 1,), (*hist.shape[:-1], nbins + 1)]
    if tuple(bin_edges.shape) not in expected:
        raise ValueError(f"entropy_amax: bin_edges of shape {tuple(bin_edges.shape)} do not fit hist of shape "
                         f"{tuple(hist.shape)}: expected {' or '.join(map(str, dict.fromkeys(expected)))}")
    num_bits = check_int("num_bits", num_bits, 1, 64, "entropy_amax")
    start_bin = check_int("start_bin", start_bin, 1, nbins, "entropy_amax")
    stride = check_int("stride", stride, 1, 1 << 30, "entropy_amax")


def entropy_amax(hist: torch.Tensor, bin_edges: torch.Tensor, num_bits: int = 8, unsigned: bool = False,
                 start_bin: int = 128, stride: int = 1) -> torch.Tensor:
    """The KL-divergence calibration of TensorRT / ModelOpt on a linear histogram of ``|x|``.

    For each candidate ``i`` (``start_bin..len(hist)`` by ``stride``), ``P`` is ``hist[:i]`` with the
    outliers added to its last bin and ``Q`` is ``P`` quantized to ``2**(num_bits - 1 + unsigned)``
    levels; the amax is ``bin_edges[i]`` of the last minimum of ``KL(P || Q)``. As ModelOpt, the first
    bin's count is replaced by the second's (ReLU zeros would dominate). Vectorised over candidates.

    Args:
      hist: counts, shape ``(*P, nbins)``.
      bin_edges: edges, shape ``(*P, nbins + 1)`` (or ``(nbins + 1,)``); tensors or numpy arrays
        (ModelOpt's ``np.histogram`` ones, ``torch_hist=False``).

    Raises ValueError naming a bad argument (``start_bin`` in ``[1, nbins]``, at least 2 bins).
    """
    hist, bin_edges = torch.as_tensor(hist), torch.as_tensor(bin_edges)
    _check_entropy_args(hist, bin_edges, num_bits, start_bin, stride)
    hist = hist.double()
    hist = torch.cat([hist[..., 1:2], hist[..., 1:]], -1)
    # more levels than bins leave every bin a level of its own (Q is P without the outliers), whatever
    # their number: capped there, so that int16/int32 grids cost what 2048 levels do (2**31 hung)
    levels = min(1 << (num_bits - 1 + int(unsigned)), hist.shape[-1])
    cand = torch.arange(start_bin, hist.shape[-1] + 1, stride, device=hist.device)  # (C,)
    per_candidate = (levels + 1) * hist[..., :1].numel()
    kl = in_chunks(lambda cand: _divergences(hist, cand, levels), (cand,), per_candidate)
    best = kl.shape[-1] - 1 - torch.argmin(kl.flip(-1), -1)  # the last minimum
    # index_select rather than indexing with a 0-dim tensor: traceable without a host read
    chosen = cand.index_select(0, best.reshape(-1)).reshape(best.shape)
    if bin_edges.dim() == 1:
        return bin_edges.index_select(0, chosen.reshape(-1)).reshape(chosen.shape)
    return torch.gather(bin_edges, -1, chosen.unsqueeze(-1)).squeeze(-1)


def _abs_linear_histogram(state, num_linear: int):
    """A linear histogram of ``|x|`` over ``[0, absmax]`` (``num_linear`` bins), re-binned from
    the state's buckets under the piecewise-uniform model: ``(counts, edges)``."""
    bins, low, _ = config(state)
    edges, counts = window(state, bins, low, 24, from_both_extremes=True)
    mom = moments(edges, counts)
    absmax = torch.maximum(-state.min_val, state.max_val).double().clamp(min=0).unsqueeze(-1)
    steps = torch.arange(num_linear + 1, dtype=torch.float64, device=edges.device) / num_linear
    linear_edges = absmax * steps  # (*P, L + 1)
    positive, _, _ = cumulative(mom, linear_edges)
    negative, _, _ = cumulative(mom, -linear_edges)
    # mass of |x| <= t = F(t) - F(-t) (+ the atom at -t, negligible under the uniform model)
    cdf = positive - negative
    cdf = torch.cat([torch.zeros_like(cdf[..., :1]), cdf[..., 1:-1], mom.c0[..., -1:]], -1)
    return cdf.diff(dim=-1).clamp(min=0), linear_edges


def entropy_search(state, spec: QuantSpec, num_bits=None, start_bin: int = 128, stride: int = 1,
                   num_linear: int = 2048) -> Range:
    """TensorRT / ModelOpt's KL calibration on a ``num_linear``-bin histogram of ``|x|``, with
    ``num_bits`` (default: the spec's) and ModelOpt's ``start_bin`` and ``stride``."""
    num_linear = check_int("num_linear", num_linear, 2, 1 << 16)
    if num_bits is not None:
        num_bits = check_int("num_bits", num_bits, 1, 32)  # every spec's width (levels past the bins cost nothing)
    start_bin = check_int("start_bin", start_bin, 1, num_linear)
    stride = check_int("stride", stride, 1, num_linear)
    hist, linear_edges = _abs_linear_histogram(state, num_linear)
    unsigned = (not spec.is_signed) and spec.mapping == "asymmetric"
    amax = entropy_amax(hist, linear_edges, spec.bits if num_bits is None else num_bits, unsigned,
                        start_bin, stride)
    if spec.mapping == "asymmetric":
        return within_extremes(state, torch.maximum(state.min_val.double(), -amax),
                               torch.minimum(state.max_val.double(), amax), spec)
    return within_extremes(state, -amax, amax)
