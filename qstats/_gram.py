"""``add_masked_gram(total, rows, keep)``: ``total`` plus the sum of ``r^T r`` over the rows ``keep`` marks.

The reference is ``total + where(keep, rows, 0).T @ rows``. Written on one ``torch.library`` op over
groups of masks that share their rows, ``qstats::add_masked_grams(total [G, K, F, F], rows [G, R, F],
keep [G, K, R])``: ``total[g, k]`` plus the gram of the rows of ``rows[g]`` that ``keep[g, k]`` keeps.
Its vmap rule folds the vmapped dimension into the groups (when the rows are batched) or into the
masks of each group (when they are shared) and calls the op again, so any number of nested vmaps
(layers x experts) reach the plain implementation as one call. There, under `qstats.stacked_observer`
of `qstats.hessian` with the rows shared by every expert and one mask each, each expert multiplies
only its own rows (a top-k router's E experts cost what k dense products cost, not E), and experts
that keep the same rows (every expert calibrated on every token, llm-compressor's default for MoE)
share one product. Every path computes the product, then adds it to ``total``, in a new tensor.
"""

from __future__ import annotations

import torch

from ._ops import op, register_fake, register_vmap

__all__ = ["add_masked_gram"]


def _add_group(out: torch.Tensor, total: torch.Tensor, rows: torch.Tensor, keep: torch.Tensor) -> None:
    """Writes ``total[k] + gram of the rows [R, F] that keep[k] keeps`` into ``out[k]`` for every mask
    ``k`` of ``keep`` ``[K, R]``: one product when every mask keeps the same rows, else the kept rows
    gathered once in mask order and one product per mask."""
    if bool((keep == keep[:1]).all()):
        kept = rows[keep[0]]
        torch.add(total, kept.T @ kept, out=out)
        return
    masks, rows_index = keep.nonzero(as_tuple=True)
    gathered = rows.index_select(0, rows_index)
    counts = torch.bincount(masks, minlength=keep.shape[0]).tolist()
    for mask, part in enumerate(torch.split(gathered, counts)):
        torch.mm(part.T, part, out=out[mask])
    out.add_(total)  # the products' own buffer: the same sum as total + grams


@op("add_masked_grams")
def _add_masked_grams(total: torch.Tensor, rows: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(total)
    for group in range(keep.shape[0]):
        _add_group(out[group], total[group], rows[group], keep[group])
    return out


@register_fake(_add_masked_grams)
def _(total, rows, keep):
    return torch.empty_like(total)


def _batched(tensor: torch.Tensor, dim, size: int) -> torch.Tensor:
    """``tensor`` with its vmapped dimension first (``size`` copies of it when it is not vmapped)."""
    return tensor.movedim(dim, 0) if dim is not None else tensor.expand(size, *tensor.shape)


def _add_masked_grams_vmap(info, in_dims, total, rows, keep):
    total_dim, rows_dim, keep_dim = in_dims
    size = info.batch_size
    total, keep = _batched(total, total_dim, size), _batched(keep, keep_dim, size)
    groups, masks = keep.shape[1], keep.shape[2]
    if rows_dim is None:  # rows shared along the vmapped dimension: its slices are more masks of each group
        total = total.movedim(0, 1).reshape(groups, size * masks, *total.shape[3:])
        keep = keep.movedim(0, 1).reshape(groups, size * masks, keep.shape[3])
        out = _add_masked_grams(total, rows, keep)
        return out.reshape(groups, size, masks, *out.shape[2:]), 1
    rows = rows.movedim(rows_dim, 0)  # each slice its own rows: its slices are more groups
    out = _add_masked_grams(total.reshape(size * groups, *total.shape[2:]), rows.reshape(size * groups, *rows.shape[2:]),
                            keep.reshape(size * groups, *keep.shape[2:]))
    return out.reshape(size, groups, *out.shape[1:]), 0


register_vmap(_add_masked_grams, _add_masked_grams_vmap)


def add_masked_gram(total: torch.Tensor, rows: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``total + sum over i with keep[i] of outer(rows[i], rows[i])``: ``total`` ``[F, F]``, ``rows``
    ``[R, F]`` in ``total``'s dtype, a bool ``keep`` ``[R]``. A new tensor; the inputs are unchanged."""
    return _add_masked_grams(total[None, None], rows[None], keep[None, None])[0, 0]
