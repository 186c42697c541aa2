"""What differs between the torch releases qstats supports (torch >= 2.6; see pyproject.toml).

- `bitcast`: ``x.view(dtype)`` of the same element size under ``vmap`` too (torch gained a
  batching rule for ``aten::view.dtype`` only in 2.13);
- `torch_dtype`: ``torch.<name>`` or None for dtypes of recent releases (``float8_e8m0fnu``:
  torch 2.7, ``float4_e2m1fn_x2``: torch 2.8), so that tables of dtypes build on every release;
- `assume_constant_result`: ``torch.compiler.assume_constant_result`` without importing the
  compiler (``torch._dynamo``: about two seconds, which ``import qstats`` paid for two marks).
"""

from __future__ import annotations

import sys
from typing import Optional

import torch

__all__ = ["assume_constant_result", "bitcast", "torch_dtype"]


def assume_constant_result(fn):
    """``fn``, marked as ``torch.compiler.assume_constant_result`` marks it (a call the compiler
    replaces by its result when tracing), without importing ``torch._dynamo`` as that function
    does: the mark is the attribute ``torch._dynamo.decorators.assume_constant_result`` sets, and
    the compiler reads it whenever it is imported (a test checks that torch's own function sets
    exactly this mark). Where ``torch._dynamo`` is loaded already, torch's own function."""
    if "torch._dynamo" in sys.modules:
        return torch.compiler.assume_constant_result(fn)
    fn._dynamo_marked_constant = True
    return fn


def torch_dtype(name: str) -> Optional[torch.dtype]:
    """``torch.<name>`` where this torch has that dtype, else None."""
    dtype = getattr(torch, name, None)
    return dtype if isinstance(dtype, torch.dtype) else None


def bitcast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.view(dtype)`` (``dtype`` of ``x``'s element size), under ``vmap`` too: a batched tensor
    is viewed underneath its batch dimension, which stays where it is (torch before 2.13 has no
    batching rule for ``view.dtype``). Under ``torch.compile`` the plain view."""
    functorch = torch._C._functorch
    if torch.compiler.is_compiling() or not functorch.is_batchedtensor(x):
        return x.view(dtype)
    level = functorch.maybe_get_level(x)
    inner, dim = functorch._unwrap_batched(x, level)
    return functorch._add_batch_dim(bitcast(inner, dtype), dim, level)
