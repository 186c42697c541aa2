"""Stacked execution under a plain ``torch.vmap``.

Each op of an observer's update or of ``compute_qparams`` costs a few microseconds on a [64, 512]
state, and ``vmap`` adds its batching overhead to every one of them (about as much again). When
such a function runs under one plain ``vmap`` level (no other transform, no compile, dense
tensors), `run_stacked` unwraps the batched arguments, moves their batch dimension to the front,
calls the function's stacked form (plain ops on ``[E, ...]`` tensors, equal to the batching rules'
result bit for bit: tests check both against each other with routing switched off) and wraps the
results back at the same level.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Optional, Sequence

import torch

__all__ = ["call_stacked", "generic_batching", "outside_level", "run_stacked"]

_LOCAL = threading.local()


@contextlib.contextmanager
def generic_batching():
    """Within this context ``vmap`` runs every op through its batching rules (no stacked
    routing): the reference the stacked forms are tested against."""
    previous = getattr(_LOCAL, "off", False)
    _LOCAL.off = True
    try:
        yield
    finally:
        _LOCAL.off = previous


def _dense(t: torch.Tensor) -> bool:
    return type(t) is torch.Tensor and t.layout == torch.strided and t.device.type != "meta"


def _unwrapped(tensors: Sequence[Optional[torch.Tensor]], required: Sequence[int]):
    """``(level, size, [(tensor, batch dim or None), ...])`` when ``tensors`` (None entries
    allowed) are the arguments of a call under exactly one plain ``vmap`` level: each a tensor
    batched at the current level over a dense tensor, or a dense tensor. None otherwise, and when
    none of the tensors at positions ``required`` is batched."""
    if torch.compiler.is_compiling() or getattr(_LOCAL, "off", False) or _pop_layer is None:
        return None
    functorch = torch._C._functorch
    level = functorch.maybe_current_level()
    if level is None:
        return None
    items, size, any_required = [], None, False
    for i, t in enumerate(tensors):
        if t is None:
            items.append((None, None))
            continue
        if not isinstance(t, torch.Tensor):
            return None
        if functorch.is_batchedtensor(t):
            if functorch.maybe_get_level(t) != level:
                return None
            inner, dim = functorch._unwrap_batched(t, level)
            if functorch.is_functorch_wrapped_tensor(inner) or not _dense(inner):
                return None
            if size is not None and inner.shape[dim] != size:
                return None
            size = inner.shape[dim]
            any_required = any_required or i in required
            items.append((inner, dim))
        elif functorch.is_functorch_wrapped_tensor(t) or not _dense(t):
            return None
        else:
            items.append((t, None))
    if size is None or not any_required:
        return None
    return level, size, items


def call_stacked(fn: Callable, tensors: Sequence[Optional[torch.Tensor]], required: Sequence[int]):
    """``fn(*stacked)`` rewrapped at the current ``vmap`` level, where ``stacked`` holds
    ``tensors`` unwrapped with their batch dimension first (unbatched ones expanded, stride 0) and
    ``fn`` returns a NamedTuple of ``[E, ...]`` tensors; run outside the level (`outside_level`).
    None when the call is not under one plain ``vmap`` level with a tensor at a ``required``
    position batched (`_unwrapped`)."""
    found = _unwrapped(tensors, required)
    if found is None:
        return None
    level, size, items = found
    with outside_level():
        stacked = [
            t if t is None or dim == 0 else (t.expand(size, *t.shape) if dim is None else t.movedim(dim, 0))
            for t, dim in items
        ]
        outputs = fn(*stacked)
    add = torch._C._functorch._add_batch_dim
    return type(outputs)(*(add(t, 0, level) for t in outputs))


@contextlib.contextmanager
def outside_level():
    """Runs the body with the current ``vmap`` level popped off functorch's stack and pushed back
    after: ops on the unwrapped tensors then dispatch as outside any transform (every op under
    a level pays functorch's interposition, a few microseconds, even on plain tensors), and a
    ``vmap`` inside takes a fresh level."""
    saved = _pop_layer()
    try:
        yield
    finally:
        _push_layer(saved)


_pop_layer = getattr(torch._C._functorch, "pop_dynamic_layer_stack", None)
_push_layer = getattr(torch._C._functorch, "push_dynamic_layer_stack", None)


def run_stacked(stacked_fn: Callable, state, x: torch.Tensor, weight: Optional[torch.Tensor]):
    """``stacked_fn(state, x, weight)`` on unwrapped ``[E, ...]`` tensors when called under one
    plain ``vmap`` level with ``x`` or ``weight`` batched (an ``x`` shared by every slice, without
    a weight, stays with vmap, which reduces it once); None when that does not apply."""
    if not (isinstance(state, tuple) and hasattr(state, "_fields")):
        return None
    n = len(state)
    return call_stacked(
        lambda *t: stacked_fn(type(state)(*t[:n]), t[n], t[n + 1]), [*state, x, weight], required=(n, n + 1)
    )
