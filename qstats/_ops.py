"""How qstats defines its ``torch.library`` ops: ``@op("name")`` over a typed plain-torch function.

The function becomes ``torch.ops.qstats.name``, its schema inferred from its type hints as
``torch.library.custom_op`` infers it, and its one kernel serves every device
(``CompositeExplicitAutograd``). Each op then registers a fake (shape) rule for the compiler and,
where it runs under ``torch.vmap``, a vmap rule (``torch.library.register_fake`` /
``register_vmap``). No qstats op is differentiated (they read extremes, counts and checks), so none
takes ``custom_op``'s Python autograd layer, which costs more per call than a small reduction.
"""

from __future__ import annotations

import torch

__all__ = ["op"]

_LIBRARY = torch.library.Library("qstats", "FRAGMENT")  # filled at import, as custom_op's would be


def op(name: str):
    """Decorator: defines ``qstats::name`` from the function and returns the op (``.default``)."""

    def define(function):
        _LIBRARY.define(name + torch.library.infer_schema(function, mutates_args=()))
        _LIBRARY.impl(name, function, "CompositeExplicitAutograd")
        return getattr(torch.ops.qstats, name).default

    return define
