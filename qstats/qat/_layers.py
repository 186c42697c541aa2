"""The layers `prepare` quantizes, the function each computes, and each computed as its forward reads
it: its stock forward with a fake-quantized weight (`_stock_forward`), a parameter computed by a pruning or
weight-norm hook (`_layer_parameter`), a transposed convolution's weight in a convolution's layout."""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import prune
from torch.nn.utils.weight_norm import WeightNorm


# the layers `prepare` can quantize, and the function each computes
_LAYER_FUNCTIONS = {
    nn.Linear: F.linear, nn.Conv1d: F.conv1d, nn.Conv2d: F.conv2d, nn.Conv3d: F.conv3d,
    nn.ConvTranspose1d: F.conv_transpose1d, nn.ConvTranspose2d: F.conv_transpose2d,
    nn.ConvTranspose3d: F.conv_transpose3d, nn.Embedding: F.embedding, nn.EmbeddingBag: F.embedding_bag,
}
_DEFAULT_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
_CONV_TRANSPOSE = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
# the batch norm a layer's output may feed, to fold (prepare's fold_batchnorm): torch.ao's QAT ConvBn1d/2d/3d, LinearBn1d
_FOLDS = {nn.Conv1d: nn.BatchNorm1d, nn.Conv2d: nn.BatchNorm2d, nn.Conv3d: nn.BatchNorm3d, nn.Linear: nn.BatchNorm1d}
# weight-only layers: their inputs are integer ids, never observed (torch.ao's QAT Embedding/EmbeddingBag)
_EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)
# forwards that `prepare` rewrites: a subclass that keeps one is the layer it subclasses
_STOCK_FORWARDS = (*(layer.forward for layer in _LAYER_FUNCTIONS), nn.modules.batchnorm._BatchNorm.forward)
_EXTRA_INPUTS = ("qat_state", "qat_phase", "qat_ranges")  # keyword arguments the rewritten forward takes
# functional calls a traced-through forward makes (a subclass's own forward, `super().forward`): the
# layer type whose ``weight`` they may read, as torch.ao's prepare_qat_fx quantizes functional linear/conv
_FUNCTIONAL_LAYERS = {function: layer for layer, function in _LAYER_FUNCTIONS.items()}
# functional calls that read a parameter or buffer of the model no quantized layer's own forward passes (plain
# parameters, a weight tied to a layer's, a buffer): fake-quantized by the observers of the layer type computing the
# same function (torch.ao's prepare_qat_fx fake-quantizes their weight and input); torch.matmul is none (torch.ao
# gives its operands no weight observer), nor F.embedding (torch.ao's default backend config quantizes the
# nn.Embedding module only: the call stays in float there, whatever the qconfig)
_PARAMETER_CALLS = {F.linear: nn.Linear, F.conv1d: nn.Conv1d, F.conv2d: nn.Conv2d, F.conv3d: nn.Conv3d,
                    F.conv_transpose1d: nn.ConvTranspose1d, F.conv_transpose2d: nn.ConvTranspose2d,
                    F.conv_transpose3d: nn.ConvTranspose3d}


class _Substituted:
    """``layer`` as its stock forward reads it: ``weight`` (the fake-quantized one) and ``sparse`` replaced,
    every other attribute the layer's as `_layer_parameter` reads it; the layer stays as it is."""

    def __init__(self, layer: nn.Module, weight, sparse: bool):
        self.layer, self.weight, self.sparse = layer, weight, sparse

    def __getattr__(self, name: str):
        return _layer_parameter(self.layer, name)


def _stock_forward(layer: nn.Module, weight, sparse: bool, arguments: Dict[str, Any]):
    """``layer`` computed by the forward of the class of `_LAYER_FUNCTIONS` it is an instance of, with
    ``weight`` and (an embedding's) ``sparse`` in place of its own, running no hook. With
    ``max_norm``, an embedding renorms a copy of ``weight``: F.embedding renorms the rows it looks up in
    place, and ``weight`` is the parameter itself where nothing fake-quantizes it (torch.ao's QAT Embedding
    renorms its fake-quantized copy; the parameter stays as given)."""
    if getattr(layer, "max_norm", None) is not None:
        weight = weight.clone()
    forward = next(cls.forward for cls in _LAYER_FUNCTIONS if isinstance(layer, cls))
    return forward(_Substituted(layer, weight, sparse), **arguments)


# forward pre-hooks that compute a layer's parameter before each call from other attributes:
# torch.nn.utils.prune's (``name_orig * name_mask``) and the deprecated torch.nn.utils.weight_norm's
# (``name_g``, ``name_v``); the rewritten call runs no hook, so `_layer_parameter` computes them as they do


def _computing_hook(layer: nn.Module, name: str):
    """The pruning or weight-norm hook that computes ``layer``'s ``name`` before each call, or None."""
    return next((hook for hook in layer._forward_pre_hooks.values() if _computes(hook) == name), None)


def _computes(hook) -> Optional[str]:
    if isinstance(hook, prune.BasePruningMethod):
        return hook._tensor_name
    return hook.name if isinstance(hook, WeightNorm) else None


def _layer_parameter(layer: nn.Module, name: str):
    """``layer``'s attribute ``name`` (weight, bias, ...) as its forward reads it: where a pruning or weight-norm
    hook computes it (`_computing_hook`), computed as the hook does (the attribute holds the last call's result,
    with no gradient to the hook's parameters): a pruned one as torch.nn.utils.prune's ``apply_mask``
    (``mask * orig``), a weight-normed one with ``torch._weight_norm(v, g, dim)``; a parametrized one is
    computed from its parametrization."""
    hook = _computing_hook(layer, name)
    if hook is None:
        return getattr(layer, name)
    if isinstance(hook, prune.BasePruningMethod):
        orig = getattr(layer, f"{name}_orig")
        return getattr(layer, f"{name}_mask").to(dtype=orig.dtype) * orig
    return torch._weight_norm(getattr(layer, f"{name}_v"), getattr(layer, f"{name}_g"), hook.dim)


def _conv_layout(weight: torch.Tensor, groups: int) -> torch.Tensor:
    """A transposed convolution's weight ``[in, out/groups, *k]`` in the layout of a convolution's,
    ``[out, in/groups, *k]`` (output channel ``g * out/groups + j`` is column ``j`` of group ``g``'s rows),
    so that a weight spec reads as for Conv: ``PerAxis(0)`` is per output channel. Its own inverse."""
    rows, columns, kernel = weight.shape[0], weight.shape[1], weight.shape[2:]
    grouped = weight.reshape(groups, rows // groups, columns, *kernel).transpose(1, 2)
    return grouped.reshape(groups * columns, rows // groups, *kernel)


def _named_tensors(module: nn.Module) -> list:
    """``(name, tensor)`` of ``module``'s parameters and buffers, a shared one under each of its names."""
    return [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
