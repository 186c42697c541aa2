"""``add_masked_gram(total, rows, keep)``: ``total`` plus the sum of ``r^T r`` over the rows ``keep`` marks.

The reference is ``total + where(keep, rows, 0).T @ rows``. Written as one ``torch.library`` op so
that, under ``torch.vmap`` over experts with the rows shared by every expert and one routing mask
each (`qstats.stacked_observer` of `qstats.hessian`), each expert multiplies only its own rows (the
products of a top-k router's E experts cost what k dense products cost, not E), added to its sum
in the same product (``addmm``), in a new tensor.
"""

from __future__ import annotations

import torch

__all__ = ["add_masked_gram"]


@torch.library.custom_op("qstats::add_masked_gram", mutates_args=())
def _add_masked_gram(total: torch.Tensor, rows: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    kept = rows[keep]
    return torch.addmm(total, kept.T, kept)


@_add_masked_gram.register_fake
def _(total, rows, keep):
    return torch.empty_like(total)


def _add_grams_of_shared_rows(total: torch.Tensor, rows: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``total[e] + gram of the rows [R, F] that keep[e] keeps`` for every expert ``e`` of ``keep``
    ``[E, R]``: the kept rows gathered once in expert order, one ``addmm`` per expert into the result."""
    experts, rows_index = keep.nonzero(as_tuple=True)
    gathered = rows.index_select(0, rows_index)
    counts = torch.bincount(experts, minlength=keep.shape[0]).tolist()
    out = torch.empty_like(total)
    for expert, part in enumerate(torch.split(gathered, counts)):
        torch.addmm(total[expert], part.T, part, out=out[expert])
    return out


def _add_masked_gram_vmap(info, in_dims, total, rows, keep):
    total_dim, rows_dim, keep_dim = in_dims
    size = info.batch_size
    total = total.movedim(total_dim, 0) if total_dim is not None else total.expand(size, *total.shape)
    if rows_dim is None and keep_dim is not None and keep.dim() == 2:
        return _add_grams_of_shared_rows(total, rows, keep.movedim(keep_dim, 0)), 0
    rows = rows.movedim(rows_dim, 0) if rows_dim is not None else rows.expand(size, *rows.shape)
    keep = keep.movedim(keep_dim, 0) if keep_dim is not None else keep.expand(size, *keep.shape)
    out = torch.empty_like(total)
    for index in range(size):
        kept = rows[index][keep[index]]
        torch.addmm(total[index], kept.T, kept, out=out[index])
    return out, 0


_add_masked_gram.register_vmap(_add_masked_gram_vmap)


def add_masked_gram(total: torch.Tensor, rows: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``total + sum over i with keep[i] of outer(rows[i], rows[i])``: ``total`` ``[F, F]``, ``rows``
    ``[R, F]`` in ``total``'s dtype, a bool ``keep`` ``[R]``. A new tensor; the inputs are unchanged."""
    return _add_masked_gram(total, rows, keep)
