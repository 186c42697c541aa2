"""Recipes from plain data (parsed YAML or JSON): what `Recipe.from_dict` reads.

A rule is a dict of `Rule` fields whose ``observer`` is a registered name
(`qstats.observers.registered`) and whose ``spec`` is one of:
``{"dtype": "int8", "granularity": {"PerAxis": {"axis": 0}}, ...}`` (`QuantSpec` fields; a
granularity without arguments may be its bare name, ``"PerTensor"``),
``{"preset": "nvfp4", ...overrides}`` (`qstats.preset`) or
``{"compressed_tensors": {...QuantizationArgs fields}}`` (`QuantSpec.from_compressed_tensors`; its
``observed_dtype`` by name, ``"bfloat16"``).
"""

from __future__ import annotations

from typing import Any, Mapping

from . import _granularity
from ._schemes import recipe_keys
from ._spec import QuantSpec, preset
from ._torch_features import dtype_named

__all__ = ["recipe_fields", "spec_from_data"]

_GRANULARITIES = ("PerTensor", "PerAxis", "PerHead", "PerToken", "PerRow", "PerGroup", "TensorGroup", "PerBlock")
_RULE_KEYS = ("targets", "sites", "observer", "spec", "observer_kwargs", "qparams_kwargs", "dynamic")


def _granularity_from_data(data: Any):
    if isinstance(data, _granularity.Granularity):
        return data
    if isinstance(data, str):
        name, arguments = data, {}
    elif isinstance(data, Mapping) and len(data) == 1:
        (name, arguments), = data.items()
    else:
        raise ValueError(f"granularity must be a name or {{name: {{arguments}}}}, got {data!r}")
    if name not in _GRANULARITIES:
        raise ValueError(f"unknown granularity {name!r}; known: {', '.join(_GRANULARITIES)}")
    if not isinstance(arguments, Mapping):
        raise ValueError(f"granularity {name!r}: arguments must be a mapping ({{name: {{arguments}}}}), got {arguments!r}")
    return getattr(_granularity, name)(**arguments)


def spec_from_data(data: Any) -> QuantSpec:
    """The `QuantSpec` a rule's ``spec`` data describes (see the module docstring)."""
    if isinstance(data, QuantSpec):
        return data
    if not isinstance(data, Mapping):
        raise TypeError(f"Recipe.from_dict: a rule's spec must be a mapping, got {type(data).__name__}")
    fields = dict(data)
    if "granularity" in fields:
        fields["granularity"] = _granularity_from_data(fields["granularity"])
    if "compressed_tensors" in fields:
        if "observed_dtype" in fields:  # plain data names it, as the scheme form reads it: "bfloat16"
            fields["observed_dtype"] = dtype_named(fields["observed_dtype"])
        return QuantSpec.from_compressed_tensors(fields.pop("compressed_tensors"), **fields)
    if "preset" in fields:
        name = fields.pop("preset")
        try:
            return preset(name, **fields)
        except ValueError as error:
            raise ValueError(f"{error}{_scheme_hint(name)}") from None
    return QuantSpec(**fields)


def _scheme_hint(name: Any) -> str:
    """A hint for a ``{"preset": name}`` spec naming a compressed-tensors preset scheme (``"W4A16"``), which
    is a whole scheme, not the spec of one tensor; else ""."""
    try:
        from compressed_tensors.quantization.quant_scheme import is_preset_scheme
    except ImportError:
        return ""
    if not isinstance(name, str) or not is_preset_scheme(name):
        return ""
    return (f"; {name!r} is a compressed-tensors preset scheme (weights and activations), not the spec of one "
            f"tensor: read it with {{'scheme': {name!r}, 'ignore': [...]}} (Recipe.from_scheme), or give this rule "
            "{'compressed_tensors': {...QuantizationArgs fields}}")


def recipe_fields(Rule, data: Mapping) -> tuple:
    """``(rules, ignore, shared)`` of a recipe's plain data ``{"rules": [...], "ignore": [...],
    "shared": {...}}``; a ValueError names the rule and the key that is wrong."""
    if not isinstance(data, Mapping):
        raise TypeError(f"Recipe.from_dict expects a mapping, got {type(data).__name__}")
    extra = set(data) - {"rules", "ignore", "shared"}
    if extra & {"config_groups", "quantization_config"} or recipe_keys(data):  # compressed-tensors' or
        # llm-compressor's data (a config, a config.json, a parsed recipe.yaml)
        raise ValueError(f"Recipe.from_dict: keys {sorted(extra)}: a compressed-tensors quantization config (or a "
                         "checkpoint's config.json) or an llm-compressor recipe reads with Recipe.from_compressed_tensors")
    if extra:
        raise ValueError(f"Recipe.from_dict: unknown keys {sorted(extra)}; expected 'rules', 'ignore', 'shared'")
    if not isinstance(data.get("rules") or (), (list, tuple)):
        raise TypeError(f"Recipe.from_dict: 'rules' must be a list of rules (mappings), got {type(data['rules']).__name__}")
    rules = []
    for index, rule in enumerate(data.get("rules") or ()):
        if not isinstance(rule, Mapping):
            raise TypeError(f"Recipe.from_dict: rules[{index}] must be a mapping, got {type(rule).__name__}")
        unknown = set(rule) - set(_RULE_KEYS)
        if unknown:
            raise ValueError(f"Recipe.from_dict: rules[{index}] has unknown keys {sorted(unknown)}; known: {_RULE_KEYS}")
        fields = dict(rule)  # Rule takes sites and targets as lists too
        try:  # a wrong spec names its rule too
            if "spec" in fields:
                fields["spec"] = spec_from_data(fields["spec"])
            rules.append(Rule(**fields))
        except (TypeError, ValueError) as error:
            raise type(error)(f"Recipe.from_dict: rules[{index}]: {error}") from None
    return rules, data.get("ignore") or (), data.get("shared")  # Recipe checks ignore (a name or names)
