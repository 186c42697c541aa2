"""The checkpoint's names of a transformers model's tensors and modules: transformers 5 loads
checkpoints through a conversion mapping (Mixtral's ``block_sparse_moe.*`` becomes ``mlp.*``,
GraniteMoE's ``router.layer.weight`` becomes ``router.weight``) and its ``save_pretrained``
writes the original names back (``revert_weight_conversion``). llm-compressor's checkpoints carry
those names, and compressed-tensors maps its ``ignore`` list the same way
(``quant_config._map_to_checkpoint_names``); so does this export. Models without a mapping (and
plain ``nn.Module``s) keep their in-memory names.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ._checks import is_instance_named

__all__ = ["legacy_renamer", "load_transposes", "saved_tensors", "module_renamer"]


def _save_transforms(model: torch.nn.Module) -> list:
    """The transforms ``save_pretrained`` reverts (transformers' ``revert_weight_conversion``): those
    ``from_pretrained`` applied, else the model type's registered ones without prefix changes. A model
    that is no transformers ``PreTrainedModel`` has none, and does not import transformers (seconds)."""
    if not is_instance_named(model, "transformers", "PreTrainedModel"):
        return []
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange
    except ImportError:  # no transformers (5): nothing was renamed on load
        return []
    if not isinstance(model, PreTrainedModel):
        return []
    transforms = getattr(model, "_weight_conversions", None)
    if transforms is None:
        transforms = [t for t in get_model_conversion_mapping(model, add_legacy=False)
                      if not isinstance(t, PrefixChange)]
    return list(transforms or ())


def saved_tensors(model: torch.nn.Module, tensors: dict) -> dict:
    """``tensors`` under the names (and layout) transformers' ``save_pretrained`` gives the model's
    state dict: its own ``revert_weight_conversion``."""
    if not _save_transforms(model):
        return tensors
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, tensors)


def _renamer(transforms) -> Callable[[str], str]:
    """``name -> name`` with each of ``transforms`` reversed and applied in turn, last first."""
    reversed_transforms = [t.reverse_transform() for t in reversed(list(transforms))]

    def rename(name: str) -> str:
        for transform in reversed_transforms:
            renamed, matched = transform.rename_source_key(name)
            if matched is not None:
                name = renamed
        return name

    return rename


def module_renamer(model: torch.nn.Module) -> Callable[[str], str]:
    """``name -> checkpoint name`` of a module path, each reversed transform applied in turn, as
    compressed-tensors maps the ``ignore`` list of a checkpoint llm-compressor saves."""
    return _renamer(_save_transforms(model))


def legacy_renamer(model: torch.nn.Module) -> Callable[[str], str]:
    """``name -> name`` a tensor of ``model`` may have in an old checkpoint, which ``from_pretrained``
    renames on load (transformers' "legacy" conversions, applied to every model it loads): BERT's
    ``LayerNorm.gamma`` / ``LayerNorm.beta`` (``bert-base-uncased``'s safetensors) for ``weight`` /
    ``bias``, ``weight_g`` / ``weight_v`` of weight-normed layers for their parametrizations. The
    name itself where none applies, and for models transformers does not load."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:
        return lambda name: name
    if not isinstance(model, PreTrainedModel):
        return lambda name: name
    return _renamer(get_checkpoint_conversion_mapping("legacy") or ())


def load_transposes(model: torch.nn.Module) -> Callable[[str], Optional[tuple]]:
    """``name -> (dim0, dim1)`` of the transpose ``from_pretrained`` applies to the stored tensor
    ``name`` where its shape is not the model's (transformers' ``Transpose(check_dims=True)``:
    Qwen3-VL-MoE's stacked experts, stored ``[experts, in, out]`` in its released checkpoints), None
    where it applies none. Patterns with wildcards are not matched (none of these converters has one)."""
    try:
        from transformers.core_model_loading import Transpose, WeightConverter
    except ImportError:
        return lambda name: None
    found = [(pattern, converter.operations[0]) for converter in _save_transforms(model)
             if isinstance(converter, WeightConverter) and len(converter.operations) == 1
             and isinstance(converter.operations[0], Transpose) and converter.operations[0].check_dims
             for pattern in converter.target_patterns if "*" not in pattern]  # fmt: skip

    def dims(name: str) -> Optional[tuple]:
        return next(((op.dim0, op.dim1) for pattern, op in found if name.endswith(pattern)), None)

    return dims
