"""compressed-tensors' configuration: the ``QuantizationArgs`` of a spec, the checkpoint formats,
and the config groups of ``quantization_config``.

`quantization_args` translates a `QuantSpec` (for one site) into compressed-tensors'
``QuantizationArgs`` fields, refusing what compressed-tensors cannot express by naming the field;
`default_format` is the format compressed-tensors itself infers for a scheme; `config_groups`
groups the modules by scheme.
"""

from __future__ import annotations

import json
import re
from typing import Any, Optional

import torch

from .._granularity import PerAxis, PerBlock, PerGroup, PerHead, PerRow, PerTensor, PerToken, TensorGroup
from .._schemes import FORMATS
from .._spec import QuantSpec
from ..experts import linearized_experts
from ..observers import registry
from .._warn import warn
from ._categories import ExportWarning

__all__ = ["ATTENTION_SITES", "COMPRESSED_TENSORS_VERSION", "ignored_modules", "listed", "module_targets",
           "llm_compressor_observer", "llm_compressor_observers", "FORMATS", "agreed_observer",
           "allowed_formats", "code_offset", "config_groups", "default_format", "fail", "quantization_args"]

ATTENTION_SITES = ("q", "k", "v")
COMPRESSED_TENSORS_VERSION = "0.19.0"  # the release whose checkpoint layout this export writes


def fail(where: str, message: str):
    """Raises the export's ValueError, naming the site (``where``) it is about."""
    raise ValueError(f"export.compressed_tensors: {where}: {message}")


def listed(names: list, limit: int) -> str:
    """The first ``limit`` names, and how many more there are."""
    more = f", and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _element_type(spec: QuantSpec, where: str, site: str) -> str:
    """compressed-tensors' ``type`` of the elements (``"int"`` or ``"float"``) at ``site``; refuses the
    element formats and two-level or MX specs it has no compressor for."""
    if spec.scale_dtype == "e8m0":
        # MXFP4 / MXFP8: fp4 or fp8 elements in groups of 32 under power-of-two (e8m0) scales, stored
        # as uint8 biased exponents (compressed_tensors/compressors/mx_utils.py)
        if spec.dtype not in ("fp4_e2m1", "fp8_e4m3fn") or spec.granularity != PerGroup(32):
            fail(where, f"e8m0 (MX) scales export as MXFP4 / MXFP8 only: dtype 'fp4_e2m1' or 'fp8_e4m3fn' "
                 f"with PerGroup(32), got dtype {spec.dtype!r} and {spec.granularity!r}")
        return "float"
    if isinstance(spec.granularity, TensorGroup):
        # NVFP4: fp4 elements in groups, fp8 group scales under one float32 global scale; activations
        # (dynamic='local': their group scales come at run time) may keep them unrounded, float32
        # (compressed-tensors' args without scale_dtype: llm-compressor's recipe_nvfp4_fp8_mixed.yaml)
        unrounded = spec.scale_dtype == "float32" and site != "weight"
        if spec.dtype != "fp4_e2m1" or not (spec.scale_dtype == "float8_e4m3fn" or unrounded):
            fail(where, "TensorGroup exports as NVFP4 only: dtype 'fp4_e2m1' with scale_dtype 'float8_e4m3fn', or "
                 f"'float32' (unrounded run-time group scales) for activations; got dtype {spec.dtype!r} and "
                 f"scale_dtype {spec.scale_dtype!r} at a {site!r} site")
        if spec.global_scale_formula != "range_over_amax":
            fail(where, f"global_scale_formula {spec.global_scale_formula!r}: compressed-tensors' global scale "
                 "is range / amax; use qstats.Recipe.from_scheme('NVFP4') (or "
                 "QuantSpec.from_compressed_tensors), or spec.replace(global_scale_formula='range_over_amax')")
        return "float"
    if spec.is_float:
        if spec.dtype != "fp8_e4m3fn":
            fail(where, f"dtype {spec.dtype!r}: this export writes float8_e4m3fn elements, or fp4_e2m1 as NVFP4")
        return "float"
    if spec.bits > 8:
        fail(where, f"dtype {spec.dtype!r}: compressed-tensors integer checkpoints hold at most 8 bits")
    return "int"


def _is_symmetric(spec: QuantSpec, where: str) -> bool:
    if spec.mapping in ("symmetric", "narrow"):
        return True
    if spec.mapping != "asymmetric":
        fail(where, f"mapping {spec.mapping!r} has no compressed-tensors equivalent")
    return False


def _strategy(granularity, site: str, where: str) -> dict:
    """The ``strategy`` (and ``group_size``, ``block_structure``, ``dynamic``) fields of a
    granularity (the caller checks that q/k/v sites are per tensor or per head): ``attn_head``, the
    weight strategies, and the activation ones (per-token and per-group activations are dynamic)."""
    if isinstance(granularity, PerTensor):
        return {"strategy": "tensor"}
    if site in ATTENTION_SITES:  # PerHead(1): one scale per head of [batch, heads, tokens, head_dim]
        return {"strategy": "attn_head"}
    if isinstance(granularity, PerRow) and granularity.dim != -1:
        fail(where, f"granularity {granularity!r}: compressed-tensors reduces along the last dimension only (dim=-1)")
    if site == "weight":
        if isinstance(granularity, PerRow) or (isinstance(granularity, PerAxis) and granularity.axis in (0, -2)):
            return {"strategy": "channel"}
        if isinstance(granularity, PerGroup):
            return {"strategy": "group", "group_size": granularity.group_size}
        if isinstance(granularity, PerBlock):
            if len(granularity.block_shape) != 2:
                fail(where, f"granularity {granularity!r}: compressed-tensors' block strategy takes 2-D blocks")
            return {"strategy": "block", "block_structure": list(granularity.block_shape)}
        fail(where, f"granularity {granularity!r} of a weight has no compressed-tensors strategy")
    if isinstance(granularity, (PerToken, PerRow)):
        return {"strategy": "token", "dynamic": True}
    if type(granularity) is PerGroup:
        return {"strategy": "group", "group_size": granularity.group_size, "dynamic": True}
    fail(where, f"granularity {granularity!r} of an activation has no compressed-tensors strategy")


def quantization_args(spec: QuantSpec, site: str, where: str = "spec", dynamic: bool = False) -> dict:
    """The compressed-tensors ``QuantizationArgs`` fields (a plain dict) equivalent to ``spec``
    for a ``site`` (``"weight"``, ``"input"``, ``"output"``, or ``"q"``/``"k"``/``"v"`` of an
    attention module). Activations quantized per token (``PerToken``/``PerRow``) or per group
    (``PerGroup``, MX) are dynamic: nothing is calibrated or written for them; so is an
    activation site with ``dynamic=True`` (its Rule's ``dynamic``, e.g. per tensor).

    Raises:
      ValueError: naming the spec field compressed-tensors cannot express.
    """
    if not isinstance(spec, QuantSpec):
        raise TypeError(f"export.compressed_tensors: {where}: expected a QuantSpec, got {type(spec).__name__}")
    two_level = isinstance(spec.granularity, TensorGroup)
    mx = spec.scale_dtype == "e8m0"
    qtype = _element_type(spec, where, site)
    symmetric = _is_symmetric(spec, where)
    if symmetric and qtype == "int" and spec.zero_point_of_symmetric + code_offset(spec, where) != 0:
        fail(where, f"symmetric_zero_point {spec.zero_point_of_symmetric} of dtype {spec.dtype!r}: compressed-tensors' "
             "symmetric args quantize around zero (code 0 of its signed range); use mapping='asymmetric', or the "
             "default symmetric zero point")
    if spec.zero_point_domain == "float":
        fail(where, "zero_point_domain 'float' has no compressed-tensors equivalent")
    if spec.scale_dtype not in ("float32", "bfloat16", "float16") and not (two_level or mx):
        fail(where, f"scale_dtype {spec.scale_dtype!r} is not supported by this export yet")
    fields: dict[str, Any] = {
        "num_bits": spec.bits, "type": qtype, "symmetric": symmetric, "group_size": None, "strategy": None,
        "block_structure": None, "dynamic": False, "actorder": None, "observer": None, "observer_kwargs": {},
        # half-precision scales: compressed-tensors rounds dynamic scales to it at run time (float32: none)
        "scale_dtype": None if spec.scale_dtype == "float32" else f"torch.{spec.scale_dtype}",
        # compressed-tensors serializes it for asymmetric args only
        "zp_dtype": None if symmetric else ("torch.float8_e4m3fn" if qtype == "float" else "torch.int8"),
    }
    if site in ATTENTION_SITES and not isinstance(spec.granularity, PerTensor) and spec.granularity != PerHead(1):
        fail(where, f"granularity {spec.granularity!r} of a {site!r} site: compressed-tensors' kv-cache and "  # NVFP4, MX too
             "attention scales are exported per tensor (PerTensor) or per head (PerHead(1), strategy 'attn_head')")
    if two_level or mx:
        # activations: group scales at run time, NVFP4's under the calibrated global scale ("local"),
        # MX ones on their own (compressed-tensors' MXFP4/MXFP8); float32 (unrounded) group scales of
        # two-level activations are compressed-tensors' args without scale_dtype (None)
        two_level_scales = "torch.float8_e4m3fn" if spec.scale_dtype == "float8_e4m3fn" else None
        fields.update(strategy="tensor_group" if two_level else "group",
                      group_size=spec.granularity.group_size,  # 32 for MX (`_element_type`)
                      scale_dtype=two_level_scales if two_level else "torch.uint8")
        if site != "weight":
            fields["dynamic"] = "local" if two_level else True
        return fields
    fields.update(_strategy(spec.granularity, site, where))
    if site != "weight":
        _check_activation_range(spec, site, where)
        if dynamic:
            if site in ATTENTION_SITES:
                fail(where, "dynamic q/k/v scales are not exportable: the export writes calibrated (static) "
                     "k_scale/v_scale/q_scale only; calibrate the q/k/v sites with a static spec")
            fields["dynamic"] = True  # scales from each tensor at run time (compute_dynamic_scales_and_zp)
    return fields


def _check_activation_range(spec: QuantSpec, site: str, where: str) -> None:
    """Refuses an integer activation spec whose range, moved onto compressed-tensors' signed one, is
    narrower than the whole ``num_bits`` range: compressed-tensors and vLLM quantize activations at run
    time on the whole range (weights keep theirs: their codes are stored), so values beyond the
    calibrated range would clamp elsewhere and dynamic scales would differ."""
    if spec.is_float:
        return
    lo, hi = -(2 ** (spec.bits - 1)), 2 ** (spec.bits - 1) - 1
    offset = code_offset(spec, where)
    qmin, qmax = spec.qrange
    if (qmin + offset, qmax + offset) != (lo, hi):
        fail(where, f"the {site} range [{qmin}, {qmax}] of dtype {spec.dtype!r} is narrower than the {2 ** spec.bits} "
             f"codes compressed-tensors quantizes activations on at run time ([{lo}, {hi}]; mapping "
             f"{spec.mapping!r}, reduce_range={spec.reduce_range}, quant_min/quant_max {spec.quant_min}/"
             f"{spec.quant_max}): the loaded model would clamp them elsewhere; calibrate the activations on the "
             "whole range (weights may keep a narrower one)")


def code_offset(spec: QuantSpec, where: str) -> int:
    """Shift from our integer range onto compressed-tensors' signed one."""
    if spec.is_float:
        return 0
    lo, hi = -(2 ** (spec.bits - 1)), 2 ** (spec.bits - 1) - 1
    offset = 0 if spec.is_signed else lo
    qmin, qmax = spec.qrange
    if qmin + offset < lo or qmax + offset > hi:
        fail(where, f"the integer range [{qmin}, {qmax}] does not fit compressed-tensors' [{lo}, {hi}]")
    return offset


def allowed_formats(weight_args: dict) -> tuple:
    """The formats that can hold weights of these args."""
    if weight_args["strategy"] == "tensor_group":
        return ("nvfp4-pack-quantized",)
    if weight_args.get("scale_dtype") == "torch.uint8":  # MX: e8m0 scales as uint8 exponents
        return ("mxfp4-pack-quantized",) if weight_args["num_bits"] == 4 else ("mxfp8-quantized",)
    if weight_args["type"] == "int":
        return ("pack-quantized", "int-quantized", "naive-quantized")
    return ("float-quantized", "naive-quantized")


def default_format(weights, inputs) -> str:
    """compressed-tensors' own inference (``infer_module_format``: the first compressor of its
    priority list that takes the scheme): NVFP4 and MX pack; integer weights are
    ``int-quantized`` with quantized inputs of any type (fp8 too), else ``pack-quantized``; fp8
    weights are ``float-quantized`` with quantized inputs, else ``naive-quantized``."""
    if weights is None:
        return "dense"
    formats = allowed_formats(weights)
    if len(formats) == 1:  # NVFP4, MX
        return formats[0]
    if weights["type"] == "int":  # of up to 8 bits (`quantization_args` refuses wider)
        return "int-quantized" if inputs is not None else "pack-quantized"
    return "float-quantized" if inputs is not None else "naive-quantized"


# llm-compressor's name of a qstats min-max observer, of weights (observed once) and of activations
_WEIGHT_OBSERVERS = {"minmax": "memoryless_minmax", "memoryless_minmax": "memoryless_minmax"}
_ACTIVATION_OBSERVERS = {"minmax": "static_minmax", "moving_average_minmax": "minmax",
                         "memoryless_minmax": "memoryless_minmax"}
# the options of qstats.mse that llm-compressor's mse observers take under the same names, and
# llm-compressor's defaults of the ones qstats writes only when they differ
_MSE_SEARCH = ("maxshrink", "grid", "norm", "expand")
_PATIENCE, _AVERAGING_CONSTANT = 5, 0.01
_MAXSHRINK, _GRID = 0.2, 100  # the search's defaults, the same in both libraries


def llm_compressor_observer(found) -> tuple:
    """``(name, observer_kwargs)``: llm-compressor's observer equivalent to a plan site's qstats observer
    and its options (what llm-compressor writes into the args' ``observer`` and ``observer_kwargs``, and
    `qstats.Recipe.from_compressed_tensors` reads back into the same observer): weights observed once by
    min-max are ``"memoryless_minmax"``, by the MSE search ``"memoryless_mse"`` (its ``patience`` from
    ``qparams_kwargs``, none: every candidate); activations: ``"static_minmax"`` (`qstats.minmax`), ``"minmax"`` (its moving
    average, with its ``averaging_constant``), ``"memoryless_minmax"``, ``"mse"`` / ``"memoryless_mse"``
    (`qstats.mse` in ``mode="moving_average"``, averaging constant 1 for the memoryless one); ``(None, {})``
    for the others (`qstats.mse` in its default accumulating mode too)."""
    name = registry.name_of(found.rule.observer)
    options = dict(found.rule.observer_kwargs)
    weight = found.kind == "parameter"
    constant = options.get("averaging_constant", _AVERAGING_CONSTANT)
    if name != "mse":
        written = (_WEIGHT_OBSERVERS if weight else _ACTIVATION_OBSERVERS).get(name)
        if written == "minmax" and constant != _AVERAGING_CONSTANT:  # the moving average of activations
            return written, {"averaging_constant": constant}
        return written, {}
    moving = options.get("mode", "accumulate") == "moving_average"
    if set(options) - {*_MSE_SEARCH, "mode", "averaging_constant", "patience"} or not (weight or moving):
        return None, {}  # options llm-compressor has no name for (reference, importance, steps)
    kwargs = {key: options[key] for key in _MSE_SEARCH if key in options}
    patience = options.get("patience", _PATIENCE) if moving else dict(found.rule.qparams_kwargs).get("patience")
    if patience is None:  # no early stop: llm-compressor's patience takes an int, as many as the candidates
        patience = int(options.get("maxshrink", _MAXSHRINK) * options.get("grid", _GRID))
    if patience != _PATIENCE:
        kwargs["patience"] = patience
    if weight or constant == 1.0:
        return "memoryless_mse", kwargs
    return "mse", kwargs if constant == _AVERAGING_CONSTANT else {**kwargs, "averaging_constant": constant}


def llm_compressor_observers(plan) -> dict:
    """``{path: {site: (name, observer_kwargs)}}``: the llm-compressor observer equivalent to each site's
    qstats observer (`llm_compressor_observer`)."""
    return {path: {site: llm_compressor_observer(found) for site, found in sites.items()}
            for path, sites in plan.sites.items()}


def ignored_modules(modules: dict, schemes: dict, rename) -> list:
    """The ``ignore`` list, as compressed-tensors' ``QuantizationConfig.from_pretrained`` writes it:
    the unquantized modules of a type some quantized module has (MoE routers and gates count as
    Linear, as vLLM matches them; unpacked experts are Linear), grouped by type in order of first
    appearance, then in ``named_modules`` order, under their checkpoint names (``rename``,
    `names.module_renamer`); then the module paths of those saved under another name that
    transformers' loading would quantize (Linear, Embedding: `module_targets`). A module the
    recipe's ``ignore`` names but no group could quantize (an embedding under Linear groups) is not
    listed. Stacked experts count as the Linear modules
    llm-compressor linearizes them into (`linearized_experts`): those left unquantized are listed."""
    quantized = {vllm_module_type(modules[path]) if path in modules else "Linear" for path in schemes}
    by_type: dict = {}
    renamed = []  # module paths of ignored Linear / Embedding modules saved under another name
    for path, module in modules.items():
        linear = linearized_experts(path, module)
        kind = "Linear" if linear else vllm_module_type(module)
        unquantized = [name for name in linear or [path] if name not in schemes]
        if path and kind in quantized:
            by_type.setdefault(kind, []).extend(rename(name) for name in unquantized)
            if not linear and unquantized and rename(path) != path and isinstance(module, _LOADED_CLASSES):
                renamed.append(path)
    return [path for paths in by_type.values() for path in paths] + renamed


# the modules compressed-tensors quantizes when transformers loads a checkpoint: it matches the config's
# targets and ignore list against the module paths of the model it builds, not the checkpoint's names
_LOADED_CLASSES = (torch.nn.Linear, torch.nn.Embedding)


def module_targets(path: str, rename, modules: dict) -> list:
    """The targets naming the module at ``path``: its module path, which compressed-tensors matches when
    transformers loads the checkpoint (``apply_quantization_config`` on the model it builds), and its
    checkpoint name (``rename``) where that differs (a VLM's ``model.layers.0...`` for
    ``model.language_model.layers.0...``), which vLLM maps to its own modules, unless that name is
    another of the model's ``modules``' paths."""
    name = rename(path)
    return [path] if name == path or name in modules else [path, name]


def vllm_module_type(module: torch.nn.Module) -> str:
    """compressed-tensors' ``get_vllm_module_type``: the class name, "Linear" for routers and gates."""
    name = type(module).__name__
    if "ExpertMLP" not in name and ("Router" in name or "Gating" in name or re.search(r"Gate(?![a-z])", name)):
        return "Linear"
    return name


def _observer_of(observers: dict, module_path: str, site: str, expert_projection: dict) -> tuple:
    """``(name, observer_kwargs)`` of ``site`` of a Linear, or of an unpacked expert's projection
    (from its experts module's sites of that kind, when they agree)."""
    if module_path not in expert_projection:
        return observers.get(module_path, {}).get(site, (None, {}))
    experts_path, projection = expert_projection[module_path]
    entry = observers.get(experts_path, {})
    if site != "weight":
        return entry.get(f"{projection}.input", entry.get("input", (None, {})))
    return agreed_observer(observer for key, observer in entry.items()
                           if key != "input" and not key.endswith(".input"))


def agreed_observer(found) -> tuple:
    """The ``(name, observer_kwargs)`` of the observers ``found`` when they are all the same, else
    ``(None, {})`` (the args of several sites hold one observer)."""
    distinct = {json.dumps(observer, sort_keys=True, default=str): observer for observer in found}
    return distinct.popitem()[1] if len(distinct) == 1 else (None, {})


def _with_observers(scheme: dict, module_path: str, observers: dict, expert_projection: dict) -> dict:
    if not observers:
        return scheme
    out = {}
    for site, args in scheme.items():
        if args is not None and args.get("dynamic") is not True:
            name, kwargs = _observer_of(observers, module_path, site, expert_projection)
            args = {**args, "observer": name, "observer_kwargs": kwargs}
        out[site] = args
    return out


def _class_targets(groups: dict, modules: dict, expert_projection: dict) -> None:
    """One group of Linear modules only targets ``["Linear"]`` (every other Linear is in the
    ignore list), as llm-compressor writes a one-scheme recipe on ``targets="Linear"``. Unpacked
    experts keep their regexes: transformers' ``get_experts_scheme`` looks for them."""
    if len(groups) != 1 or expert_projection:
        return
    (group,) = groups.values()
    paths = group["_paths"]
    if all(isinstance(modules.get(path), torch.nn.Linear) for path in paths) and _ignore_covers(modules, paths):
        group["targets"] = ["Linear"]


def _ignore_covers(modules: dict, paths: list) -> bool:
    """True when every Linear but ``paths`` is in the ``ignore`` list (`ignored_modules`: the unquantized
    modules of a quantized class): compressed-tensors' ``"Linear"`` target matches any module with a
    class named Linear in its MRO, so an unquantized Linear subclass of another class would be quantized
    at load (its scales missing)."""
    kinds = {vllm_module_type(modules[path]) for path in paths}
    chosen = set(paths)
    return all(path in chosen or vllm_module_type(module) in kinds
               for path, module in modules.items() if isinstance(module, torch.nn.Linear))


def config_groups(schemes: dict, expert_projection: dict, format: Optional[str], modules: dict, observers: dict,
                  rename) -> dict:
    """One config group per distinct (weights, input, output, format) combination, targeting the
    exact module paths, and one regex per projection of unpacked experts; keyed by that
    combination (insertion order). A single group of Linear ``modules`` (the model's) targets
    ``["Linear"]`` instead. ``observers``: ``{path: {site: (name, observer_kwargs)}}``
    (`llm_compressor_observers`, none without a recipe), the args' ``observer`` and ``observer_kwargs``.
    ``rename``: a module path's checkpoint name (`names.module_renamer`), for the targets."""
    groups: dict[str, dict] = {}
    for module_path, scheme in schemes.items():
        scheme = _with_observers(scheme, module_path, observers, expert_projection)
        weights, inputs, outputs = scheme.get("weight"), scheme.get("input"), scheme.get("output")
        # a group without weights is dense whatever ``format`` says: compressed-tensors' weight compressors
        # fail on it (naive_quantized compress: 'NoneType' object has no attribute 'strategy')
        group_format = format if format is not None and weights is not None else default_format(weights, inputs)
        key = json.dumps([weights, inputs, outputs, group_format], sort_keys=True)
        group = groups.setdefault(key, {"targets": [], "weights": weights, "input_activations": inputs,
                                        "output_activations": outputs, "format": group_format, "_paths": []})
        group["_paths"].append(module_path)
        targets = module_targets(module_path, rename, modules)
        if module_path in expert_projection:
            # every expert of a stacked module shares its scheme: one regex per projection of the
            # module (transformers' get_experts_scheme picks the group whose re: target names experts)
            experts_path, projection = expert_projection[module_path]
            targets = [rf"re:^{re.escape(rename(experts_path))}\.\d+\.{projection}$"]
        group["targets"].extend(target for target in targets if target not in group["targets"])
    _class_targets(groups, modules, expert_projection)
    _warn_packed_embeddings(groups, modules)
    for group in groups.values():
        group.pop("_paths", None)
    return groups


# the formats whose compressors replace a module's ``weight`` by ``weight_packed``
_PACKED_FORMATS = ("pack-quantized", "nvfp4-pack-quantized", "mxfp4-pack-quantized")


def _warn_packed_embeddings(groups: dict, modules: dict) -> None:
    """Warns, naming them, of Embedding modules written in a packed format: llm-compressor writes them
    so too, but transformers cannot load them (its ``_init_weights`` reads the ``weight`` that
    compressed-tensors' compressor replaced: "'Embedding' object has no attribute 'weight'")."""
    packed = [(path, group["format"]) for group in groups.values() if group["format"] in _PACKED_FORMATS
              for path in group["_paths"] if isinstance(modules.get(path), torch.nn.Embedding)]
    if not packed:
        return
    integer = all(fmt == "pack-quantized" for _, fmt in packed)
    instead = ("pass format='int-quantized' (or 'naive-quantized'), which keeps their weight unpacked" if integer
               else "leave them out of the recipe (ignore=), or quantize them to int or fp8 weights")
    warn(f"export.compressed_tensors: the Embedding module(s) {[path for path, _ in packed]} are written "
         f"{sorted({fmt for _, fmt in packed})}, as llm-compressor writes them, but transformers cannot load a packed "
         f"Embedding ('Embedding' object has no attribute 'weight'); {instead}", ExportWarning)
