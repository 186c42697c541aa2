"""Reductions over the canonical view, shared by observers.

`finite_aminmax(view, mask)` reduces ``(observations, *qparam_shape, group)`` over dims
``(0, -1)`` and returns the min and max of the finite, unmasked values together with how many
finite values and how many non-finite values each parameter saw.

In eager mode and under ``vmap`` it is a ``torch.library`` custom op (a batching rule reduces the
stacked tensor in one call; plain eager tensors call its implementation directly). Inside, on
CPU, a finite input takes a fast path (one ``aminmax`` pass for a single parameter; for many, one
pass of `qstats._native.row_extremes` where it applies, else an ``amin`` and an ``amax`` row
reduction), checked with one scalar read of the range's maximum (or the kernel's flag);
other inputs, and every input on an accelerator, take the masked path, which needs no host
synchronisation. Under ``torch.compile`` (``nonfinite="ignore"``), unmasked, plain extremes come
first (the native kernel as the op ``qstats::row_extremes`` where it applies, else ``amin`` and
``amax``, which the compiler fuses into one pass over the data) and the full reduction runs only
when an extreme is not finite: a small opaque op reads that flag on the host (CPU only).
Masked inputs, and unmasked ones on an accelerator, take the decomposition, which the compiler
also fuses into one pass, with no host read. With ``nonfinite="raise"`` the op stays, opaque to
the compiler, so that it can raise.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from . import _native
from ._native import row_extremes, whole_extremes
from ._torch_features import assume_constant_result

__all__ = ["finite_aminmax"]

_POLICY_IGNORE = 0
_POLICY_RAISE = 1


def _f32(t: torch.Tensor) -> torch.Tensor:
    """``t`` as float32, without a call when it already is (every op call counts on small states)."""
    return t if t.dtype == torch.float32 else t.float()


def _reduce(view: torch.Tensor, op) -> torch.Tensor:
    """``op`` (amin or amax) over dims (0, -1): the contiguous group dim first, then the
    observations (faster than one multi-dim reduction; exact for min/max)."""
    if view.shape[0] == 1:
        return op(view[0], dim=-1)
    if view.shape[-1] == 1:
        return op(view[..., 0], dim=0)
    return op(op(view, dim=-1), dim=0)


def _masked_path(view: torch.Tensor, include: torch.Tensor):
    lo = _reduce(torch.where(include, view, torch.inf), torch.amin)
    hi = _reduce(torch.where(include, view, -torch.inf), torch.amax)
    return lo, hi


def _nothing_seen(view: torch.Tensor):
    """The result for an empty view: +inf / -inf extremes and zero counts per parameter."""
    out_shape = view.shape[1:-1]
    inf = view.new_full(out_shape, torch.inf, dtype=torch.float32)
    zeros = torch.zeros(out_shape, dtype=torch.int64, device=view.device)
    return inf, -inf, zeros, zeros.clone()


def _finite_aminmax_impl(view: torch.Tensor, mask: Optional[torch.Tensor], policy: int, uniform: str = "dense"):
    """The reduction on dense tensors. ``uniform`` says how counts that are the same for every
    parameter (a finite, unmasked input) come back: ``"dense"`` tensors; ``"views"``, expanded
    0-dim tensors (stride 0), which later additions read as scalars (an int64 add of two
    [64, 512] tensors costs twice as much); ``"ints"``, Python ints (no op at all). Only eager
    callers take views or ints, never the custom op, whose outputs the compiler assumes dense."""
    out_shape = view.shape[1:-1]
    per_param = view.shape[0] * view.shape[-1]
    if view.numel() == 0:
        return _nothing_seen(view)
    if mask is None and view.device.type == "cpu":
        if math.prod(out_shape) == 1:
            # one parameter: a full reduction, both extremes in one pass over memory (two passes
            # cost twice as much once the tensor does not stay in cache): the native whole pass
            # where it applies (about half of aminmax's time), else aminmax
            native = whole_extremes(view)
            if native is not None:
                lo, hi, finite = native[0].reshape(out_shape), native[1].reshape(out_shape), native[2]
            else:
                lo, hi = (t.reshape(out_shape) for t in torch.aminmax(view.reshape(-1)))
                finite = None
        else:  # one native pass where it applies; ATen's per-row aminmax is far slower than two
            native = row_extremes(view)
            if native is not None:
                lo, hi, finite = native
            else:
                lo = _reduce(view, torch.amin)
                hi = _reduce(view, torch.amax)
                finite = None
        # hi - lo is finite exactly when both are (or the range overflows: then the slow path);
        # its max is finite exactly when every entry is (amax propagates NaN), and a max and a
        # scalar check cost less than an elementwise isfinite.
        if finite is None:
            finite = math.isfinite((hi - lo).amax().item())
        if finite:
            if uniform == "ints":
                return _f32(lo), _f32(hi), per_param, 0
            if uniform == "views":
                count = torch.tensor(per_param, dtype=torch.int64, device=view.device)
                return _f32(lo), _f32(hi), count.expand(out_shape), torch.zeros_like(count).expand(out_shape)
            count = torch.full(out_shape, per_param, dtype=torch.int64, device=view.device)
            return _f32(lo), _f32(hi), count, torch.zeros_like(count)
    dims = (0, view.ndim - 1)
    if mask is not None:
        mask = mask.expand(view.shape)
        if view.device.type == "cpu":
            # Masked fast path: exclude masked values, then check that what was kept is finite.
            lo = _reduce(torch.where(mask, view, torch.inf), torch.amin)
            hi = _reduce(torch.where(mask, view, -torch.inf), torch.amax)
            count = torch.count_nonzero(mask, dim=dims)
            if not bool((~torch.isfinite(hi - lo) & (count > 0)).any()):
                return _f32(lo), _f32(hi), count, torch.zeros_like(count)
        included = mask & torch.isfinite(view)
        count = torch.count_nonzero(included, dim=dims)
        nonfinite = torch.count_nonzero(mask, dim=dims) - count
    else:
        included = torch.isfinite(view)
        count = torch.count_nonzero(included, dim=dims)
        nonfinite = per_param - count
    if policy == _POLICY_RAISE and bool(nonfinite.any()):
        raise ValueError(
            f"qstats: the observed tensor holds {int(nonfinite.sum())} non-finite values (NaN or Inf) "
            "and the spec says nonfinite='raise'"
        )
    lo, hi = _masked_path(view, included)
    return _f32(lo), _f32(hi), count, nonfinite


@torch.library.custom_op("qstats::finite_aminmax", mutates_args=())
def _finite_aminmax_op(
    view: torch.Tensor, mask: Optional[torch.Tensor], policy: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _finite_aminmax_impl(view, mask, policy)


def _fake_results(view, *_):
    """Fake (shape-only) results of both ops: float32 extremes and int64 counts per parameter."""
    out_shape = view.shape[1:-1]
    lo = view.new_empty(out_shape, dtype=torch.float32)
    count = view.new_empty(out_shape, dtype=torch.int64)
    return lo, torch.empty_like(lo), count, torch.empty_like(count)


_finite_aminmax_op.register_fake(_fake_results)


def _batched_arguments(view, view_dim, mask, mask_dim):
    """Moves the vmap dimension of ``view`` (and ``mask``) to dim 1, inside the parameter dims
    of the canonical view, so that one reduction over dims (0, -1) serves every slice."""
    if mask is not None:
        mask = mask.unsqueeze(1) if mask_dim is None else mask.movedim(mask_dim, 1)
    if view_dim is None:  # only the mask is batched: every slice sees the same tensor
        view = view.unsqueeze(1)
        shape = list(view.shape)
        shape[1] = mask.shape[1]
        view = view.expand(shape)
    else:
        view = view.movedim(view_dim, 1)
    if mask is not None:
        mask = mask.expand(view.shape)
    return view, mask


def _vmap_rule(info, in_dims, view, mask, policy):
    view, mask = _batched_arguments(view, in_dims[0], mask, in_dims[1])
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    if torch.compiler.is_compiling() or wrapped(view) or (mask is not None and wrapped(mask)):
        outs = _finite_aminmax_op(view, mask, policy)  # tracing or nested transforms: dispatch again
    else:
        outs = _finite_aminmax_impl(view, mask, policy)  # plain tensors: skip a dispatch
    return outs, (0, 0, 0, 0)


torch.library.register_vmap("qstats::finite_aminmax", _vmap_rule)


def _unwrapped_vmap(view, mask, policy):
    """Under a plain ``vmap`` (no other transform), runs the batching rule directly on the
    unwrapped tensors, skipping the custom-op dispatch (a few hundred microseconds per call).
    Returns None where that does not apply (compile, nested or other transforms)."""
    functorch = torch._C._functorch
    if torch.compiler.is_compiling() or not functorch.is_batchedtensor(view):
        return None
    level = functorch.maybe_get_level(view)
    if level != functorch.maybe_current_level():
        return None
    inner, view_dim = functorch._unwrap_batched(view, level)
    mask_dim = None
    if mask is not None:
        if functorch.is_batchedtensor(mask) and functorch.maybe_get_level(mask) == level:
            mask, mask_dim = functorch._unwrap_batched(mask, level)
        if functorch.is_functorch_wrapped_tensor(mask):
            return None
    if functorch.is_functorch_wrapped_tensor(inner):
        return None
    outs = _finite_aminmax_impl(*_batched_arguments(inner, view_dim, mask, mask_dim), policy, uniform="views")
    return tuple(functorch._add_batch_dim(out, 0, level) for out in outs)


# Per-parameter counts up to this many values are summed exactly in float32 (every partial sum
# of 0/1 values is an integer below 2**24), which vectorises better than an int64 sum.
_EXACT_FLOAT32_COUNT = 2**24


def _traceable_finite_aminmax(view: torch.Tensor, mask: Optional[torch.Tensor]):
    """The ``nonfinite="ignore"`` reduction in plain torch ops, for ``torch.compile``: the
    compiler fuses the finiteness test, both extremes and the counts into one pass over the data
    (the opaque custom op would take two passes and a host check)."""
    if view.numel() == 0:
        return _nothing_seen(view)
    dims = (0, view.ndim - 1)
    finite = view.abs() < torch.inf  # False for NaN and +-Inf
    included = finite if mask is None else (finite & mask)
    lo = torch.where(included, view, torch.inf).amin(dim=dims).float()
    hi = torch.where(included, view, -torch.inf).amax(dim=dims).float()
    exact_in_float = view.shape[0] * view.shape[-1] <= _EXACT_FLOAT32_COUNT
    count_dtype = torch.float32 if exact_in_float else torch.int64
    count = included.to(count_dtype).sum(dim=dims).to(torch.int64)
    seen = view.shape[0] * view.shape[-1] if mask is None else mask.to(count_dtype).sum(dim=dims).to(torch.int64)
    return lo, hi, count, seen - count


def _no_functorch_transform() -> bool:
    """True outside every vmap/grad transform; read when tracing."""
    return torch._C._functorch.maybe_current_level() is None


if hasattr(torch.compiler, "assume_constant_result"):
    _no_functorch_transform = assume_constant_result(_no_functorch_transform)


@torch.library.custom_op("qstats::row_extremes", mutates_args=())
def _row_extremes_op(view: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`qstats._native.row_extremes` as an op the compiler calls (one pass for both extremes,
    faster than the compiler's own fused reduction): float32 extremes and a 0-dim bool, True when
    every value and every range is finite. Where the kernel does not take the tensor it gets at
    run time, ATen's reductions give the same results."""
    out = row_extremes(view)
    if out is None:
        lo, hi = _f32(_reduce(view, torch.amin)), _f32(_reduce(view, torch.amax))
        return lo, hi, torch.isfinite(hi - lo).all()
    lo, hi, finite = out
    return lo, hi, torch.tensor(finite, device=view.device)


@_row_extremes_op.register_fake
def _(view):
    lo = view.new_empty(view.shape[1:-1], dtype=torch.float32)
    return lo, torch.empty_like(lo), view.new_empty((), dtype=torch.bool)


def _row_extremes_vmap_rule(info, in_dims, view):
    if in_dims[0] is None:
        return _row_extremes_op(view), (None, None, None)
    # the batch inside the parameter dims, as `_batched_arguments` puts it; one flag for all slices
    return _row_extremes_op(view.movedim(in_dims[0], 1)), (0, 0, None)


torch.library.register_vmap("qstats::row_extremes", _row_extremes_vmap_rule)


def _plain_extremes(view: torch.Tensor):
    """Both extremes of an unmasked view and one flag, True when every extreme and every range is
    finite, for the compiled paths: the native op where it takes the view, else ``amin`` and
    ``amax``, which the compiler fuses into one pass."""
    # under vmap the view is one slice; the size that counts, every slice together, is not known
    # when tracing: the op takes it at run time where it is large enough, else ATen's passes
    if _native.applies(view, numel=None if _no_functorch_transform() else _native._MIN_NUMEL):
        return _row_extremes_op(view)
    dims = (0, view.ndim - 1)
    lo = view.amin(dim=dims)
    hi = view.amax(dim=dims)
    # hi - lo is finite exactly when both are (or the range overflows: then the full path)
    return lo, hi, torch.isfinite(hi - lo).all()


@torch.library.custom_op("qstats::nonfinite_fallback", mutates_args=())
def _nonfinite_fallback_op(
    view: torch.Tensor, finite: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_finite_aminmax_impl`'s result where ``finite`` (a 0-dim bool: every extreme the caller
    found is finite) is False; zeros of the same shapes and dtypes where it is True, and the
    caller keeps its own extremes. One scalar read on the host: CPU only."""
    if bool(finite):
        out_shape = view.shape[1:-1]
        lo = torch.zeros(out_shape, dtype=torch.float32, device=view.device)
        count = torch.zeros(out_shape, dtype=torch.int64, device=view.device)
        return lo, torch.zeros_like(lo), count, torch.zeros_like(count)
    return _finite_aminmax_impl(view, None, _POLICY_IGNORE)


_nonfinite_fallback_op.register_fake(_fake_results)


def _nonfinite_fallback_vmap_rule(info, in_dims, view, finite):
    if in_dims[0] is None:  # only the flags are batched: every slice sees the same view
        view = view.unsqueeze(1).expand(view.shape[0], info.batch_size, *view.shape[1:])
    else:  # the batch dimension inside the parameter dims, as `_batched_arguments` puts it
        view = view.movedim(in_dims[0], 1)
    if in_dims[1] is not None:
        finite = finite.all()  # one flag for every slice: the fallback serves them all
    return _nonfinite_fallback_op(view, finite), (0, 0, 0, 0)


torch.library.register_vmap("qstats::nonfinite_fallback", _nonfinite_fallback_vmap_rule)


def _finite_first_aminmax(view: torch.Tensor):
    """The unmasked reduction for ``torch.compile`` on CPU: plain extremes (the native op, or
    ``amin`` and ``amax``, which the compiler fuses into one pass), then an opaque op that reads
    one flag on the host and runs the full reduction only when some extreme is not finite; a
    select keeps the plain extremes otherwise (under ``vmap`` the flag is per slice; the op takes
    all of them at once). Not ``torch.cond``, which runs under no functorch transform and whose
    branches inductor cannot generate for tensors of symbolic sizes (a QAT step recompiled for
    another batch size failed with "expected [s17] to have been codegen-ed")."""
    if view.numel() == 0:
        return _nothing_seen(view)
    lo, hi, finite = _plain_extremes(view)  # finite: also False when a range overflows (full path)
    full_lo, full_hi, full_count, full_nonfinite = _nonfinite_fallback_op(view, finite)
    per_param = view.shape[0] * view.shape[-1]
    return (
        torch.where(finite, lo.float(), full_lo),
        torch.where(finite, hi.float(), full_hi),
        torch.where(finite, per_param, full_count),
        torch.where(finite, 0, full_nonfinite),
    )


def finite_aminmax(
    view: torch.Tensor, mask: Optional[torch.Tensor] = None, nonfinite: str = "ignore", int_counts: bool = False
):
    """Min, max, finite count and non-finite count over dims ``(0, -1)`` of a canonical view.

    Args:
      view: a tensor of shape ``(observations, *qparam_shape, group)``.
      mask: optional bool tensor broadcastable to ``view``; False excludes a value.
      nonfinite: ``"ignore"`` or ``"raise"``.
      int_counts: in eager mode, counts that are the same for every parameter (a finite input,
        no mask) may come back as Python ints (``count`` values per parameter, ``0`` non-finite):
        callers that only add them to a state save four op calls.

    Returns:
      ``(min_val, max_val, count, nonfinite_count)``; min/max are float32 (``+inf``/``-inf``
      where a parameter saw no finite value), counts are int64 tensors (or ints, see
      ``int_counts``).
    """
    policy = _POLICY_RAISE if nonfinite == "raise" else _POLICY_IGNORE
    if mask is not None:
        mask = (mask if mask.dtype == torch.bool else mask.to(torch.bool)).expand(view.shape)
    compiling = torch.compiler.is_compiling()
    if not compiling and _plain(view) and (mask is None or _plain(mask)):
        # plain eager tensors, also inside a transform that does not wrap them (a tensor captured
        # from outside a vmap, the row reductions of shared tokens): skip a dispatch
        wrapped = torch._C._functorch.is_functorch_wrapped_tensor
        outside = _no_functorch_transform()
        if outside or not (wrapped(view) or (mask is not None and wrapped(mask))):
            # ints only outside transforms: under vmap a caller's result must come out batched
            uniform = "ints" if int_counts and outside else "views"
            return _finite_aminmax_impl(view.detach(), mask, policy, uniform=uniform)
    view = view.detach()
    if policy == _POLICY_IGNORE and compiling:
        if mask is None and view.device.type == "cpu":
            return _finite_first_aminmax(view)
        return _traceable_finite_aminmax(view, mask)  # no host read on an accelerator
    outs = _unwrapped_vmap(view, mask, policy)
    if outs is not None:
        return outs
    return _finite_aminmax_op(view, mask, policy)


def _plain(t: torch.Tensor) -> bool:
    """A dense tensor of the base class (no fake, functional or other subclass), not on meta."""
    return type(t) is torch.Tensor and t.device.type != "meta" and t.layout == torch.strided
