"""``add_masked_gram(total, rows, keep)``: ``total`` plus the sum of ``r^T r`` over the rows ``keep`` marks.

The reference is ``total + where(keep, rows, 0).T @ rows``. Written as one ``torch.library`` op so
that, under ``torch.vmap`` over experts with the rows shared by every expert and one mask each
(`qstats.stacked_observer` of `qstats.hessian`), each expert multiplies only its own rows (a top-k
router's E experts cost what k dense products cost, not E), and experts that keep the same rows
(every expert calibrated on every token, llm-compressor's default for MoE) share one product.
Every path computes the product, then adds it to ``total``, in a new tensor.
"""

from __future__ import annotations

import torch

__all__ = ["add_masked_gram"]


def _gram(rows: torch.Tensor) -> torch.Tensor:
    return rows.T @ rows


@torch.library.custom_op("qstats::add_masked_gram", mutates_args=())
def _add_masked_gram(total: torch.Tensor, rows: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    return total + _gram(rows[keep])


@_add_masked_gram.register_fake
def _(total, rows, keep):
    return torch.empty_like(total)


def _add_grams_of_shared_rows(total: torch.Tensor, rows: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``total[e] + gram of the rows [R, F] that keep[e] keeps`` for every expert ``e`` of ``keep``
    ``[E, R]``: one product when every expert keeps the same rows, else the kept rows gathered once
    in expert order and one product per expert."""
    if bool((keep == keep[:1]).all()):
        return total + _gram(rows[keep[0]])
    experts, rows_index = keep.nonzero(as_tuple=True)
    gathered = rows.index_select(0, rows_index)
    counts = torch.bincount(experts, minlength=keep.shape[0]).tolist()
    grams = torch.empty_like(total)
    for expert, part in enumerate(torch.split(gathered, counts)):
        torch.mm(part.T, part, out=grams[expert])
    return grams.add_(total)  # the product's own buffer: the same sum as total + grams


def _add_masked_gram_vmap(info, in_dims, total, rows, keep):
    total_dim, rows_dim, keep_dim = in_dims
    size = info.batch_size
    total = total.movedim(total_dim, 0) if total_dim is not None else total.expand(size, *total.shape)
    if rows_dim is None and keep_dim is not None and keep.dim() == 2:
        return _add_grams_of_shared_rows(total, rows, keep.movedim(keep_dim, 0)), 0
    rows = rows.movedim(rows_dim, 0) if rows_dim is not None else rows.expand(size, *rows.shape)
    keep = keep.movedim(keep_dim, 0) if keep_dim is not None else keep.expand(size, *keep.shape)
    grams = torch.empty_like(total)
    for index in range(size):
        kept = rows[index][keep[index]]
        torch.mm(kept.T, kept, out=grams[index])
    return grams.add_(total), 0


_add_masked_gram.register_vmap(_add_masked_gram_vmap)


def add_masked_gram(total: torch.Tensor, rows: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``total + sum over i with keep[i] of outer(rows[i], rows[i])``: ``total`` ``[F, F]``, ``rows``
    ``[R, F]`` in ``total``'s dtype, a bool ``keep`` ``[R]``. A new tensor; the inputs are unchanged."""
    return _add_masked_gram(total, rows, keep)
