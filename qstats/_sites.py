"""Where a site's tensor is in a module's call: the input among its arguments, the output inside
what it returns, and the hook that hands either to a function. `observing`, `fake_quantized` and
`qstats.report` all read the same tensors through these."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import torch

from .recipe import Plan

__all__ = ["run_model", "observe_tensor", "first_tensor", "input_tensor", "replace_first_tensor",
           "replace_input_tensor", "is_float_tensor"]


def first_tensor(value) -> Optional[torch.Tensor]:
    """The first tensor in ``value``, depth first through tuples, lists, mappings and transformers'
    ``ModelOutput``; None when it holds none."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, Mapping):
        value = tuple(value.values())
    elif hasattr(value, "to_tuple"):  # transformers ModelOutput
        value = value.to_tuple()
    if not isinstance(value, (tuple, list)):
        return None
    return next((found for found in map(first_tensor, value) if found is not None), None)


def replace_first_tensor(value, fn: Callable[[torch.Tensor], torch.Tensor]):
    """``value`` with the tensor `first_tensor` finds replaced by ``fn(tensor)`` (same containers);
    ``(value, False)`` when there is none, else ``(new_value, True)``."""
    if isinstance(value, torch.Tensor):
        return fn(value), True
    if isinstance(value, (tuple, list)):
        for index, item in enumerate(value):
            new, done = replace_first_tensor(item, fn)
            if done:
                items = list(value[:index]) + [new] + list(value[index + 1 :])
                if isinstance(value, list):
                    return items, True
                if hasattr(value, "_fields"):  # a NamedTuple
                    return type(value)(*items), True
                if hasattr(type(value), "n_fields"):  # torch.return_types (max, topk, sort): .values, .indices
                    return type(value)(items), True
                return tuple(items), True
    elif isinstance(value, Mapping):  # a transformers ModelOutput is rebuilt as its own type, others as a dict
        for key, item in value.items():
            new, done = replace_first_tensor(item, fn)
            if done:
                items = {**dict(value.items()), key: new}
                return (type(value)(**items) if hasattr(value, "to_tuple") else items), True
    return value, False


# the keyword arguments a module's input is looked for under, in this order, when none is positional
_INPUT_NAMES = ("hidden_states", "input", "x", "inputs_embeds")


def replace_input_tensor(args: tuple, kwargs: dict, fn: Callable[[torch.Tensor], torch.Tensor]):
    """``(args, kwargs)`` with the tensor `input_tensor` finds replaced by ``fn(tensor)``."""
    if args:
        return (replace_first_tensor(args[0], fn)[0],) + tuple(args[1:]), kwargs
    for name in _INPUT_NAMES:
        if isinstance(kwargs.get(name), torch.Tensor):
            return args, {**kwargs, name: fn(kwargs[name])}
    return args, replace_first_tensor(dict(kwargs), fn)[0]


def input_tensor(args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
    if args:
        return first_tensor(args[0])
    for name in _INPUT_NAMES:
        if isinstance(kwargs.get(name), torch.Tensor):
            return kwargs[name]
    return first_tensor(kwargs)


def run_model(model: torch.nn.Module, batch) -> Any:
    """``model(batch)``, ``model(*batch)`` for a tuple/list, ``model(**batch)`` for a mapping."""
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def is_float_tensor(x) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def observe_tensor(plan: Plan, path: str, site: str, fn: Callable[[Any], None]):
    """Registers the hook that calls ``fn(x)`` with the tensor an activation site observes, and
    returns its handle: for ``"input"`` the module's input (`input_tensor`: the first positional
    argument, or the hidden states passed by keyword), for ``"output"`` its (first) output tensor,
    for ``q``/``k``/``v`` the output of its child projection. `calibrate` and `qstats.report` read
    the same tensors through it."""
    module = plan.hooked_module(path, site)
    if plan.sites[path][site].kind == "input":

        def pre_hook(module, args, kwargs):
            fn(input_tensor(args, kwargs))

        return module.register_forward_pre_hook(pre_hook, with_kwargs=True)

    def hook(module, args, output):
        fn(first_tensor(output))

    return module.register_forward_hook(hook)

