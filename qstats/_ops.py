"""How qstats defines its ``torch.library`` ops: ``@op("name")`` over a typed plain-torch function.

The function becomes ``torch.ops.qstats.name`` (pt2-compliant), its schema inferred from its type
hints as ``torch.library.custom_op`` infers it, and its one kernel serves every device
(``CompositeExplicitAutograd``). Each op then registers a fake (shape) rule for the compiler and,
where it runs under ``torch.vmap``, a vmap rule, with `register_fake` / `register_vmap` below. No
qstats op has a derivative (they read extremes, counts and checks; callers pass detached values),
so none takes ``custom_op``'s Python autograd layer, which costs more per call than a small reduction.
"""

from __future__ import annotations

import torch

__all__ = ["op", "register_fake", "register_vmap"]

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
