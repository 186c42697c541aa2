"""The one reduction every min/max-style observer shares: finite extremes and counts.

`finite_aminmax(view, mask, nonfinite)` reduces a canonical view ``(observations, *params, group)``
over dims ``(0, -1)`` and returns, per parameter, the min and max of the finite values that the
mask keeps, how many finite values it kept and how many non-finite values (NaN, +-Inf) it left out.

It is one ``torch.library`` op with a fake (shape) rule and a vmap rule, so the same code runs
eagerly, under ``torch.vmap`` (every slice reduced in one call) and under ``torch.compile``
(``fullgraph=True``: the op is opaque to the compiler). Inside the op, an unmasked input whose
extremes are finite is done after one ``amin``/``amax`` pass; others take the masked pass. The
op's body may read a flag on the host: nothing outside it does.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ._ops import is_dtensor, op, register_fake, register_vmap

__all__ = ["finite_aminmax"]


def _reduce(view: torch.Tensor, op) -> torch.Tensor:
    """``op`` (amin or amax) over dims (0, -1): the contiguous group dim first (exact for min/max)."""
    if view.shape[0] == 1:
        return op(view[0], dim=-1)
    if view.shape[-1] == 1:
        return op(view[..., 0], dim=0)
    return op(op(view, dim=-1), dim=0)


def _nothing_seen(view: torch.Tensor):
    """The result for an empty view: +inf / -inf extremes and zero counts per parameter."""
    shape = view.shape[1:-1]
    inf = torch.full(shape, torch.inf, dtype=torch.float32, device=view.device)
    zeros = torch.zeros(shape, dtype=torch.int64, device=view.device)
    return inf, -inf, zeros, zeros.clone()


def _plain_extremes(view: torch.Tensor):
    """Extremes of every value, or None when some extreme or range is not finite (one host read)."""
    params = view.shape[1:-1]
    if params.numel() == 1:
        lo, hi = torch.aminmax(view.reshape(-1))
        lo, hi = (lo, hi) if params == lo.shape else (lo.reshape(params), hi.reshape(params))
    else:
        lo, hi = _reduce(view, torch.amin), _reduce(view, torch.amax)
    # amin/amax propagate NaN, so the summed ranges are finite exactly when every value is (or a
    # range or their sum overflows float32: then the masked pass, which gives the same extremes)
    return (lo, hi) if math.isfinite((hi.float() - lo.float()).sum()) else None


def _masked_extremes(view: torch.Tensor, mask: Optional[torch.Tensor]):
    dims = (0, view.ndim - 1)
    included = torch.isfinite(view)
    if mask is not None:  # of the view's shape: finite_aminmax and the vmap rule expand it
        included = included & mask
    lo = _reduce(torch.where(included, view, torch.inf), torch.amin)
    hi = _reduce(torch.where(included, view, -torch.inf), torch.amax)
    count = torch.count_nonzero(included, dim=dims)
    seen = view.shape[0] * view.shape[-1] if mask is None else torch.count_nonzero(mask, dim=dims)
    return lo, hi, count, seen - count


def _finite_aminmax(view: torch.Tensor, mask: Optional[torch.Tensor], raise_on_nonfinite: bool):
    if view.numel() == 0:
        return _nothing_seen(view)
    plain = _plain_extremes(view) if mask is None else None
    if plain is not None:
        count = torch.full(view.shape[1:-1], view.shape[0] * view.shape[-1], dtype=torch.int64, device=view.device)
        return plain[0].float(), plain[1].float(), count, torch.zeros_like(count)
    lo, hi, count, nonfinite = _masked_extremes(view, mask)
    if raise_on_nonfinite and bool(nonfinite.any()):
        raise ValueError(
            f"qstats: the observed tensor holds {int(nonfinite.sum())} non-finite values (NaN or Inf) "
            "and the spec says nonfinite='raise'"
        )
    return lo.float(), hi.float(), count, nonfinite


@op("finite_aminmax")
def _finite_aminmax_op(
    view: torch.Tensor, mask: Optional[torch.Tensor], raise_on_nonfinite: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _finite_aminmax(view, mask, raise_on_nonfinite)


@register_fake(_finite_aminmax_op)
def _(view, mask, raise_on_nonfinite):
    shape = view.shape[1:-1]
    lo = view.new_empty(shape, dtype=torch.float32)
    count = view.new_empty(shape, dtype=torch.int64)
    return lo, torch.empty_like(lo), count, torch.empty_like(count)


def batch_inside(batch_size: int, view, view_dim, mask, mask_dim):
    """The vmap rule of an op over a canonical view ``(observations, *params, group)`` and its
    optional mask: the vmapped dimension moves inside the parameter dims (dim 1), so that one
    call serves every slice (a view that only the mask batches is expanded, not copied)."""
    if view_dim is None:  # only the mask is batched: every slice sees the same values
        view = view.unsqueeze(1).expand(view.shape[0], batch_size, *view.shape[1:])
    else:
        view = view.movedim(view_dim, 1)
    if mask is not None:
        mask = mask.unsqueeze(1) if mask_dim is None else mask.movedim(mask_dim, 1)
        mask = mask.expand(view.shape)
    return view, mask


def _vmap_rule(info, in_dims, view, mask, raise_on_nonfinite):
    view, mask = batch_inside(info.batch_size, view, in_dims[0], mask, in_dims[1])
    return _finite_aminmax_op(view, mask, raise_on_nonfinite), (0, 0, 0, 0)


register_vmap(_finite_aminmax_op, _vmap_rule)


def finite_aminmax(view: torch.Tensor, mask: Optional[torch.Tensor] = None, nonfinite: str = "ignore"):
    """Min, max, finite count and non-finite count over dims ``(0, -1)`` of a canonical view.

    Args:
      view: a tensor of shape ``(observations, *qparam_shape, group)``, at least 2-d (any float
        dtype; float64 values past float32's range count as non-finite).
      mask: optional tensor broadcastable to ``view``; zero / False leaves a value out.
      nonfinite: ``"ignore"`` (NaN/Inf are left out and counted) or ``"raise"`` (ValueError).

    Returns:
      ``(min_val, max_val, count, nonfinite_count)``: float32 extremes (``+inf``/``-inf`` where a
      parameter saw no finite value) and int64 counts, each of shape ``qparam_shape``.

    >>> import torch
    >>> lo, hi, count, bad = finite_aminmax(torch.tensor([[[1.0, float("nan"), -2.0]]]))
    >>> lo.item(), hi.item(), count.item(), bad.item()
    (-2.0, 1.0, 2, 1)
    """
    if nonfinite not in ("ignore", "raise"):
        raise ValueError(f"finite_aminmax: nonfinite must be 'ignore' or 'raise', got {nonfinite!r}")
    if is_dtensor(view):  # no sharding rule: the caller says whether the whole tensor or this rank's shard
        raise TypeError(
            f"finite_aminmax: got a DTensor (placements {tuple(view.placements)}), a tensor sharded across ranks "
            "(FSDP2's fully_shard parameters between forwards, tensor parallelism); observe x.full_tensor() for "
            "the whole tensor's statistics (as qstats.calibrate does for parameter sites), or x.to_local() for "
            "this rank's shard alone"
        )
    if view.ndim < 2:  # a 1-d view is its own observation and group dim: every value counted twice
        raise ValueError(
            f"finite_aminmax: expected a canonical view (observations, *qparam_shape, group) of at least "
            f"2 dimensions, got shape {tuple(view.shape)}; kit.canonical_view(x, granularity) builds one"
        )
    if mask is not None:
        mask = (mask if mask.dtype == torch.bool else mask != 0).expand(view.shape)
    if view.is_floating_point() and view.element_size() in (1, 8):
        # float8 values are float32 values exactly (ATen has no float8 reductions); float64 values
        # are reduced as the float32 the extremes are kept in: past its range they are Inf, left out
        view = view.float()
    return _finite_aminmax_op(view.detach(), mask, nonfinite == "raise")

