"""Recipes: which observer and spec watch which module and site of a model.

A `Rule` maps module patterns and sites to an observer factory and a `QuantSpec`; a `Recipe` is
an ordered list of rules (first match wins) plus an ignore list; `Recipe.resolve(model)` gives
the `Plan` every consumer reads. See docs/calibrate_api.md.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from types import MappingProxyType
from typing import Any, Callable, Mapping, NamedTuple, Optional

import torch

from ._attention import attention_module, intercepted
from ._checkpoint_names import module_renamer
from ._granularity import PerAxis, PerBlock, PerHead, PerTensor, TensorGroup, qparam_shape
from ._rule_data import recipe_fields
from ._schemes import (PROJECTION_NAMES, ExpertsMatch, GroupMatch, as_written, child_projection,
                       compressed_tensors_ignore, config_rules, head_count_problem, kv_cache_module, kv_cache_sites,
                       matches_targets, scheme_rules, unquantized_matches, with_checkpoint_names)
from ._spec import QuantSpec
from ._torch_features import dtype_named, unwrapped
from .experts import (StackLayout, expert_count, is_stacked_parameter, linearized_experts, linearized_layout_problem,
                      own_parameters, parameter_input_site, stack_layout, stacked_observer)
from .fused import fused_groups
from .observers import Observer
from .observers import registry as observer_registry
from .observers._column_groups import column_groups
from .observers.minmax import minmax
from .observers.mse import searched_per_part
from ._warn import warn

__all__ = ["Rule", "Recipe", "Plan", "Site", "ACTIVATION_SITES", "PROJECTION_NAMES", "as_plan",
           "runtime_scaled"]

ACTIVATION_SITES = ("input", "output", "q", "k", "v")


def _freeze(mapping: Optional[Mapping[str, Any]], what: str) -> tuple:
    if mapping is None:
        return ()
    if isinstance(mapping, tuple):  # the frozen form: (key, value) pairs
        if not all(isinstance(pair, tuple) and len(pair) == 2 for pair in mapping):
            raise TypeError(f"Rule.{what} must be a mapping of keyword arguments (or its (key, value) pairs), "
                            f"got {mapping!r}")
        mapping = dict(mapping)
    if not isinstance(mapping, Mapping):
        raise TypeError(f"Rule.{what} must be a mapping of keyword arguments, got {type(mapping).__name__}")
    for key in mapping:
        if not isinstance(key, str):
            raise TypeError(f"Rule.{what} keys must be strings, got {key!r}")
    return tuple(sorted(mapping.items()))


def _targets(targets, what: str) -> tuple:
    if isinstance(targets, str):
        targets = (targets,)
    if not isinstance(targets, (tuple, list)):
        raise TypeError(f"{what} must be a string or a tuple of strings, got {type(targets).__name__}")
    for target in targets:
        if not isinstance(target, str) or not target:
            raise TypeError(f"{what} must be non-empty strings, got {target!r}")
        if target.startswith("re:"):
            try:
                re.compile(target[3:])
            except re.error as error:
                raise ValueError(f"{what}: invalid regular expression {target[3:]!r}: {error}") from None
    return tuple(targets)


def _ignore_hits(target: str, paths, classes) -> bool:
    """Whether an ``ignore`` entry matches one of ``paths`` (``re:`` full match, or exact) or names
    one of ``classes``."""
    if target.startswith("re:"):
        return any(re.fullmatch(target[3:], path) for path in paths)
    return target in paths or target in classes


def _ignored_module(ignore: tuple, path: str, module: torch.nn.Module, rename: Callable[[str], str]) -> bool:
    """Whether ``ignore`` names the module at ``path`` by its path or by its checkpoint name
    (``rename``, `_checkpoint_names.module_renamer`): compressed-tensors writes a checkpoint's
    ``ignore`` list under the names ``save_pretrained`` gives (Mixtral's ``block_sparse_moe.gate``
    for the model's ``mlp.gate``)."""
    return matches_targets(ignore, path, module) or matches_targets(ignore, rename(path), module)


def _checkpoint_rule(rule: "Rule", path: str, module: Optional[torch.nn.Module],
                     rename: Callable[[str], str]) -> "Rule":
    """``rule`` with its matcher reading the per-expert Linears of the module at ``path`` by their
    checkpoint names too (`with_checkpoint_names`): how `Recipe.resolve` and `Recipe.rule_for` read a
    rule there."""
    matcher = with_checkpoint_names(rule.matcher, path, module, rename)
    return rule if matcher is rule.matcher else dataclasses.replace(rule, matcher=matcher)


def _refuse_ignored_kv_cache(rules: list, found: list, ignored: dict) -> None:
    """ValueError where a ``kv_cache_scheme`` rule selects no site because ``ignore`` skips every
    attention module compressed-tensors caches (``ignored``: path -> module): the checkpoint would
    hold no kv-cache scheme, where llm-compressor's ``oneshot`` saves uncalibrated k/v scales."""
    if not any(rule.matcher is kv_cache_sites and not sites for rule, sites in zip(rules, found)):
        return
    cached = [path for path, module in ignored.items() if kv_cache_module(path, module)]
    if cached:
        raise ValueError(
            f"Recipe: the kv_cache_scheme quantizes the k/v cache of attention modules, and ignore skips every "
            f"one ({cached[0]!r}" + (f" and {len(cached) - 1} more" if len(cached) > 1 else "") + "): llm-compressor "
            "saves their k/v scales uncalibrated; drop the kv_cache_scheme or leave the attention modules out of ignore"
        )


def _refuse_unloadable_heads(rules: list, found: list, model: torch.nn.Module) -> None:
    """ValueError where a ``kv_cache_scheme`` or a config group's attention rule selects q/k/v sites of a
    model whose scales compressed-tensors cannot load (`head_count_problem`): llm-compressor's ``oneshot``
    refuses the model as it starts, where the export would refuse it only after calibrating."""
    if not any(sites and (rule.matcher is kv_cache_sites or getattr(rule.matcher, "attention", False))
               for rule, sites in zip(rules, found)):
        return
    problem = head_count_problem(model)
    if problem is not None:
        raise ValueError(f"Recipe: the recipe quantizes the q/k/v of attention modules of this {type(model).__name__} "
                         f"(a kv_cache_scheme or an attention config group), whose scales compressed-tensors cannot "
                         f"load: {problem}; drop them (llm-compressor's oneshot refuses this model too)")


def _unmatched_ignore(ignore: tuple, modules: dict, rename: Callable[[str], str]) -> list:
    """The ``ignore`` entries that match no module of ``modules`` (by path or checkpoint name,
    `_ignored_module`) and no per-expert Linear name (`linearized_experts`, which compressed-tensors'
    ignore lists name). Only modules holding parameters count by checkpoint name: the checkpoint
    names tensors, so a parameterless child (an activation) there names nothing llm-compressor wrote."""
    classes = {cls.__name__ for module in modules.values() for cls in type(module).__mro__
               if issubclass(cls, torch.nn.Module)}
    paths = set(modules) | {rename(path) for path, module in modules.items()
                            if next(module.parameters(), None) is not None}
    names = None
    unmatched = []
    for target in ignore:
        if _ignore_hits(target, paths, classes):
            continue
        if names is None:  # by model name and by checkpoint name (`with_checkpoint_names`)
            names = {name for path, module in modules.items() for name in linearized_experts(path, module)}
            names |= {rename(name) for name in names}
        if not _ignore_hits(target, names, {"Linear"} if names else ()):  # per-expert Linears
            unmatched.append(target)
    return unmatched


def _target_hits(rule: "Rule", target: str) -> Callable[[set], bool]:
    """``hits(names)``: whether ``target`` of ``rule`` matches one of ``names`` as the rule reads it (a config
    group's as compressed-tensors does, ``re:`` from the start; a qstats Rule's in full)."""
    if isinstance(rule.matcher, GroupMatch):
        from compressed_tensors.utils import match_name

        return lambda names: any(match_name(name, target) for name in names)
    return lambda names: any(matches_targets((target,), name, None) for name in names)


def _why_unmatched(rule: "Rule", modules: dict, rename: Callable[[str], str]) -> str:
    """Why ``rule`` selects no site: for a config group's rule whose targets match modules compressed-tensors
    does not quantize (`unquantized_matches`: a ``Conv2d``, a decoder layer), those modules; for a plain
    rule whose targets match no module, that; else that no module it matches has its sites."""
    others = unquantized_matches(rule.targets, modules) if isinstance(rule.matcher, GroupMatch) else []
    if not others and rule.matcher is None and not any(_checkpoint_rule(rule, path, module, rename).matches(path, module)
                                                        for path, module in modules.items()):
        return "no module matches its targets by path, class name or 're:' full match of the path"
    if not others:
        return "no module it matches has such a parameter, input or projection"
    (path, name), more = others[0], f" and {len(others) - 1} more" if len(others) > 1 else ""
    return (f"its targets match {path!r} ({name}){more}, which compressed-tensors does not quantize: it quantizes "
            "the Linear and Embedding modules a target matches itself, not their parent modules, nor other layers "
            "such as convolutions; observe those with a qstats Rule")


# vLLM's fused modules (its models' packed_modules_mapping) -> the Linears transformers models hold for them
_VLLM_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _fused_hint(written: str, hits: Callable[[set], bool], modules: dict) -> str:
    """A hint for a target or ignore entry (``written``) that matches no module but names a vLLM fused module
    (``...self_attn.qkv_proj``) where the model holds its shards (``q_proj``, ``k_proj``, ``v_proj``):
    ``hits(names)`` says whether the entry matches one of ``names``; else ""."""
    for fused, shards in _VLLM_FUSED.items():
        for path in modules:
            parent, _, name = path.rpartition(".")
            if name in shards and hits({f"{parent}.{fused}" if parent else fused}):
                return (f"; {written!r} names vLLM's fused {fused!r}, which this model holds as {'/'.join(shards)} "
                        f"(e.g. {path!r}): targets and ignore entries match the model's own module names (as "
                        "compressed-tensors reads them): name those")
    return ""


# characters of a regular expression that no module path or class name holds
_REGEX_SIGNS = re.compile(r"[*+?^$|()\[\]{}\\]")


def _regex_hint(target: str) -> str:
    """A hint for a target or ignore entry that reads as a regular expression but lacks ``re:`` (``".*mlp.gate$"``),
    which qstats and compressed-tensors read as a module path or class name: it matches nothing; else ""."""
    if target.startswith("re:") or not _REGEX_SIGNS.search(target):
        return ""
    return f"; {target!r} has no 're:' prefix, so it is read as a module path or class name: did you mean 're:{target}'?"


def _case_hint(target: str, modules: dict) -> str:
    """A hint for a target or ignore entry that matches no module but names one of ``modules`` (path ->
    module) by path or class name in other letter case (``"linear"``): names are case-sensitive; else ""."""
    if target.startswith("re:"):
        return ""
    names = {type(module).__name__ for module in modules.values()} | set(modules)
    close = sorted(name for name in names if name != target and name.lower() == target.lower())
    return f"; names are case-sensitive: did you mean {close[0]!r}?" if close else ""


def _group_of(rule: "Rule") -> Optional[tuple]:
    """``(config groups, group index)`` of a rule read from a compressed-tensors config group
    (its `GroupMatch`), else None."""
    group = getattr(rule.matcher, "group", None)
    return None if group is None else (rule.matcher.groups, group)


def _same(a: Any, b: Any) -> bool:
    """``a == b`` through tuples, lists and mappings, tensors compared by dtype, shape and values; an
    object is the same as itself (as in Python's own container comparisons: a NaN, an array)."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and torch.equal(a, b))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_same(a[key], b[key]) for key in a)
    return bool(a == b)


def _fields(rule: "Rule") -> list:
    return [getattr(rule, field.name) for field in dataclasses.fields(rule)]


@dataclasses.dataclass(frozen=True)
class Rule:
    """One line of a recipe.

    Args:
      targets: a string or tuple of strings: ``"re:<regex>"`` (full match on the module path), a
        module class name (subclasses match too) or an exact module path.
      sites: ``"weight"`` or any parameter name (observed once), ``"input"``, ``"output"``,
        ``"q"``/``"k"``/``"v"`` (of a transformers attention module: the query, key and value its
        attention function receives, with or without ``q_proj``/``k_proj``/``v_proj`` children, as
        Phi-3's fused ``qkv_proj``; of other modules: their child projections' outputs), and on
        stacked-experts modules ``"<parameter>.input"`` (e.g. ``"down_proj.input"``: the input of
        each expert's down projection).
      observer: an observer factory, ``observer(spec, **observer_kwargs) -> Observer``, or its
        registered name (``"minmax"``, ``"mse"``, ...).
      spec: the QuantSpec of one observed tensor (of one expert, for stacked experts).
      observer_kwargs: extra keyword arguments of the factory.
      qparams_kwargs: options for ``compute_qparams`` (e.g. ``method=`` for histogram states).
      dynamic: this rule's activation sites take their scales at run time from each tensor
        (compressed-tensors' ``dynamic=True``): no calibrated QParams, exported as dynamic.
        Parameter sites ignore it.
      matcher: None (``targets`` select the modules), or a hashable predicate
        ``matcher(path, module) -> bool`` that selects them in place of ``targets`` (which then
        only name them): `Recipe.from_scheme` and `Recipe.from_compressed_tensors` give one that
        picks the modules compressed-tensors' ``apply_quantization_config`` gives that scheme.

    >>> import qstats
    >>> rule = qstats.Rule(targets="Linear", sites=("weight",), spec=qstats.QuantSpec())
    >>> rule.sites
    ('weight',)
    """

    targets: Any
    sites: tuple = ("weight", "input")
    observer: Callable[..., Observer] = minmax
    spec: QuantSpec = dataclasses.field(default_factory=QuantSpec)
    observer_kwargs: Any = ()
    qparams_kwargs: Any = ()
    dynamic: bool = False
    matcher: Optional[Callable[[str, Optional[torch.nn.Module]], bool]] = None

    def __eq__(self, other) -> bool:
        """Field by field, tensors of ``observer_kwargs`` (``qstats.mse``'s ``reference``) by dtype and values
        (`_same`): a copy of a rule is equal to it."""
        if not isinstance(other, Rule):
            return NotImplemented
        return _same(_fields(self), _fields(other))

    def __hash__(self) -> int:  # of fields always hashable (observer_kwargs may hold lists or tensors)
        return hash((self.targets, self.sites))

    def __post_init__(self) -> None:
        object.__setattr__(self, "targets", _targets(self.targets, "Rule.targets"))
        sites = (self.sites,) if isinstance(self.sites, str) else tuple(self.sites)
        if not sites or not all(isinstance(site, str) and site for site in sites):
            raise ValueError(f"Rule.sites must be non-empty strings, got {self.sites!r}")
        object.__setattr__(self, "sites", sites)
        if isinstance(self.observer, str):
            try:
                object.__setattr__(self, "observer", observer_registry.get(self.observer))
            except ValueError as error:
                raise ValueError(f"Rule.observer: {error}") from None
        if isinstance(self.observer, Observer):  # the factory's result, not the factory
            raise TypeError(f"Rule.observer got an Observer ({self.observer.name}); give the factory that builds it, "
                            "factory(spec, **observer_kwargs), or a registered name")
        if not callable(self.observer):
            raise TypeError(f"Rule.observer must be an observer factory or a registered name, got {self.observer!r}")
        if not isinstance(self.spec, QuantSpec):
            raise TypeError(f"Rule.spec must be a QuantSpec, got {type(self.spec).__name__}")
        object.__setattr__(self, "observer_kwargs", _freeze(self.observer_kwargs, "observer_kwargs"))
        object.__setattr__(self, "qparams_kwargs", _freeze(self.qparams_kwargs, "qparams_kwargs"))
        if not isinstance(self.dynamic, bool):
            raise TypeError(f"Rule.dynamic must be a bool, got {self.dynamic!r}")
        if self.matcher is not None and not callable(self.matcher):
            raise TypeError(f"Rule.matcher must be None or a predicate (path, module) -> bool, got {self.matcher!r}")

    def matches(self, path: str, module: Optional[torch.nn.Module]) -> bool:
        """Whether this rule selects the module at ``path`` (its ``matcher``, else its ``targets``)."""
        if self.matcher is not None:
            return bool(self.matcher(path, module))
        return matches_targets(self.targets, path, module)

    def sites_on(self, path: str, module: Optional[torch.nn.Module]) -> tuple:
        """The sites of the module at ``path`` this rule covers: its ``sites`` where it `matches`,
        or those its matcher's ``sites_on(path, module, sites)`` picks (`GroupMatch`: the sites of
        stacked experts whose linearized Linears its config group takes)."""
        pick = getattr(self.matcher, "sites_on", None)
        if pick is not None:
            return tuple(pick(path, module, self.sites))
        return self.sites if self.matches(path, module) else ()

    def make_observer(self, spec: Optional[QuantSpec] = None) -> Observer:
        """The observer of one tensor: ``observer(spec, **observer_kwargs)`` (the rule's spec by
        default)."""
        obs = self.observer(self.spec if spec is None else spec, **dict(self.observer_kwargs))
        if not isinstance(obs, Observer):
            raise TypeError(f"Rule.observer {self.observer!r} returned {type(obs).__name__}, not an Observer")
        return obs


class Site(NamedTuple):
    """One observed (module, site) pair of a model, as a recipe resolves it.

    Attributes:
      rule: the Rule that matched.
      observer: the Observer for this state; for stacked experts already vmapped over the
        leading expert dimension. A `runtime` site observes each whole tensor, per tensor (a
        two-level one under a moving average: per group of features, `averages_feature_groups`, but
        per tensor where it arrives 2-D, as an expert's routed rows, `feature_grouped`).
      spec: the spec of one tensor (one expert's tensor for stacked experts).
      num_experts: the leading expert dimension of the state, 0 when not stacked.
      runtime: the site's scales come at run time (`runtime_scaled` spec or ``dynamic=True``).
      kind: ``"parameter"`` (observed once), ``"input"``, ``"output"``, ``"projection"``
        (``q``/``k``/``v``) or ``"parameter_input"`` (``"<parameter>.input"`` of stacked experts).
      layout: of a stacked parameter stored otherwise than as the per-expert Linear weights
        ``[E, out, in]`` (Llama 4's and GPT-OSS' transposed experts): its `StackLayout`, through
        which every reader sees the stack as ``[E, out, in]`` (`Plan.parameter`); else None.
    """

    rule: Rule
    observer: Observer
    spec: QuantSpec
    num_experts: int
    runtime: bool = False
    kind: str = "parameter"
    layout: Optional[StackLayout] = None

    def canonical(self, stored: torch.Tensor) -> torch.Tensor:
        """The parameter's stored value as the site observes it (`layout`'s canonical view)."""
        return stored if self.layout is None else self.layout.canonical(stored)

    def stored(self, canonical: torch.Tensor) -> torch.Tensor:
        """The inverse of `canonical`: a value of the observed view as the parameter stores it."""
        return canonical if self.layout is None else self.layout.stored(canonical)


def runtime_scaled(spec: QuantSpec) -> bool:
    """Whether an activation site under ``spec`` gets its scales at run time, from each tensor:
    specs with parameters per row (`Granularity.row_wise`: per token, per group, ``PerRow(-1)``,
    blocks one row tall) and two-level (NVFP4) specs, whose global scale alone is calibrated.
    Such sites are observed per tensor, since a per-row state would be shaped by the first batch."""
    return spec.granularity.row_wise()


def averages_feature_groups(factory: Callable, options: Mapping, spec: QuantSpec) -> bool:
    """Whether a two-level (`TensorGroup`, NVFP4) activation site scaled at run time, observed by
    ``factory(spec, **options)``, observes each group of features over the batches (`feature_grouped`), as
    llm-compressor 0.14's ``minmax`` and ``mse`` observers do: under a moving average of extremes
    (`qstats.moving_average_minmax`) or of searched ranges (`qstats.mse` in ``mode="moving_average"``), whose
    per-group averages and searches differ from the whole tensor's (a 2-D input excepted, as there:
    `feature_grouped`). Other observers see the whole tensor (running and latest extremes: the same
    maximum). `Recipe` sites and `qstats.llmcompressor`'s drop-ins."""
    return isinstance(spec.granularity, TensorGroup) and (
        observer_registry.name_of(factory) == "moving_average_minmax"
        or _moving_average_mse(factory, options))


def _moving_average_mse(factory: Callable, options: Mapping) -> bool:
    """Whether ``factory(spec, **options)`` is `qstats.mse` in ``mode="moving_average"``."""
    return observer_registry.name_of(factory) == "mse" and dict(options).get("mode") == "moving_average"


def feature_grouped(make: Callable[[QuantSpec], Observer], spec: QuantSpec) -> Observer:
    """The observer of a two-level activation site scaled at run time that `averages_feature_groups`:
    ``make(grouped spec)`` seeing each group of ``spec``'s features (`column_groups`), one state entry per
    group (llm-compressor's view), the global scale from the largest range; the candidates of a search
    have unrounded float32 group scales, as llm-compressor's. A 2-D ``[rows, features]`` input (a
    linearized or stacked expert's routed rows, Qwen2-MoE's shared expert) is observed per tensor
    (``make(per-tensor spec)``), as llm-compressor 0.14's ``flatten_for_calibration`` gives it no group
    dimension: its ``minmax`` averages (its ``mse`` searches) the whole tensor's range there."""
    float32 = spec.replace(scale_dtype="float32")
    grouped = column_groups(make(float32.replace(granularity=PerAxis(1))), spec.granularity.group_size)
    whole = make(float32.replace(granularity=PerTensor()))

    def init_fn(x: torch.Tensor):
        return (whole if x.ndim == 2 else grouped).init(x)

    def update_fn(state, x: torch.Tensor, weight: Optional[torch.Tensor] = None):
        return (whole if x.ndim == 2 else grouped).update(state, x, weight)

    return grouped._replace(init=init_fn, update=update_fn)


def _site_kind(module: torch.nn.Module, params: dict, num_experts: int, site: str) -> Optional[tuple]:
    """``(kind, stacked experts)`` of ``site`` on ``module`` (see `Site.kind`), or None when the
    module has no such site."""
    if site in params:
        return "parameter", num_experts if is_stacked_parameter(params[site], num_experts) else 0
    if site in PROJECTION_NAMES:  # a transformers attention module's, or a child projection's output
        return ("projection", 0) if attention_module(module) or child_projection(module, site) is not None else None
    if site == "input":
        return "input", num_experts
    if site == "output":
        return "output", 0
    stack = params.get(parameter_input_site(site))
    if stack is not None and stack.ndim >= 3 and is_stacked_parameter(stack, num_experts):
        return "parameter_input", num_experts
    return None


def _make_site(rule: Rule, spec: QuantSpec, kind: str, stacked: int, layout: Optional[StackLayout] = None,
               parts: int = 1) -> Site:
    """The Site of ``rule`` on one site; ``parts`` (`_searched_parts`): the parts of a stacked parameter's rows
    whose moving-average search runs on its own (`searched_per_part`)."""
    # an activation site whose scales are computed at run time from each tensor observes its
    # whole range: its state is the same for batches of any length
    runtime = kind != "parameter" and (rule.dynamic or runtime_scaled(spec))
    if runtime and averages_feature_groups(rule.observer, rule.observer_kwargs, spec):
        observer = feature_grouped(rule.make_observer, spec)
    else:
        observer = rule.make_observer(spec.replace(granularity=PerTensor()) if runtime else spec)
    if parts > 1:
        observer = searched_per_part(observer, parts)
    if stacked:
        observer = stacked_observer(observer, stacked)
    return Site(rule, observer, spec, stacked, runtime, kind, layout)


def _searched_parts(rule: Rule, spec: QuantSpec, site: str, kind: tuple, shapes: dict) -> int:
    """2 for a stacked ``gate_up_proj`` (`gate_up_halves`) under `qstats.mse` in ``mode="moving_average"``:
    llm-compressor's ``linearize_moe`` makes two Linears of it, each searched with its own early stop
    (the condition `compute_qparams_tree` stops an accumulating search per projection under); else 1."""
    return 2 if (site == "gate_up_proj" and kind[0] == "parameter" and kind[1]
                 and _moving_average_mse(rule.observer, rule.observer_kwargs)
                 and gate_up_halves(shapes, spec.granularity)) else 1


def _halves(shapes: dict) -> Optional[tuple]:
    """``(I, H)``, the shape of each half of a stacked ``gate_up_proj`` ``[E, 2I, H]`` (gate rows, then
    up rows) beside a ``down_proj`` ``[E, H, I]`` (``shapes`` from `stack_shapes`, empty where the
    stack does not read as per-expert Linears), or None."""
    param, down = shapes.get("gate_up_proj"), shapes.get("down_proj")
    if param is None or down is None or len(param) != 3 or len(down) != 3 or param[1] != 2 * down[2]:
        return None
    return down[2], param[2]


def gate_up_halves(shapes: dict, granularity) -> bool:
    """Whether a stacked ``gate_up_proj`` (`_halves`) has quantization parameters that split into the
    two halves' rows, as its linearized gate and up Linears have."""
    halves = _halves(shapes)
    if halves is None:
        return False
    whole, half = (qparam_shape(shape, granularity) for shape in ((2 * halves[0], halves[1]), halves))
    return bool(half) and whole == (2 * half[0], *half[1:])


def stack_shapes(module: torch.nn.Module, params: dict) -> dict:
    """``{name: shape}`` of ``params`` as the stacked sites observe them: ``[E, out, in]`` for
    stacks stored otherwise (`stack_layout`)."""
    shapes = {}
    for name, param in params.items():
        layout = stack_layout(module, name) if param.ndim == 3 else None
        shapes[name] = tuple(param.shape) if layout is None else layout.canonical_shape(param.shape)
    return shapes


def _refuse_unsplit_heads(path: str, module: torch.nn.Module, site: str, found: Site) -> None:
    """ValueError for a per-head q/k/v site (`PerHead`, compressed-tensors' ``attn_head``) qstats cannot
    split into heads: a PerHead axis other than 1 (the heads of the attention function's ``[batch, heads,
    tokens, head_dim]``), or an attention module with no transformers config, whose q/k/v sites are its
    projections' ``[batch, tokens, heads * head_dim]`` outputs (`qstats._attention`)."""
    granularity = found.spec.granularity
    if found.kind != "projection" or not isinstance(granularity, PerHead):
        return
    if granularity.axis != 1:
        raise ValueError(f"Recipe: site {site!r} of {path!r}: {granularity!r}; a q/k/v site is split into heads "
                         "along axis 1 of [batch, heads, tokens, head_dim]: use PerHead(1)")
    if not intercepted(module):
        raise ValueError(f"Recipe: site {site!r} of {path!r} ({type(module).__name__}) is per head ({granularity!r}), "
                         "but the module holds no transformers config, so its q/k/v are its projections' outputs "
                         "[batch, tokens, heads * head_dim], not split into heads: use a per-tensor spec")


def _refuse_conv_hessian(path: str, module: torch.nn.Module, site: Site) -> None:
    """ValueError for `qstats.hessian` or `qstats.imatrix` on a convolution's input: they reduce over
    the input's last dimension (image width), where a conv's GPTQ Hessian is over its unfolded patches
    (``in_channels * kernel`` features) and its importance over input channels (llm-compressor's
    imatrix observes modules with ``in_features`` only); `qstats.gptq` takes Linear weights only."""
    per_feature = site.observer.name in ("hessian", "imatrix")
    if site.kind == "input" and per_feature and isinstance(module, torch.nn.modules.conv._ConvNd):
        raise ValueError(
            f"Recipe: qstats.{site.observer.name} on the input of {path!r} ({type(module).__name__}): only the "
            "inputs of Linear layers (and stacked experts) are supported; a convolution's input features are its "
            "unfolded patches, not the input's last dimension"
        )


def _stacked_spec(path: str, rule: Rule, site: str, shapes: dict) -> QuantSpec:
    """The spec of a stacked site under ``rule``: its own, but on fused experts' ``gate_up_proj``
    ``[E, 2I, H]`` (`_halves`), whose gate and up are two matrices (llm-compressor linearizes them
    into ``gate_proj`` and ``up_proj``; vLLM keeps both scales): a per-tensor spec is made per
    projection, ``PerBlock((I, H))``, and a compressed-tensors block spec (a `GroupMatch` or
    `ExpertsMatch` rule) whose block rows do not divide ``I`` is refused (ValueError): llm-compressor
    blocks its linearized ``gate_proj`` and ``up_proj`` apart (each with partial edge blocks), where a
    block of the stack would hold rows of both (the export refused it, after the calibration)."""
    granularity, halves = rule.spec.granularity, _halves(shapes) if site == "gate_up_proj" else None
    if halves is not None and isinstance(granularity, PerTensor):
        return rule.spec.replace(granularity=PerBlock(halves))
    if (halves is not None and isinstance(granularity, PerBlock) and isinstance(rule.matcher, (GroupMatch, ExpertsMatch))
            and halves[0] % granularity.block_shape[-2]):
        raise ValueError(
            f"Recipe: {path}:gate_up_proj ({shapes[site]}, gate rows then up rows) under blocks of "
            f"{granularity.block_shape}: the {granularity.block_shape[-2]}-row blocks straddle the gate and up "
            f"halves of {halves[0]} rows each, which llm-compressor blocks apart as two Linears; not supported: "
            "ignore these experts' gate/up projections or choose a block height that divides the intermediate size")
    return rule.spec


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """A `Recipe` resolved on one model (`Recipe.resolve`), computed once, so that every consumer
    (`calibrate`, `compute_qparams_tree`, `fake_quantized`, `report`, the export) reads the model
    once. Mappings are read-only; modules are the model's own, never copied.

    Attributes:
      recipe: the Recipe it was resolved from.
      sites: ``{module_path: {site: Site}}`` of every observed site, in ``named_modules`` order.
      modules: ``{module_path: module}`` of every module of the model (``""`` is the model).
      fused_groups: the module paths of each fused group (`qstats.fused.fused_groups`).
      shared: ``{(path, site): (owner path, owner site)}``: the sites that share another site's
        state (``Recipe(shared=...)``, torch.ao's ``ReuseInputObserver``).

    >>> import torch, qstats
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 3))
    >>> plan = qstats.Recipe([qstats.Rule("Linear", sites=("weight",))]).resolve(model)
    >>> plan.sites["0"]["weight"].kind, plan.model is model
    ('parameter', True)
    """

    recipe: Recipe
    sites: Mapping
    modules: Mapping
    fused_groups: tuple
    shared: Mapping = dataclasses.field(default_factory=lambda: MappingProxyType({}))

    @property
    def model(self) -> torch.nn.Module:
        """The model the plan was resolved on."""
        return self.modules[""]

    def site(self, path: str, site: str) -> Optional[Site]:
        """The `Site` of ``site`` of the module at ``path``, or None when not observed."""
        return self.sites.get(path, {}).get(site)

    def parameter(self, path: str, site: str) -> torch.Tensor:
        """The current value (detached) of the parameter observed by a ``"parameter"`` site, as the
        site sees it (`Site.canonical`: stacks as the per-expert Linear weights ``[E, out, in]``): a
        parametrized one's computed value (inside `qstats.fake_quantized`, the fake-quantized
        weights, as if they had replaced the float ones)."""
        return self.sites[path][site].canonical(getattr(self.modules[path], site).detach())

    def attention_argument(self, path: str, site: str) -> bool:
        """Whether ``site`` of ``path`` is a ``q``/``k``/``v`` its transformers attention module hands
        its attention function (`qstats._attention.intercepted`), read by `qstats._attention.SiteHooks`;
        other ``q``/``k``/``v`` sites are their child projections' outputs."""
        return self.sites[path][site].kind == "projection" and intercepted(self.modules[path])

    def hooked_module(self, path: str, site: str) -> torch.nn.Module:
        """The module whose forward carries an activation site's tensor: the child projection
        of a ``q``/``k``/``v`` site that is no `attention_argument`, the module itself otherwise."""
        module = self.modules[path]
        child = self.sites[path][site].kind == "projection" and not self.attention_argument(path, site)
        return child_projection(module, site) if child else module

    def state_keys(self, path: str, site: str) -> tuple:
        """The ``(path, site)`` keys holding one shared state with ``site`` of ``path``: its
        owner first, then the sites sharing it (only ``((path, site),)`` when not shared)."""
        owner = self.shared.get((path, site), (path, site))
        return (owner,) + tuple(key for key, of in self.shared.items() if of == owner)

    def share_states(self, states: Mapping) -> dict:
        """``states`` with every shared group holding one state: the owner's and its sharers'
        states merged (``observer.merge``), under each of their keys, so they get the same
        QParams. For exact observers (min-max, histogram) this equals observing every tensor of
        the group into one state; a group whose states are one object already is left as is."""
        out = {path: dict(entry) for path, entry in states.items()}
        for owner in dict.fromkeys(self.shared.values()):
            keys = self.state_keys(*owner)
            present = [state for state in (out.get(path, {}).get(site) for path, site in keys)
                       if state is not None]
            if not present or all(state is present[0] for state in present):
                continue
            merged = functools.reduce(self.sites[owner[0]][owner[1]].observer.merge, present)
            for path, site in keys:
                out.setdefault(path, {})[site] = merged
        return out

    def _for_states(self, states: Mapping, field: str) -> dict:
        if not isinstance(states, Mapping):
            raise TypeError(f"expected a states tree {{path: {{site: state}}}}, got {type(states).__name__}")
        out = {}
        for path, entry in states.items():
            if not isinstance(entry, Mapping):
                raise TypeError(f"states[{path!r}] must be a dict {{site: state}}, got {type(entry).__name__}")
            out[path] = {}
            for site in entry:
                found = self.site(path, site)
                if found is None:
                    raise ValueError(f"the recipe observes no site {site!r} of module {path!r} in this model")
                out[path][site] = getattr(found, field)
        return out

    def observers(self, states: Mapping) -> dict:
        """The Observer tree matching ``states`` (same keys): ``{path: {site: Observer}}``."""
        return self._for_states(states, "observer")

    def specs(self, states: Mapping) -> dict:
        """The QuantSpec tree matching ``states`` (same keys): ``{path: {site: QuantSpec}}``."""
        return self._for_states(states, "spec")


def _site_key(text: Any, what: str) -> tuple:
    if not isinstance(text, str) or ":" not in text:
        raise ValueError(f"Recipe.shared: {what} must be '<module path>:<site>', got {text!r}")
    path, _, site = text.rpartition(":")
    if not site:
        raise ValueError(f"Recipe.shared: {what} {text!r} names no site after ':'")
    return path, site


def _shared_sites(shared: Optional[Mapping[str, str]]) -> dict:
    """``{(path, site): (owner path, owner site)}`` of ``Recipe(shared={"<path>:<site>":
    "<owner path>:<owner site>"})``; an owner cannot itself share another site's state."""
    if shared is None:
        return {}
    if not isinstance(shared, Mapping):
        raise TypeError(f"Recipe.shared must be a mapping {{'<path>:<site>': '<path>:<site>'}}, got {type(shared).__name__}")
    out = {_site_key(key, "a key"): _site_key(value, "a value") for key, value in shared.items()}
    for key, owner in out.items():
        if key == owner or owner in out:
            raise ValueError(f"Recipe.shared: {':'.join(key)} shares {':'.join(owner)}, which itself shares "
                             "another state (or is the same site); name the owner directly")
    return out


def _resolve_shared(shared: dict, resolved: dict) -> dict:
    """Checks each shared pair on the model: both sites observed, activation sites, one
    observer, spec and stacking (they hold one state)."""
    for key, owner in shared.items():
        found = [resolved.get(path, {}).get(site) for path, site in (key, owner)]
        for (path, site), site_found in zip((key, owner), found):
            if site_found is None:
                raise ValueError(f"Recipe.shared: the recipe observes no site {site!r} of module {path!r} in this model")
            if site_found.kind == "parameter":
                raise ValueError(f"Recipe.shared: {path}:{site} is a parameter; only activation sites share a state")
        same = [(f.rule.observer, f.rule.observer_kwargs, f.spec, f.num_experts, f.runtime) for f in found]
        if same[0] != same[1]:
            raise ValueError(
                f"Recipe.shared: {':'.join(key)} and {':'.join(owner)} must have the same observer, observer_kwargs, "
                f"spec and stacking to share one state; got {same[0]} and {same[1]}"
            )
    return shared


def as_plan(recipe, model: Optional[torch.nn.Module], caller: str) -> Plan:
    """``recipe`` itself when it is a `Plan` (of ``model``, when one is given), else
    ``recipe.resolve(model)``: how every consumer resolves its argument, once, at its entry. A
    wrapped model (``torch.compile``, ``DistributedDataParallel``, ``DataParallel``) resolves as the
    module it wraps: its sites keep the bare model's paths."""
    model = None if model is None else unwrapped(model)
    if isinstance(recipe, Plan):
        if model is not None and model is not recipe.model:
            raise ValueError(f"{caller}: the Plan was resolved on another model than the one given")
        return recipe
    if isinstance(recipe, str):
        raise TypeError(f"{caller} expects a qstats.Recipe or Plan, got the string {recipe!r}; for a scheme "
                        f"name use qstats.Recipe.from_scheme({recipe!r}, ...)")
    if not isinstance(recipe, Recipe):
        raise TypeError(f"{caller} expects a qstats.Recipe or Plan, got {type(recipe).__name__}")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{caller} expects an nn.Module to resolve the recipe on, got {type(model).__name__}")
    return recipe.resolve(model)


class Recipe:
    """An ordered list of rules and an ignore list.

    For each module and site, the first rule whose targets match the module and whose ``sites``
    contain the site wins; modules matching ``ignore`` (``Rule.targets`` syntax) by their path or
    their checkpoint name (the name transformers' ``save_pretrained`` writes) are skipped. A site
    applies only to modules that have it: a parameter owned directly, ``q``/``k``/``v`` on a
    transformers attention module or a child projection, a stacked parameter for ``"<parameter>.input"``. ``shared`` maps
    ``"<path>:<site>"`` to the ``"<owner path>:<owner site>"`` whose state it shares.

    >>> import torch, qstats
    >>> recipe = qstats.Recipe([qstats.Rule("Linear", sites=("weight",))])
    >>> list(recipe.sites(torch.nn.Sequential(torch.nn.Linear(2, 3))))
    ['0']
    """

    def __init__(self, rules, ignore=(), shared: Optional[Mapping[str, str]] = None):
        rules = [rules] if isinstance(rules, Rule) else list(rules)
        for rule in rules:
            if not isinstance(rule, Rule):
                raise TypeError(f"Recipe rules must be qstats.Rule, got {type(rule).__name__}")
        self.rules = tuple(rules)
        self.ignore = _targets(ignore, "Recipe.ignore")
        self.shared = _shared_sites(shared)

    def __eq__(self, other) -> bool:
        """Recipes are equal when their rules, ignore lists and shared sites are (a copy, a pickled
        and loaded one, or one read again from the same config)."""
        if not isinstance(other, Recipe):
            return NotImplemented
        rules, others = [_fields(rule) for rule in self.rules], [_fields(rule) for rule in other.rules]
        return _same((rules, self.ignore, self.shared), (others, other.ignore, other.shared))

    def __hash__(self) -> int:  # of fields always hashable (observer_kwargs may hold lists)
        return hash((tuple((rule.targets, rule.sites) for rule in self.rules), self.ignore,
                     frozenset(self.shared.items())))

    def __repr__(self) -> str:
        shared = f", shared={self.shared!r}" if self.shared else ""
        return f"Recipe(rules={list(self.rules)!r}, ignore={list(self.ignore)!r}{shared})"

    @classmethod
    def from_scheme(cls, scheme, targets=None, ignore=(), observed_dtype=None, shared=None,
                    experts=None, kv_cache_scheme=None) -> "Recipe":
        """The recipe llm-compressor's ``QuantizationModifier(targets=, scheme=, ignore=,
        kv_cache_scheme=)`` applies (docs/recipes.md): ``targets`` and ``ignore`` read as
        compressed-tensors reads them (``re:`` matches from the start of the path; only Linear and
        Embedding modules are quantized; the most specific target picks a module's group).

        Args:
          scheme: a compressed-tensors ``PRESET_SCHEMES`` name (``"W4A16"``, ``"FP8"``, ...), a
            ``QuantizationScheme``, a dict of its fields, or a dict mapping preset names to their
            targets (``{"W4A16": ["Linear"], "W8A16": ["re:.*down_proj"]}``).
          targets: default: the scheme's own ``targets``, else ``"Linear"``.
          observed_dtype: the weights' dtype when bfloat16/float16 (qparams are computed in it), or its
            name (``"bfloat16"``, ``"torch.float16"``).
          experts: targets of stacked-experts modules (``"Qwen3MoeExperts"``, in qstats' syntax),
            quantized as llm-compressor quantizes them once linearized.
          kv_cache_scheme: ``QuantizationArgs`` (or a dict of them) of the k/v sites of every
            attention module compressed-tensors caches.
          shared: as in `Recipe`.

        >>> import qstats
        >>> [rule.sites for rule in qstats.Recipe.from_scheme("W4A16").rules]
        [('weight',)]
        """

        return cls(scheme_rules(Rule, scheme, targets, dtype_named(observed_dtype), experts,
                                kv_cache_scheme, ignore),
                   ignore=compressed_tensors_ignore(ignore), shared=shared)

    @classmethod
    def from_compressed_tensors(cls, config, observed_dtype=None) -> "Recipe":
        """The recipe of a compressed-tensors ``QuantizationConfig``, of the
        ``quantization_config`` dict of a checkpoint's ``config.json``, of an llm-compressor
        ``QuantizationModifier``/``GPTQModifier``, or of an llm-compressor recipe (YAML text or
        file) holding one of them and nothing else: one rule per site of each config group, each
        selecting the modules compressed-tensors gives that group (`from_scheme`), and its
        ``ignore`` list, with llm-compressor's observers."""

        return cls(*config_rules(Rule, config, dtype_named(observed_dtype)))  # (rules, ignore)

    @classmethod
    def from_dict(cls, data: Mapping) -> "Recipe":
        """A recipe from plain data (parsed YAML or JSON): ``{"rules": [...], "ignore": [...],
        "shared": {...}}`` with rules as dicts of `Rule` fields, observers by registered name, or
        ``{"scheme": name, ...}`` (`from_scheme`). The formats are in docs/recipes.md."""

        if isinstance(data, Mapping) and "scheme" in data:
            extra = set(data) - {"scheme", "targets", "ignore", "shared", "observed_dtype", "kv_cache_scheme",
                                 "experts"}
            if extra:
                raise ValueError(f"Recipe.from_dict: unknown keys {sorted(extra)} beside 'scheme'")
            return cls.from_scheme(**{**data, "ignore": data.get("ignore") or ()})  # its keys: from_scheme's arguments
        return cls(*recipe_fields(Rule, data))  # (rules, ignore, shared)

    def rule_for(self, path: str, site: str, module: Optional[torch.nn.Module] = None,
                 model: Optional[torch.nn.Module] = None) -> Optional[Rule]:
        """The first rule covering ``site`` of the module at ``path`` (None when none, or ignored).

        ``model``: the model holding that module (its ``get_submodule(path)`` when ``module`` is not
        given), whose checkpoint names the ``ignore`` list may use, as `resolve` reads them (a config
        llm-compressor saved for Mixtral ignores ``block_sparse_moe.gate`` for ``mlp.gate``). Without
        it, ``ignore`` is matched against ``path`` alone.
        """
        rename = str  # each path as it is: a path has no other (checkpoint) name here
        if model is not None:
            if not isinstance(model, torch.nn.Module):
                raise TypeError(f"Recipe.rule_for: model must be an nn.Module, got {type(model).__name__}")
            model = unwrapped(model)
            rename = module_renamer(model)
            module = model.get_submodule(path) if module is None else module
        if _ignored_module(self.ignore, path, module, rename):
            return None
        return next((rule for rule in self.rules if site in
                     _checkpoint_rule(rule, path, module, rename).sites_on(path, module)), None)

    def resolve(self, model: torch.nn.Module) -> Plan:
        """The `Plan` of this recipe on ``model``: every observed site, the modules by path and
        the fused groups, computed once. A rule that selects no site, and an ``ignore`` entry that
        matches no module, warn, naming it. A wrapped model (``torch.compile``, ``DistributedDataParallel``,
        ``DataParallel``) resolves as the module it wraps."""
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"Recipe.resolve expects an nn.Module, got {type(model).__name__}")
        model = unwrapped(model)
        modules = dict(model.named_modules())
        rename = module_renamer(model)
        resolved: dict = {}
        found = [set() for _ in self.rules]  # per rule: the sites it resolved (or that an earlier rule took)
        ignored = {}  # path -> module the ignore list skips
        for path, module in modules.items():
            if _ignored_module(self.ignore, path, module, rename):
                ignored[path] = module
                continue
            entry = self._module_sites(path, module, found, rename)
            if entry:
                resolved[path] = MappingProxyType(entry)
        _refuse_ignored_kv_cache(self.rules, found, ignored)
        _refuse_unloadable_heads(self.rules, found, model)
        self._warn_unmatched(found, modules, model, rename)
        self._warn_parent_ignore(ignored, resolved, model, rename)
        shared = MappingProxyType(_resolve_shared(self.shared, resolved))
        return Plan(self, MappingProxyType(resolved), MappingProxyType(modules), tuple(fused_groups(model)), shared)

    def _module_sites(self, path: str, module: torch.nn.Module, found: list, rename: Callable[[str], str]) -> dict:
        """``{site: Site}`` of one module; records in ``found`` which rule took which site. The
        config's ignore list names per-expert Linears by model or checkpoint name (``rename``)."""
        params = own_parameters(module)  # parametrized ones too (inside `qstats.fake_quantized`)
        num_experts = expert_count(module)
        # gate/up halves of stacks read as per-expert Linears only
        shapes = stack_shapes(module, params) if num_experts and linearized_layout_problem(module) is None else {}
        entry: dict = {}
        for index, rule in enumerate(self.rules):
            for site in _checkpoint_rule(rule, path, module, rename).sites_on(path, module):
                kind = None if site in entry else _site_kind(module, params, num_experts, site)
                if kind is not None:
                    spec = _stacked_spec(path, rule, site, shapes) if kind[1] else rule.spec
                    layout = stack_layout(module, site) if kind == ("parameter", num_experts) and num_experts else None
                    parts = _searched_parts(rule, spec, site, kind, shapes)
                    entry[site] = _make_site(rule, spec, *kind, layout, parts)
                    _refuse_conv_hessian(path, module, entry[site])
                    _refuse_unsplit_heads(path, module, site, entry[site])
                if site in entry:  # taken here or by an earlier rule
                    found[index].add(site)
        return entry

    def _warn_unmatched(self, found: list, modules: dict, model: torch.nn.Module, rename: Callable[[str], str]) -> None:
        # config groups whose q/k/v rule took attention modules: their other rules need not select any
        attention = {_group_of(rule) for rule, sites in zip(self.rules, found)
                     if sites and getattr(rule.matcher, "attention", False)}
        for rule, sites in zip(self.rules, found):
            if getattr(rule.matcher, "attention", False) or _group_of(rule) in attention:
                continue  # a config group's q/k/v rule: its group need not name an attention module
            # a config group's rule that took stacked experts' sites (`GroupMatch.sites_on`) selects them
            unmatched = [] if sites and hasattr(rule.matcher, "sites_on") else [s for s in rule.sites if s not in sites]
            if unmatched:  # a misspelt target or site would otherwise select nothing, silently
                warn(
                    f"Recipe: the rule for targets {list(rule.targets)!r} selects no site {unmatched} in this "
                    f"{type(model).__name__} ({_why_unmatched(rule, modules, rename)})"
                    + "".join(_regex_hint(target) + _case_hint(target, modules)
                              + _fused_hint(target, _target_hits(rule, target), modules) for target in rule.targets),
                    UserWarning,
                )
        for target in _unmatched_ignore(self.ignore, modules, rename):  # a misspelt ignore would quantize it, silently
            written = as_written(target)  # as the user wrote it: compressed-tensors' re: matches from the start
            how = "full match" if written == target else "match from the start"
            warn(
                f"Recipe: the ignore entry {written!r} matches no module in this {type(model).__name__} "
                f"(by path, checkpoint name, class name or 're:' {how} of either), so it ignores nothing"
                + _regex_hint(written) + _case_hint(written, modules)
                + _fused_hint(written, lambda names: _ignore_hits(target, names, ()), modules),
                UserWarning,
            )

    def _warn_parent_ignore(self, ignored: dict, resolved: dict, model: torch.nn.Module,
                            rename: Callable[[str], str]) -> None:
        """Warns naming each ``ignore`` entry whose modules (``ignored``: path -> module) no rule would observe
        while modules below one of them are observed (``resolved``): an entry matches a module itself, not its
        children, as compressed-tensors reads it, so ignoring a decoder layer or an MLP by name or class leaves
        its Linears quantized, silently."""
        for target in self.ignore:
            paths = [path for path, module in ignored.items() if _ignored_module((target,), path, module, rename)]
            if not paths or any(self._observed_if_kept(path, ignored[path], rename) for path in paths):
                continue
            below = next((kept for path in paths for kept in resolved if kept.startswith(f"{path}.")), None)
            if below is None:
                continue
            written, path = as_written(target), paths[0]
            instead = f"'re:{re.escape(path)}\\..*'" if written == path else "a 're:' regex of their paths"
            warn(f"Recipe: the ignore entry {written!r} matches {path!r} ({type(ignored[path]).__name__})"
                 f"{f' and {len(paths) - 1} more' if len(paths) > 1 else ''}, which the recipe does not observe, but "
                 f"not the modules below it ({below!r}, ...), which it quantizes: an ignore entry matches a module "
                 f"itself, not its children, as compressed-tensors reads it; to leave those out, use {instead}",
                 UserWarning)

    def _observed_if_kept(self, path: str, module: torch.nn.Module, rename: Callable[[str], str]) -> bool:
        """Whether a rule would observe a site of the ignored module at ``path`` (or refuse it) were it kept."""
        try:
            return bool(self._module_sites(path, module, [set() for _ in self.rules], rename))
        except ValueError:
            return True

    def sites(self, model: torch.nn.Module) -> dict:
        """``{module_path: {site: Site}}`` for every observed site of ``model`` (a plain copy of
        ``self.resolve(model).sites``)."""
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"Recipe.sites expects an nn.Module, got {type(model).__name__}")
        return {path: dict(entry) for path, entry in self.resolve(model).sites.items()}

    def observers(self, states: Mapping, model: torch.nn.Module) -> dict:
        """The Observer tree matching ``states`` (same keys): ``{path: {site: Observer}}``."""
        return self.resolve(model).observers(states)

    def specs(self, states: Mapping, model: torch.nn.Module) -> dict:
        """The QuantSpec tree matching ``states`` (same keys): ``{path: {site: QuantSpec}}``."""
        return self.resolve(model).specs(states)
