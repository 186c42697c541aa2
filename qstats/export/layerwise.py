"""`compressed_tensors_layerwise`: the compressed-tensors export of a model whose weights do not fit
in memory, read from its safetensors checkpoint one decoder layer at a time and written one shard
per layer (the modules outside the layers in a last shard), or in shards of ``max_shard_size``, with
``model.safetensors.index.json``."""

from __future__ import annotations

import contextlib
import os
from typing import Mapping, Optional, Union

import torch
from tqdm.auto import tqdm

from .._checks import check_flag
from .._lazy_checkpoint import LazyCheckpoint, Overlay, check_covers, load_modules, release_modules
from ..layerwise import check_on_meta, decoder_layers, inside, outer_paths
from ._categories import ExportWarning
from .checkpoint import (ShardSplitter, Writer, _check_arguments, _source_folder, check_new_folder, parameter_count,
                         remove_shards, shard_bytes, shard_names, tensor_bytes, without_tied_copies, write_config,
                         write_shard_index, write_tensors)
from .mtp import PREFIX as MTP_PREFIX, declares_mtp

__all__ = ["compressed_tensors_layerwise"]

_WHERE = "export.compressed_tensors_layerwise"


def _parts(model: torch.nn.Module, layers: Optional[str]) -> list:
    """``(paths to load, recurse, keep(name))`` of each shard: every decoder layer, then the rest."""
    container_path, container = decoder_layers(model, layers, _WHERE)
    paths = [f"{container_path}.{index}" for index in range(len(container))]
    outer = (outer_paths(model, container_path), False, lambda name: not inside(name, container_path))
    return [([path], True, lambda name, path=path: inside(name, path)) for path in paths] + [outer]


class _Shards:
    """The shards of one export, written as the parts come (`add`) under temporary names, named as
    ``save_pretrained`` names them once their count is known (`close`). A `checkpoint.ShardSplitter`
    splits the tensors (as `compressed_tensors` does); without ``max_bytes`` each part is a shard. Only
    the open shard's tensors are kept (copied) from one part to the next, and every tensor's shape
    (``written``: meta tensors, counted into the index's ``total_parameters``)."""

    def __init__(self, path: str, max_bytes: Optional[int]):
        self.path, self.max_bytes = path, max_bytes
        self.splitter = ShardSplitter(max_bytes)
        self.files: list = []  # every file written (temporary names, then final ones): removed on failure
        self.open: dict = {}  # copies of the open shard's tensors of earlier parts
        self.written: dict = {}  # name -> a meta tensor of its shape and dtype, for every tensor added

    def add(self, tensors: dict) -> None:
        """Writes the shards that one part's ``tensors`` close, and copies those left in the open shard."""
        self.written.update((name, tensor.to("meta")) for name, tensor in tensors.items())
        for name, tensor in tensors.items():
            for shard in self.splitter.add(name, tensor_bytes(tensor)):
                self._write(shard, tensors)
        if self.max_bytes is None:
            self._write(self.splitter.close(), tensors)
        for name in self.splitter.open.keys() - self.open.keys():  # not a view holding the loaded layer
            self.open[name] = tensors[name].detach().to("cpu", copy=True)

    def _write(self, shard: dict, part: dict) -> None:
        tensors = {name: self.open.pop(name) if name in self.open else part[name] for name in shard}
        self.files.append(f"model-{len(self.splitter.shards):05d}.safetensors.partial")
        write_tensors(self.path, tensors, self.files[-1])

    def close(self, model: torch.nn.Module) -> None:
        """The open shard written; the files renamed: ``model.safetensors`` when ``max_bytes`` leaves
        one, else ``model-0000i-of-0000n.safetensors`` and ``model.safetensors.index.json`` (its
        ``total_parameters``: `checkpoint.parameter_count` of ``model`` and the tensors written)."""
        last = self.splitter.finish()
        if last is not None:
            self._write(last, {})
        names = shard_names(len(self.splitter.shards), single=self.max_bytes is not None)
        for partial, name in zip(list(self.files), names):
            os.replace(os.path.join(self.path, partial), os.path.join(self.path, name))
            self.files.append(name)
        write_shard_index(self.path, names, self.splitter.shards, parameter_count(model, self.written))


def _copied_mtp(model: torch.nn.Module, checkpoint: Union[str, os.PathLike]) -> tuple:
    """``("^mtp",)`` where the export copies the checkpoint's ``mtp.*`` tensors (`copy_mtp_tensors`): a
    config declaring MTP layers read from ``checkpoint``, or naming no folder (`write_config`); else ``()``."""
    config = getattr(model, "config", None)
    source = None if config is None else _source_folder(config)
    copied = config is not None and declares_mtp(config) and (source is None or _same_folder(source, checkpoint))
    return (f"^{MTP_PREFIX}",) if copied else ()


def _same_folder(first, second) -> bool:
    return os.path.abspath(os.fspath(first)) == os.path.abspath(os.fspath(second))


def _part_tensors(model: torch.nn.Module, source, writer: Writer, part: tuple, shards: _Shards) -> None:
    """Loads the modules of one part (a `_parts` entry), adds their tensors to ``shards`` and puts
    them back on meta."""
    paths, recurse, keep = part
    saved = load_modules(model, paths, source, recurse=recurse)
    try:
        state = {name: tensor for name, tensor in model.state_dict().items() if keep(name)}
        qparams = {module: sites for module, sites in writer.qparams.items() if keep(module)}
        shards.add(without_tied_copies(model, writer.part(qparams, state)))
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
    max_shard_size: Optional[Union[int, str]] = None,
    progress: bool = True,
    actorder: Optional[str] = None,
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
        safetensors (`gptq_layerwise`'s GPTQ'd weights), each under its name only: a GPTQ'd ``lm_head``
        tied to the embeddings is written alone, the embeddings float and ``config.json`` untied
        (llm-compressor's checkpoint); the model stays tied.
      layers: the path of the decoder layers' ``nn.ModuleList`` (default: the longest one).
      max_shard_size: None (default): one shard per decoder layer and one for the rest; else the
        largest shard, as in `compressed_tensors` (``"5GB"``, or bytes): the tensors, layer after layer,
        are split in order as ``save_pretrained(max_shard_size=...)`` splits them (one shard:
        ``model.safetensors``, no index). The shard being filled is kept in memory.
      progress: a progress bar over the parts (the decoder layers and the rest).
      actorder: as in `compressed_tensors` (`gptq_layerwise`'s, written into the weights' args).

    Returns:
      The ``quantization_config`` written into ``config.json``.

    Raises:
      ValueError: as `compressed_tensors`; ``checkpoint`` not a directory; parameters off the meta device;
        a tensor the checkpoint lacks; a tensor of ``weights`` the model lacks; ``path`` the checkpoint or
        holding safetensors files or an index.
    """
    _check_arguments(model, qparams, format)
    check_flag(progress, "progress", _WHERE)
    max_bytes = shard_bytes(max_shard_size, _WHERE)
    # a loaded model, or one accelerate offloads in part
    check_on_meta(model, _WHERE, "their values would be written instead of the checkpoint's",
                  ", or export a loaded model (one accelerate offloads too) with qstats.export.compressed_tensors")
    check_new_folder(path, checkpoint, _WHERE, "path")
    source = LazyCheckpoint(checkpoint, _WHERE)
    source = source if weights is None else Overlay(weights, source)
    check_covers(model, source, ExportWarning, read_elsewhere=_copied_mtp(model, checkpoint))
    writer = Writer(recipe, qparams, model, format, actorder)
    parts = _parts(model, layers)
    shards = _Shards(path, max_bytes)
    created = not os.path.exists(path)  # a folder the shards create is removed on failure, as never made
    try:
        for part in tqdm(parts, desc="qstats.export", disable=not progress):
            _part_tensors(model, source, writer, part, shards)
        unused = sorted(source.names() - source.used) if weights is not None else []
        if unused:
            raise ValueError(f"{_WHERE}: {len(unused)} tensor(s) of weights= name no tensor "
                             f"of the model: {', '.join(unused[:6])}")
        quantization_config = writer.finish()  # its refusals (a kv-cache scheme, ...) too leave no shard
        shards.close(model)
        write_config(path, model, quantization_config, retied=writer.retied, checkpoint=os.fspath(checkpoint))
    except BaseException:  # no half-written checkpoint left (check_new_folder found no shard there before)
        remove_shards(path, shards.files)
        if created:  # as compressed_tensors, whose refusals come before it writes: no folder left
            with contextlib.suppress(OSError):  # not emptied (another writer's files): kept
                os.rmdir(path)
        raise
    return quantization_config
