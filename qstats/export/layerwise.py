"""`compressed_tensors_layerwise`: the compressed-tensors export of a model whose weights do not fit
in memory, read from its safetensors checkpoint one decoder layer at a time and written one shard
per layer (the modules outside the layers in a last shard) with ``model.safetensors.index.json``."""

from __future__ import annotations

import os
from typing import Mapping, Optional, Union

import torch
from tqdm.auto import tqdm

from .._lazy_checkpoint import LazyCheckpoint, Overlay, check_covers, load_modules, release_modules
from ..layerwise import check_on_meta, decoder_layers, inside, outer_paths
from .checkpoint import (Writer, _check_arguments, check_new_folder, remove_shards, shard_name, tensor_bytes,
                         without_tied_copies, write_config, write_index, write_tensors)

__all__ = ["compressed_tensors_layerwise"]

_WHERE = "export.compressed_tensors_layerwise"


def _parts(model: torch.nn.Module, layers: Optional[str]) -> list:
    """``(paths to load, recurse, keep(name))`` of each shard: every decoder layer, then the rest."""
    container_path, container = decoder_layers(model, layers, _WHERE)
    paths = [f"{container_path}.{index}" for index in range(len(container))]
    outer = (outer_paths(model, container_path), False, lambda name: not inside(name, container_path))
    return [([path], True, lambda name, path=path: inside(name, path)) for path in paths] + [outer]


def _write_part(model: torch.nn.Module, source, writer: Writer, part: tuple, path: str,
                filename: str) -> dict:
    """Loads the modules of one shard (a `_parts` entry), writes their tensors as ``path/filename``
    and puts them back on meta; returns ``{name: bytes}`` of the tensors written."""
    paths, recurse, keep = part
    saved = load_modules(model, paths, source, recurse=recurse)
    try:
        state = {name: tensor for name, tensor in model.state_dict().items() if keep(name)}
        qparams = {module: sites for module, sites in writer.qparams.items() if keep(module)}
        tensors = without_tied_copies(model, writer.part(qparams, state))
        write_tensors(path, tensors, filename)
        return {name: tensor_bytes(tensor) for name, tensor in tensors.items()}
    finally:
        release_modules(saved)


def compressed_tensors_layerwise(
    model: torch.nn.Module,
    checkpoint: Union[str, os.PathLike],
    qparams: Mapping,
    path: str,
    recipe,
    *,
    weights: Optional[Union[dict, str, os.PathLike]] = None,
    layers: Optional[str] = None,
    format: Optional[str] = None,
    progress: bool = True,
) -> dict:
    """`compressed_tensors` of a model built on the meta device, its tensors read from ``checkpoint``.

    Writes the tensors `compressed_tensors` writes for the loaded model, as one shard per decoder
    layer and one for the modules outside them, with ``model.safetensors.index.json`` and
    ``config.json``. Only one layer's tensors are in memory at a time.

    Args:
      model: the model on the meta device (as `calibrate_layerwise` takes it); left on meta.
      checkpoint: its safetensors folder (``model.safetensors`` or shards and their index).
      qparams, path, format: as in `compressed_tensors`.
      recipe: the calibration `qstats.Recipe` or its `Plan` (resolved on ``model``).
      weights: tensors to write instead of the checkpoint's: ``{name: tensor}`` or a folder of
        safetensors (`gptq_layerwise`'s GPTQ'd weights).
      layers: the path of the decoder layers' ``nn.ModuleList`` (default: the longest one).
      progress: a progress bar over the shards.

    Returns:
      The ``quantization_config`` written into ``config.json``.

    Raises:
      ValueError: as `compressed_tensors`; ``checkpoint`` not a directory; parameters off the meta device;
        a tensor the checkpoint lacks; a tensor of ``weights`` the model lacks; ``path`` the checkpoint or
        holding safetensors files or an index.
    """
    _check_arguments(model, qparams, format)
    check_on_meta(model)
    check_new_folder(path, checkpoint, _WHERE, "path")
    source = LazyCheckpoint(checkpoint, _WHERE)
    source = source if weights is None else Overlay(weights, source)
    check_covers(model, source)
    writer = Writer(recipe, qparams, model, format)
    parts = _parts(model, layers)
    weight_map: dict = {}
    written: list = []  # the shards this call wrote: removed if it fails
    size = 0
    try:
        for number, part in enumerate(tqdm(parts, desc="qstats.export", disable=not progress), 1):
            written.append(shard_name(number, len(parts)))
            tensors = _write_part(model, source, writer, part, path, written[-1])
            weight_map.update(dict.fromkeys(tensors, written[-1]))
            size += sum(tensors.values())
        unused = sorted(source.names() - source.used) if weights is not None else []
        if unused:
            raise ValueError(f"{_WHERE}: {len(unused)} tensor(s) of weights= name no tensor "
                             f"of the model: {', '.join(unused[:6])}")
        quantization_config = writer.finish()  # its refusals (a kv-cache scheme, ...) too leave no shard
        write_index(path, weight_map, size)
        write_config(path, model, quantization_config)
    except BaseException:  # no half-written checkpoint left (check_new_folder found no shard there before)
        remove_shards(path, written)
        raise
    return quantization_config
