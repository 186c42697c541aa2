"""compressed-tensors schemes as qstats rules: the rules behind `Recipe.from_scheme` and
`Recipe.from_compressed_tensors`.

Each ``QuantizationArgs`` of a scheme becomes a `Rule` whose spec is
`QuantSpec.from_compressed_tensors(args)` and whose observer is the one llm-compressor attaches
for those args (``initialize_observer``): weights are observed once (the static min-max, or the
MSE search for ``observer="mse"``); static activations take the moving average of per-batch
extremes (llm-compressor's ``"minmax"``, constant ``observer_kwargs["averaging_constant"]``,
0.01), or the named one (``"memoryless_mse"``: the latest batch's search); dynamic activations are scaled at run time (``Rule(dynamic=True)``); NVFP4's
``dynamic="local"`` activations calibrate their global scale like static ones.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import enum
import importlib
import inspect
import json
import os
import re
from typing import Any, Mapping

import torch

from ._attention import LATENT_CACHE, attention_module, latent_attention
from ._checks import is_instance_named
from ._granularity import PerTensor
from ._qparams import compute_qparams
from ._spec import QuantSpec
from .observers import registry
from .observers.mse import checked_patience
from .observers.search import search
from .experts import linearized_experts, linearized_layout_problem
from ._warn import warn

__all__ = ["scheme_rules", "config_rules", "compressed_tensors_ignore", "as_written", "GroupMatch",
           "split_observer_kwargs", "DROPIN_OBSERVERS"]

# the compressed-tensors checkpoint formats `qstats.export.compressed_tensors` writes
FORMATS = (
    "pack-quantized",
    "int-quantized",
    "float-quantized",
    "naive-quantized",
    "nvfp4-pack-quantized",
    "mxfp4-pack-quantized",
    "mxfp8-quantized",
)

# llm-compressor's observer names (of activations; of weights: `_weight_observer`) -> (qstats
# registered name, the observer_kwargs llm-compressor 0.14's observer reads (llmcompressor.observers
# .min_max, .mse: it ignores any other key; qstats' observer takes them all but the mse observers'
# triton_error_buffer, read by llm-compressor's CUDA kernel only), llm-compressor's defaults): its mse
# searches per batch, then takes a moving average; its memoryless_mse keeps the latest batch's search
# (a moving average with constant 1), and so does its nvfp4_expanded_mse (alias fouroversix), with
# these defaults
_EXPANDED_MSE = {"expand": 1.8, "maxshrink": 1 - 0.8 / 1.8, "grid": 200.0, "patience": 1000}
_MSE_OPTIONS = ("maxshrink", "patience", "grid", "norm", "triton_error_buffer", "expand")
_MEMORYLESS_MSE = ("mse", _MSE_OPTIONS, {"mode": "moving_average", "averaging_constant": 1.0})
_EXPANDED_MEMORYLESS_MSE = (*_MEMORYLESS_MSE[:2], {**_MEMORYLESS_MSE[2], **_EXPANDED_MSE})
_ACTIVATION_OBSERVERS = {
    "minmax": ("moving_average_minmax", ("averaging_constant",), {"averaging_constant": 0.01}),
    "static_minmax": ("minmax", (), {}),
    "memoryless_minmax": ("memoryless_minmax", (), {}),
    "mse": ("mse", ("averaging_constant", *_MSE_OPTIONS), {"mode": "moving_average", "averaging_constant": 0.01}),
    "memoryless_mse": _MEMORYLESS_MSE,
    "nvfp4_expanded_mse": _EXPANDED_MEMORYLESS_MSE,
    "fouroversix": _EXPANDED_MEMORYLESS_MSE,
}
_MSE_SEARCH = ("maxshrink", "grid", "norm", "expand")
_SITES = (("weights", "weight"), ("input_activations", "input"), ("output_activations", "output"))


def require_compressed_tensors(caller: str) -> None:
    """ImportError naming the install when compressed-tensors, an optional dependency that reading
    its schemes and configs needs, is missing."""
    try:
        importlib.import_module("compressed_tensors")
    except ImportError as error:
        raise ImportError(f"{caller} needs compressed-tensors: pip install 'qstats[calibrate]' ({error})") from None


def _args(args):
    """``args`` as compressed-tensors' ``QuantizationArgs`` (from a dict of its fields too)."""
    from compressed_tensors.quantization import QuantizationArgs

    if isinstance(args, QuantizationArgs):
        return args
    if isinstance(args, Mapping):
        return QuantizationArgs.model_validate(dict(args))
    raise TypeError(f"expected compressed-tensors QuantizationArgs or a dict of its fields, got {type(args).__name__}")


DROPIN_OBSERVERS = {"minmax": "moving_average_minmax", "static_minmax": "minmax",
                    "memoryless_minmax": "memoryless_minmax", "histogram": "histogram", "mse": "mse"}
"""``{suffix: qstats observer name}`` of the observers `qstats.llmcompressor` registers in
llm-compressor as ``"qstats_<suffix>"`` (a drop-in checkpoint names them)."""

_QSTATS_OBSERVERS = {f"qstats_{suffix}": name for suffix, name in DROPIN_OBSERVERS.items()}


def _histogram_method_options(options: Mapping, where: str) -> set:
    """The compute_qparams options a histogram takes with ``options["method"]`` (default ``"l2"``):
    ``method`` and its search's keyword options (any, for a search taking ``**options``). An unknown
    method raises here, when the observer is made, rather than after the calibration."""
    method = options.get("method", "l2")
    try:
        found = search(method, "histogram")
    except (ValueError, TypeError) as error:
        raise ValueError(f"{where}: observer_kwargs method={method!r}: {error}") from None
    parameters = list(inspect.signature(found).parameters.values())[2:]  # after (state, spec)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return set(options)
    return {"method"} | {p.name for p in parameters}


def split_observer_kwargs(factory, options: Mapping, where: str, weight: bool = False) -> tuple:
    """``(factory options, compute_qparams options)`` of llm-compressor ``observer_kwargs`` for the
    qstats observer ``factory``: those it takes, and the others. `mse` in its accumulating mode
    takes ``patience`` at compute_qparams (5 on a ``weight``, as ``memoryless_mse`` stops early) and
    drops a ``weight``'s ``averaging_constant`` (one observation); its ``triton_error_buffer`` (read by llm-compressor's CUDA kernel only) is dropped. TypeError
    naming options an observer's qparams do not take (any, for min/max observers; for a histogram,
    those its ``method``'s search does not take: `_histogram_method_options`)."""
    accepted = set(inspect.signature(factory).parameters) - {"spec"}
    own = {key: value for key, value in options.items() if key in accepted}
    rest = {key: value for key, value in options.items() if key not in accepted}
    name = factory.__name__
    taken = _histogram_method_options(rest, where) if name == "histogram" else set()
    if name == "mse":
        rest.pop("triton_error_buffer", None)
        if own.get("mode", "accumulate") == "accumulate":
            taken = {"patience"}
            if "patience" in own or weight:  # a search option there (mse's factory takes it for moving averages)
                rest["patience"] = own.pop("patience", 5)
            if weight:  # observed once: unused, as llm-compressor's memoryless_mse ignores it
                own.pop("averaging_constant", None)
    if set(rest) - taken:
        raise TypeError(f"{where}: observer_kwargs {sorted(set(rest) - taken)} are not options of qstats.{name}")
    return own, rest


def check_observer_kwargs(factory, factory_options: Mapping, qparams_options: Mapping, spec: QuantSpec,
                          where: str) -> None:
    """ValueError or TypeError for bad ``observer_kwargs`` now, as the recipe is read: an input's qparams
    come after the whole calibration. ``averaging_constant`` on an accumulating `mse` is refused
    (llm-compressor's ``mse`` averages with it; there it would be ignored). The searches check their
    values (a histogram's ``percentile``, ``candidates``, ``start_bin``) only when they run, so those
    are tried on a small per-tensor sample."""
    if (factory is registry.get("mse") and factory_options.get("mode", "accumulate") == "accumulate"
            and "averaging_constant" in factory_options):
        raise ValueError(  # a weight's is dropped (split_observer_kwargs)
            f"{where}: observer_kwargs averaging_constant applies to mode='moving_average' (llm-compressor's "
            "mse); qstats_mse sums the losses of all batches unless observer_kwargs give mode='moving_average'")
    if "patience" in qparams_options:
        checked_patience(qparams_options["patience"], where)
    spec = spec.replace(granularity=PerTensor())
    observer = factory(spec, **factory_options)  # its own options' errors
    if not set(qparams_options) - {"method", "patience"}:
        return
    sample = torch.linspace(-1.0, 1.0, 64)
    try:
        compute_qparams(observer.update(observer.init(sample), sample), spec, **qparams_options)
    except (ValueError, TypeError) as error:
        raise type(error)(f"{where}: observer_kwargs {error}") from None


def _observer_name(args):
    """``args.observer`` as llm-compressor's registry looks it up (compressed-tensors'
    ``standardize_lookup_name``: case, ``-``, ``_`` and spaces alike: ``"MSE"`` is ``"mse"``,
    ``"static-minmax"`` is ``"static_minmax"``), spelt as llm-compressor registers it; None stays None."""
    if args.observer is None:
        return None
    return args.observer.replace("-", "_").replace(" ", "_").lower()


def _qstats_observer(args, weight: bool) -> tuple:
    """``(observer name, observer_kwargs, qparams_kwargs)`` of a ``qstats_*`` observer, its
    ``observer_kwargs`` split as `qstats.llmcompressor` splits them (`split_observer_kwargs`)."""
    name = _QSTATS_OBSERVERS[_observer_name(args)]
    where = f"observer {args.observer!r}"
    factory, qparams = split_observer_kwargs(registry.get(name), dict(args.observer_kwargs or {}), where, weight)
    check_observer_kwargs(registry.get(name), factory, qparams, QuantSpec.from_compressed_tensors(args), where)
    if weight and name in ("moving_average_minmax", "memoryless_minmax"):
        name, factory = "minmax", {}  # a weight is observed once: its averaging constant is unused
    return name, factory, qparams


def _warn_unread_options(args, name: str, site: str) -> None:
    """Warns naming the ``observer_kwargs`` of ``args`` that llm-compressor's observer ``name`` does not
    read (a misspelt ``averging_constant``, ``maxshrnk``): it ignores them silently, and so does the
    Recipe, which takes that observer's defaults."""
    read = _ACTIVATION_OBSERVERS[name][1]
    unread = sorted(key for key in (args.observer_kwargs or {}) if key not in read)
    if not unread:
        return
    nearest = {key: difflib.get_close_matches(str(key), read, n=1) for key in unread}
    hint = "".join(f"; {key!r}: did you mean {near[0]!r}?" for key, near in nearest.items() if near)
    warn(f"the {site} observer {name!r}: observer_kwargs {unread} are none that llm-compressor's {name!r} observer "
         f"reads (it reads {list(read) or 'none'}), so it ignores them, and so does the Recipe{hint}", UserWarning)


def _weight_observer(args) -> tuple:
    """``(observer name, observer_kwargs, qparams_kwargs)`` llm-compressor uses for weights, observed
    once: the min-max of its min-max observers (and of none named), one search for its mse observers
    (``memoryless_mse``'s, with the named observer's defaults)."""
    name = _observer_name(args)
    name = "memoryless_minmax" if name is None else name
    if name in _QSTATS_OBSERVERS:
        return _qstats_observer(args, weight=True)
    if name not in _ACTIVATION_OBSERVERS:
        raise ValueError(f"weights observer {args.observer!r}: no qstats equivalent of this llm-compressor observer; "
                         f"known: {list(_ACTIVATION_OBSERVERS) + list(_QSTATS_OBSERVERS)}")
    _warn_unread_options(args, name, "weights")
    ours, _, defaults = _ACTIVATION_OBSERVERS[name]
    if ours != "mse":
        return "minmax", {}, {}
    kwargs = {**defaults, **dict(args.observer_kwargs or {})}
    return "mse", {k: kwargs[k] for k in _MSE_SEARCH if k in kwargs}, {"patience": kwargs.get("patience", 5)}


def _activation_observer(args) -> tuple:
    """``(observer name, observer_kwargs, qparams_kwargs)`` llm-compressor uses for static activations."""
    name = _observer_name(args) or "minmax"
    if name in _QSTATS_OBSERVERS:
        return _qstats_observer(args, weight=False)
    if name not in _ACTIVATION_OBSERVERS:
        raise ValueError(
            f"activation observer {args.observer!r}: no qstats equivalent of this llm-compressor observer; "
            f"known: {sorted(_ACTIVATION_OBSERVERS) + list(_QSTATS_OBSERVERS)}"
        )
    _warn_unread_options(args, name, "activations")
    ours, read, defaults = _ACTIVATION_OBSERVERS[name]
    taken = {key: value for key, value in (args.observer_kwargs or {}).items() if key in read}
    taken.pop("triton_error_buffer", None)  # llm-compressor's CUDA kernel's
    return ours, {**defaults, **taken}, {}


# why attn_head args of Linear modules are refused (`_rule`, `GroupMatch.linear_refusal`)
ATTN_HEAD_LINEAR = (
    "strategy 'attn_head' (one scale per attention head) is not supported on Linear weights and activations, as "
    "compressed-tensors refuses it there: it quantizes the q, k and v of attention modules per head only (a "
    "kv_cache_scheme, or the input_activations of a config group targeting attention modules)"
)


# why compressed-tensors' static per-group activations are refused (`_STATIC_REFUSALS`)
STATIC_GROUP_ACTIVATIONS = (
    "static per-group activations (compressed-tensors strategy 'group' or 'tensor_group' with dynamic=False, "
    "not NVFP4's dynamic='local') are not supported end to end by llm-compressor 0.14 / compressed-tensors "
    "0.19: llm-compressor calibrates one scale per group of the features, but compressed-tensors' forward (the "
    "model after oneshot, the reloaded checkpoint) broadcasts those scales against the sequence dimension and "
    "fails (or quantizes token i with group i's scale); use dynamic=True (per-group scales of each tensor at run time) or strategy 'tensor'"
)
# why static per-channel and per-block activations are refused (`_STATIC_REFUSALS`)
STATIC_ROW_ACTIVATIONS = (
    "static per-channel and per-block activations (compressed-tensors strategy 'channel' or 'block', which "
    "compressed-tensors takes for output_activations) are not supported, as llm-compressor 0.14's calibration "
    "refuses them ('Channel quantization cannot be applied to activations'); use strategy 'tensor', or "
    "'token' with dynamic=True"
)

# why q/k/v args of NVFP4's dynamic="local" groups are refused (`_kv_rule`, `_attention_refusal`)
GROUPED_ATTENTION = (
    "tensor_group args with dynamic='local' (NVFP4's per-group scales at run time under a calibrated global "
    "scale) are not supported on the q, k and v of attention (a kv_cache_scheme, or the input_activations of "
    "a config group targeting attention modules), as llm-compressor 0.14's calibration refuses them ('Group "
    "quantization cannot be applied to attention'), and compressed-tensors' checkpoints take q/k/v scales "
    "per tensor or per head (strategy 'tensor' or 'attn_head')"
)

# why weights args with dynamic=True or "local" are refused (`_rule`)
DYNAMIC_WEIGHTS = (
    "dynamic weights are not supported: compressed-tensors computes their scales from the weight at each forward "
    "and holds no weight_scale, so llm-compressor 0.14's oneshot cannot save the checkpoint (it fails compressing "
    "it); a weight's scales come from the weight itself either way: use dynamic=False (the same scales, calibrated "
    "once and saved)"
)

# why static activation args are refused, by strategy: per-group ones (``group``, and ``tensor_group``
# with ``dynamic=False``, not NVFP4's ``"local"``), per-channel and per-block ones. Their specs read per
# row, so a site would otherwise be scaled at run time in silence (`qstats.recipe.runtime_scaled`) and
# exported as dynamic.
_STATIC_REFUSALS = {"group": STATIC_GROUP_ACTIVATIONS, "tensor_group": STATIC_GROUP_ACTIVATIONS,
                    "channel": STATIC_ROW_ACTIVATIONS, "block": STATIC_ROW_ACTIVATIONS}


def _rule(Rule, targets, args, site: str, observed_dtype, caller: str):
    # PerHead(1) would read a Linear's second axis
    if args.strategy == "attn_head" and site not in ("q", "k", "v"):
        raise ValueError(f"the {site} args: {ATTN_HEAD_LINEAR}")
    if site != "weight" and args.dynamic is False and args.strategy in _STATIC_REFUSALS:
        raise ValueError(f"{caller}: the {site} args: {_STATIC_REFUSALS[args.strategy]}")
    if site == "weight" and args.dynamic:  # True or "local": read as static weights, the export would differ
        raise ValueError(f"{caller}: the weights args: {DYNAMIC_WEIGHTS} (got dynamic={args.dynamic!r})")
    overrides = {} if observed_dtype is None else {"observed_dtype": observed_dtype}
    if site != "weight" and args.dynamic is True:  # scales at run time: llm-compressor observes nothing
        # the Rule says so (dynamic=True): the spec of the args read as static, which does not warn
        # that it alone does not (a per-tensor dynamic strategy)
        spec = QuantSpec.from_compressed_tensors(args.model_copy(update={"dynamic": False}), **overrides)
        return Rule(targets, sites=(site,), observer="memoryless_minmax", spec=spec, dynamic=True)
    spec = QuantSpec.from_compressed_tensors(args, **overrides)
    observer, observer_kwargs, qparams_kwargs = (
        _weight_observer if site == "weight" else _activation_observer)(args)
    return Rule(targets, sites=(site,), observer=observer, spec=spec, observer_kwargs=observer_kwargs,
                qparams_kwargs=qparams_kwargs)


# the sites of stacked experts (`qstats.experts`) that llm-compressor's linearized experts quantize
_EXPERT_SITES = {"weight": ("gate_up_proj", "down_proj"), "input": ("input", "down_proj.input")}
# those of any layout llm-compressor linearizes (gate-less experts: ``up_proj``)
_LINEARIZED_SITES = {**_EXPERT_SITES, "weight": ("gate_up_proj", "up_proj", "down_proj")}


def matches_targets(targets: tuple, path: str, module) -> bool:
    """Whether a module at ``path`` is one of ``targets``: a ``re:`` full match of the path, the path, or a class name."""
    return any(re.fullmatch(target[3:], path) if target.startswith("re:")
               else target == path or (module is not None and _is_class_name(module, target))
               for target in targets)


def _is_class_name(module: torch.nn.Module, target: str) -> bool:
    """The module's class or one of its ``nn.Module`` base classes is named ``target`` (as
    compressed-tensors matches: ``"Linear"`` also matches subclasses of ``nn.Linear``)."""
    return any(
        issubclass(cls, torch.nn.Module) and cls.__name__ == target for cls in type(module).__mro__
    )


@dataclasses.dataclass(frozen=True)
class ExpertsMatch:
    """`Rule.matcher` of ``from_scheme(experts=...)``: the stacked-experts modules ``targets`` names
    (class names, paths or regexes, in qstats' syntax), less the sites whose per-expert Linears
    (`qstats.experts.linearized_experts`) the ``ignore`` list (compressed-tensors' syntax) names, as
    llm-compressor leaves those Linears unquantized; ValueError where it names only some of them."""

    targets: tuple
    ignore: tuple = ()

    def __call__(self, path: str, module) -> bool:
        return matches_targets(self.targets, path, module)

    def sites_on(self, path: str, module, sites: tuple) -> tuple:
        if not self(path, module):
            return ()
        kept = []
        for site in sites:
            names = linearized_experts(path, module, site)
            ignored = _ignored(names, self.ignore)
            if ignored and len(ignored) != len(names):
                raise ValueError(f"Recipe: the ignore list names {len(ignored)} of the {len(names)} per-expert Linears "
                                 f"behind {site!r} of the stacked experts {path!r} (e.g. {sorted(ignored)[0]!r}); qstats "
                                 "observes a stacked site with one scheme for every expert: ignore all of them or none")
            if not ignored:
                kept.append(site)
        problem = linearized_layout_problem(module) if kept else None
        if problem:  # the sites would be observed as stored, not as the per-expert Linears
            raise ValueError(f"Recipe: from_scheme(experts=...) takes the stacked experts {path!r} as llm-compressor's "
                             f"per-expert Linears, but {problem}; quantize them with a qstats Rule that states "
                             "their layout, or leave them out of experts")
        return tuple(kept)


def _expert_rules(rules: list, experts, ignore: tuple) -> list:
    """Rules quantizing stacked-experts modules ``experts`` (class names, paths or regexes, in
    qstats' syntax) as llm-compressor quantizes their linearized ``gate_proj``/``up_proj``/``down_proj``,
    less those the config's ``ignore`` names (`ExpertsMatch`)."""
    out = []
    for rule in rules:
        (site,) = rule.sites
        if site not in _EXPERT_SITES:
            raise ValueError(f"from_scheme: experts: {site} activations of stacked experts are not supported")
        matcher = ExpertsMatch(tuple(_list(experts, "experts")), tuple(ignore))
        out.append(dataclasses.replace(rule, targets=experts, sites=_EXPERT_SITES[site], matcher=matcher))
    return out


def _list(targets, what: str) -> list:
    if isinstance(targets, str):
        return [targets]
    if isinstance(targets, (list, tuple)):
        return list(targets)
    raise TypeError(f"{what} must be a string or a list of strings, got {type(targets).__name__}")


def _scheme_groups(scheme: Any, targets) -> list:
    """The ``QuantizationScheme`` config groups of llm-compressor's ``QuantizationModifier(scheme=,
    targets=)`` (``resolve_quantization_config``): a preset name, a dict of ``QuantizationScheme``
    fields, a ``QuantizationScheme``, or a dict mapping preset names to their targets."""
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES, is_preset_scheme, preset_name_to_scheme

    if isinstance(scheme, str):
        if not is_preset_scheme(scheme):
            raise ValueError(f"unknown compressed-tensors scheme {scheme!r}; presets: {', '.join(PRESET_SCHEMES)}")
        return [preset_name_to_scheme(scheme, _list("Linear" if targets is None else targets, "targets"))]
    if isinstance(scheme, QuantizationScheme):
        return [scheme if targets is None else scheme.model_copy(update={"targets": _list(targets, "targets")})]
    if not isinstance(scheme, Mapping):
        raise TypeError(f"expected a scheme name, QuantizationScheme or dict, got {type(scheme).__name__}")
    presets = [isinstance(key, str) and is_preset_scheme(key) for key in scheme]
    if any(presets) and not all(presets):  # a mapping of presets with a misspelt one
        unknown = [key for key, known in zip(scheme, presets) if not known]
        raise ValueError(f"unknown compressed-tensors scheme(s) {unknown} in a mapping of preset names to their "
                         f"targets; presets: {', '.join(PRESET_SCHEMES)}")
    if scheme and all(presets):
        if targets is not None:  # llm-compressor drops them silently
            raise ValueError(f"targets={targets!r} with a scheme mapping presets to their targets ({scheme!r}): "
                             "name each preset's targets in the mapping")
        return [preset_name_to_scheme(name, _list(names, f"the targets of {name}")) for name, names in scheme.items()]
    targets = _list(scheme.get("targets", "Linear") if targets is None else targets, "targets")
    return [_validated(scheme, targets, f"scheme {scheme!r} is neither a dict of QuantizationScheme fields nor a "
                                        "mapping of preset names to targets")]


def _validated(fields: Mapping, targets: list, what: str):
    """The ``QuantizationScheme`` of ``fields`` with ``targets``; its ValueError (which names unknown
    fields) prefixed with ``what``."""
    from compressed_tensors.quantization import QuantizationScheme

    try:
        return QuantizationScheme.model_validate({**fields, "targets": targets})
    except ValueError as error:
        raise ValueError(f"{what}: {error}") from None


@dataclasses.dataclass(frozen=True)
class GroupMatch:
    """`Rule.matcher` of config group ``group``: the modules compressed-tensors'
    ``apply_quantization_config`` gives that group's scheme. Of the groups whose ``targets``
    (``groups``, in config order) match a module, its ``match_targets`` picks the group of the most
    specific target (an exact name, then a regex, ``re.match`` from the start of the path, then a
    class name; a target repeated in a later group belongs to the later one); Linear and Embedding
    modules take the scheme's args (``attention=False``), attention modules it matches narrowly
    (``is_narrow_match``, its parent checked by name) quantize q, k and v with its input args
    (``attention=True``). On transformers' stacked experts, `sites_on` gives the sites whose
    linearized Linears (what llm-compressor quantizes) take this group."""

    groups: tuple
    group: int
    attention: bool = False
    ignore: tuple = ()  # the config's ignore list (compressed-tensors syntax), for per-expert Linears
    refusal: str = ""  # why compressed-tensors refuses this group's scheme on an attention module (`_attention_refusal`)
    linear_refusal: str = ""  # why it refuses the group's scheme on a Linear or Embedding it matches (attn_head)
    renamed: tuple = ()  # (model name, checkpoint name) of per-expert Linears (`with_checkpoint_names`)

    def __call__(self, path: str, module) -> bool:
        from compressed_tensors.utils import match_targets

        if module is None:
            raise TypeError(f"the rules of Recipe.from_scheme / from_compressed_tensors select modules by their "
                            f"class too, as compressed-tensors does: pass the module of {path!r}")

        owner = self._owner()
        matched = match_targets(path, module, owner)
        if not matched or owner[matched[0]] != self.group:
            return False
        if kv_cache_module(path, module) and self._narrow(path, module):
            if self.refusal:  # compressed-tensors' `_validate_attention_scheme` raises: not quantized silently
                raise ValueError(f"Recipe: config group {self.group} (targets {list(self.groups[self.group])}) narrowly "
                                 f"matches the attention module {path!r}, which compressed-tensors refuses: {self.refusal}")
            if self.attention:
                _check_projections(path, module, ("q", "k", "v"), f"config group {self.group}")
            return self.attention
        linear = isinstance(module, (torch.nn.Linear, torch.nn.Embedding))
        if linear and self.linear_refusal:
            raise ValueError(f"Recipe: config group {self.group} (targets {list(self.groups[self.group])}) matches the "
                             f"{type(module).__name__} {path!r}: {self.linear_refusal}")
        return not self.attention and linear

    def _owner(self) -> dict:
        """``{target: group}``: a target repeated in a later group belongs to the later one."""
        return {target: index for index, targets in enumerate(self.groups) for target in targets}

    def sites_on(self, path: str, module, sites: tuple) -> tuple:
        """The ``sites`` of the module at ``path`` this group quantizes, but an Embedding's input (its
        integer token ids, which compressed-tensors would quantize: docs/differences.md); on stacked
        experts, those of their sites (`_EXPERT_SITES`) whose per-expert Linears
        (`qstats.experts.linearized_experts`) take this group; ValueError where they take several groups."""
        if self(path, module):
            return tuple(site for site in sites if site != "input") if isinstance(module, torch.nn.Embedding) else sites
        if self.attention or not linearized_experts(path, module):
            return ()
        if "output" in sites and self._takes_experts(path, module, None):
            raise ValueError(f"Recipe: config group {self.group} quantizes output activations of the stacked experts "
                             f"{path!r}; output activations of stacked experts are not supported")
        taken = tuple(expert_site for site in sites for expert_site in _LINEARIZED_SITES.get(site, ())
                      if self._takes_experts(path, module, expert_site))
        problem = linearized_layout_problem(module) if taken else None
        if problem:
            raise ValueError(f"Recipe: config group {self.group} takes the per-expert Linears of the stacked experts "
                             f"{path!r}, but {problem}; ignore them (e.g. 're:{re.escape(path)}\\..*') or quantize "
                             "them with a qstats Rule that states their layout")
        return taken

    def _takes_experts(self, path: str, module, site) -> bool:
        from compressed_tensors.utils import match_targets

        owner = self._owner()
        linear = torch.nn.Linear(1, 1, bias=False, device="meta")  # what linearize_moe makes of each
        names = linearized_experts(path, module, site)
        ignored = _ignored(names, self.ignore)
        saved = dict(self.renamed)
        groups: dict = {}
        for name in names:  # by model name, else by the checkpoint name a checkpoint's config targets
            matched = None if name in ignored else (match_targets(name, linear, owner)
                                                    or match_targets(saved.get(name, name), linear, owner))
            groups.setdefault(owner[matched[0]] if matched else None, []).append(name)
        if self.group in groups and len(groups) > 1:
            raise ValueError(
                f"Recipe: the config groups give the per-expert Linears behind {site or 'the outputs'!r} of the "
                f"stacked experts {path!r} different schemes ({_listed_groups(groups)}); qstats observes a stacked "
                "site with one scheme for every expert: target all of them alike"
            )
        return self.group in groups

    def _narrow(self, path: str, module) -> bool:
        from compressed_tensors.utils import is_match, match_name

        parent = path.rsplit(".", 1)[0]
        return any(
            is_match(path, module, target) and parent != path and not match_name(parent, target)
            and not any(is_match(f"{path}.{name}", child, target) for name, child in module.named_modules() if name)
            for target in self.groups[self.group]
        )


def _ignored(names: list, ignore: tuple) -> set:
    """The per-expert Linear ``names`` compressed-tensors' ``ignore`` matches (an exact name, a
    ``re:`` regex matched from the start, or the class name ``Linear``)."""
    exact = {target for target in ignore if not target.startswith("re:")}
    if "Linear" in exact:
        return set(names)
    patterns = [re.compile(target[3:]) for target in ignore if target.startswith("re:")]
    return {name for name in names if name in exact or any(pattern.match(name) for pattern in patterns)}


def with_checkpoint_names(matcher, path: str, module, rename) -> Any:
    """``matcher`` (`GroupMatch`, `ExpertsMatch`) reading the per-expert Linears of the stacked experts
    at ``path`` by their checkpoint names too (``rename``, `_checkpoint_names.module_renamer`), as
    compressed-tensors reads a checkpoint's config: its ``ignore`` also naming, by model name, those it
    names by checkpoint name (Mixtral's ``block_sparse_moe.experts.0.down_proj`` for
    ``mlp.experts.0.down_proj``), and a `GroupMatch` matching their checkpoint names against its
    groups' targets (the export writes them so). Any other matcher, or experts not renamed, as it is."""
    if not isinstance(matcher, (GroupMatch, ExpertsMatch)):
        return matcher
    renamed = tuple((name, rename(name)) for name in linearized_experts(path, module) if rename(name) != name)
    if not renamed:
        return matcher
    changes: dict = {"renamed": renamed} if isinstance(matcher, GroupMatch) else {}
    extra = tuple(name for name, saved in renamed if _ignored([saved], matcher.ignore))
    if extra:
        changes["ignore"] = matcher.ignore + extra
    return dataclasses.replace(matcher, **changes) if changes else matcher


def _listed_groups(groups: dict) -> str:
    return "; ".join(f"{'no group' if group is None else f'group {group}'}: {names[0]}"
                     + (f" and {len(names) - 1} more" if len(names) > 1 else "") for group, names in groups.items())


def unquantized_matches(targets: tuple, modules: dict) -> list:
    """``[(path, class name)]`` of the modules of ``modules`` (path -> module) that compressed-tensors'
    ``targets`` match (``is_match``: a path, a ``re:`` match from the start, a class name) but that no
    config group quantizes: neither Linear nor Embedding nor an attention module compressed-tensors
    caches (a ``Conv2d``, a decoder layer whose children are the Linears)."""
    from compressed_tensors.utils import is_match

    return [(path, type(module).__name__) for path, module in modules.items()
            if path and is_match(path, module, list(targets))
            and not isinstance(module, (torch.nn.Linear, torch.nn.Embedding)) and not kv_cache_module(path, module)]


def kv_cache_module(path: str, module) -> bool:
    """`Rule.matcher` of a ``kv_cache_scheme``: compressed-tensors' ``is_cached_attention_module``."""
    from compressed_tensors.quantization.lifecycle.initialize import is_cached_attention_module

    if module is None:
        raise TypeError(f"a kv_cache_scheme rule selects attention modules by their class, as compressed-tensors "
                        f"does: pass the module of {path!r}")
    return is_cached_attention_module(module)


# the children whose outputs are an attention module's sites "q", "k", "v" (`qstats.recipe`)
PROJECTION_NAMES = {
    "q": ("q_proj", "query", "q"),
    "k": ("k_proj", "key", "k"),
    "v": ("v_proj", "value", "v"),
}


def child_projection(module, site: str):
    """The child of an attention ``module`` whose output is its ``site`` (``"q"``, ``"k"``, ``"v"``:
    `PROJECTION_NAMES`), or None."""
    children = dict(module.named_children())
    return next((children[name] for name in PROJECTION_NAMES[site] if name in children), None)


def kv_cache_sites(path: str, module) -> bool:
    """`Rule.matcher` of a ``kv_cache_scheme``: the attention modules compressed-tensors caches
    (`kv_cache_module`), each with k/v sites qstats observes (`_check_projections`)."""
    if not kv_cache_module(path, module):
        return False
    _check_projections(path, module, ("k", "v"), "the kv_cache_scheme")
    return True


def head_count_problem(model) -> "str | None":
    """Why compressed-tensors cannot load q/k/v scales of ``model``: its ``get_num_attn_heads``,
    ``get_num_kv_heads`` or ``get_head_dim`` raises on the model's decoder config (OPT's has no
    ``num_key_value_heads``); None where they read it, or where ``model`` has no transformers config."""
    config = getattr(model, "config", None)
    if not callable(getattr(config, "get_text_config", None)):  # not a transformers model: no such config read
        return None
    try:  # compressed-tensors is optional (the `calibrate` extra): without it there is no loader to ask
        from compressed_tensors.utils import get_head_dim, get_num_attn_heads, get_num_kv_heads
    except ImportError:
        return None
    text_config = config.get_text_config(decoder=True)
    for read in (get_num_attn_heads, get_num_kv_heads, get_head_dim):
        try:
            read(text_config)
        except ValueError as error:
            reason = str(error).replace(str(text_config), "").strip()
            return (f"its {read.__name__} raises on the model's decoder config ({type(text_config).__name__}, "
                    f"model_type {getattr(text_config, 'model_type', None)!r}): {reason}")
    return None


def _check_projections(path: str, module, sites: tuple, what: str) -> None:
    """ValueError where the attention module at ``path``, which compressed-tensors quantizes, has no
    q/k/v sites of ``sites``: a transformers attention module (`qstats._attention.attention_module`)
    has them all (its attention function's arguments); another module has those of its projection
    children only, so a fused ``qkv_proj`` there would lose that quantization silently. MLA's k/v
    are not the tensors compressed-tensors quantizes (`qstats._attention.LATENT_CACHE`)."""
    if latent_attention(module) and {"k", "v"} & set(sites):
        raise ValueError(f"Recipe: {what} applies to the attention module {path!r} ({type(module).__name__}), whose "
                         f"k/v compressed-tensors quantizes, but {LATENT_CACHE}")
    missing = [] if attention_module(module) else [site for site in sites if child_projection(module, site) is None]
    if missing:
        raise ValueError(f"Recipe: {what} applies to the attention module {path!r} ({type(module).__name__}), whose "
                         f"{'/'.join(sites)} compressed-tensors quantizes, but it is no transformers attention module "
                         "(no config naming its attention implementation, read through AttentionInterface), where "
                         f"qstats finds these sites by their {'/'.join(PROJECTION_NAMES[site][0] for site in missing)} "
                         "children, which it has not (a fused qkv_proj): not supported; ignore the module or drop "
                         "that scheme")


def compressed_tensors_ignore(ignore) -> Any:
    """An ``ignore`` list of compressed-tensors (``re:`` regexes ``re.match`` from the start of the
    path) in qstats' syntax (``re.fullmatch``): ``re:X`` becomes ``re:(?:X).*`` (leading inline
    flags kept first); names and class names are unchanged. Anything else is left for `Recipe`
    to refuse."""
    if isinstance(ignore, str):
        ignore = (ignore,)
    if not isinstance(ignore, (list, tuple)):
        return ignore
    return tuple(_fullmatch_form(target) if isinstance(target, str) and target.startswith("re:") else target
                 for target in ignore)


class WrittenTarget(str):
    """An ``ignore`` target in qstats' syntax (`_fullmatch_form`) that keeps the entry as the user
    wrote it in compressed-tensors' syntax (``written``), which messages name."""

    written: str

    def __new__(cls, target: str, written: str) -> "WrittenTarget":
        out = super().__new__(cls, target)
        out.written = written
        return out

    def __getnewargs__(self) -> tuple:  # copy and pickle
        return str(self), self.written


def as_written(target: str) -> str:
    """An ``ignore`` target as its user wrote it (`WrittenTarget.written`), else itself."""
    return getattr(target, "written", target)


def _fullmatch_form(target: str) -> str:
    pattern = target[3:]
    try:  # named as written, not in the rewritten form
        re.compile(pattern)
    except re.error as error:
        raise ValueError(f"ignore: invalid regular expression {target!r}: {error}") from None
    flags = re.match(r"(?:\(\?[aiLmsux]+\))+", pattern)
    head = flags.group() if flags else ""
    end = "\n" if "x" in head else ""  # a verbose pattern's trailing comment ends at a newline
    return WrittenTarget(f"re:{head}(?:{pattern[len(head):]}{end}).*", target)


_LINEAR_CLASSES = {"Linear", "Embedding"}


def _attention_refusal(group) -> str:
    """compressed-tensors' ``_validate_attention_scheme`` message for config group ``group`` applied to
    an attention module it narrowly matches (or `GROUPED_ATTENTION`, which llm-compressor's calibration
    refuses), or "" when it takes q, k and v."""
    if group.weights is not None:
        return "cannot apply weight quantization to attention; target the (q|k|v)_proj submodule layers of attention"
    if group.input_activations is None:
        return "cannot apply attention quantization without specifying input activations"
    if group.output_activations is not None:
        return "cannot apply output quantization to attention"
    if group.input_activations.dynamic == "local":  # llm-compressor's calibration refuses it
        return GROUPED_ATTENTION
    return ""


def _check_format(group, index: int) -> None:
    """ValueError naming a config group's ``format`` other than the one compressed-tensors infers for
    its scheme (``infer_module_format``), which llm-compressor's checkpoint writes for that group (an
    unpacked ``naive-quantized`` weight for W8A16, say): a Recipe holds no checkpoint format, and its
    export would write the inferred one."""
    if group.format is None:
        return
    from compressed_tensors.compressors.format import infer_module_format

    given = getattr(group.format, "value", group.format)
    inferred = infer_module_format(torch.nn.Linear, group.model_copy(update={"format": None})).value
    if given != inferred:
        then = (f"pass format={given!r} to qstats.export.compressed_tensors (it applies to every group with "
                "weights)" if given in FORMATS else f"qstats.export.compressed_tensors writes none of that format "
                f"(it writes {', '.join(FORMATS)})")
        raise ValueError(f"config group {index} (targets {list(group.targets)}): format {given!r} is not the "
                         f"{inferred!r} compressed-tensors infers for its scheme, and a qstats Recipe holds no "
                         f"checkpoint format: leave 'format' out of the group; {then}")


def _group_rules(Rule, groups: list, observed_dtype, ignore: tuple, caller: str) -> list:
    """One rule per site of each ``QuantizationScheme`` of ``groups`` (config order), each
    selecting the modules compressed-tensors gives that group (`GroupMatch`); a group's ``format``
    other than the inferred one is refused (`_check_format`)."""
    names = tuple(tuple(group.targets) for group in groups)
    rules = []
    for index, group in enumerate(groups):
        _check_format(group, index)
        matcher = GroupMatch(names, index, ignore=_strings(ignore), refusal=_attention_refusal(group))
        # an attention group (it may name attention modules): their q, k, v take the input args; per-head
        # (attn_head) input args quantize those alone, and compressed-tensors refuses them on a Linear
        attention = group.weights is None and group.input_activations is not None and set(group.targets) - _LINEAR_CLASSES
        per_head = attention and group.input_activations.strategy == "attn_head"
        for key, site in _SITES:
            args = getattr(group, key)
            if args is not None and not (per_head and site == "input"):
                rule = _rule(Rule, tuple(group.targets), args, site, observed_dtype, caller)
                rules.append(dataclasses.replace(rule, matcher=matcher))
        if attention:
            rule = _rule(Rule, tuple(group.targets), group.input_activations, "q", observed_dtype, caller)
            rules.append(dataclasses.replace(rule, sites=("q", "k", "v"), matcher=GroupMatch(
                names, index, True, linear_refusal=ATTN_HEAD_LINEAR if per_head else "")))
    return rules


def _warn_quantizes_nothing(rules: list, groups: list, caller: str) -> None:
    """Warns where no config group of ``groups`` has weights, input or output args and there is no
    kv-cache scheme (no ``rules``): compressed-tensors gives the targeted modules a scheme that quantizes
    nothing, silently (an llm-compressor modifier with ``targets`` or ``ignore`` but no ``scheme``)."""
    if rules:
        return
    targets = [list(group.targets) for group in groups]
    warn(f"{caller}: no config group has weights, input_activations or output_activations args and there is no "
         f"kv_cache_scheme (groups' targets: {targets}), so the Recipe quantizes nothing; a scheme= or "
         "config_groups= missing?", UserWarning)


def _kv_rule(Rule, kv_cache_scheme, observed_dtype, caller: str):
    from compressed_tensors.quantization import QuantizationScheme

    try:  # checked as compressed-tensors checks the scheme it makes of it: no channel or block strategy
        args = _args(kv_cache_scheme)
        QuantizationScheme(targets=["re:.*"], input_activations=args)
    except (ValueError, NotImplementedError) as error:
        raise ValueError(f"kv_cache_scheme: {error}") from None
    except TypeError as error:  # a preset name ("FP8"): a whole scheme, not the args of the k/v
        raise TypeError(f"kv_cache_scheme: {error}") from None
    if args.dynamic == "local":
        raise ValueError(f"{caller}: the kv_cache_scheme: {GROUPED_ATTENTION}")
    # its matcher selects the modules; its targets only name it (in warnings: "selects no site")
    return dataclasses.replace(_rule(Rule, "kv_cache_scheme", args, "k", observed_dtype, caller),
                               sites=("k", "v"), matcher=kv_cache_sites)


def _strings(ignore) -> tuple:
    """An ``ignore`` list's strings (`Recipe` refuses anything else, naming it)."""
    ignore = (ignore,) if isinstance(ignore, str) else ignore
    return tuple(t for t in ignore if isinstance(t, str)) if isinstance(ignore, (list, tuple)) else ()


def scheme_rules(Rule, scheme: Any, targets, observed_dtype=None, experts=None, kv_cache_scheme=None,
                 ignore=()) -> list:
    """The rules of llm-compressor's ``QuantizationModifier(scheme=, targets=, kv_cache_scheme=)``
    (`_scheme_groups`); with ``experts``, rules for those stacked-experts modules first."""
    require_compressed_tensors("Recipe.from_scheme")
    groups = _scheme_groups(scheme, targets)
    rules = _group_rules(Rule, groups, observed_dtype, ignore, "Recipe.from_scheme")
    if experts:
        if len(groups) != 1:
            raise ValueError("from_scheme: experts= takes one scheme, not a mapping of several presets")
        # every rule here has a GroupMatch; an attention group's q/k/v rule has no expert sites
        rules = _expert_rules([r for r in rules if not r.matcher.attention], experts, _strings(ignore)) + rules
    if kv_cache_scheme is not None:
        rules.append(_kv_rule(Rule, kv_cache_scheme, observed_dtype, "Recipe.from_scheme"))
    _warn_quantizes_nothing(rules, groups, "Recipe.from_scheme")
    return rules


def _modifier_config(config: Any) -> Any:
    """The ``QuantizationConfig`` of an llm-compressor quantization modifier, or of an
    llm-compressor recipe (YAML text, a file's path, a list of modifiers as ``oneshot(recipe=)``
    takes it, ``llmcompressor.recipe.Recipe``) holding one and nothing else; any other ``config``
    as it is."""
    if isinstance(config, os.PathLike):  # a recipe file
        config = os.fspath(config)
        _check_recipe_file(config)
    if isinstance(config, str):
        _check_recipe_text(config)
    if is_instance_named(config, "llmcompressor", "Modifier") and not hasattr(config, "resolve_quantization_config"):
        config = [config]  # SmoothQuant, QuIP, SparseGPT alone: a recipe of it (refused below, naming it)
    parsed = isinstance(config, Mapping) and recipe_keys(config)  # a recipe's YAML or JSON, parsed
    if isinstance(config, (str, list)) or parsed or hasattr(config, "modifiers"):  # a list: of modifiers
        recipe = config if hasattr(config, "modifiers") else _llm_compressor_recipe(config, parsed)
        quantizing = [m for m in recipe.modifiers if hasattr(m, "resolve_quantization_config")]
        others = [type(m).__name__ for m in recipe.modifiers if not hasattr(m, "resolve_quantization_config")]
        if others or len(quantizing) != 1:
            if others:
                what = f"{others}: modifiers that change the model (weights, rotations, sparsity) in ways a Recipe does not hold"
            else:
                what = ("several quantization modifiers" if quantizing else "no quantization modifier: llm-compressor "
                        "reads modifiers only under '<name>_stage:' and then '<group>_modifiers:' keys, e.g. "
                        "'quant_stage: {quant_modifiers: {QuantizationModifier: {...}}}'")
            raise ValueError(f"an llm-compressor recipe reads as a qstats Recipe when it holds one quantization modifier "
                             f"and nothing else; it holds {[type(m).__name__ for m in recipe.modifiers]} ({what})")
        config = quantizing[0]
    if not hasattr(config, "resolve_quantization_config"):
        return config
    _check_has_config(config)
    from llmcompressor.modifiers.quantization import QuantizationModifier

    algorithm = {name: getattr(config, name) for name in type(config).model_fields
                 if name not in QuantizationModifier.model_fields}
    resolved = config.resolve_quantization_config()
    if "actorder" in algorithm:  # as GPTQ applies it: the config groups' (its own is a "static" sentinel)
        orders = {getattr(group.weights.actorder, "value", group.weights.actorder)
                  for group in resolved.config_groups.values() if group.weights is not None}
        algorithm["actorder"] = orders.pop() if len(orders) == 1 else sorted(map(str, orders))
    if algorithm:  # GPTQModifier's block_size, dampening_frac, actorder, ...
        warn(f"{type(config).__name__}: the qstats Recipe holds its quantization config (observers and specs); "
             f"its algorithm options {algorithm} are not part of it (qstats.gptq takes GPTQ's: docs/gptq.md)",
             UserWarning)
    return resolved


def _check_has_config(modifier) -> None:
    """ValueError for an llm-compressor quantization modifier that specifies no quantization (no
    ``scheme``, ``config_groups`` or ``kv_cache_scheme``; ``targets`` and ``ignore`` at their defaults:
    its ``has_config()`` is False): llm-compressor's ``QuantizationModifier`` refuses it when it is
    initialized, and its ``GPTQModifier`` when calibration starts (it finds no module to quantize); read
    here it would be a Recipe without rules, observing nothing."""
    if modifier.has_config():
        return
    raise ValueError(
        f"{type(modifier).__name__} specifies no quantization: give it scheme= (a preset such as 'W4A16'), "
        "config_groups= or kv_cache_scheme=; llm-compressor refuses it too ('QuantizationModifier requires that "
        "quantization fields be specified', 'GPTQModifier was unable to find any modules to quantize')")


def _llm_compressor_recipe(config, parsed: bool):
    """llm-compressor's ``Recipe`` of ``config``: of a recipe's ``parsed`` data as llm-compressor reads
    a file's data (its ``from_dict``, of a copy: the data is not ours to change), else its
    ``Recipe.create_instance(config)``; YAML text or a file holding compressed-tensors enums as Python
    tags (``type: !!python/object/apply:compressed_tensors...QuantizationType [int]``), which
    llm-compressor's ``recipe.yaml`` writes for args built with enums (``QuantizationArgs()``'s default
    ``type``) but its own safe loader refuses, read with those tags as the enums (`_enum_loader`)."""
    try:
        from llmcompressor.recipe import Recipe as LLMCompressorRecipe
    except ImportError as error:
        raise ImportError("reading an llm-compressor recipe needs llm-compressor: pip install llmcompressor "
                          f"({error})") from None
    if parsed:
        return LLMCompressorRecipe.from_dict(copy.deepcopy(dict(config)))
    import yaml

    try:
        return LLMCompressorRecipe.create_instance(config)
    except (yaml.constructor.ConstructorError, ValueError) as error:  # text: a ValueError from the yaml error
        cause = error
        while cause is not None and not isinstance(cause, yaml.constructor.ConstructorError):
            cause = cause.__cause__
        if cause is None or not isinstance(config, str):
            raise
        from llmcompressor.recipe.utils import filter_dict

        text = config
        if os.path.isfile(config):
            with open(config) as file:
                text = file.read()
        return LLMCompressorRecipe.from_dict(filter_dict(yaml.load(text, Loader=_enum_loader(yaml))))


def _enum_loader(yaml):
    """yaml's SafeLoader that also reads ``!!python/object/apply:<class> [value]`` where the class is
    an Enum of compressed-tensors (any other Python tag is refused, as SafeLoader refuses it)."""

    def construct(loader, suffix: str, node):
        module, _, name = suffix.rpartition(".")
        found = None
        if module.split(".")[0] == "compressed_tensors" and isinstance(node, yaml.SequenceNode):
            try:
                found = getattr(importlib.import_module(module), name, None)
            except ImportError:
                pass
        if not (isinstance(found, type) and issubclass(found, enum.Enum)):
            raise yaml.constructor.ConstructorError(None, None, f"could not determine a constructor for the tag "
                                                    f"'python/object/apply:{suffix}'", node.start_mark)
        return found(*loader.construct_sequence(node))

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("tag:yaml.org,2002:python/object/apply:", construct)
    return Loader


def _check_recipe_text(text: str) -> None:
    """ValueError for strings that are not an llm-compressor recipe but another input of qstats'."""
    from compressed_tensors.quantization.quant_scheme import is_preset_scheme

    if is_preset_scheme(text):
        raise ValueError(f"{text!r} is a compressed-tensors preset scheme: use Recipe.from_scheme({text!r})")
    if "\n" not in text and text.strip().lower().endswith(_RECIPE_SUFFIXES):  # a file's path, not YAML text
        _check_recipe_file(text)
    if text.lower().endswith(".json") and not _is_json_recipe(text):  # as llm-compressor reads it: any case
        raise ValueError(f"{text!r}: a config.json is read as a dict: pass "
                         "json.load(open(path))['quantization_config']")
    if os.path.isdir(text):  # a checkpoint's folder: its config.json, or the recipe.yaml oneshot saves there
        raise ValueError(f"{text!r} is a folder: pass json.load(open(<folder>/config.json))['quantization_config'], "
                         "or the path of the recipe.yaml llm-compressor's oneshot saves in it")


_RECIPE_SUFFIXES = (".yaml", ".yml", ".json", ".md")  # the files llm-compressor's Recipe reads


def _check_recipe_file(path: str) -> None:
    """ValueError naming ``path`` when no file is there (as llm-compressor's reader raises one, taking the
    path for recipe text): a path is read as an llm-compressor recipe file, not as a checkpoint's
    ``config.json`` (which a ``.json`` one was taken for)."""
    if not os.path.exists(path):
        raise ValueError(
            f"{path!r}: no such file. A path is read as an llm-compressor recipe file (YAML or JSON: stages of "
            "modifiers, as the recipe.yaml oneshot saves); a checkpoint's config.json is read as a dict: pass "
            "json.load(open(path))['quantization_config']")


def recipe_keys(data: Mapping) -> bool:
    """Whether the mapping ``data`` is an llm-compressor recipe (its keys name stages, modifier groups or
    modifiers), not a quantization config (``config_groups``) or a checkpoint's ``config.json``."""
    return "config_groups" not in data and any(str(key).endswith(("_stage", "_modifiers", "Modifier")) for key in data)



def _is_json_recipe(path: str) -> bool:
    """Whether ``path`` is a JSON file of an llm-compressor recipe (which ``Recipe.create_instance``
    reads: `recipe_keys`), not a checkpoint's ``config.json`` or a quantization config."""
    if not os.path.isfile(path):
        return False
    try:
        with open(path) as file:
            data = json.load(file)
    except (OSError, ValueError):
        return False
    return isinstance(data, Mapping) and recipe_keys(data)


def _config_group(name: Any, group: Any):
    """The ``QuantizationScheme`` of ``config_groups[name]``: a mapping of its fields (``targets``
    required, as compressed-tensors requires it; an empty list targets nothing, as there), or, as
    compressed-tensors' ``QuantizationConfig`` reads it, a preset name mapped to its targets
    (``{"W4A16": ["Linear"]}``)."""
    from compressed_tensors.quantization.quant_scheme import is_preset_scheme, preset_name_to_scheme

    if isinstance(group, (list, tuple)) and isinstance(name, str) and is_preset_scheme(name):
        return preset_name_to_scheme(name, _list(group, f"config_groups[{name!r}]"))
    if not isinstance(group, Mapping):
        raise TypeError(f"quantization config: config_groups[{name!r}] must be a mapping of scheme fields (or, "
                        f"under a preset name, its targets), got {type(group).__name__}")
    if group.get("targets") is None:  # compressed-tensors and llm-compressor refuse it ("Field required")
        raise ValueError(f"quantization config: config_groups[{name!r}] has no 'targets' (a list of class names, "
                         "module names or 're:' regexes, e.g. [\"Linear\"]), which compressed-tensors requires")
    return _validated(group, _list(group["targets"], f"config_groups[{name!r}].targets"),
                      f"quantization config: config_groups[{name!r}]")


def _warn_dropped_configs(config: Mapping) -> None:
    """Warns where a checkpoint's ``quantization_config`` holds what a Recipe does not: the
    ``transform_config`` of llm-compressor's QuIP/SpinQuant transforms (rotations), the
    ``sparsity_config`` of a sparse model; a model calibrated with the Recipe alone has neither."""
    dropped = [key for key in ("transform_config", "sparsity_config") if config.get(key)]
    if dropped:
        warn(f"Recipe.from_compressed_tensors: the config's {' and '.join(dropped)} (transforms / sparsity "
             "llm-compressor applied to that model) are not part of a qstats Recipe, which holds its quantization "
             "only: calibrating a model without them gives other scales than that checkpoint's", UserWarning)


def _warn_gptq_order(schemes: list) -> None:
    """Warns where a config's weights args carry GPTQ's ``actorder`` (a checkpoint llm-compressor's
    GPTQModifier wrote): the column order GPTQ quantized in, which a Recipe (observers and specs)
    does not hold and calibrating does not apply; `qstats.gptq_layerwise` takes it."""
    orders = {str(getattr(s.weights.actorder, "value", s.weights.actorder)) for s in schemes
              if s.weights is not None and s.weights.actorder is not None}
    if orders:
        warn(f"Recipe.from_compressed_tensors: the config's weights args have actorder {sorted(orders)}, GPTQ's column "
             "order: a qstats Recipe holds observers and specs only, so calibrating with it rounds to nearest; "
             "qstats.gptq_layerwise(..., actorder=...) runs GPTQ (docs/gptq.md)", UserWarning)


# what a checkpoint's quantization_config holds beside QuantizationConfig's fields: compressed-tensors'
# sparsity and transform configs and version (``compressed_tensors.base``), transformers'
# CompressedTensorsConfig options
_CHECKPOINT_KEYS = ("sparsity_config", "transform_config", "version", "run_compressed", "dequantize",
                    "use_optimized_inference")


def _warn_unknown_keys(config: Mapping) -> None:
    """Warns naming each top-level key of ``config`` that is no field of compressed-tensors'
    ``QuantizationConfig`` (nor of a checkpoint's quantization_config), and the nearest one
    (``difflib``): compressed-tensors drops such keys silently, so a misspelt ``ignores`` or
    ``config_group`` would quantize what it meant to leave out, or nothing."""
    from compressed_tensors.quantization import QuantizationConfig

    known = (*QuantizationConfig.model_fields, *_CHECKPOINT_KEYS)
    for key in [key for key in config if key not in known]:
        nearest = difflib.get_close_matches(str(key), known, n=1)
        hint = f"; did you mean {nearest[0]!r}?" if nearest else f"; known: {', '.join(known)}"
        warn(f"Recipe.from_compressed_tensors: the quantization config's key {key!r} is none compressed-tensors "
             f"reads, so it is ignored (as compressed-tensors ignores it){hint}", UserWarning)


def config_rules(Rule, config: Any, observed_dtype=None) -> tuple:
    """``(rules, ignore)`` of a compressed-tensors ``QuantizationConfig``, of the
    ``quantization_config`` dict of a ``config.json`` (its config groups in order) or the
    ``CompressedTensorsConfig`` transformers holds for it (``model.config.quantization_config`` of a
    model loaded from a compressed-tensors checkpoint: its ``to_dict()`` is the
    ``QuantizationConfig``'s ``model_dump``), or of an llm-compressor ``QuantizationModifier`` /
    ``GPTQModifier`` (its ``resolve_quantization_config``) or recipe (`_modifier_config`)."""
    require_compressed_tensors("Recipe.from_compressed_tensors")
    read = _modifier_config(config)
    from_modifier, config = read is not config, read  # a modifier warned of its algorithm options
    if getattr(config, "quant_method", None) == "compressed-tensors" and hasattr(config, "to_dict"):
        config = config.to_dict()
    if hasattr(config, "model_dump"):
        config = config.model_dump()
    if not isinstance(config, Mapping):
        raise TypeError(f"expected a QuantizationConfig, QuantizationModifier or a dict, got {type(config).__name__}")
    if "quantization_config" in config and "config_groups" not in config:  # a whole config.json
        raise ValueError("quantization config: this is a checkpoint's config.json; pass its "
                         "['quantization_config'] dict")
    _warn_unknown_keys(config)
    groups = config.get("config_groups")
    if not isinstance(groups, Mapping) or not (groups or config.get("kv_cache_scheme") is not None):
        # a kv-cache-only checkpoint writes "config_groups": {} (QuantizationConfig.from_pretrained)
        raise ValueError("quantization config: 'config_groups' must be a mapping of schemes, non-empty unless a "
                         "'kv_cache_scheme' is given")
    _warn_dropped_configs(config)
    schemes = [_config_group(name, group) for name, group in groups.items()]
    if not from_modifier:
        _warn_gptq_order(schemes)
    rules = _group_rules(Rule, schemes, observed_dtype, config.get("ignore") or (), "Recipe.from_compressed_tensors")
    if config.get("kv_cache_scheme") is not None:  # every attention module compressed-tensors caches
        rules.append(_kv_rule(Rule, config["kv_cache_scheme"], observed_dtype, "Recipe.from_compressed_tensors"))
    _warn_quantizes_nothing(rules, schemes, "Recipe.from_compressed_tensors")
    return rules, compressed_tensors_ignore(config.get("ignore") or ())  # Recipe checks it
