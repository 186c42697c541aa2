"""Loading the weights of one module at a time from a directory of safetensors shards.

`LazyCheckpoint` reads a checkpoint (``model.safetensors``, else shards and their
``model.safetensors.index.json``, as ``from_pretrained`` picks them) tensor by tensor with
``safetensors.safe_open``; `load_modules` puts a module's parameters and buffers (built on the meta
device) on the CPU (or a device) in the meta tensor's dtype (as ``from_pretrained`` casts a checkpoint
to the model's dtype) and returns what `release_modules` needs to put the meta tensors back.
Stacked experts (3-D ``gate_up_proj`` / ``down_proj``) are read from the per-expert keys
transformers writes (``experts.<e>.gate_proj.weight`` ...) when the checkpoint has no stacked key.
A tensor the checkpoint lacks under its in-memory name is looked up under the name transformers'
``save_pretrained`` gives it (its reversed conversion mapping, `_checkpoint_names.module_renamer`):
Mixtral's ``mlp.gate.weight`` is stored as ``block_sparse_moe.gate.weight``.
"""

from __future__ import annotations

import itertools
import json
import os
import re
from typing import Callable, Optional

import torch
from safetensors import safe_open

from ._checkpoint_names import legacy_renamer, load_transposes, module_renamer
from ._warn import warn

__all__ = ["LazyCheckpoint", "Overlay", "check_covers", "load_modules", "release_modules"]

# Stacked parameter -> the per-expert Linear weights it is made of, concatenated along their
# output dimension in this order (transformers' MergeModulelist + Concatenate conversions).
_EXPERT_SOURCES = {
    "gate_up_proj": (("gate_proj", "up_proj"), ("w1", "w3")),
    "down_proj": (("down_proj",), ("w2",)),
}


class LazyCheckpoint:
    """The tensor names of a safetensors checkpoint directory and where each one lives; tensors
    are read one at a time (`tensor`), never the whole file."""

    def __init__(self, directory, where: str = "calibrate_layerwise"):
        self.directory = os.fspath(directory)
        self.where = where  # the public function named in errors
        if not os.path.isdir(self.directory):
            raise ValueError(f"{where}: checkpoint {self.directory!r} is not a directory")
        _check_float_weights(self.directory, where)
        index = os.path.join(self.directory, "model.safetensors.index.json")
        # model.safetensors first, as from_pretrained reads it: save_pretrained writing one file over
        # shards removes the shards but leaves their index behind
        if os.path.exists(os.path.join(self.directory, "model.safetensors")):
            with self._open("model.safetensors") as file:
                self.files = {key: "model.safetensors" for key in file.keys()}
        elif os.path.exists(index):
            try:
                with open(index) as file:
                    self.files = _weight_map(json.load(file))
            except (ValueError, KeyError, TypeError) as error:  # not JSON, or no {name: file} weight_map
                raise ValueError(f"{where}: {index!r} is not a safetensors index with a weight_map: "
                                 f"{type(error).__name__}: {error}") from None
            self._check_shards()
        else:
            raise ValueError(f"{where}: {self.directory!r} holds neither model.safetensors nor "
                             f"model.safetensors.index.json{_other_formats(self.directory)}")

    def _open(self, filename: str):
        """``safe_open`` of one of the checkpoint's files; a missing or unreadable file is a ValueError naming it."""
        path = os.path.join(self.directory, filename)
        if not os.path.isfile(path):
            raise ValueError(f"{self.where}: the checkpoint's file {path!r} is missing")
        try:
            return safe_open(path, "pt", device="cpu")
        except Exception as error:  # safetensors' SafetensorError (corrupt or truncated header), OSError
            raise ValueError(f"{self.where}: the checkpoint's file {path!r} cannot be read as safetensors: "
                             f"{error}") from None

    def _check_shards(self) -> None:
        """Every shard the index names exists, reads as safetensors and holds the tensors the index
        puts there (headers only): a bad checkpoint fails before any batch runs, naming the file."""
        for filename, keys in self._by_file(self.files).items():
            try:
                file = self._open(filename)
            except ValueError as error:  # which tensors the index puts there: the download that failed
                more = " ..." if len(keys) > 3 else ""
                raise ValueError(f"{error} (the index puts {len(keys)} tensor(s) there: {', '.join(keys[:3])}{more})") from None
            with file:
                held = set(file.keys())
            absent = [key for key in keys if key not in held]
            if absent:
                raise ValueError(f"{self.where}: the index puts {len(absent)} tensor(s) in {filename!r}, which lacks "
                                 f"them: {', '.join(absent[:3])}")

    def _by_file(self, keys) -> dict:
        """``{file name: [its keys]}`` of the tensors ``keys``, in their order."""
        by_file: dict = {}
        for key in keys:
            by_file.setdefault(self.files[key], []).append(key)
        return by_file

    def __contains__(self, key: str) -> bool:
        return key in self.files

    def file_of(self, key: str) -> str:
        """The path of the file holding the tensor ``key`` (named in errors about it)."""
        return os.path.join(self.directory, self.files[key])

    def headers(self, keys: list) -> dict:
        """``{key: (shape, dtype)}`` of the tensors ``keys`` from their files' headers (no tensor is
        read; each file opened once); the dtype as torch's where it has one, else safetensors' name."""
        found = {}
        for filename, held in self._by_file(keys).items():
            with self._open(filename) as file:
                for key in held:
                    view = file.get_slice(key)
                    found[key] = (tuple(view.get_shape()), _ST_DTYPES.get(view.get_dtype(), view.get_dtype()))
        return found

    def tensor(self, key: str) -> torch.Tensor:
        """The tensor ``key``, read from its shard onto the CPU in its stored dtype."""
        if key not in self.files:
            raise ValueError(f"{self.where}: the checkpoint has no tensor {key!r}")
        with self._open(self.files[key]) as file:
            return file.get_tensor(key)

    def stacked_experts(self, key: str) -> Optional[torch.Tensor]:
        """``[E, out, in]`` for a stacked-experts key (``...experts.gate_up_proj``) stored per
        expert, or None when the checkpoint has no such per-expert keys."""
        experts = _per_expert(self, key)
        if experts is None:
            return None
        prefix = key.rpartition(".")[0]
        stacked = None  # filled expert by expert: never the per-expert copies and the stack at once
        for expert, names in enumerate(experts):
            parts = [self.tensor(name) for name in names]
            first = None if stacked is None else tuple(stacked.shape[1:])
            shape = _expert_shape(self, f"{prefix}.{expert}", names, [tuple(part.shape) for part in parts], first)
            if stacked is None:
                stacked = parts[0].new_empty((len(experts), *shape))
            stacked[expert] = torch.cat(parts)
        return stacked


def _expert_shape(checkpoint, expert: str, names: list, shapes: list, first: Optional[tuple]) -> tuple:
    """The shape of one expert's tensors ``names`` (of ``shapes``) concatenated along their output
    dimension, as `LazyCheckpoint.stacked_experts` stacks them; ValueError naming them and their files
    where they differ in input width (torch.cat would fail without naming them) or the result differs
    from expert 0's (``first``; None for expert 0)."""
    listed = ", ".join(f"{name!r} {tuple(shape)}" for name, shape in zip(names, shapes))
    if len({tuple(shape[1:]) for shape in shapes}) > 1:
        raise ValueError(f"{checkpoint.where}: checkpoint expert {expert}'s tensors differ in their input width: "
                         f"{listed}{_stored_in(checkpoint, *names)}")
    shape = (sum(shape[0] for shape in shapes), *shapes[0][1:])
    if first is not None and shape != first:
        raise ValueError(f"{checkpoint.where}: checkpoint expert {expert}'s tensors {listed} stack to {shape}, unlike "
                         f"expert 0's {first}{_stored_in(checkpoint, *names)}")
    return shape


# safetensors' dtype names (`safe_open(...).get_slice(key).get_dtype()`) as torch's
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
              "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


# compressed-tensors formats whose weights are stored as floats ("fakequant": QuantizationConfig's default)
_FLOAT_FORMATS = {None, "dense", "fakequant"}


def _quantization_config(directory: str) -> Optional[dict]:
    """The ``quantization_config`` of the checkpoint's ``config.json``, else None (no such file or key,
    or a file that is not a JSON object: the model was built from its config, not read here)."""
    try:
        with open(os.path.join(directory, "config.json")) as file:
            config = json.load(file)
    except (OSError, ValueError):
        return None
    quantization = config.get("quantization_config") if isinstance(config, dict) else None
    return quantization if isinstance(quantization, dict) else None


def _check_float_weights(directory: str, where: str) -> None:
    """ValueError naming the ``quantization_config`` of a checkpoint whose weights are stored quantized
    (compressed-tensors' int8, float8 or packed codes beside their scales; another library's quantized
    weights), before any tensor is read: cast to the model's dtype they would lose their scales. A
    compressed-tensors config whose weights are stored as floats (format ``dense``: activations or the
    kv cache quantized only, or saved with ``save_compressed=False``) is read as a float checkpoint."""
    config = _quantization_config(directory)
    if config is None:
        return
    groups = config.get("config_groups")
    sparsity = config.get("sparsity_config")
    formats = {config.get("format"), sparsity.get("format") if isinstance(sparsity, dict) else None}
    formats |= {group.get("format") for group in (groups.values() if isinstance(groups, dict) else ())
                if isinstance(group, dict)}
    if config.get("quant_method") == "compressed-tensors" and formats <= _FLOAT_FORMATS:
        return
    named = ", ".join(f"{key}={config[key]!r}" for key in ("quant_method", "format", "quantization_status")
                      if key in config) or f"keys {sorted(config)}"
    raise ValueError(f"{where}: checkpoint {directory!r} is quantized: its config.json holds a quantization_config "
                     f"({named}) whose weights are stored quantized, which is not read here (cast to the model's "
                     "dtype they would lose their scales); give the float checkpoint it was quantized from")


def _weight_map(index) -> dict:
    """The ``{tensor name: file name}`` ``weight_map`` of a parsed safetensors index (TypeError or KeyError otherwise)."""
    weight_map = index["weight_map"]
    if not isinstance(weight_map, dict):
        raise TypeError(f"its weight_map is a {type(weight_map).__name__}, not a {{tensor name: file name}} object")
    odd = next((key for key, name in weight_map.items() if not isinstance(name, str) or not name), None)
    if odd is not None:
        raise TypeError(f"its weight_map puts {odd!r} in {weight_map[odd]!r}, not a file name")
    return dict(weight_map)


def _other_formats(directory: str) -> str:
    """What a checkpoint folder without safetensors' files holds instead, for the error: pytorch
    ``.bin`` weights (which ``torch.load`` unpickles whole) or safetensors shards without their index."""
    names = sorted(os.listdir(directory))
    pickled = [name for name in names if name.startswith("pytorch_model") and name.endswith((".bin", ".bin.index.json"))]
    if pickled:
        return (f", but {', '.join(pickled[:2])}: pytorch .bin weights are not read here; save the model as safetensors "
                "(from_pretrained, then save_pretrained)")
    shards = [name for name in names if name.endswith(".safetensors")]
    if shards:
        return f", but {', '.join(shards[:2])}: safetensors files without model.safetensors.index.json naming their tensors"
    return ""


class Overlay:
    """A checkpoint whose tensors named in ``weights`` (a dict of tensors, or a checkpoint folder)
    are read from there, the others from ``base`` (e.g. GPTQ'd weights over the float checkpoint).
    ``used`` collects the names read from ``weights``."""

    def __init__(self, weights, base: LazyCheckpoint):
        if not isinstance(weights, dict) and not os.path.isdir(weights):
            raise ValueError(f"{base.where}: weights={os.fspath(weights)!r} is neither a dict of tensors nor a "
                             "directory")
        self.weights = weights if isinstance(weights, dict) else LazyCheckpoint(weights, base.where)
        self.base = base
        self.where = base.where
        self.used: set = set()

    def names(self) -> set:
        return set(self.weights) if isinstance(self.weights, dict) else set(self.weights.files)

    def __contains__(self, key: str) -> bool:
        return key in self.weights or key in self.base

    def file_of(self, key: str) -> str:
        if key not in self.weights:
            return self.base.file_of(key)
        return "weights=" if isinstance(self.weights, dict) else self.weights.file_of(key)

    def headers(self, keys: list) -> dict:
        own = [key for key in keys if key in self.weights]
        found = self.base.headers([key for key in keys if key not in self.weights])
        if isinstance(self.weights, dict):
            return {**found, **{key: (tuple(self.weights[key].shape), self.weights[key].dtype) for key in own}}
        return {**found, **self.weights.headers(own)}

    def tensor(self, key: str) -> torch.Tensor:
        if key not in self.weights:
            return self.base.tensor(key)
        self.used.add(key)
        return self.weights[key] if isinstance(self.weights, dict) else self.weights.tensor(key)

    stacked_experts = LazyCheckpoint.stacked_experts  # per-expert keys from either side


def _checkpoint_names(model: torch.nn.Module) -> Callable[[str], list]:
    """``name -> [names]`` a tensor of ``model`` may be stored under: its in-memory name, then the
    name transformers' ``save_pretrained`` writes (`_checkpoint_names.module_renamer`, applied to the
    tensor's name and to its module's path, for stacked experts stored per expert)."""

    rename = module_renamer(model)

    def names(name: str) -> list:
        owner, _, leaf = name.rpartition(".")
        found = (name, rename(name), f"{rename(owner)}.{leaf}" if owner else name)
        return list(dict.fromkeys(key for key in found if "*" not in key))  # a converter's pattern is no key

    return names


def _base_model_names(model: torch.nn.Module) -> Callable[[str], list]:
    """``name -> [names]`` a tensor may also be stored under in the checkpoint of the base model or
    of a task model around it, as ``from_pretrained`` adds or strips ``base_model_prefix``: a
    ``LlamaModel`` reads ``model.layers.*`` of a ``LlamaForCausalLM`` checkpoint, and the reverse."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    if not prefix or not isinstance(prefix, str):
        return lambda name: []
    if isinstance(getattr(model, prefix, None), torch.nn.Module):  # a task model: its base is `prefix`
        return lambda name: [name[len(prefix) + 1 :]] if name.startswith(prefix + ".") else []
    return lambda name: [f"{prefix}.{name}"]


def _aliases(model: torch.nn.Module, stored: Callable[[str], list]) -> dict:
    """``{id(tensor): [names]}`` of every parameter and buffer, tied ones under all their names, each
    followed by its checkpoint names (``stored``, `_checkpoint_names`), by the legacy names that
    ``from_pretrained`` renames on load (`legacy_renamer`: BERT's ``LayerNorm.gamma``), then by those
    names in a base or task model's checkpoint (`_base_model_names`)."""
    names: dict = {}
    other, legacy = _base_model_names(model), legacy_renamer(model)
    for name, value in itertools.chain(model.named_parameters(remove_duplicate=False),
                                       model.named_buffers(remove_duplicate=False)):
        names.setdefault(id(value), []).extend(key for key in stored(name) if key not in names.get(id(value), ()))
    for keys in names.values():
        keys.extend(dict.fromkeys(legacy(known) for known in list(keys) if legacy(known) not in keys))
        keys.extend(dict.fromkeys(key for known in list(keys) for key in other(known) if key not in keys))
    return names


def _no_tensor(checkpoint, missing: str, name: str, non_persistent: bool = False) -> ValueError:
    """The error for a tensor ``name`` of the model the checkpoint lacks as ``missing``; one stored
    packed (compressed-tensors' ``weight_packed``: int4 or fp4 codes) is named as a quantized checkpoint,
    a ``non_persistent`` buffer (of a model without ``_init_weights`` to compute it) as one no checkpoint holds."""
    if non_persistent:
        return ValueError(f"{checkpoint.where}: {name!r} is a non-persistent buffer, which no checkpoint holds (the "
                          "model's state_dict leaves it out) and which has no values on the meta device: give the "
                          "model its values (register_buffer(..., persistent=False) on the CPU) before the call")
    also = f" (the model's {name!r})" if missing != name else ""
    packed = f"{missing}_packed"
    if packed in checkpoint:
        also += (f": it holds {packed!r}, the packed codes of a quantized checkpoint, which is not read here; "
                 "give its float weights")
    directory = (checkpoint.base if isinstance(checkpoint, Overlay) else checkpoint).directory
    return ValueError(f"{checkpoint.where}: the checkpoint {directory!r} has no tensor {missing!r}{also}")


def check_covers(model: torch.nn.Module, checkpoint: LazyCheckpoint, category: type = UserWarning,
                 read_elsewhere: tuple = ()) -> None:
    """ValueError naming a meta parameter of ``model`` that ``checkpoint`` holds under none of its
    names (in memory or as saved; nor, for stacked experts, per expert), or holds with another shape
    or a dtype it does not cast (`_check_headers`); the same for a meta buffer it reads (of a model
    without ``_init_weights`` to recompute a missing one: a plain ``nn.Module``'s). Names and headers
    only, before any layer is read: a checkpoint of another model, or one missing a tensor, fails
    before any batch runs.
    The checkpoint's tensors the model does not read are a warning of ``category``, but for those
    matching a pattern of ``read_elsewhere`` (the export copies DeepSeek's ``mtp.*`` tensors)."""
    stored = _checkpoint_names(model)
    aliases = _aliases(model, stored)
    for name, value in _read_tensors(model):  # each tensor under its first name
        keys = aliases[id(value)]
        if value.device.type != "meta" or any(key in checkpoint for key in keys):
            continue
        if not isinstance(value, torch.nn.Parameter) and hasattr(model, "_init_weights"):
            continue  # a buffer the checkpoint lacks, which `load_modules` recomputes
        per_expert = [_experts_missing(checkpoint, key, value.shape[0]) for key in keys] if value.ndim == 3 else []
        if "" not in per_expert:
            missing = next((key for key in per_expert if key), stored(name)[-1])
            owner, _, leaf = name.rpartition(".")
            raise _no_tensor(checkpoint, missing, name, leaf in model.get_submodule(owner)._non_persistent_buffers_set)
    _check_headers(model, checkpoint, aliases)
    _warn_unused(model, checkpoint, aliases, category, read_elsewhere)


def _read_tensors(model: torch.nn.Module) -> list:
    """``[(name, tensor)]`` of the parameters of ``model``, then of the buffers `load_modules` reads
    from the checkpoint (those not `_recomputed`): the tensors `check_covers` checks."""
    buffers = [(f"{path}.{name}" if path else name, value) for path, owner in model.named_modules()
               for name, value in owner._buffers.items()
               if value is not None and not _recomputed(model, owner, "_buffers", name)]
    return [*model.named_parameters(), *buffers]


def _check_headers(model: torch.nn.Module, checkpoint: LazyCheckpoint, aliases: dict) -> None:
    """The ValueError `_read` raises for a tensor of another shape than the model's meta tensor, or
    of a dtype it does not cast (float8, integers), found from the files' headers before any layer is
    read: a bad tensor of the last layer fails before the first one runs; stacked experts stored per
    expert too, expert by expert (`_stacked_header`)."""
    transposes = load_transposes(model)
    read = {}  # the key each meta tensor is read from (its first name the checkpoint holds), as `_read` picks
    experts: dict = {}  # {stacked key: per-expert keys} of stacked experts stored per expert, as `_read` stacks them
    for _, value in _read_tensors(model):
        names = aliases[id(value)]
        if isinstance(checkpoint, Overlay):
            names = sorted(names, key=lambda name: name not in checkpoint.weights)
        key = next((name for name in names if name in checkpoint), None)
        if key is None and value.ndim == 3:
            key = next((name for name in names if _per_expert(checkpoint, name)), None)
            if key is not None:
                experts[key] = _per_expert(checkpoint, key)
        if value.device.type == "meta" and key is not None:
            read.setdefault(key, value)
    each = [name for keys in experts.values() for names in keys for name in names]
    headers = checkpoint.headers([key for key in read if key not in experts] + each)
    for key, like in read.items():  # in the model's order, as the layers read them
        if key in experts:
            shape, dtype = _stacked_header(checkpoint, key, experts[key], headers, like)
        else:
            shape, dtype = headers[key]
        _loaded_transpose(checkpoint, key, shape, like, transposes)
        if _uncastable(dtype, like):
            raise _dtype_error(checkpoint, key, dtype, like)


def _stacked_header(checkpoint, key: str, experts: list, headers: dict, like: torch.Tensor) -> tuple:
    """``(shape, dtype)`` of the stack `LazyCheckpoint.stacked_experts` reads for ``key`` from the
    per-expert tensors ``experts`` (`_per_expert`), from their ``headers``: ValueError naming a tensor
    of a dtype `_read` does not cast to ``like``'s (each expert's, not only the first's, which the
    stack takes), or an expert whose tensors do not stack (`_expert_shape`)."""
    first = None
    for expert, names in enumerate(experts):
        for name in names:
            if _uncastable(headers[name][1], like):
                raise _dtype_error(checkpoint, name, headers[name][1], like)
        shape = _expert_shape(checkpoint, f"{key.rpartition('.')[0]}.{expert}", names,
                              [headers[name][0] for name in names], first)
        first = first or shape
    return (len(experts), *first), like.dtype


# the checkpoint tensors transformers ignores beside the model's own patterns (`_adjust_missing_and_unexpected_keys`)
_IGNORED_UNUSED = (r"rotary_emb\.inv_freq", r"(^|\.)position_ids$")


def _warn_unused(model: torch.nn.Module, checkpoint: LazyCheckpoint, aliases: dict, category: type,
                 read_elsewhere: tuple = ()) -> None:
    """Warns of the checkpoint's tensors that no tensor of ``model`` is read from, as ``from_pretrained``
    reports them UNEXPECTED (a config of fewer layers than the checkpoint's calibrates part of it),
    but for those transformers ignores (``_keys_to_ignore_on_load_unexpected``: DeepSeek-V3's
    multi-token-prediction layer)."""
    used = {key for keys in aliases.values() for key in keys if key in checkpoint}
    for value in itertools.chain(model.parameters(), model.buffers()):
        for experts in (_per_expert(checkpoint, key, value.shape[0]) for key in aliases[id(value)] if value.ndim == 3):
            used.update(name for names in experts or () for name in names)
    ignored = [*(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()), *_IGNORED_UNUSED, *read_elsewhere]
    files = checkpoint.base.files if isinstance(checkpoint, Overlay) else checkpoint.files  # the export checks weights=
    unused = [key for key in files if key not in used and not any(re.search(at, key) for at in ignored)]
    if unused:
        more = " ..." if len(unused) > 3 else ""
        warn(f"{checkpoint.where}: the checkpoint holds {len(unused)} tensor(s) the model has no tensor for, which are "
             f"not read: {', '.join(unused[:3])}{more} (a model built from another config, of fewer layers than the "
             "checkpoint's?)", category)


def _per_expert(checkpoint, key: str, count: Optional[int] = None) -> Optional[list]:
    """The keys a stacked-experts key (``<prefix>.gate_up_proj``, `_EXPERT_SOURCES`) has per expert,
    ``[[<prefix>.<e>.<source>.weight for each source] for each expert e]``, when the checkpoint holds
    expert 0's, else None: ``count`` experts, or as many as the checkpoint holds from 0 on."""
    prefix, _, name = key.rpartition(".")
    for sources in _EXPERT_SOURCES.get(name, ()):
        if f"{prefix}.0.{sources[0]}.weight" in checkpoint:
            keys = lambda expert: [f"{prefix}.{expert}.{source}.weight" for source in sources]  # noqa: E731
            if count is None:
                count = next(expert for expert in itertools.count() if keys(expert)[0] not in checkpoint)
            return [keys(expert) for expert in range(count)]
    return None


def _experts_missing(checkpoint: LazyCheckpoint, key: str, count: int) -> Optional[str]:
    """For a stacked-experts key: "" when the checkpoint holds its ``count`` experts per expert, the
    first per-expert key it lacks when it holds expert 0's, None when it holds none."""
    experts = _per_expert(checkpoint, key, count)
    if experts is None:
        return None
    return next((name for names in experts for name in names if name not in checkpoint), "")


def _read(checkpoint: LazyCheckpoint, names: list, like: torch.Tensor,
          transposes: Callable[[str], Optional[tuple]] = lambda name: None) -> Optional[torch.Tensor]:
    """The checkpoint's value of a tensor known under ``names`` (tied tensors have several; an
    `Overlay`'s own names first), transposed where ``from_pretrained`` transposes it (``transposes``,
    `_checkpoint_names.load_transposes`: only where its shape is not the model's)."""
    if isinstance(checkpoint, Overlay):
        names = sorted(names, key=lambda name: name not in checkpoint.weights)
    for name in names:
        if name in checkpoint:
            value = checkpoint.tensor(name)
        else:
            value = checkpoint.stacked_experts(name) if like.ndim == 3 else None
            if value is None:
                continue
        dims = _loaded_transpose(checkpoint, name, tuple(value.shape), like, transposes)
        if dims is not None:
            value = value.transpose(*dims).contiguous()
        _check_tied(checkpoint, name, value, names)
        # in the model tensor's dtype, as from_pretrained casts a checkpoint (float32 norms of a bfloat16
        # checkpoint); a float8 or integer tensor for a floating-point one (a quantized checkpoint) would
        # lose its scales
        if _uncastable(value.dtype, like):
            raise _dtype_error(checkpoint, name, value.dtype, like)
        return value if value.dtype == like.dtype or not like.is_floating_point() else value.to(like.dtype)
    return None


def _loaded_transpose(checkpoint, name: str, shape: tuple, like: torch.Tensor,
                      transposes: Callable[[str], Optional[tuple]]) -> Optional[tuple]:
    """The dims ``from_pretrained`` swaps in the stored tensor ``name`` of ``shape`` to give the model's
    tensor ``like`` its shape (``transposes``, only where the shapes differ), or None; ValueError where
    the stored shape, swapped or not, is not the model's."""
    if shape == tuple(like.shape):
        return None
    dims = transposes(name)
    if dims is not None:
        swapped = list(shape)
        swapped[dims[0]], swapped[dims[1]] = swapped[dims[1]], swapped[dims[0]]
        if tuple(swapped) == tuple(like.shape):
            return dims
    raise ValueError(f"{checkpoint.where}: checkpoint tensor {name!r} has shape {shape}, the model's "
                     f"{tuple(like.shape)}{_stored_in(checkpoint, name)}")


def _stored_in(checkpoint, *names: str) -> str:
    """`` (in '<file>', ...)``: the files of the checkpoint holding the tensors ``names`` (for stacked
    experts stored per expert, those of their per-expert tensors), three at most named."""
    keys = [key for name in names
            for key in ([name] if name in checkpoint else
                        [key for keys in _per_expert(checkpoint, name) or () for key in keys])]
    files = list(dict.fromkeys(checkpoint.file_of(key) for key in keys))
    more = f" and {len(files) - 3} more" if len(files) > 3 else ""
    return f" (in {', '.join(map(repr, files[:3]))}{more})" if files else ""


def _check_tied(checkpoint, name: str, value: torch.Tensor, names: list) -> None:
    """ValueError where the checkpoint holds a tensor the model ties (``lm_head`` to the embeddings)
    under another of its ``names`` too, with other values: ``from_pretrained`` then unties them, and
    reading one for both would calibrate a head the checkpoint does not have."""
    if isinstance(checkpoint, Overlay):  # GPTQ'd weights replace their float values on purpose: the base's copies
        names = [key for key in names if key not in checkpoint.weights and key in checkpoint.base]
        checkpoint = checkpoint.base
        if name not in names:
            if len(names) < 2:
                return
            name, value = names[0], checkpoint.tensor(names[0])
    for other in (key for key in names if key != name and key in checkpoint):
        stored = checkpoint.tensor(other)
        if stored.shape != value.shape or not torch.equal(stored, value.to(stored.dtype)):
            raise ValueError(
                f"{checkpoint.where}: the model ties {name!r} and {other!r} (one tensor), but the checkpoint holds "
                f"them with different values{_stored_in(checkpoint, name, other)}: build the model with "
                "tie_word_embeddings=False, as from_pretrained unties them"
            )


_CASTABLE_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _uncastable(dtype, like: torch.Tensor) -> bool:
    """Whether a stored tensor of ``dtype`` (torch's, or safetensors' name of one torch lacks) is not
    cast to the floating-point model tensor ``like``'s dtype: float8, integers (a quantized checkpoint)."""
    return (like.is_floating_point() and dtype != like.dtype
            and not (dtype in _CASTABLE_FLOATS and like.dtype in _CASTABLE_FLOATS))


def _dtype_error(checkpoint, name: str, dtype, like: torch.Tensor) -> ValueError:
    return ValueError(f"{checkpoint.where}: checkpoint tensor {name!r} is stored as {dtype}, the model's is "
                      f"{like.dtype}: a quantized checkpoint is not read here; give its float weights"
                      f"{_stored_in(checkpoint, name)}")


def _read_as(checkpoint, names: list, value: torch.Tensor, full: str, stored: Callable[[str], list]) -> tuple:
    """``(key, names)``: which load of the tensor ``value`` the name ``full`` shares, and the names to
    read it under. A tensor tied under several names is read once for all, but where an `Overlay`
    replaces it under some of them (a GPTQ'd ``lm_head`` tied to the embeddings): there it is read
    from the overlay under those names alone, and the others keep the checkpoint's value (untied
    while loaded, as llm-compressor unties a quantized ``lm_head`` from the embeddings)."""
    replaced = [name for name in names if isinstance(checkpoint, Overlay) and name in checkpoint.weights]
    if not replaced or len(replaced) == len(names):
        return id(value), names
    own = [name for name in replaced if name in stored(full)]
    if own:
        return (id(value), full), own
    return id(value), [name for name in names if name not in replaced]


def load_modules(model: torch.nn.Module, paths: list, checkpoint: LazyCheckpoint, recurse: bool = True,
                 device: Optional[torch.device] = None) -> list:
    """Puts every meta parameter and buffer of the modules at ``paths`` of ``model`` (their own
    only, without ``recurse``) on ``device`` (default the CPU), read from ``checkpoint`` (floating-point
    tensors cast to the meta tensor's dtype); a tensor tied under several names is read once and
    stays tied. Returns ``[(owner, kind, name, meta tensor)]``
    for `release_modules`. A meta buffer the checkpoint lacks, or a non-persistent one (rotary
    frequencies, `_recomputed`), is recomputed by the model's ``_init_weights`` (transformers models),
    as ``from_pretrained`` computes it; anything else missing is a ValueError,
    after the tensors loaded before it are put back on meta."""
    stored = _checkpoint_names(model)
    aliases = _aliases(model, stored)
    transposes = load_transposes(model)
    loaded_by_id: dict = {}
    saved: list = []
    try:
        for path in paths:
            module = model.get_submodule(path)
            owners = module.named_modules(prefix=path) if recurse else [(path, module)]
            for owner_path, owner in owners:
                for kind in ("_buffers", "_parameters"):  # buffers first: `_init_weights` meets meta parameters
                    recompute = False
                    for name, value in list(getattr(owner, kind).items()):
                        if value is None or value.device.type != "meta":
                            continue
                        full = f"{owner_path}.{name}" if owner_path else name
                        key, names = _read_as(checkpoint, aliases.get(id(value), [full]), value, full, stored)
                        tied = loaded_by_id.get(key)  # read already under another name
                        recomputed = _recomputed(model, owner, kind, name)
                        loaded = tied if tied is not None or recomputed else _read(checkpoint, names, value, transposes)
                        empty = loaded is None and kind == "_buffers" and hasattr(model, "_init_weights")
                        if empty:
                            loaded, recompute = torch.empty_like(value, device=device or "cpu"), True
                        if loaded is None:
                            raise _no_tensor(checkpoint, stored(full)[-1], full, name in owner._non_persistent_buffers_set)
                        loaded = loaded if device is None else loaded.to(device)
                        if kind == "_parameters" and not isinstance(loaded, torch.nn.Parameter):
                            # the meta parameter's requires_grad, as from_pretrained keeps it: a linear layer
                            # whose weight requires none runs another CPU kernel, which rounds otherwise
                            loaded = torch.nn.Parameter(loaded, requires_grad=value.requires_grad)
                        elif not empty and tied is None:
                            loaded = loaded.detach()  # a buffer: our own tensor object, flagged below
                        if not empty and tied is None:  # transformers' init functions leave it as it is
                            loaded._is_hf_initialized = True
                        loaded_by_id[key] = loaded
                        saved.append((owner, kind, name, value))
                        getattr(owner, kind)[name] = loaded
                    if recompute:
                        _recompute_buffers(model, owner_path)
    except BaseException:  # a missing tensor: the modules loaded so far go back to meta
        release_modules(saved)
        raise
    return saved


def _recomputed(model: torch.nn.Module, owner: torch.nn.Module, kind: str, name: str) -> bool:
    """Whether the tensor ``name`` of ``owner`` is computed, never read from the checkpoint: a
    non-persistent buffer of a transformers model (rotary ``inv_freq``), which is no part of its state
    dict, so ``from_pretrained`` leaves a checkpoint's copy (an old save, in bfloat16) unread."""
    return kind == "_buffers" and name in owner._non_persistent_buffers_set and hasattr(model, "_init_weights")


def _recompute_buffers(model: torch.nn.Module, owner_path: str) -> None:
    """Runs transformers' ``_init_weights`` on the module at ``owner_path`` and then on each module
    holding it, up to ``model``, as ``from_pretrained`` initialises every module (children first,
    each under the nearest enclosing model's ``_init_weights``): a buffer may be set by a module
    above its own (FalconH1Model fills its layers' ``mup_vector``). The tensors read from the
    checkpoint carry ``_is_hf_initialized``, which transformers' init functions leave as they are;
    those still on the meta device take no values."""
    parts = owner_path.split(".") if owner_path else []
    chain = [model.get_submodule(".".join(parts[:count])) for count in range(len(parts) + 1)]
    initialise, steps = model._init_weights, []
    for module in chain:
        initialise = getattr(module, "_init_weights", None) or initialise
        steps.append((initialise, module))
    for initialise, module in reversed(steps):
        initialise(module)


def release_modules(saved: list) -> None:
    """Puts back the meta tensors `load_modules` replaced (ties and the user's objects intact)."""
    for owner, kind, name, value in reversed(saved):
        getattr(owner, kind)[name] = value
