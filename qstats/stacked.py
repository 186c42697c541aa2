"""Stacked observers: one observer call over ``[E, ...]`` stacks (mixture-of-experts weights).

`stacked_observer` is ``torch.vmap`` of an observer's own pure functions over the leading expert
dimension, for any observer: the laws of ``observer`` hold per expert, and there is no
per-observer registration. `stacked_qparams` is ``torch.vmap`` of `compute_qparams`.
"""

from __future__ import annotations

from typing import Optional

import torch

from ._checks import as_index
from ._qparams import compute_qparams
from .observers._base import Observer

__all__ = ["stacked_observer", "stacked_qparams"]


def _check_stack(x, num_experts: int, what: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"stacked_observer: {what} must be a tensor, got {type(x).__name__}")
    if x.ndim < 1 or x.shape[0] != num_experts:
        raise ValueError(f"stacked_observer: {what} of shape {tuple(x.shape)} does not have the leading "
                         f"expert dimension {num_experts}")


def _check_stacked_state(state, num_experts: int) -> None:
    if not (isinstance(state, tuple) and hasattr(type(state), "_fields")):
        raise TypeError(f"stacked_observer: expected a state (a NamedTuple of tensors), got {type(state).__name__}")
    for name, field in zip(state._fields, state):
        if isinstance(field, torch.Tensor):
            _check_stack(field, num_experts, f"state field {name!r}")


def _expert_count(num_experts) -> int:
    """``num_experts`` as a Python int: any integer (``operator.index``: numpy ints, a one-element
    integer tensor), not a bool; ValueError naming it otherwise."""
    count = as_index(num_experts)
    if count is None or count < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    return count


def stacked_observer(observer: Observer, num_experts: int) -> Observer:
    """An observer of ``[E, ...]`` stacks built from an observer of one expert's tensor.

    ``init``, ``update`` and ``merge`` are ``torch.vmap`` of the given ones over dimension 0, so its laws
    hold per expert; ``weight`` is ``[E, ...]`` (the routing mask: a nonzero entry keeps its row, once,
    whatever its value, so routing probabilities act as their 0/1 mask). For activations shared by every
    expert pass ``x.expand(E, *x.shape)``: a stride-0 stack is observed once, under each expert's mask.

    >>> import torch, qstats
    >>> spec = qstats.QuantSpec(granularity=qstats.PerAxis(0))
    >>> obs = qstats.stacked_observer(qstats.minmax(spec), 4)
    >>> w = torch.randn(4, 6, 3)
    >>> obs.update(obs.init(w), w).max_val.shape
    torch.Size([4, 6])
    """
    if not isinstance(observer, Observer):
        raise TypeError(f"stacked_observer expects an Observer, got {type(observer).__name__}")
    num_experts = _expert_count(num_experts)
    batched_update = torch.vmap(observer.update)

    def init_fn(x: torch.Tensor):
        _check_stack(x, num_experts, "x")
        return torch.vmap(observer.init)(x)

    def update_fn(state, x: torch.Tensor, weight: Optional[torch.Tensor] = None):
        _check_stack(x, num_experts, "x")
        _check_stacked_state(state, num_experts)
        if weight is not None:
            _check_stack(weight, num_experts, "weight")
        try:
            if weight is None:
                return batched_update(state, x)
            if x.stride(0) == 0:  # one tensor shared by every expert (x.expand(E, ...)): observe it once
                return torch.vmap(observer.update, in_dims=(0, None, 0))(state, x[0], weight)
            return batched_update(state, x, weight)
        except ValueError as error:  # the observer's message names one expert's shapes, not the ones passed
            if type(error) is not ValueError:  # a subclass, which a caller may catch by its type: kept
                raise
            given = f"x {tuple(x.shape)}" + ("" if weight is None else f" and weight {tuple(weight.shape)}")
            raise ValueError(f"stacked_observer: per expert of {given}, less their leading expert dimension "
                             f"{num_experts}: {error}") from error

    def merge_fn(a, b):
        _check_stacked_state(a, num_experts)
        _check_stacked_state(b, num_experts)
        return torch.vmap(observer.merge)(a, b)

    return Observer(init_fn, update_fn, merge_fn, exact=observer.exact, spec=observer.spec,
                    name=f"stacked({observer.name})", shared_rows=observer.shared_rows, state_type=observer.state_type,
                    options=observer.options)


def stacked_qparams(state, spec, **options):
    """Quantization parameters of every expert of a stacked state: ``torch.vmap`` of `compute_qparams`.
    Experts that saw no data get the fallback and ``calibrated`` False whatever ``spec.on_uncalibrated``
    (apply it as `qstats.compute_qparams_tree` does). A tensor ``global_scale`` is one shared by all
    experts (one element) or one per expert (``[E]``, e.g. each expert's gate and up fused by
    ``torch.vmap(qstats.fused_global_scale)``).

    >>> import torch, qstats
    >>> spec = qstats.QuantSpec(granularity=qstats.PerAxis(0))
    >>> obs = qstats.stacked_observer(qstats.minmax(spec), 4)
    >>> w = torch.randn(4, 6, 3)
    >>> qstats.stacked_qparams(obs.update(obs.init(w), w), spec).scale.shape
    torch.Size([4, 6])
    """
    fields = [t for t in state if isinstance(t, torch.Tensor)] if isinstance(state, tuple) else []
    if not fields or any(t.ndim < 1 or t.shape[0] != fields[0].shape[0] for t in fields):
        raise ValueError(f"stacked_qparams: expected a stacked state (every field with the same leading "
                         f"dimension), got {type(state).__name__} with field shapes "
                         f"{[tuple(t.shape) for t in fields]}")
    num_experts = fields[0].shape[0]
    if num_experts == 0:  # torch.vmap gave empty QParams; stacked_observer takes no 0-expert stack either
        raise ValueError(f"stacked_qparams: the state holds 0 experts (field shapes {[tuple(t.shape) for t in fields]}); "
                         "there are no qparams to compute")
    global_scale = options.get("global_scale")
    if isinstance(global_scale, torch.Tensor) and global_scale.numel() != 1:
        if global_scale.shape[0] != num_experts or global_scale.numel() != num_experts:
            raise ValueError(f"stacked_qparams: global_scale of shape {tuple(global_scale.shape)} is neither "
                             f"one value shared by the experts nor one per expert ([{num_experts}])")
        options.pop("global_scale")
        return torch.vmap(lambda one, scale: compute_qparams(one, spec, global_scale=scale, **options))(
            state, global_scale.reshape(num_experts))
    return torch.vmap(lambda one: compute_qparams(one, spec, **options))(state)
