"""How qstats defines its ``torch.library`` ops: ``@op("name")`` over a typed plain-torch function.

The function becomes ``torch.ops.qstats.name`` (pt2-compliant), its schema inferred from its type
hints as ``torch.library.custom_op`` infers it, and its one kernel serves every device
(``CompositeExplicitAutograd``). Each op then registers a fake (shape) rule for the compiler and,
where it runs under ``torch.vmap``, a vmap rule, with `register_fake` / `register_vmap` below. No
qstats op has a derivative (they read extremes, counts and checks; callers pass detached values),
so none takes ``custom_op``'s Python autograd layer, which costs more per call than a small reduction.
Nor has any a DTensor (sharding) rule: callers observe a DTensor's ``full_tensor()`` (`is_dtensor`).
"""

from __future__ import annotations

import sys

import torch

__all__ = ["is_dtensor", "op", "register_fake", "register_vmap"]

# One library per op, filled at import: a module reloaded (``importlib.reload``, autoreload)
# destroys its op's library, rules included, and defines the op again.
_LIBRARIES: dict = {}


def op(name: str):
    """Decorator: defines ``qstats::name`` from the function and returns the op (``.default``)."""

    def define(function):
        previous = _LIBRARIES.pop(name, None)
        if previous is not None:
            previous._destroy()
        library = _LIBRARIES[name] = torch.library.Library("qstats", "FRAGMENT")
        schema = torch.library.infer_schema(function, mutates_args=())
        library.define(name + schema, tags=(torch.Tag.pt2_compliant_tag,))
        library.impl(name, function, "CompositeExplicitAutograd")
        return getattr(torch.ops.qstats, name).default

    return define


def _library(operator) -> torch.library.Library:
    return _LIBRARIES[operator._schema.name.split("::")[1]]


def register_fake(operator):
    """Decorator: the fake (shape) rule of a qstats op, kept with its library."""
    return torch.library.register_fake(operator, lib=_library(operator))


def register_vmap(operator, rule) -> None:
    """The vmap rule of a qstats op, kept with its library."""
    torch.library.register_vmap(operator, rule, lib=_library(operator))


def is_dtensor(x) -> bool:
    """Whether ``x`` is a ``torch.distributed.tensor.DTensor`` (the parameters of FSDP2's
    ``fully_shard`` between forwards, tensor-parallel ones), which no qstats op takes. Imports
    nothing: where ``torch.distributed.tensor`` was never imported, no tensor is one."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(x, module.DTensor)
