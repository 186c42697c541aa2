"""What differs between the torch releases qstats supports (torch >= 2.6; see pyproject.toml).

- `bitcast`: ``x.view(dtype)`` of the same element size under ``vmap`` too (torch gained a
  batching rule for ``aten::view.dtype`` only in 2.13);
- `torch_dtype`: ``torch.<name>`` or None for dtypes of recent releases (``float8_e8m0fnu``:
  torch 2.7, ``float4_e2m1fn_x2``: torch 2.8), so that tables of dtypes build on every release;
- `recomputing`: whether a forward runs inside autograd's backward (activation checkpointing),
  which torch tells only through a private call;
- `cached_parametrization`: the value ``torch.nn.utils.parametrize.cached()`` holds for a
  parametrized tensor, which torch keeps private;
- `capturing_graph`: whether ``torch.export`` or ``torch.jit.trace`` is recording a forward (the
  torch.ao drop-in modules write into their buffers in place there, as torch.ao's observers do);
- `rounded_to`: a tensor rounded to a half-precision dtype's values that ``torch.compile`` keeps
  (inductor drops a ``x.to(half).float()`` pair of casts unless the process-wide
  ``torch._inductor.config.emulate_precision_casts`` is set).
"""

from __future__ import annotations

import sys
from typing import Optional

import torch
from torch.nn.utils import parametrize

from ._ops import op, register_fake, register_vmap

__all__ = ["bitcast", "cached_parametrization", "capturing_graph", "compiled", "eager", "recomputing", "rounded_to", "torch_dtype", "unwrapped"]


def torch_dtype(name: str) -> Optional[torch.dtype]:
    """``torch.<name>`` where this torch has that dtype, else None."""
    dtype = getattr(torch, name, None)
    return dtype if isinstance(dtype, torch.dtype) else None


def dtype_named(value):
    """``value`` as a torch dtype where it names one as plain data does (``"bfloat16"``, or
    ``"torch.float16"`` as compressed-tensors serialises it), else ``value`` (for the caller's check)."""
    return (torch_dtype(value.removeprefix("torch.")) or value) if isinstance(value, str) else value


# torch 2.13 added the batching rule of ``aten::view.dtype``
_VIEW_DTYPE_BATCHES = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 13)


def bitcast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.view(dtype)`` (``dtype`` of ``x``'s element size), under ``vmap`` too: on torch before
    2.13, which has no batching rule for ``view.dtype``, a batched tensor is viewed underneath its
    batch dimension. (The one place qstats reads functorch's internals: a shim for old releases.)"""
    if _VIEW_DTYPE_BATCHES:
        return x.view(dtype)
    functorch = torch._C._functorch
    if torch.compiler.is_compiling() or not functorch.is_batchedtensor(x):
        return x.view(dtype)
    level = functorch.maybe_get_level(x)
    inner, dim = functorch._unwrap_batched(x, level)
    return functorch._add_batch_dim(bitcast(inner, dtype), dim, level)


def _wrappers(model: torch.nn.Module):
    """``model`` and each module it wraps in turn (see `unwrapped`), outermost first."""
    dynamo = sys.modules.get("torch._dynamo")  # imported by torch.compile; importing it costs seconds
    wrappers = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
    while True:
        yield model
        if dynamo is not None and isinstance(model, dynamo.eval_frame.OptimizedModule):
            model = model._orig_mod
        elif isinstance(model, wrappers):
            model = model.module
        else:
            return


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The module that ``torch.compile`` (``OptimizedModule._orig_mod``), ``DistributedDataParallel``
    and ``DataParallel`` (``module``) wrap, however nested, else ``model``: recipes resolve on it, so a
    wrapped model's sites are named (and targeted, and ignored) by the bare model's paths rather than
    ``"_orig_mod.<path>"`` or ``"module.<path>"``, as ``save_pretrained(model.module)`` names them."""
    *_, model = _wrappers(model)
    return model


def compiled(model: torch.nn.Module) -> bool:
    """Whether ``model`` is, or wraps (under DDP or DataParallel), a ``torch.compile``'d module."""
    dynamo = sys.modules.get("torch._dynamo")
    return dynamo is not None and any(isinstance(m, dynamo.eval_frame.OptimizedModule) for m in _wrappers(model))


def eager(hook):
    """``hook`` run eagerly inside a compiled model (``torch.compiler.disable(hook)``) once
    ``torch.compile`` is loaded, else ``hook`` itself: ``torch.compiler.disable`` imports dynamo,
    which costs seconds, and a model cannot be compiled before torch.compile is loaded. Applied
    where a hook is registered, not where it is defined, so that importing qstats imports no dynamo."""
    if "torch._dynamo" not in sys.modules:
        return hook
    return torch.compiler.disable(hook)


def recomputing() -> bool:
    """Whether autograd's backward is running: a forward there is activation checkpointing's
    recomputation (`torch.utils.checkpoint`, transformers' gradient checkpointing) of tensors
    already observed, not new data (torch's own ``ModuleTracker`` and FSDP tell backward apart so)."""
    return torch._C._current_graph_task_id() != -1


def cached_parametrization(module: torch.nn.Module, name: str) -> Optional[torch.Tensor]:
    """The value of ``module``'s parametrized ``name`` that ``torch.nn.utils.parametrize.cached()``
    holds (computed by an earlier read inside it, whose later reads return it without running the
    parametrization or its hooks), else None; torch keeps that cache private."""
    return parametrize._cache.get((id(module), name)) if parametrize._cache_enabled else None


def capturing_graph() -> bool:
    """Whether ``torch.export`` or ``torch.jit.trace`` is recording the running forward: both keep
    in-place writes into a module's buffers and drop attributes it assigns anew."""
    return torch.compiler.is_exporting() or torch.jit.is_tracing()


@op("rounded_to")
def _rounded_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype).to(x.dtype)


@register_fake(_rounded_to)
def _(x, dtype):
    return torch.empty_like(x)


register_vmap(_rounded_to, lambda info, in_dims, x, dtype: (_rounded_to(x, dtype), in_dims[0]))


def rounded_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype).to(x.dtype)``: ``x`` rounded to ``dtype``'s values (bf16/fp16 arithmetic that a
    reference library does in that dtype), eagerly, under ``vmap`` and under ``torch.compile``, where
    inductor would drop the pair of casts and keep float32 values. One opaque op: no gradient."""
    return _rounded_to(x, dtype)
