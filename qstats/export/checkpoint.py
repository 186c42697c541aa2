"""`compressed_tensors`: the checkpoint writer, putting together the linear, experts and
attention parts and the ``quantization_config`` of `qstats.export` (see its docstring)."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
from typing import Any, Mapping, Optional, Union

import torch

from .._granularity import TensorGroup
from .._ops import is_dtensor
from .._qparams import QParams
from .._schemes import matches_targets
from .._torch_features import unwrapped
from .._spec import QuantSpec
from ..experts import UncalibratedWarning, expert_count, own_parameters
from ..fused import fused_groups
from ..gptq_quantize import check_actorder
from ..recipe import Plan, Recipe, as_plan
from .attention import attention_config, write_attention
from .config import (ATTENTION_SITES, COMPRESSED_TENSORS_VERSION, FORMATS, config_groups, ignored_modules,
                     listed, llm_compressor_observers)
from .experts import expert_entries, unpack_loaded_per_expert, warn_mixed_experts, warn_unloaded_experts
from .linear import linear_entry, write_linear
from .mtp import MTP_IGNORE, SHARD as MTP_SHARD, copy_mtp_tensors
from .._checkpoint_names import module_renamer, saved_tensors
from .._warn import warn
from ._categories import ExportWarning

__all__ = ["compressed_tensors", "Writer", "check_new_folder", "shard_bytes", "write_config", "write_index",
           "write_tensors"]


def compressed_tensors(model: torch.nn.Module, qparams: Mapping[str, Mapping[str, QParams]], path: str,
                       recipe: Any, *, format: Optional[str] = None,
                       max_shard_size: Optional[Union[int, str]] = "20GB",
                       actorder: Optional[str] = None) -> dict:
    """Writes ``model`` with ``qparams`` as a compressed-tensors checkpoint in folder ``path``.

    Args:
      model: the calibrated model (its float weights are quantized with ``qparams``), or the
        ``torch.compile`` of it (the model it wraps is written); a model accelerate offloads is onloaded to
        the CPU for the export (all of it at once) and offloaded again after.
      qparams: ``{module_path: {site: QParams}}`` (`qstats.compute_qparams_tree`); dynamic sites may be None.
      path: output folder for ``model.safetensors`` (or its shards), ``config.json`` and, for a transformers
        model that generates, ``generation_config.json``: new, or one without safetensors files or index (an
        existing ``config.json`` there is replaced, or extended for a model without a config).
      recipe: the calibration `qstats.Recipe` (or its Plan), or a ``{path: {site: QuantSpec}}`` tree (named
        ``recipe`` as in `compressed_tensors_layerwise`, `qstats.fake_quantized` and `qstats.report`).
      format: one compressed-tensors format for every Linear group with quantized weights (groups without
        are dense); default: what it infers per group.
      max_shard_size: the largest shard, in bytes or as ``save_pretrained`` reads it (``"5GB"``: units KB,
        MB, GB, TB of powers of 1000): the tensors are split in order into ``model-0000i-of-0000n.safetensors``
        with ``model.safetensors.index.json``, as ``save_pretrained(max_shard_size=...)`` splits them (a tensor
        larger than it gets a shard of its own); one shard is ``model.safetensors``. Default ``"20GB"``, as
        llm-compressor's save (the Hugging Face Hub's recommended largest file); None: one file of any size.
      actorder: the column order GPTQ quantized the weights in (`qstats.gptq_layerwise`'s ``actorder``),
        written into every group's weights args as ``oneshot(GPTQModifier(actorder=...))`` writes it: None
        (default; also False, which compressed-tensors reads as None), ``"static"`` or ``"weight"``.

    Returns:
      The ``quantization_config`` dict written into ``config.json`` (not written when it quantizes
      nothing: no config group and no kv-cache scheme, as llm-compressor writes none; a warning says so).

    Raises:
      ValueError: a site, spec or shape compressed-tensors cannot express (names it); ``path`` holding
        safetensors files or a safetensors index (a loader would read those stale tensors), or a file; a
        bad ``max_shard_size``; a model on the meta device, or one whose tensors are DTensors (FSDP2: export
        the gathered full state dict loaded into the model unwrapped).
      TypeError: wrong argument types.
    """
    _check_arguments(model, qparams, format)
    model = _bare_model(model, qparams)  # a wrapper would prefix every tensor name ("module.", "_orig_mod.")
    with onloaded(model):  # an accelerate-offloaded model's tensors, read as save_pretrained reads them
        _check_whole_tensors(model)
        max_bytes = shard_bytes(max_shard_size)
        check_new_folder(path, None, "export.compressed_tensors", "path")
        writer = Writer(recipe, qparams, model, format, actorder)
        tensors = without_tied_copies(model, writer.part(writer.qparams, model.state_dict()))
        quantization_config = writer.finish()
        names = _write_shards(path, tensors, max_bytes, parameter_count(model, tensors))
        try:
            write_config(path, model, quantization_config, retied=writer.retied)
        except BaseException:  # no checkpoint left without its config (the next export would refuse the folder)
            remove_shards(path, names)
            raise
    return quantization_config


def _bare_model(model: torch.nn.Module, qparams: Mapping) -> torch.nn.Module:
    """The model that ``torch.compile`` (``_orig_mod``), ``DistributedDataParallel`` and ``DataParallel``
    (``module``) wrap, however nested, as ``save_pretrained`` and ``oneshot`` take it; ValueError where
    ``qparams`` name modules by the wrapper's paths (``"module.<path>"``; `qstats.calibrate` and
    `compute_qparams_tree` name a wrapped model's sites by the bare model's paths)."""
    bare = unwrapped(model)
    if bare is model:
        return model
    paths = dict(bare.named_modules())
    wrapped = [path for path in qparams if path not in paths and path in dict(model.named_modules())]
    if wrapped:
        raise ValueError(f"export.compressed_tensors: the model is a {type(model).__name__} wrapping a "
                         f"{type(bare).__name__}, which the export writes (names without the wrapper's prefix), but "
                         f"qparams name {len(wrapped)} module(s) by the wrapper's paths ({listed(wrapped, 3)}); "
                         "name them by the bare model's paths (model.module of DistributedDataParallel, "
                         "model._orig_mod of torch.compile), as qstats.calibrate and compute_qparams_tree name them")
    return bare


def parameter_count(model: torch.nn.Module, tensors: Mapping) -> int:
    """The elements of the checkpoint's ``tensors`` that are parameters of the compressed model, counted
    once (transformers' ``num_parameters``, which ``save_pretrained`` writes into the index as
    ``total_parameters``; compressed-tensors' ``compress_model`` makes every quantized tensor a
    parameter): every tensor but the model's persistent buffers (written as they are) and the copies
    written under the later paths of a module the model holds under several (`shared_module_copies`)."""
    buffers = {id(buffer) for _, buffer in model.named_buffers(remove_duplicate=False)}
    state = model.state_dict(keep_vars=True)
    elements = sum(tensor.numel() for tensor in tensors.values())
    elements -= sum(tensor.numel() for tensor in state.values() if id(tensor) in buffers)
    rename = module_renamer(model)
    for path, module, _ in _later_paths(model):
        copies = _own_tensors(tensors, rename(path))
        own_buffers = {name for name, _ in module.named_buffers(recurse=False)}
        elements -= sum(tensor.numel() for name, tensor in copies.items() if name not in own_buffers)
    return elements


def _later_paths(model: torch.nn.Module) -> list:
    """``(path, module, its first path)`` of each later path of a module the model holds under several."""
    first: dict = {}
    return [(path, module, first[id(module)]) for path, module in model.named_modules(remove_duplicate=False)
            if first.setdefault(id(module), path) != path]


@contextlib.contextmanager
def onloaded(model: torch.nn.Module):
    """The tensors of ``model``'s modules that accelerate offloads (``from_pretrained(device_map=...)``
    with CPU or disk offloading, ``cpu_offload``, ``disk_offload``: meta tensors in the module, the data
    in its hook's ``weights_map``) onloaded to the CPU for the duration, as ``save_pretrained`` reads
    them, and offloaded again after (the hooks' own ``pre_forward`` / ``post_forward``)."""
    hooked = [module for module in model.modules() if getattr(module, "_hf_hook", None) is not None]
    if not hooked:
        yield
        return
    from accelerate.utils import align_module_device, has_offloaded_params

    with contextlib.ExitStack() as stack:
        for module in hooked:
            if has_offloaded_params(module):
                stack.enter_context(align_module_device(module, execution_device=torch.device("cpu")))
        yield


def _check_whole_tensors(model: torch.nn.Module) -> None:
    """Refuses a model whose parameters or buffers are DTensors (FSDP2's ``fully_shard``, tensor
    parallelism: each rank holds a shard, and the export needs the whole weights) or on the meta
    device (no values to write)."""
    tensors = model.state_dict()
    sharded = [name for name, tensor in tensors.items() if is_dtensor(tensor)]
    if sharded:
        raise ValueError(f"export.compressed_tensors: {len(sharded)} tensor(s) of the model are DTensors "
                         f"({listed(sharded, 3)}), each rank holding a shard (FSDP2's fully_shard, tensor "
                         "parallelism); gather the full state dict with "
                         "torch.distributed.checkpoint.state_dict.get_model_state_dict(model, "
                         "options=StateDictOptions(full_state_dict=True, cpu_offload=True)) on every rank, "
                         "load it on rank 0 into the model unwrapped (not sharded) and export that "
                         "(docs/distributed.md)")
    on_meta = [name for name, tensor in tensors.items() if tensor.is_meta]
    if on_meta:
        raise ValueError(f"export.compressed_tensors: {len(on_meta)} tensor(s) of the model are on the meta "
                         f"device ({listed(on_meta, 3)}) and hold no values; load them, or export a meta "
                         "model from its checkpoint with qstats.export.compressed_tensors_layerwise")


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def shard_names(count: int, single: bool = True) -> list:
    """``save_pretrained``'s file names of ``count`` shards: ``model.safetensors`` for one (``single``),
    else ``model-0000i-of-0000n.safetensors``."""
    if count == 1 and single:
        return ["model.safetensors"]
    return [f"model-{number:05d}-of-{count:05d}.safetensors" for number in range(1, count + 1)]


def write_shard_index(path: str, names: list, shards: list, parameters: Optional[int] = None) -> None:
    """The index of ``shards`` (``{tensor name: bytes}`` each) written as files ``names``, with their
    ``total_size`` and (given) ``total_parameters``, as transformers 5's ``save_pretrained`` writes
    them; none for one file."""
    if len(names) > 1:
        weight_map = {tensor: name for name, shard in zip(names, shards) for tensor in shard}
        write_index(path, weight_map, sum(sum(shard.values()) for shard in shards), parameters)


def remove_shards(path: str, filenames: list) -> None:
    """Removes the shards ``filenames``, the index and the MTP shard (`copy_mtp_tensors`) a failed write
    may have left in ``path`` (the next export would refuse the folder)."""
    for filename in filenames + ["model.safetensors.index.json", MTP_SHARD]:
        with contextlib.suppress(OSError):
            os.remove(os.path.join(path, filename))


def shard_bytes(max_shard_size, where: str = "export.compressed_tensors") -> Optional[int]:
    """``max_shard_size`` in bytes (None: no sharding): an int, or digits and a unit ``KB``, ``MB``,
    ``GB``, ``TB`` (powers of 1000), as huggingface_hub's ``parse_size_to_int`` reads it for
    ``save_pretrained``."""
    if max_shard_size is None:
        return None
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
    size = None
    text = max_shard_size.strip() if isinstance(max_shard_size, str) else ""
    if isinstance(max_shard_size, int) and not isinstance(max_shard_size, bool):
        size = max_shard_size
    elif text[-2:].upper() in units:
        with contextlib.suppress(ValueError, OverflowError):  # NaN, Inf
            size = int(float(text[:-2]) * units[text[-2:].upper()])
    if size is None or size <= 0:
        raise ValueError(f"{where}: max_shard_size must be a positive number of bytes or a string "
                         f"such as '5GB' (units KB, MB, GB, TB), got {max_shard_size!r}")
    return size


class ShardSplitter:
    """Tensors put in order into shards of at most ``max_bytes`` (None: no limit), as huggingface_hub's
    ``split_torch_state_dict_into_shards`` (``save_pretrained``) splits a state dict: a tensor larger
    than ``max_bytes`` gets a shard of its own, and the open shard is closed when the next tensor would
    overflow it. It keeps names and sizes only: the writer keeps the tensors of the shards not closed."""

    def __init__(self, max_bytes: Optional[int]):
        self.max_bytes = max_bytes
        self.shards: list = []  # {name: bytes} of each shard closed, in order
        self.open: dict = {}  # {name: bytes} of the shard being filled
        self.open_bytes = 0

    def add(self, name: str, nbytes: int) -> list:
        """Puts tensor ``name`` of ``nbytes`` into a shard; returns the shards this closes (none or one)."""
        limit = float("inf") if self.max_bytes is None else self.max_bytes
        if nbytes > limit:
            self.shards.append({name: nbytes})  # before the open one
            return [self.shards[-1]]
        closed = [self.close()] if self.open and self.open_bytes + nbytes > limit else []
        self.open[name] = nbytes
        self.open_bytes += nbytes
        return closed

    def close(self) -> dict:
        """Closes the open shard (an empty one too) and returns it."""
        self.shards.append(self.open)
        self.open, self.open_bytes = {}, 0
        return self.shards[-1]

    def finish(self) -> Optional[dict]:
        """The last shard closed (the open one, or an empty one when there is no shard), or None."""
        return self.close() if self.open or not self.shards else None


def _write_shards(path: str, tensors: dict, max_bytes: Optional[int], parameters: Optional[int] = None) -> list:
    """``path/model.safetensors``, or (``max_bytes`` given and exceeded) numbered shards and their
    index (with ``parameters`` as its ``total_parameters``), as ``save_pretrained`` names them (split
    in order by a `ShardSplitter`); the names of the shards written. Shards of a failed write are removed."""
    splitter = ShardSplitter(max_bytes)
    for name, tensor in tensors.items():
        splitter.add(name, tensor_bytes(tensor))
    splitter.finish()
    shards = splitter.shards
    names = shard_names(len(shards))
    try:
        for filename, shard in zip(names, shards):
            write_tensors(path, {name: tensors[name] for name in shard}, filename)
        write_shard_index(path, names, shards, parameters)
    except BaseException:  # no partial checkpoint
        remove_shards(path, names)
        raise
    return names


class Writer:
    """The export of a model in parts: `part` gives the checkpoint's tensors of some modules' qparams
    (the model's tensors of those modules present), `finish` the warnings and the
    ``quantization_config`` of every part written."""

    def __init__(self, specs_or_recipe, qparams: Mapping, model: torch.nn.Module, format: Optional[str],
                 actorder: Optional[str] = None):
        self.actorder = None if actorder is False else actorder  # False: None, as compressed-tensors reads it
        check_actorder(self.actorder, "export.compressed_tensors")
        self.specs, self.groups, self.modules, self.dynamic, self.plan, qparams = _resolve(specs_or_recipe, qparams,
                                                                                            model)
        self.qparams, self.format, self.model = qparams, format, model
        self.log: dict = {"uncalibrated": [], "rounded": [], "rotary": [], "compute_dtype": [], "float64": [],
                           "activation_rounding": []}
        self.schemes: dict = {}
        self.expert_projection: dict = {}  # unpacked expert path -> (experts module path, projection)
        self.attention: dict = {}
        self.retied = False  # the output embeddings equal the input ones: written once, tied (`retied_copies`)

    def part(self, qparams: Mapping, state: Mapping) -> dict:
        """The tensors to write for ``qparams`` (some modules') and ``state`` (those modules'
        ``state_dict`` entries, float weights replaced by their packed codes or unpacked experts),
        under the names transformers' ``save_pretrained`` writes (`names.saved_tensors`)."""
        tensors: dict[str, torch.Tensor] = {}
        dropped: set[str] = set()
        entries, attention = _entries(self.modules, qparams, self.specs, self.dynamic, tensors, dropped, self.log)
        self.attention.update(attention)
        for entry in entries:  # each has a site: `_entries` makes none without
            self.schemes[entry.path] = write_linear(entry, self.format, tensors, dropped, self.log)
            if entry.experts is not None:
                self.expert_projection[entry.path] = entry.experts
        if self.specs:  # else config.json gets no quantization_config: transformers loads the stacks as saved
            unpack_loaded_per_expert(self.model, state, tensors, dropped)
        for name, tensor in state.items():
            if name not in tensors and name not in dropped:
                tensors[name] = tensor.detach()
        tensors = saved_tensors(self.model, shared_module_copies(self.model, tensors))
        copies = retied_copies(self.model, tensors)
        self.retied = self.retied or bool(copies)
        return {name: tensor for name, tensor in tensors.items() if name not in copies}

    def finish(self) -> dict:
        _warn_log(self.log)
        _warn_missing_qparams(self.plan.sites if self.plan is not None else self.specs, self.qparams)
        warn_mixed_experts(self.schemes, self.expert_projection)
        rename = module_renamer(self.model)
        warn_unloaded_experts(self.model, self.expert_projection, rename)
        _warn_unshared_global_scales(self.groups, self.qparams, self.specs)
        config = _quantization_config(self._in_qparams_order(self.schemes), self.expert_projection,
                                      self._in_qparams_order(self.attention), self.modules, self.format, self.plan,
                                      rename)
        for group in config["config_groups"].values():
            if group["weights"] is not None:
                group["weights"]["actorder"] = self.actorder
        if _quantizes_nothing(config):
            warn("export.compressed_tensors: no module is quantized (no config group and no kv-cache scheme; "
                 "e.g. a recipe on 'Linear' of a model of Conv1D layers, such as GPT-2); config.json gets no "
                 "quantization_config, as llm-compressor writes none: the checkpoint is the float model", ExportWarning)
        return config


    def _in_qparams_order(self, entries: dict) -> dict:
        """``entries`` (``{path: ...}`` of the parts written; an unpacked expert under its experts module) in
        the order of ``qparams``, as one part of the whole model writes them: the config groups' targets
        of a layer-by-layer export (its decoder layers first, then the embeddings and lm_head) as in memory."""
        order = {path: index for index, path in enumerate(self.qparams)}

        def position(path: str) -> int:
            return order.get(self.expert_projection.get(path, (path,))[0], len(order))

        return dict(sorted(entries.items(), key=lambda entry: position(entry[0])))


def _check_arguments(model, qparams, format) -> None:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"export.compressed_tensors: model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(qparams, Mapping):
        raise TypeError("export.compressed_tensors: qparams must be a {path: {site: QParams}} dict, "
                        f"got {type(qparams).__name__}")
    if format is not None and format not in FORMATS:
        raise ValueError(f"export.compressed_tensors: format must be one of {FORMATS}, got {format!r}")


def _resolve(specs_or_recipe, qparams: Mapping, model: torch.nn.Module) -> tuple:
    """``(specs, fused groups, {path: module}, {path: dynamic sites}, plan or None, qparams)`` from a recipe's plan
    (``qparams`` with its sites that saw no data, `_with_unobserved_sites`), or from a specs tree and the model
    (then per-token and per-group activations are the dynamic ones).
    """
    if isinstance(specs_or_recipe, (Recipe, Plan)):
        plan = as_plan(specs_or_recipe, model, "export.compressed_tensors")
        qparams = _with_unobserved_sites(plan, qparams)
        specs = plan.specs(qparams)  # refuses sites the plan does not observe
        dynamic = {path: frozenset(site for site in sites if plan.site(path, site).runtime)
                   for path, sites in qparams.items()}
        return specs, plan.fused_groups, plan.modules, dynamic, plan, qparams
    if hasattr(specs_or_recipe, "specs") and callable(specs_or_recipe.specs):  # a recipe-like object
        specs = specs_or_recipe.specs(qparams, model)
    elif isinstance(specs_or_recipe, Mapping):
        specs = specs_or_recipe
    else:
        raise TypeError("export.compressed_tensors: specs must be a qstats.Recipe or a "
                        f"{{path: {{site: QuantSpec}}}} tree, got {type(specs_or_recipe).__name__}")
    return specs, fused_groups(model), dict(model.named_modules()), {}, None, qparams


def _with_unobserved_sites(plan: Plan, qparams: Mapping) -> Mapping:
    """``qparams`` with the plan's sites that a module with qparams lacks (their states saw no data, so
    `qstats.compute_qparams_tree` has none: the calibration forward never reached the module): a site
    whose scales come at run time needs none (None); one with calibrated scales (static, or NVFP4's
    global scale) is refused, since writing the module without it would drop that quantization."""
    completed = dict(qparams)
    for path, sites in qparams.items():
        if not isinstance(sites, Mapping) or not sites:  # refused or warned about later
            continue
        missing = {site: found for site, found in plan.sites.get(path, {}).items() if site not in sites}
        calibrated = sorted(site for site, found in missing.items()
                            if not found.runtime or isinstance(found.spec.granularity, TensorGroup))
        if calibrated:
            raise ValueError(f"export.compressed_tensors: {path}: the recipe calibrates its site(s) "
                             f"{calibrated}, but qparams holds none: {_why_missing(missing, calibrated)}")
        if missing:
            completed[path] = {**sites, **dict.fromkeys(missing)}
    return completed


def _why_missing(missing: Mapping, calibrated: list) -> str:
    """Why a module's qparams lack the sites ``calibrated``, and the remedy: an activation's states saw no
    data; a parameter is observed before the first batch, so only a states or qparams tree without the site
    (of another recipe, or edited) lacks it."""
    parameters = [site for site in calibrated if missing[site].kind == "parameter"]
    if not parameters:
        return ("their states saw no data (the calibration forward never reached them), or the qparams tree lacks "
                "them (computed with another recipe, or loaded from a file of one), and the checkpoint would leave "
                "that quantization out; calibrate with data that reaches the module, leave it out of the recipe "
                "(ignore=), or compute the qparams with this recipe from its states")
    return (f"{', '.join(map(repr, parameters))} {'is a parameter' if len(parameters) == 1 else 'are parameters'}, "
            "observed before the first batch, so the states or qparams tree lacks the site (computed with another "
            "recipe, loaded from a file of one, or edited), and the checkpoint would leave that quantization out; "
            "compute the qparams with this recipe from its states")


def _entries(modules: Mapping, qparams: Mapping, specs, dynamic: Mapping, tensors: dict, dropped: set, log: dict) -> tuple:
    """``(Linear entries, {attention path: {site: args}})`` of ``qparams``: the Linear modules,
    the unpacked projections of stacked experts (whose fused parameters go to ``dropped``) and the
    attention modules (whose scales are written into ``tensors`` here)."""
    entries: list = []
    attention: dict = {}
    for module_path, sites in qparams.items():
        if module_path not in modules:
            raise ValueError(f"export.compressed_tensors: qparams name module {module_path!r}, which the model lacks")
        module = modules[module_path]
        if not isinstance(sites, Mapping):
            raise TypeError(f"export.compressed_tensors: qparams[{module_path!r}] must be a dict {{site: QParams}}")
        module_specs = specs.get(module_path, {}) if isinstance(specs, Mapping) else {}
        module_specs = module_specs if isinstance(module_specs, Mapping) else {}
        num_experts = expert_count(module)
        module_dynamic = dynamic.get(module_path, frozenset())
        if num_experts:
            entries.extend(expert_entries(module_path, module, sites, module_specs, num_experts, tensors,
                                          module_dynamic))
            prefix = module_path + "." if module_path else ""
            dropped.update(prefix + name for name in own_parameters(module))  # inside fake_quantized too
            continue
        kv_sites = {site: qp for site, qp in sites.items() if site in ATTENTION_SITES}
        if kv_sites:
            attention[module_path] = write_attention(module_path, module, kv_sites, module_specs, tensors,
                                                     log, module_dynamic)
        linear_sites = {site: qp for site, qp in sites.items() if site not in ATTENTION_SITES}
        if linear_sites:
            entries.append(linear_entry(module_path, module, linear_sites, module_specs, module_dynamic))
    return entries, attention


def _quantization_config(schemes: dict, expert_projection: dict, attention: dict, modules: Mapping, format, plan,
                         rename) -> dict:
    """The ``quantization_config`` of ``config.json``: config groups per scheme, the kv-cache scheme
    and the Linear modules left unquantized (``ignore``), modules under their checkpoint names."""
    observers = llm_compressor_observers(plan) if plan is not None else {}
    groups = config_groups(schemes, expert_projection, format, modules, observers, rename)
    # as compressed-tensors' infer_model_format: dense groups (activations only) do not count
    formats = {group["format"] for group in groups.values()} - {"dense"}
    top_format = formats.pop() if len(formats) == 1 else ("mixed-precision" if formats else "dense")
    kv_cache_scheme = attention_config(attention, groups, modules, rename, observers)
    return {"quant_method": "compressed-tensors", "format": top_format, "quantization_status": "compressed",
            "config_groups": {f"group_{i}": group for i, group in enumerate(groups.values())},
            "ignore": ignored_modules(modules, schemes, rename), "kv_cache_scheme": kv_cache_scheme,
            "global_compression_ratio": None, "sparsity_config": {}, "transform_config": {},
            "version": COMPRESSED_TENSORS_VERSION}


def _warn_named(names: list, limit: int, message: str, category: type = ExportWarning) -> None:
    """Warns ``message`` when ``names`` is not empty, its ``{count}`` how many they are and its
    ``{names}`` the first ``limit`` (`listed`)."""
    if names:
        warn(message.format(count=len(names), names=listed(names, limit)), category)


# (log key, names listed, warning) of `_warn_log`, in the order it warns.
# Integer activations are quantized at run time by the loader (compressed-tensors, vLLM) as round(x / scale);
# a spec of another convention (torch.ao's, qstats' default) rounds x * (1 / scale), whose codes differ by one
# where x / scale falls near a rounding boundary: `qstats.fake_quantized` then computes another model than the
# checkpoint's (logits 1e-3 apart on a tiny Mixtral with per-tensor dynamic int8 inputs).
_LOG_WARNINGS = (
    ("activation_rounding", 4, "export.compressed_tensors: {count} integer activation site(s) use a spec of another "
     "convention than compressed-tensors' ({names}): the loaded checkpoint quantizes them as "
     "round(x / scale), qstats.fake_quantized as round(x * (1 / scale)), so a few codes differ by one; "
     "build their specs with QuantSpec.from_compressed_tensors (or Recipe.from_scheme) for the same model"),
    ("rounded", 4, "export.compressed_tensors: scales of {count} site(s) were rounded to the model's dtype "
     "({names}); calibrate with a spec whose scale_dtype is that dtype (Recipe.from_scheme, "
     "QuantSpec.from_compressed_tensors: observed_dtype=<the model's dtype>) to keep "
     "qstats' and the checkpoint's quantization identical"),
    ("compute_dtype", 4, "export.compressed_tensors: {count} site(s) were calibrated with compressed-tensors specs "
     "computing in another dtype than their module's ({names}); llm-compressor computes "
     "their qparams in the model's dtype, so this checkpoint differs from its: build the recipe with "
     "observed_dtype=<the model's dtype> (Recipe.from_scheme, QuantSpec.from_compressed_tensors)"),
    ("float64", 4, "export.compressed_tensors: {count} site(s) of a float64 model were calibrated with "
     "compressed-tensors specs ({names}); qstats computes their qparams in float32, "
     "llm-compressor in the model's float64, so this checkpoint can differ from its (scales in their last "
     "bits, codes at rounding ties); it is self-consistent: its codes are quantized with the scales "
     "written"),
    ("uncalibrated", 8, "export.compressed_tensors: {count} site(s) hold uncalibrated (fallback) qparams: "
     "{names}"),
)


def _warn_log(log: dict) -> None:
    """The warnings of a written checkpoint: rounded scales, qparams computed in another dtype than
    llm-compressor's, uncalibrated sites, q/k scales observed before a rotary embedding."""
    for key, limit, message in _LOG_WARNINGS:
        # gate_proj and up_proj of an expert share its input site: each site is named (and counted) once
        _warn_named(list(dict.fromkeys(log[key])), limit, message)
    if log["rotary"]:
        warn(f"export.compressed_tensors: the q/k scales of {len(log['rotary'])} attention module(s) "
             f"({', '.join(log['rotary'][:4])}) were observed on the projection outputs, before the rotary "
             "embedding (and any q/k norm) the attention applies; compressed-tensors and vLLM quantize the "
             "rotated queries and keys, whose range can be wider", ExportWarning)


def _warn_missing_qparams(quantized: Any, qparams: Mapping) -> None:
    """Warns (`qstats.UncalibratedWarning`) naming the modules that the recipe's sites (or the specs
    tree) quantize but ``qparams`` leaves out: they are written unquantized, in full precision."""
    if not isinstance(quantized, Mapping):
        return
    missing = [path for path, sites in quantized.items() if sites and not qparams.get(path)]
    _warn_named(missing, 6, "export.compressed_tensors: {count} module(s) that the recipe (or specs tree) quantizes "
                "have no qparams and are written unquantized, in full precision ({names}); pass the whole "
                "qstats.compute_qparams_tree of the calibration states to quantize them", UncalibratedWarning)


def _warn_unshared_global_scales(groups, qparams: Mapping, specs: Any) -> None:
    """vLLM runs each fused group (q/k/v, gate/up: `qstats.fused.FUSED_LAYER_NAMES`) as one matmul
    under one global scale (it keeps one of the group's): a warning names the groups whose
    two-level (NVFP4) weights were given different global scales."""
    unshared = []
    for group in groups:
        scales = []
        for path in group:
            sites = qparams.get(path)
            module_specs = specs.get(path) if isinstance(specs, Mapping) else None
            if not (isinstance(sites, Mapping) and isinstance(module_specs, Mapping)):
                continue
            qp, spec = sites.get("weight"), module_specs.get("weight")
            if isinstance(qp, QParams) and isinstance(spec, QuantSpec) and isinstance(spec.granularity, TensorGroup):
                scales.append(qp.global_scale.detach().float().reshape(-1))
        if len(scales) > 1 and not all(torch.equal(scales[0], other) for other in scales[1:]):
            unshared.append("/".join(path.rsplit(".", 1)[-1] for path in group) + f" of {group[0].rsplit('.', 1)[0]!r}")
    if unshared:
        warn(f"export.compressed_tensors: {len(unshared)} fused group(s) hold NVFP4 weights under different "
             f"global scales ({', '.join(unshared[:4])}); vLLM runs each group as one matmul with one global "
             "scale, which misreads the others' weights. qstats.compute_qparams_tree shares them (fuse=True, "
             "its default); qstats.fused_qparams does it for a group", ExportWarning)


def without_tied_copies(model: torch.nn.Module, tensors: dict) -> dict:
    """``tensors`` without the float copies of tied weights (an unquantized ``lm_head`` equal to
    the embeddings it is tied to, transformers' ``all_tied_weights_keys``), as ``save_pretrained``
    leaves them out; a quantized tied weight has tensors of its own, kept (the config unties it)."""
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    # a quantized weight's codes may equal the embeddings' (both quantized alike, lm_head with input scales
    # too): kept, as the loader reads them under lm_head's scales (its config is untied)
    quantized = {name.rpartition(".")[0] for name in tensors if name.endswith(".weight_scale")}
    drop = {target for target, source in tied.items() if target in tensors and source in tensors
            and target.rpartition(".")[0] not in quantized
            and tensors[target].dtype == tensors[source].dtype and tensors[target].shape == tensors[source].shape
            and torch.equal(tensors[target], tensors[source])}
    return {name: tensor for name, tensor in tensors.items() if name not in drop}


def shared_module_copies(model: torch.nn.Module, tensors: dict) -> dict:
    """``tensors`` with each module that the model holds under several paths (one object, e.g.
    ``self.b = self.a``) written under every path as under its first: ``state_dict`` lists a shared
    module under each path, and compressed-tensors quantizes the object at load (its ``named_modules``
    meets it once), so a loader expects the quantized tensors (``weight_packed``, ``weight_scale``)
    under every path, as compressed-tensors' ``compress_model`` writes them, not the float weight."""
    aliases = [(path, source) for path, _, source in _later_paths(model)]
    if not aliases:
        return tensors
    tensors = dict(tensors)
    for alias, source in aliases:
        for name in _own_tensors(tensors, alias):
            del tensors[f"{alias}.{name}"]
        tensors.update({f"{alias}.{name}": tensor for name, tensor in _own_tensors(tensors, source).items()})
    return tensors


def embedding_modules(model: torch.nn.Module) -> list:
    """``[input, output]`` embedding modules of a transformers model (``get_input_embeddings`` and
    ``get_output_embeddings``); fewer where it has none."""
    found = []
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        with contextlib.suppress(AttributeError, NotImplementedError):
            module = getattr(model, getter)()
            if isinstance(module, torch.nn.Module):
                found.append(module)
    return found


def retied_copies(model: torch.nn.Module, tensors: dict) -> set:
    """The names of the output embeddings' tensors (``lm_head.*``) in ``tensors`` when they equal the input
    embeddings' one for one (the same names under each module, dtypes, shapes and values; e.g. both quantized
    alike by a recipe on ``Linear`` and ``Embedding``), else none. llm-compressor's save re-ties such
    embeddings (its ``_retie_embeddings``): it writes the input embeddings' tensors alone, with
    ``tie_word_embeddings`` true. Not where their quantized weight is stored unpacked (``weight`` codes:
    int-quantized, naive-quantized, fp8): transformers loads such a re-tied checkpoint, tying the weight
    alone, with ``lm_head.weight_scale`` left uninitialised (NaN or wrong logits, oneshot's checkpoint
    too); written untied, it loads as calibrated. Packed embeddings, which it cannot load at all, are
    re-tied as oneshot writes them."""
    embeddings = embedding_modules(model)
    if len(embeddings) != 2 or embeddings[0] is embeddings[1]:
        return set()
    paths = {id(module): path for path, module in model.named_modules()}  # each module's first path
    names = [paths.get(id(module)) for module in embeddings]
    if not all(names):
        return set()
    rename = module_renamer(model)
    source, target = (_own_tensors(tensors, rename(name)) for name in names)
    if not source or source.keys() != target.keys() or not all(  # torch.equal compares the shapes too
            source[name].dtype == target[name].dtype and torch.equal(source[name], target[name]) for name in source):
        return set()
    if "weight_scale" in source and "weight_packed" not in source:  # unpacked quantized codes
        return set()
    return {f"{rename(names[1])}.{name}" for name in target}


def _own_tensors(tensors: dict, prefix: str) -> dict:
    """``{name: tensor}`` of the tensors ``<prefix>.<name>`` of one module (not of its children)."""
    start = len(prefix) + 1
    return {key[start:]: tensor for key, tensor in tensors.items()
            if key.startswith(f"{prefix}.") and "." not in key[start:]}


def write_tensors(path: str, tensors: dict, filename: str) -> None:
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    # safetensors refuses shared storage (tied weights): give every tensor its own.
    owned = {name: tensor.detach().to("cpu").contiguous().clone() for name, tensor in tensors.items()}
    save_file(owned, os.path.join(path, filename), metadata={"format": "pt"})


def write_index(path: str, weight_map: dict, size: Optional[int] = None, parameters: Optional[int] = None) -> None:
    """``path/model.safetensors.index.json``: which shard holds each tensor (and their bytes and parameter
    elements, when given)."""
    metadata = {} if size is None else {"total_size": size}
    if parameters is not None:
        metadata = {"total_parameters": parameters, **metadata}
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as file:
        json.dump({"metadata": metadata, "weight_map": weight_map}, file, indent=2, sort_keys=True)


def check_new_folder(folder: str, checkpoint, where: str, what: str) -> None:
    """Refuses a ``checkpoint`` (None: none is read) that is no directory, and shards written into
    the checkpoint being read or beside existing safetensors files or a safetensors index."""
    if checkpoint is not None and not os.path.isdir(checkpoint):
        raise ValueError(f"{where}: checkpoint {os.fspath(checkpoint)!r} is not a directory")
    folder = os.fspath(folder)
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise ValueError(f"{where}: {what} {folder!r} is a file; give a directory (new or empty) to write into")
    if not os.path.isdir(folder):
        return
    if checkpoint is not None and os.path.samefile(folder, checkpoint):
        raise ValueError(f"{where}: {what} {folder!r} is the checkpoint being read")
    stale = sorted(name for name in os.listdir(folder) if name.endswith((".safetensors", ".safetensors.index.json")))
    if stale:
        raise ValueError(f"{where}: {what} {folder!r} already holds safetensors files or an index "
                         f"({listed(stale, 3)}), which a loader would read beside the new checkpoint; give "
                         "an empty or new folder")


def _quantizes_nothing(quantization_config: dict) -> bool:
    """True for a ``quantization_config`` without config groups or kv-cache scheme (nothing quantized)."""
    return not quantization_config.get("config_groups") and quantization_config.get("kv_cache_scheme") is None


def _quantizes_a_tied_weight(model: torch.nn.Module, quantization_config: dict) -> bool:
    """True when a parameter the model ties (one tensor under several module names, e.g. ``lm_head``
    and the input embeddings), or an embedding its config ties (``tie_word_embeddings``), belongs to
    a module whose weights ``quantization_config`` quantizes."""
    owners: dict = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(param), []).append(name.rpartition(".")[0])
    tied = {path for paths in owners.values() if len(paths) > 1 for path in paths}
    modules = dict(model.named_modules(remove_duplicate=False))
    if getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        embeddings = embedding_modules(model)
        tied.update(path for path, module in modules.items() if any(module is e for e in embeddings))
    if not tied:
        return False
    ignore = set(quantization_config.get("ignore") or ())
    rename = module_renamer(model)  # the config names modules as the checkpoint does
    return any(rename(path) not in ignore
               and matches_targets(tuple(group.get("targets") or ()), rename(path), modules.get(path))
               for group in quantization_config.get("config_groups", {}).values()
               if group.get("weights") is not None for path in tied)


def _untie(config: dict, model_config: Any) -> None:
    """``tie_word_embeddings`` false in ``config`` and its sub-configs wherever they (or the model's
    config objects) tie them: written even where true is the config class's default, which the
    diff leaves out."""
    entries = [(model_config, config)]
    entries += [(getattr(model_config, key, None), value) for key, value in config.items() if isinstance(value, dict)]
    for source, entry in entries:
        if entry.get("tie_word_embeddings") or getattr(source, "tie_word_embeddings", False) is True:
            entry["tie_word_embeddings"] = False


def _saved_model_fields(model: torch.nn.Module) -> dict:
    """The fields transformers' ``save_pretrained`` sets from a ``PreTrainedModel`` itself before it
    writes its config: ``architectures`` (the model's class; vLLM picks its implementation by it) and
    ``dtype`` (its parameters'); none for other modules."""
    if not (callable(getattr(model, "can_generate", None)) and hasattr(model, "dtype")):
        return {}
    fields = {"architectures": [type(model).__name__.removeprefix("FSDP")]}
    if any(param.is_floating_point() for param in model.parameters()):
        fields["dtype"] = str(model.dtype).removeprefix("torch.")
    return fields


def write_generation_config(path: str, model: torch.nn.Module) -> None:
    """``path/generation_config.json`` of a model that generates, as ``save_pretrained`` writes it
    (vLLM and ``generate`` read their default sampling settings and stop tokens from it). One that
    transformers refuses to save (its strict validation) is left out with a warning naming why: the
    checkpoint is written by then."""
    generation_config = getattr(model, "generation_config", None)
    can_generate = getattr(model, "can_generate", None)
    if generation_config is None or not callable(can_generate) or not can_generate():
        return
    try:
        generation_config.save_pretrained(path)
    except ValueError as error:
        reasons = [line.strip() for line in str(error).splitlines() if line.strip().startswith("- ")]
        warn(f"export.compressed_tensors: generation_config.json was not written: transformers refuses to save the "
             f"model's generation config ({' '.join(reasons) or error}); fix model.generation_config and save it "
             "with model.generation_config.save_pretrained(path)", ExportWarning)


def _tied_config(model_config: Any) -> Any:
    """A copy of the model's config whose text config ties the word embeddings, as llm-compressor's
    re-tie sets it (the model's own config is left alone)."""
    tied = copy.deepcopy(model_config)
    get_text_config = getattr(tied, "get_text_config", None)
    text_config = get_text_config(decoder=True) if callable(get_text_config) else tied
    text_config.tie_word_embeddings = True
    return tied


# fields the export sets itself, which may differ from the config file the model was read from
_PATCHED_FIELDS = frozenset({"_name_or_path", "transformers_version", "tie_word_embeddings", "dtype", "torch_dtype"})


def _without_patched_fields(config: dict) -> dict:
    return {key: _without_patched_fields(value) if isinstance(value, dict) else value
            for key, value in config.items() if key not in _PATCHED_FIELDS}


def _source_folder(model_config: Any) -> Optional[str]:
    """The folder the model's config was read from (its ``_name_or_path``: a folder holding a
    ``config.json``, or a Hub model's snapshot in the local cache), or None."""
    return _config_folder(getattr(model_config, "_name_or_path", "") or "")


def _config_folder(name: Any) -> Optional[str]:
    """``name`` where it is a folder holding a ``config.json``, the local snapshot of a Hub model
    ``name``, else None."""
    if not isinstance(name, str) or not name:
        return None
    if os.path.isfile(os.path.join(name, "config.json")):
        return name
    with contextlib.suppress(Exception):  # not a Hub model id
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(name, "config.json")
        if isinstance(found, str):
            return os.path.dirname(found)
    return None


def _copy_python_files(source: Optional[str], path: str) -> None:
    """The ``*.py`` files of ``source`` (a remote-code model's configuration and modeling code, which
    ``trust_remote_code`` loading reads beside the checkpoint) copied into ``path``, as llm-compressor's
    save copies them (``copy_python_files_from_model_cache``)."""
    if source is None or os.path.abspath(source) == os.path.abspath(path):
        return
    for name in sorted(os.listdir(source)):
        if name.endswith(".py") and os.path.isfile(os.path.join(source, name)):
            shutil.copy(os.path.join(source, name), path)


def _original_config(source: Optional[str], model_config: Any, dtype: Optional[str]) -> Optional[dict]:
    """The ``config.json`` in ``source``, the folder the model's config was read from (`_source_folder`),
    its text config's ``tie_word_embeddings`` and dtype set to the model's, as llm-compressor's save
    writes it (its ``resave_config``): transformers' own serialization renames fields (``rope_theta``
    and ``rope_scaling`` become ``rope_parameters``) that readers running older transformers (vLLM)
    would miss. None where there is no such file, it lacks those fields, or it
    describes another config than the model's (a field changed after loading)."""
    if source is None or dtype is None:
        return None
    try:
        with open(os.path.join(source, "config.json")) as file:
            original = json.load(file)
        read = type(model_config).from_dict(copy.deepcopy(original)).to_dict()  # it edits nested fields
        text_config = model_config.get_text_config(decoder=True)
    except Exception:  # not a config of this class: the model's own serialization is written
        return None
    if _without_patched_fields(read) != _without_patched_fields(model_config.to_dict()):
        return None
    text = original.get("text_config", original)
    dtype_key = next((key for key in ("torch_dtype", "dtype") if key in text), None)
    if dtype_key is None or "tie_word_embeddings" not in text:
        return None
    text[dtype_key], text["tie_word_embeddings"] = dtype, text_config.tie_word_embeddings
    return original


def write_config(path: str, model: torch.nn.Module, quantization_config: dict, retied: bool = False,
                 checkpoint: Optional[str] = None) -> None:
    """``path/config.json``: the model's config (the file it was read from, `_original_config`, else
    transformers' serialization) with ``quantization_config``, replacing any file there, as ``save_pretrained``
    does; for a model without a config, an existing file extended with ``quantization_config`` (and ``path/generation_config.json`` of a model that generates). What else llm-compressor's save
    carries from the folder the model was read from comes with it: its ``*.py`` files and its MTP
    tensors (`copy_mtp_tensors`, then ignored in ``quantization_config``). ``retied``: the output
    embeddings were written as the input ones (`retied_copies`), so the config ties them.
    ``checkpoint``: the folder the weights come from, standing for the one the config was read from
    where the config names none (built in memory, ``from_dict``; `compressed_tensors_layerwise`)."""
    os.makedirs(path, exist_ok=True)
    config_path = os.path.join(path, "config.json")
    config: dict = {}
    model_config = getattr(model, "config", None)
    # a model's config is written whole, as save_pretrained writes it: fields of an earlier export's file
    # that it lacks would be read by the loader (a stale attention_bias: biases loaded MISSING)
    if os.path.exists(config_path) and not hasattr(model_config, "to_dict"):
        with open(config_path) as file:
            config = json.load(file)
    if retied and model_config is not None:
        model_config = _tied_config(model_config)
    copied_mtp = False
    if model_config is not None and hasattr(model_config, "to_dict"):
        saved = _saved_model_fields(model)
        source = _source_folder(model_config) or (None if checkpoint is None else _config_folder(checkpoint))
        _copy_python_files(source, path)
        copied_mtp = copy_mtp_tensors(source, path, model_config)
        # the config file the model was read from, else what differs from the config class's defaults, as
        # transformers' save_pretrained writes it: no local _name_or_path
        config.update(_original_config(source, model_config, saved.get("dtype"))
                      or {**getattr(model_config, "to_diff_dict", model_config.to_dict)(), **saved})
        if saved:  # vLLM picks its implementation by them
            config.setdefault("architectures", saved["architectures"])
    if not retied and _quantizes_a_tied_weight(model, quantization_config):
        # the checkpoint holds the tied modules' own tensors (one of them quantized): a loader that ties them
        # would replace one by the other (transformers fails, vLLM drops the quantized lm_head), so untie
        # them, as llm-compressor does (untie_word_embeddings)
        _untie(config, model_config)
    config.pop("quantization_config", None)
    if not _quantizes_nothing(quantization_config):
        # transformers' compressed-tensors quantizer fails on a config without groups or kv-cache scheme
        # (its CompressedTensorsConfig keeps no QuantizationConfig then): a float checkpoint has none
        if copied_mtp and MTP_IGNORE not in quantization_config.setdefault("ignore", []):
            quantization_config["ignore"].append(MTP_IGNORE)  # kept float, as llm-compressor's save
        config["quantization_config"] = quantization_config
    with open(config_path, "w") as file:
        json.dump(config, file, indent=2, sort_keys=True, default=str)
    write_generation_config(path, model)
