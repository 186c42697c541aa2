"""Multi-token-prediction (MTP) tensors carried from the source checkpoint into the export.

transformers does not load a model's MTP layers (``mtp.*`` tensors, kept for speculative decoding:
Qwen3-Next, Qwen3.5), so the exported model lacks them; llm-compressor's save copies them as they
are into ``model_mtp.safetensors``, adds them to the index and ignores ``re:^mtp.*`` in the
quantization config. This module does the same, for a model whose text config declares MTP layers
(``num_mtp_layers`` or ``mtp_num_hidden_layers``) and whose source folder holds such tensors.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

from .._warn import warn
from ._categories import ExportWarning

__all__ = ["copy_mtp_tensors", "MTP_IGNORE"]

PREFIX = "mtp"
SHARD = "model_mtp.safetensors"
MTP_IGNORE = f"re:^{PREFIX}.*"
INDEX = "model.safetensors.index.json"


def declares_mtp(model_config: Any) -> bool:
    """Whether the model's text config declares MTP layers, as llm-compressor's save asks."""
    text_config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    return bool(getattr(text_config, "num_mtp_layers", 0) or getattr(text_config, "mtp_num_hidden_layers", 0))


def _weight_map(folder: str) -> dict:
    """``{tensor name: file}`` of the safetensors checkpoint in ``folder``: its index's entries whose file
    is there, then the tensors of its ``model.safetensors`` (which ``from_pretrained`` reads over an index,
    one that may name removed shards); an export's ``model_mtp.safetensors`` beside ``model.safetensors``
    is named by the index only. Empty where there is neither."""
    from safetensors import safe_open

    found = {}
    if os.path.isfile(os.path.join(folder, INDEX)):
        with open(os.path.join(folder, INDEX)) as file:
            found = {name: file_name for name, file_name in json.load(file)["weight_map"].items()
                     if os.path.isfile(os.path.join(folder, file_name))}
    single = os.path.join(folder, "model.safetensors")
    if os.path.isfile(single):
        with safe_open(single, framework="pt") as file:
            found.update(dict.fromkeys(file.keys(), "model.safetensors"))
    return found


def copy_mtp_tensors(source: Optional[str], path: str, model_config: Any) -> bool:
    """Copies the ``mtp.*`` tensors of ``source`` (the folder the model was read from) into
    ``path/model_mtp.safetensors`` and the index of ``path`` (made where there was one file), for a
    model that declares MTP layers; True where it copied any (the caller ignores them in the
    quantization config). A model that declares MTP layers whose source is not found or holds none
    is warned of: the checkpoint lacks them."""
    if not declares_mtp(model_config):
        return False
    if source is None:
        warn(f"export: the model's config declares MTP layers but the folder it was read from (_name_or_path "
             f"{getattr(model_config, '_name_or_path', '')!r}) is not found (a folder with a config.json, or a Hub "
             f"model in the local cache); the checkpoint has no '{PREFIX}.*' tensors", ExportWarning)
        return False
    if os.path.abspath(source) == os.path.abspath(path):
        return False
    from safetensors import safe_open
    from safetensors.torch import save_file

    found = {name: file for name, file in _weight_map(source).items() if name.startswith(PREFIX)}
    if not found:
        warn(f"export: the model's config declares MTP layers but {source!r} holds no '{PREFIX}.*' tensors; "
             "the checkpoint has none (as llm-compressor's save)", ExportWarning)
        return False
    tensors = {}
    for name, file in sorted(found.items()):
        with safe_open(os.path.join(source, file), framework="pt") as opened:
            tensors[name] = opened.get_tensor(name)
    save_file(tensors, os.path.join(path, SHARD), metadata={"format": "pt"})
    weight_map = {**_weight_map(path), **dict.fromkeys(tensors, SHARD)}
    size = sum(os.path.getsize(os.path.join(path, file)) for file in set(weight_map.values()))
    with open(os.path.join(path, INDEX), "w") as file:
        json.dump({"metadata": {"total_size": size}, "weight_map": weight_map}, file, indent=2, sort_keys=True)
    return True
