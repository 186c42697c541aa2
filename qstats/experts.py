"""Stacked mixture-of-experts weights: one vmapped observer call, routing masks as weights.

Fused MoE implementations (transformers' ``Qwen3MoeExperts``, ``MixtralExperts``, ``OlmoeExperts``,
GPT-OSS) keep the weights of all experts in 3-D parameters ``[E, out, in]``. `stacked_observer`
turns an observer of one expert's tensor into an observer of the stack, by ``torch.vmap`` over
the leading expert dimension, so calibrating E experts is one call, not a loop.

Activation statistics per expert use the router's assignment as the update ``weight``: the
hidden states ``[tokens, hidden]`` are shared by every expert (an expanded view, no copy) and
expert ``e`` sees only the rows routed to it (`routing_mask`). An expert that received no token
keeps an empty state: ``compute_qparams`` reports it in ``QParams.calibrated`` and applies the
spec's ``on_uncalibrated`` policy, never a NaN, Inf or zero scale.
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch

from .observers import Observer

__all__ = [
    "UncalibratedWarning",
    "expert_count",
    "is_stacked_parameter",
    "dispatch",
    "routing_mask",
    "stacked_observer",
    "uncovered_experts",
    "warn_uncovered",
]


class UncalibratedWarning(UserWarning):
    """Some quantization parameters (experts that received no token) saw no data."""


def expert_count(module: torch.nn.Module) -> int:
    """The number of stacked experts of ``module``, or 0.

    A module holds stacked experts when it has an int ``num_experts`` attribute (as every fused
    experts module of transformers does) and owns, directly, a parameter of 3 or more dimensions
    whose leading dimension is that count. (Convolutions and other modules with 3-D or 4-D weights
    but no ``num_experts`` are never taken for experts.)
    """
    declared = getattr(module, "num_experts", None)
    if not isinstance(declared, int) or isinstance(declared, bool) or declared < 1:
        return 0
    for param in module.parameters(recurse=False):
        if param.ndim >= 3 and param.shape[0] == declared:
            return declared
    return 0


def is_stacked_parameter(param: torch.Tensor, num_experts: int) -> bool:
    """True when ``param`` is a stack of per-expert tensors (``[E, ...]`` with ``E = num_experts``
    and at least one more dimension)."""
    return bool(num_experts) and param.ndim >= 2 and param.shape[0] == num_experts


def stacked_observer(observer: Observer, num_experts: int) -> Observer:
    """An observer of ``[E, ...]`` stacks built from an observer of one expert's tensor.

    ``init``, ``update`` and ``merge`` are ``torch.vmap`` of the given ones over dimension 0, so the
    laws of ``observer`` hold per expert. ``update(state, x, weight=None)`` takes ``x`` of shape
    ``[E, ...]`` (use ``x.expand(E, *x.shape)`` for activations shared by every expert: such an
    expanded ``x`` is passed unbatched, so row reductions happen once for all experts) and an
    optional ``weight`` of shape ``[E, ...]`` (the routing mask).

    >>> import torch, qstats
    >>> spec = qstats.QuantSpec(granularity=qstats.PerAxis(0))
    >>> obs = qstats.stacked_observer(qstats.minmax(spec), 4)
    >>> w = torch.randn(4, 6, 3)
    >>> obs.update(obs.init(w), w).max_val.shape
    torch.Size([4, 6])
    """
    if not isinstance(observer, Observer):
        raise TypeError(f"stacked_observer expects an Observer, got {type(observer).__name__}")
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")

    def check(x: torch.Tensor, what: str) -> None:
        if x.ndim < 1 or x.shape[0] != num_experts:
            raise ValueError(
                f"stacked_observer: {what} of shape {tuple(x.shape)} does not have the leading expert "
                f"dimension {num_experts}"
            )

    batched_init = torch.vmap(observer.init)
    update_with_weight = torch.vmap(observer.update)
    update_shared = torch.vmap(observer.update, in_dims=(0, None, 0))
    update_without_weight = torch.vmap(lambda state, x: observer.update(state, x))
    batched_merge = torch.vmap(observer.merge)

    def init_fn(x: torch.Tensor):
        check(x, "x")
        return batched_init(x)

    def update_fn(state, x: torch.Tensor, weight: Optional[torch.Tensor] = None):
        check(x, "x")
        if weight is None:
            return update_without_weight(state, x)
        check(weight, "weight")
        if x.stride(0) == 0:  # one tensor shared by every expert (x.expand(E, ...)): observe it once
            return update_shared(state, x[0], weight)
        return update_with_weight(state, x, weight)

    def merge_fn(a, b):
        return batched_merge(a, b)

    return Observer(
        init_fn,
        update_fn,
        merge_fn,
        exact=observer.exact,
        spec=observer.spec,
        name=f"stacked({observer.name})",
    )


_INDEX_NAMES = ("top_k_index", "router_indices", "selected_experts", "expert_indices", "topk_ids")


def routing_mask(args: tuple, kwargs: dict, num_experts: int, tokens: int) -> Optional[torch.Tensor]:
    """The ``[E, tokens]`` float mask of which token went to which expert, read from an experts
    module's call ``forward(hidden_states, top_k_index, top_k_weights)``.

    The first integer tensor of shape ``[tokens, k]`` (or a keyword named like ``top_k_index``)
    holds the selected experts; indices outside ``[0, E)`` (padding slots) route nowhere. Returns
    None when no routing tensor is found.
    """
    candidates = [kwargs[name] for name in _INDEX_NAMES if name in kwargs]
    candidates += list(args[1:]) + list(kwargs.values())
    for value in candidates:
        if (
            isinstance(value, torch.Tensor)
            and not value.is_floating_point()
            and value.dtype != torch.bool
            and value.ndim == 2
            and value.shape[0] == tokens
        ):
            index = value.long()
            inside = (index >= 0) & (index < num_experts)
            index = torch.where(inside, index, torch.full_like(index, num_experts))
            one_hot = torch.nn.functional.one_hot(index, num_classes=num_experts + 1)[..., :num_experts]
            return one_hot.amax(dim=1).transpose(0, 1).to(torch.float32)
    return None


def dispatch(tokens: torch.Tensor, mask: torch.Tensor, capacity: Optional[int] = None):
    """Each expert's tokens gathered into a fixed-shape stack: ``(x [E, C, ...], weight [E, C])``.

    Row ``c`` of expert ``e`` is the ``c``-th token routed to ``e`` (token order kept); rows past
    an expert's token count are padding with weight 0. ``capacity`` ``C`` defaults to the largest
    token count of any expert (read on the host; pass ``tokens.shape[0]`` to avoid that). The
    statistics equal those of ``tokens`` shared by every expert with ``mask`` as the weight, on
    ``E * C`` rows instead of ``E * tokens``.
    """
    if mask.ndim != 2 or mask.shape[1] != tokens.shape[0]:
        raise ValueError(
            f"dispatch: mask of shape {tuple(mask.shape)} does not match {tokens.shape[0]} tokens ([E, tokens])"
        )
    if capacity is None:
        capacity = int((mask != 0).sum(dim=1).max()) if mask.numel() else 0
    capacity = max(1, min(int(capacity), tokens.shape[0]))
    order = torch.argsort((mask != 0).to(torch.int8), dim=1, descending=True, stable=True)[:, :capacity]
    return tokens[order], torch.gather(mask, 1, order)


def uncovered_experts(state) -> Optional[list]:
    """Indices of the experts whose stacked state saw no value (from its ``count`` field), or None
    when the state has no ``count`` field."""
    count = getattr(state, "count", None)
    if not isinstance(count, torch.Tensor) or count.ndim < 1:
        return None
    seen = count.reshape(count.shape[0], -1).sum(dim=1)
    return [int(i) for i in torch.arange(count.shape[0])[seen == 0]]


def warn_uncovered(states: dict, sites: dict) -> dict:
    """Warns (`UncalibratedWarning`) naming, per stacked activation site, the experts that
    received no token; returns ``{path: {site: [expert indices]}}`` of those sites."""
    missing: dict = {}
    for path, entry in sites.items():
        for site, found in entry.items():
            if not found.num_experts or site not in states.get(path, {}):
                continue
            experts = uncovered_experts(states[path][site])
            if experts:
                missing.setdefault(path, {})[site] = experts
    if missing:
        lines = [
            f"{path}.{site}: experts {experts} ({len(experts)} of {sites[path][site].num_experts})"
            for path, entry in missing.items()
            for site, experts in entry.items()
        ]
        warnings.warn(
            "qstats.calibrate: some experts received no calibration token; their quantization "
            "parameters follow the spec's on_uncalibrated policy (QParams.calibrated is False there): "
            + "; ".join(lines),
            UncalibratedWarning,
            stacklevel=3,
        )
    return missing
