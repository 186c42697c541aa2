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

import dataclasses
from typing import Any, Mapping

from ._spec import QuantSpec

__all__ = ["scheme_rules", "config_rules", "preset_schemes"]

# llm-compressor's observer names for activations -> (qstats registered name, kwargs it takes)
_ACTIVATION_OBSERVERS = {
    "minmax": ("moving_average_minmax", ("averaging_constant",)),
    "static_minmax": ("minmax", ()),
    "memoryless_minmax": ("memoryless_minmax", ()),
    "mse": ("mse", ("maxshrink", "patience", "grid", "norm", "expand", "averaging_constant")),
    "memoryless_mse": ("mse", ("maxshrink", "patience", "grid", "norm", "expand")),
}
_WEIGHT_MINMAX = (None, "minmax", "static_minmax", "memoryless_minmax")
_WEIGHT_MSE = ("mse", "memoryless_mse")
_MSE_SEARCH = ("maxshrink", "grid", "norm", "expand")
_SITES = (("weights", "weight"), ("input_activations", "input"), ("output_activations", "output"))


def preset_schemes() -> tuple:
    """The names of compressed-tensors' preset schemes (``PRESET_SCHEMES``) of the installed
    compressed-tensors."""
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    return tuple(PRESET_SCHEMES)


def _args(args):
    """``args`` as compressed-tensors' ``QuantizationArgs`` (from a dict of its fields too)."""
    from compressed_tensors.quantization import QuantizationArgs

    if args is None or isinstance(args, QuantizationArgs):
        return args
    if isinstance(args, Mapping):
        return QuantizationArgs.model_validate(dict(args))
    raise TypeError(f"expected compressed-tensors QuantizationArgs or a dict of its fields, got {type(args).__name__}")


def _weight_observer(args) -> tuple:
    """``(observer name, observer_kwargs, qparams_kwargs)`` llm-compressor uses for weights."""
    kwargs = dict(args.observer_kwargs or {})
    if args.observer in _WEIGHT_MINMAX:
        return "minmax", {}, {}
    if args.observer in _WEIGHT_MSE:  # llm-compressor's memoryless_mse: one search over the weight
        return "mse", {k: kwargs[k] for k in _MSE_SEARCH if k in kwargs}, {"patience": kwargs.get("patience", 5)}
    raise ValueError(
        f"weights observer {args.observer!r}: no qstats equivalent of this llm-compressor observer; "
        f"known: {[name for name in _WEIGHT_MINMAX if name] + list(_WEIGHT_MSE)}"
    )


def _activation_observer(args) -> tuple:
    """``(observer name, observer_kwargs)`` llm-compressor uses for activations."""
    name = args.observer or "minmax"
    if name not in _ACTIVATION_OBSERVERS:
        raise ValueError(
            f"activation observer {name!r}: no qstats equivalent of this llm-compressor observer; "
            f"known: {sorted(_ACTIVATION_OBSERVERS)}"
        )
    ours, taken = _ACTIVATION_OBSERVERS[name]
    given = dict(args.observer_kwargs or {})
    kwargs = {key: given[key] for key in taken if key in given}
    if name == "minmax":
        kwargs.setdefault("averaging_constant", 0.01)
    if name == "mse":  # llm-compressor's mse: a search per batch, then a moving average
        kwargs = {"mode": "moving_average", "averaging_constant": 0.01, **kwargs}
    if name == "memoryless_mse":  # the latest batch's search: a moving average with constant 1
        kwargs = {"mode": "moving_average", "averaging_constant": 1.0, **kwargs}
    return ours, kwargs


def _rule(Rule, targets, args, site: str, observed_dtype):
    overrides = {} if observed_dtype is None else {"observed_dtype": observed_dtype}
    spec = QuantSpec.from_compressed_tensors(args, **overrides)
    if site == "weight":
        observer, observer_kwargs, qparams_kwargs = _weight_observer(args)
        return Rule(targets, sites=(site,), observer=observer, spec=spec, observer_kwargs=observer_kwargs,
                    qparams_kwargs=qparams_kwargs)
    if args.dynamic is True:  # scales at run time: llm-compressor observes nothing
        return Rule(targets, sites=(site,), observer="memoryless_minmax", spec=spec, dynamic=True)
    observer, observer_kwargs = _activation_observer(args)
    return Rule(targets, sites=(site,), observer=observer, spec=spec, observer_kwargs=observer_kwargs,
                dynamic=False)


# the sites of stacked experts (`qstats.experts`) that llm-compressor's linearized experts quantize
_EXPERT_SITES = {"weight": ("gate_up_proj", "down_proj"), "input": ("input", "down_proj.input")}


def _expert_rules(Rule, rules: list, experts) -> list:
    """Rules quantizing stacked-experts modules ``experts`` (class names, paths or regexes) as
    llm-compressor quantizes their linearized ``gate_proj``/``up_proj``/``down_proj``."""
    out = []
    for rule in rules:
        (site,) = rule.sites
        if site not in _EXPERT_SITES:
            raise ValueError("from_scheme: experts: output activations of stacked experts are not supported")
        out.append(dataclasses.replace(rule, targets=experts, sites=_EXPERT_SITES[site]))
    return out


def scheme_rules(Rule, scheme: Any, targets, observed_dtype=None, experts=None) -> list:
    """The rules of one scheme: a ``QuantizationScheme``, a dict of its fields (``weights``,
    ``input_activations``, ``output_activations``, optional ``targets``) or a preset name; with
    ``experts``, rules for those stacked-experts modules first."""
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    if isinstance(scheme, str):
        name = scheme.upper()
        if name not in PRESET_SCHEMES:
            raise ValueError(f"unknown compressed-tensors scheme {scheme!r}; presets: {', '.join(PRESET_SCHEMES)}")
        fields: Mapping = PRESET_SCHEMES[name]
    elif isinstance(scheme, Mapping):
        fields = scheme
    elif hasattr(scheme, "weights"):
        fields = {key: getattr(scheme, key) for key, _ in _SITES}
        targets = scheme.targets if targets is None else targets
    else:
        raise TypeError(f"expected a scheme name, QuantizationScheme or dict, got {type(scheme).__name__}")
    if targets is None:
        targets = fields.get("targets", "Linear")
    rules = []
    for key, site in _SITES:
        args = _args(fields.get(key))
        if args is not None:
            rules.append(_rule(Rule, targets, args, site, observed_dtype))
    return (_expert_rules(Rule, rules, experts) if experts else []) + rules


def config_rules(Rule, config: Any, observed_dtype=None) -> tuple:
    """``(rules, ignore)`` of a compressed-tensors ``QuantizationConfig`` or of the
    ``quantization_config`` dict of a ``config.json`` (its config groups in order)."""
    if hasattr(config, "model_dump"):
        config = config.model_dump()
    if not isinstance(config, Mapping):
        raise TypeError(f"expected a QuantizationConfig or a dict, got {type(config).__name__}")
    groups = config.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise ValueError("quantization config: 'config_groups' must be a non-empty mapping of schemes")
    rules = []
    for name, group in groups.items():
        if not isinstance(group, Mapping):
            raise TypeError(f"quantization config: config_groups[{name!r}] must be a mapping, got {type(group).__name__}")
        rules.extend(scheme_rules(Rule, group, group.get("targets") or "Linear", observed_dtype))
    kv_args = _args(config.get("kv_cache_scheme"))
    if kv_args is not None:  # the k/v projection outputs of every attention module
        kv = _rule(Rule, "re:.*", kv_args, "k", observed_dtype)
        rules.append(dataclasses.replace(kv, sites=("k", "v")))
    return rules, config.get("ignore") or ()  # Recipe checks it (a name or names)

