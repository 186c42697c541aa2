"""Reductions over the canonical view, shared by observers.

`finite_aminmax(view, mask)` reduces ``(observations, *qparam_shape, group)`` over dims
``(0, -1)`` and returns the min and max of the finite, unmasked values together with how many
finite values and how many non-finite values each parameter saw.

It is a ``torch.library`` custom op so that one implementation serves eager mode, ``vmap``
(a batching rule reduces the stacked tensor in one call) and ``torch.compile`` (an opaque op,
no graph break). Inside the op, on CPU, a finite input takes a fast path of two reductions (the
finiteness check reads two small tensors, which costs nothing on the host); on accelerators the
masked path always runs, so no device-to-host synchronisation happens.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["finite_aminmax"]

_POLICY_IGNORE = 0
_POLICY_RAISE = 1


def _reduce(view: torch.Tensor, op) -> torch.Tensor:
    """``op`` (amin or amax) over dims (0, -1): the contiguous group dim first, then the
    observations (faster than one multi-dim reduction; exact for min/max)."""
    return op(op(view, dim=-1), dim=0)


def _masked_path(view: torch.Tensor, include: torch.Tensor):
    lo = _reduce(torch.where(include, view, torch.inf), torch.amin)
    hi = _reduce(torch.where(include, view, -torch.inf), torch.amax)
    return lo, hi


@torch.library.custom_op("qstats::finite_aminmax", mutates_args=())
def _finite_aminmax_op(
    view: torch.Tensor, mask: Optional[torch.Tensor], policy: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dims = (0, view.ndim - 1)
    out_shape = view.shape[1:-1]
    per_param = view.shape[0] * view.shape[-1]
    if view.numel() == 0:
        inf = view.new_full(out_shape, torch.inf, dtype=torch.float32)
        zeros = torch.zeros(out_shape, dtype=torch.int64, device=view.device)
        return inf, -inf, zeros, zeros.clone()
    if mask is None and view.device.type == "cpu":
        lo = _reduce(view, torch.amin)
        hi = _reduce(view, torch.amax)
        if bool(torch.isfinite(lo).all()) and bool(torch.isfinite(hi).all()):
            count = torch.full(out_shape, per_param, dtype=torch.int64, device=view.device)
            return lo.float(), hi.float(), count, torch.zeros_like(count)
    finite = torch.isfinite(view)
    if mask is not None:
        mask = mask.expand(view.shape)
        included = mask & finite
        nonfinite = (mask & ~finite).sum(dim=dims)
    else:
        included = finite
        nonfinite = (~finite).sum(dim=dims)
    if policy == _POLICY_RAISE and bool(nonfinite.any()):
        raise ValueError(
            f"qstats: the observed tensor holds {int(nonfinite.sum())} non-finite values (NaN or Inf) "
            "and the spec says nonfinite='raise'"
        )
    lo, hi = _masked_path(view, included)
    count = included.sum(dim=dims)
    return lo.float(), hi.float(), count, nonfinite


@_finite_aminmax_op.register_fake
def _(view, mask, policy):
    out_shape = view.shape[1:-1]
    lo = view.new_empty(out_shape, dtype=torch.float32)
    count = view.new_empty(out_shape, dtype=torch.int64)
    return lo, torch.empty_like(lo), count, torch.empty_like(count)


def _vmap_rule(info, in_dims, view, mask, policy):
    view_dim, mask_dim = in_dims[0], in_dims[1]
    view = view.movedim(view_dim, 1)
    if mask is not None:
        if mask_dim is None:
            mask = mask.unsqueeze(1)
        else:
            mask = mask.movedim(mask_dim, 1)
        mask = mask.expand(view.shape)
    outs = _finite_aminmax_op(view, mask, policy)
    return outs, (0, 0, 0, 0)


torch.library.register_vmap("qstats::finite_aminmax", _vmap_rule)


def finite_aminmax(view: torch.Tensor, mask: Optional[torch.Tensor] = None, nonfinite: str = "ignore"):
    """Min, max, finite count and non-finite count over dims ``(0, -1)`` of a canonical view.

    Args:
      view: a tensor of shape ``(observations, *qparam_shape, group)``.
      mask: optional bool tensor broadcastable to ``view``; False excludes a value.
      nonfinite: ``"ignore"`` or ``"raise"``.

    Returns:
      ``(min_val, max_val, count, nonfinite_count)``; min/max are float32 (``+inf``/``-inf``
      where a parameter saw no finite value), counts are int64.
    """
    policy = _POLICY_RAISE if nonfinite == "raise" else _POLICY_IGNORE
    if mask is not None:
        mask = mask.to(torch.bool).expand(view.shape)
    return _finite_aminmax_op(view.detach(), mask, policy)
