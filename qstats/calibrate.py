"""Calibrating a torch model: run it over batches and collect observer states per module and site.

`calibrate` resolves a `Recipe` on the model once (a `qstats.recipe.Plan`), observes every
parameter site once, then runs the model over the calibration batches with one small hook object
per activation site, each threading its state through pure updates: a hook replaces its entry of
the states tree the call owns with ``observer.update(old_state, x, weight)``. Per-expert sites of
stacked experts (``"input"``, ``"down_proj.input"``) are observed with one masked, vmapped update
per experts call: every expert's rows in one tensor with a ``[E, rows]`` mask saying which rows
are whose. The intermediate activation (``"down_proj.input"``) is captured, as the model computes
it, by a `qstats.experts.ExpertInputCapture` active only during the experts' forward. The result is
a plain nested dict ``{module_path: {site: state}}`` of NamedTuples of tensors, ready for
`qstats.save`, merges across ranks and `compute_qparams_tree`.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Iterable, Mapping, Optional, Union

import torch
from torch.nn.utils import parametrize

from ._formats import COMPUTE_DTYPE_NAMES
from ._granularity import TensorGroup, qparam_shape
from ._qparams import QParams, check_calibrated, compute_qparams
from ._quant import fake_quantize
from .experts import (
    ExpertInputCapture,
    all_experts_calls,
    own_parameters,
    UncalibratedWarning,
    dispatch,
    ids_mask,
    parameter_input_site,
    routing_mask,
    stacked_qparams,
    warn_uncovered,
)
from .fused import fused_qparams
from .observers import memoryless_minmax
from .recipe import Plan, Recipe, as_plan
from .tree import assert_same_structure

__all__ = ["calibrate", "compute_qparams_tree", "fake_quantized", "run_model", "observe_tensor"]


def _first_tensor(value) -> Optional[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        for item in value:
            found = _first_tensor(item)
            if found is not None:
                return found
    if isinstance(value, Mapping):
        for item in value.values():
            found = _first_tensor(item)
            if found is not None:
                return found
    if hasattr(value, "to_tuple"):  # transformers ModelOutput
        return _first_tensor(value.to_tuple())
    return None


def _replace_first_tensor(value, fn: Callable[[torch.Tensor], torch.Tensor]):
    """``value`` with the tensor `_first_tensor` finds replaced by ``fn(tensor)`` (same containers);
    ``(value, False)`` when there is none, else ``(new_value, True)``."""
    if isinstance(value, torch.Tensor):
        return fn(value), True
    if hasattr(value, "to_tuple") and isinstance(value, Mapping):  # transformers ModelOutput
        for key, item in value.items():
            new, done = _replace_first_tensor(item, fn)
            if done:
                return type(value)(**{**dict(value.items()), key: new}), True
        return value, False
    if isinstance(value, (tuple, list)):
        for index, item in enumerate(value):
            new, done = _replace_first_tensor(item, fn)
            if done:
                items = list(value[:index]) + [new] + list(value[index + 1 :])
                if isinstance(value, list):
                    return items, True
                return (type(value)(*items) if hasattr(value, "_fields") else tuple(items)), True
        return value, False
    if isinstance(value, Mapping):
        for key, item in value.items():
            new, done = _replace_first_tensor(item, fn)
            if done:
                return {**dict(value.items()), key: new}, True
        return value, False
    return value, False


def _replace_input_tensor(args: tuple, kwargs: dict, fn: Callable[[torch.Tensor], torch.Tensor]):
    """``(args, kwargs)`` with the tensor `_input_tensor` finds replaced by ``fn(tensor)``."""
    if args:
        first, _ = _replace_first_tensor(args[0], fn)
        return (first,) + tuple(args[1:]), kwargs
    for name in ("hidden_states", "input", "x", "inputs_embeds"):
        if isinstance(kwargs.get(name), torch.Tensor):
            return args, {**kwargs, name: fn(kwargs[name])}
    new, _ = _replace_first_tensor(dict(kwargs), fn)
    return args, new


def _input_tensor(args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
    if args:
        return _first_tensor(args[0])
    for name in ("hidden_states", "input", "x", "inputs_embeds"):
        if isinstance(kwargs.get(name), torch.Tensor):
            return kwargs[name]
    return _first_tensor(kwargs)


def run_model(model: torch.nn.Module, batch) -> Any:
    """``model(batch)``, ``model(*batch)`` for a tuple/list, ``model(**batch)`` for a mapping."""
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def _copy_tree(states: Optional[Mapping]) -> dict:
    if states is None:
        return {}
    if not isinstance(states, Mapping):
        raise TypeError(f"states must be a dict {{path: {{site: state}}}} or None, got {type(states).__name__}")
    copied = {}
    for path, entry in states.items():
        if not isinstance(entry, Mapping):
            raise TypeError(f"states[{path!r}] must be a dict {{site: state}}, got {type(entry).__name__}")
        copied[path] = dict(entry)
    return copied


def _is_float_tensor(x) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def observe_tensor(plan: Plan, path: str, site: str, fn: Callable[[Any], None]):
    """Registers the hook that calls ``fn(x)`` with the tensor an activation site observes, and
    returns its handle: for ``"input"`` the module's input (`_input_tensor`: the first positional
    argument, or the hidden states passed by keyword), for ``"output"`` its (first) output tensor,
    for ``q``/``k``/``v`` the output of its child projection. `calibrate` and `qstats.report` read
    the same tensors through it."""
    module = plan.hooked_module(path, site)
    if plan.sites[path][site].kind == "input":

        def pre_hook(module, args, kwargs):
            fn(_input_tensor(args, kwargs))

        return module.register_forward_pre_hook(pre_hook, with_kwargs=True)

    def hook(module, args, output):
        fn(_first_tensor(output))

    return module.register_forward_hook(hook)


def _raise_renamed(error: Exception, path: str, site: str):
    """Raises ``error`` with the module and site in front of its message (the error itself where
    its type is built from other arguments)."""
    try:
        renamed = type(error)(f"calibrate: module {path!r} site {site!r}: {error}")
    except Exception:
        raise error from None
    raise renamed from error


def _check_resumed(states: dict, plan: Plan) -> None:
    for path, entry in states.items():
        for site in entry:
            if plan.site(path, site) is None:
                raise ValueError(
                    f"calibrate: the given states hold site {site!r} of module {path!r}, which this recipe "
                    "does not observe in this model"
                )


# Stacked observers whose masked update reduces each shared row once for all experts.
_ROW_REDUCING = frozenset(f"stacked({name})" for name in ("minmax", "memoryless_minmax", "moving_average_minmax"))


def _drop_masked_rows(x: torch.Tensor, weight: Optional[torch.Tensor], spec):
    """On CPU, a 0/1 observation mask whose rows can be dropped without changing the quantization
    parameter shape is applied by selecting the kept rows (the observer then takes its unmasked
    fast path); the statistics are the same as with the mask as ``weight``. Elsewhere (accelerators,
    where selecting rows would synchronise the host, or granularities indexed by rows) the mask is
    passed on as the update's ``weight``."""
    if weight is None or x.device.type != "cpu":
        return x, weight
    if weight.dtype != torch.bool and not bool(((weight == 0) | (weight == 1)).all()):
        return x, weight
    # Selecting rows flattens the masked leading dimensions into one: only valid when the
    # quantization parameters do not depend on those dimensions (they are reduced over), which
    # holds when changing their sizes leaves the qparam shape unchanged (PerAxis(1) on [B, T, H]
    # with T == H would otherwise pass a shape comparison and mix tokens with channels).
    lead, rest = weight.ndim, tuple(x.shape[weight.ndim :])
    try:
        want = qparam_shape(x.shape, spec.granularity)
        resized = tuple(size + 1 for size in x.shape[:lead]) + rest
        if qparam_shape(resized, spec.granularity) != want:
            return x, weight
    except ValueError:
        return x, weight
    keep = weight != 0
    selected = x[keep]
    if qparam_shape(selected.shape, spec.granularity) != want:
        return x, weight
    return selected, None


class _Calibration:
    """What the hooks of one `calibrate` call share: the plan, the states tree the call builds and
    the current batch's observation weight (None between batches)."""

    def __init__(self, plan: Plan, states: dict, all_experts: bool = False):
        self.plan = plan
        self.states = states
        self.all_experts = all_experts
        self.weight: Optional[torch.Tensor] = None

    def weight_for(self, x: torch.Tensor, flattened: bool) -> Optional[torch.Tensor]:
        """The batch's observation weight as the weight of ``x``: when ``x`` starts with its
        dimensions, or (``flattened``: tokens of stacked experts) has one row per weight entry."""
        weight = self.weight
        if weight is None:
            return None
        if flattened:
            if x.ndim >= 1 and weight.numel() == x.shape[0]:
                return weight.reshape(-1).to(x.device)
            return None
        if weight.ndim <= x.ndim and tuple(x.shape[: weight.ndim]) == tuple(weight.shape):
            return weight.to(x.device)
        return None

    def update(self, path: str, site: str, x: torch.Tensor, weight=None, like: Optional[torch.Tensor] = None):
        """``states[path][site] = observer.update(previous, x, weight)``, ``previous`` starting as
        ``observer.init(like)`` (``like`` defaults to ``x``); a ValueError or TypeError (a tensor the
        spec cannot observe, a resumed state of another shape or observer) names the module and site."""
        observer = self.plan.sites[path][site].observer
        entry = self.states.setdefault(path, {})
        try:
            previous = entry.get(site)
            if previous is None:
                previous = observer.init(x if like is None else like)
            entry[site] = observer.update(previous, x, weight)
        except (ValueError, TypeError) as error:
            _raise_renamed(error, path, site)


class _ParameterSite:
    """A parameter site: the parameter observed once, before the first batch; a resumed state of
    it is checked against the parameter and kept."""

    def __init__(self, run: _Calibration, path: str, site: str):
        self.run, self.path, self.site = run, path, site

    def observe(self) -> None:
        value = self.run.plan.parameter(self.path, self.site)
        resumed = self.run.states.get(self.path, {}).get(self.site)
        if resumed is None:
            self.run.update(self.path, self.site, value)
            return
        observer = self.run.plan.sites[self.path][self.site].observer
        try:
            assert_same_structure(resumed, observer.init(value), name="state")
        except ValueError as error:
            raise ValueError(
                f"calibrate: the given states[{self.path!r}][{self.site!r}] is not a {observer.name} state "
                f"of that parameter (shape {tuple(value.shape)}): {error}"
            ) from None


class _SiteHook:
    """Base of the activation hooks: one site of one module, updated through the calibration."""

    def __init__(self, run: _Calibration, path: str, site: str):
        self.run, self.path, self.site = run, path, site
        self.found = run.plan.sites[path][site]

    def check_runtime_shape(self, shape) -> None:
        """A site whose scales come at run time (`runtime_scaled`) is observed per tensor, so its
        observer never meets the spec's granularity: the tensor's shape is checked against it here
        (a group size that does not divide the features would otherwise calibrate and export)."""
        if self.found.runtime:
            try:
                qparam_shape(shape, self.found.spec.granularity)
            except ValueError as error:
                _raise_renamed(error, self.path, self.site)


class _ActivationSite(_SiteHook):
    """An ``input``/``output``/``q``/``k``/``v`` site of a module that is not stacked experts: the
    tensor `observe_tensor` finds, weighted by the batch's observation weight."""

    def attach(self) -> list:
        return [observe_tensor(self.run.plan, self.path, self.site, self.observe)]

    def observe(self, x) -> None:
        if not _is_float_tensor(x):
            return
        x = x.detach()
        self.check_runtime_shape(x.shape)
        weight = self.run.weight_for(x, flattened=False)
        kept, weight = _drop_masked_rows(x, weight, self.found.observer.spec or self.found.spec)
        self.run.update(self.path, self.site, kept, weight, like=x)


class _RoutedSite(_SiteHook):
    """A per-expert site of stacked experts, observed as rows shared by the experts and a mask."""

    def observe_rows(self, rows: torch.Tensor, mask: torch.Tensor) -> None:
        """One masked update: ``rows [N, ...]`` shared by the experts, ``mask [E, N]`` saying which
        rows each expert observes."""
        self.check_runtime_shape(rows.shape)
        if rows.device.type == "cpu" and self.found.observer.name not in _ROW_REDUCING:
            x, weight = dispatch(rows, mask)
        else:  # every expert sees every (masked) row: no host read of the row counts, and
            # min/max observers reduce each row once for all experts
            x, weight = rows.expand(self.found.num_experts, *rows.shape), mask
        self.run.update(self.path, self.site, x, weight)


class _RoutedInputSite(_RoutedSite):
    """The ``"input"`` of stacked experts: the hidden states, each token observed by the experts
    the routing of the call (`routing_mask`) sends it to (by every expert with ``all_experts``),
    and not where the batch's observation weight is 0."""

    def attach(self) -> list:
        module = self.run.plan.modules[self.path]
        return [module.register_forward_pre_hook(self, with_kwargs=True)]

    def __call__(self, module, args, kwargs) -> None:
        x = _input_tensor(args, kwargs)
        if not _is_float_tensor(x):
            return
        tokens = x.detach().reshape(-1, x.shape[-1])
        if self.run.all_experts:  # every token observed by every expert
            mask = torch.ones(self.found.num_experts, tokens.shape[0], device=tokens.device)
        else:
            mask = routing_mask(args, kwargs or {}, self.found.num_experts, tokens.shape[0])
        if mask is None:
            raise ValueError(
                f"calibrate: cannot find the routing (an integer tensor [tokens, k] of selected experts) "
                f"in the call of the experts module {self.path!r}"
            )
        extra = self.run.weight_for(tokens, flattened=True)
        if extra is not None:
            mask = mask * (extra != 0).to(mask.dtype)
        self.observe_rows(tokens, mask)


class _ExpertMatmulInputs:
    """The ``"<parameter>.input"`` sites of one stacked-experts module: an `ExpertInputCapture`
    entered before the module's forward and left after it, whose captured rows (the input of each
    expert's matmul with the parameter) are observed under their expert ids, and not where the
    batch's observation weight of the token they come from is 0 (`ExpertInputCapture.row_tokens`).
    With ``all_experts``, the rows are captured instead from extra calls of the module's forward
    that route every token to every expert (`qstats.experts.all_experts_calls`; their outputs are
    discarded, the model's own forward is left as it is)."""

    def __init__(self, run: _Calibration, path: str, sites: list):
        self.path = path
        self.run = run
        self.module = run.plan.modules[path]
        self.sites = {site: _RoutedSite(run, path, site) for site in sites}
        self.parameters = {site: parameter_input_site(site) for site in sites}
        self.active: list = []  # (capture, parametrization hooks, tokens, observation weight) of the call

    def attach(self) -> list:
        return [
            self.module.register_forward_pre_hook(self.enter, with_kwargs=True),
            self.module.register_forward_hook(self.leave, with_kwargs=True, always_call=True),
        ]

    def _start(self, module, x) -> tuple:
        """Enters a capture for one forward of the experts over the tokens ``x``."""
        tokens = x.numel() // x.shape[-1] if isinstance(x, torch.Tensor) and x.ndim and x.shape[-1] else 0
        weight = self.run.weight_for(x.reshape(-1, x.shape[-1]), flattened=True) if tokens else None
        params = own_parameters(module)
        names = set(self.parameters.values())
        if weight is not None:  # trace the tokens of the rows: through every stacked parameter
            names |= {name for name, p in params.items() if p.ndim >= 3}
        capture = ExpertInputCapture(
            {name: params[name] for name in names}, tokens=x if weight is not None and x.ndim == 2 else None
        )
        handles = []
        if parametrize.is_parametrized(module):  # inside `qstats.fake_quantized`: each value the
            # forward computes (and slices) is watched, as the parameter's
            for name in names & set(module.parametrizations):
                handles.append(module.parametrizations[name].register_forward_hook(
                    lambda _, args, value, name=name: capture.watch(name, value)))
        capture.__enter__()
        return capture, handles, tokens, weight

    def enter(self, module, args, kwargs) -> None:
        if self.run.all_experts:  # observed from extra calls once the model's forward is done
            self.active.append(None)
            return
        self.active.append(self._start(module, _input_tensor(args, kwargs)))

    def leave(self, module, args, kwargs, output) -> None:
        if not self.active:
            return
        started = self.active.pop()
        if started is None:
            if output is not None:
                self._observe_all_experts(module, args, kwargs or {})
            return
        _stop(*started[:2])
        if output is not None:  # else the forward raised
            self._observe(module, started[0], *started[2:])

    def _observe_all_experts(self, module, args: tuple, kwargs: dict) -> None:
        x = _input_tensor(args, kwargs)
        if not _is_float_tensor(x):
            return
        num_experts = next(iter(self.sites.values())).found.num_experts
        calls = all_experts_calls(args, kwargs, num_experts, x.numel() // x.shape[-1])
        if calls is None:
            raise ValueError(
                f"calibrate: all_experts: cannot find the routing (an integer tensor [tokens, k] of selected "
                f"experts) in the call of the experts module {self.path!r}"
            )
        for call_args, call_kwargs in calls:
            capture, handles, tokens, weight = self._start(module, x)
            try:
                module.forward(*call_args, **call_kwargs)  # no hooks of the module: only the capture watches it
            finally:
                _stop(capture, handles)
            self._observe(module, capture, tokens, weight)

    def _observe(self, module, capture: ExpertInputCapture, tokens: int, weight) -> None:
        """Observes the rows a finished capture holds, site by site."""
        for site, hook in self.sites.items():
            name = self.parameters[site]
            captured = capture.captured(name)
            if captured is None:
                if tokens:
                    raise ValueError(
                        f"calibrate: site {site!r} of the experts module {self.path!r} "
                        f"({type(module).__name__}): no per-expert matmul with the stacked parameter "
                        f"{name!r} was found in its forward (recognised: F.linear/matmul with a slice "
                        f"{name}[e], bmm with a gathered {name}[ids], grouped_mm over {name})"
                    )
                continue
            rows, ids = captured
            if rows.is_floating_point():
                mask = ids_mask(ids, hook.found.num_experts)
                if weight is not None:
                    mask = mask * self._kept_rows(capture, name, site, weight).to(mask.dtype)
                hook.observe_rows(rows, mask)

    def _kept_rows(self, capture: ExpertInputCapture, name: str, site: str, weight: torch.Tensor) -> torch.Tensor:
        """``[rows]``: 1 where the token a captured row comes from has a nonzero observation
        weight; all ones, with a warning, when the rows cannot be traced to their tokens."""
        tokens = capture.row_tokens(name)
        if tokens is None:
            warnings.warn(
                f"calibrate: the rows of site {site!r} of the experts module {self.path!r} could not be traced "
                "back to the tokens they come from, so the observation weight (padding) is not applied to them",
                UserWarning,
                stacklevel=2,
            )
            rows = capture.rows[name]
            return torch.ones(sum(r.shape[0] for r in rows), dtype=torch.bool, device=rows[0].device)
        return weight.to(tokens.device)[tokens] != 0


def _stop(capture: ExpertInputCapture, handles: list) -> None:
    """Leaves a capture and removes the hooks that fed it."""
    capture.__exit__(None, None, None)
    for handle in handles:
        handle.remove()


def _activation_hooks(run: _Calibration) -> list:
    """One hook object per activation site of the plan (one per stacked-experts module for its
    ``"<parameter>.input"`` sites), in ``named_modules`` order."""
    hooks: list = []
    for path, entry in run.plan.sites.items():
        matmul_inputs = []
        for site, found in entry.items():
            if found.kind == "parameter_input":
                matmul_inputs.append(site)
            elif found.kind == "input" and found.num_experts:
                hooks.append(_RoutedInputSite(run, path, site))
            elif found.kind != "parameter":
                hooks.append(_ActivationSite(run, path, site))
        if matmul_inputs:
            hooks.append(_ExpertMatmulInputs(run, path, matmul_inputs))
    return hooks


def _run_batches(run: _Calibration, batches: Iterable, progress: bool, observation_weight) -> int:
    """Runs the model over ``batches`` (setting each one's observation weight); the batch count."""
    from tqdm.auto import tqdm

    total = len(batches) if hasattr(batches, "__len__") else None
    bar = tqdm(batches, total=total, unit="batch", desc="qstats.calibrate", disable=not progress)
    seen_batches = 0
    with torch.no_grad():
        for batch in bar:
            weight = observation_weight(batch) if observation_weight is not None else None
            if weight is not None and not isinstance(weight, torch.Tensor):
                raise TypeError(
                    f"calibrate: observation_weight(batch) must return a tensor or None, got {type(weight).__name__}"
                )
            run.weight = weight
            run_model(run.plan.model, batch)
            seen_batches += 1
    bar.close()
    return seen_batches


def calibrate(
    model: torch.nn.Module,
    batches: Iterable,
    recipe: Union[Recipe, Plan],
    states: Optional[Mapping] = None,
    progress: bool = True,
    observation_weight: Optional[Callable[[Any], Optional[torch.Tensor]]] = None,
    all_experts: bool = False,
) -> dict:
    """Observer states of ``model`` over ``batches``, per module path and site.

    Args:
      model: an ``nn.Module``, run as is (call ``model.eval()`` first), under ``torch.no_grad()``.
      batches: an iterable of batches: a tensor (``model(batch)``), a tuple or list
        (``model(*batch)``) or a mapping (``model(**batch)``).
      recipe: a `Recipe` saying which observer and spec watch which module and site, or its
        `Plan` on ``model`` (``recipe.resolve(model)``).
      states: a states tree returned by an earlier call, to continue from (resume). Its sites are
        not re-initialised and its parameter sites are not observed again, so calibrating ``A``
        then ``B`` from the returned states equals calibrating ``A + B`` at once.
      progress: show a tqdm progress bar (batches and batches per second).
      observation_weight: optional ``callable(batch) -> tensor``, e.g. the attention mask; used as
        the ``weight`` of activation updates whose tensor starts with the same dimensions (for
        stacked experts, whose hidden states are flattened to tokens, its flattened form), so
        padding is not observed. ``"<parameter>.input"`` sites leave out the rows of the tokens
        whose weight is 0, each row traced back to its token through the experts' forward
        (`qstats.experts.ExpertInputCapture.row_tokens`; a warning says when it cannot be).
      all_experts: per-expert sites of stacked experts observe every token, not only those the
        router sends to the expert (llm-compressor's ``moe_calibrate_all_experts``, its default):
        ``"input"`` sees all the hidden states, and ``"<parameter>.input"`` the rows of extra
        calls of the experts' forward that route every token to every expert (``E / k`` calls of
        ``k`` experts each; the model's outputs are unchanged). Default False: each expert's
        statistics are those of the tokens it is routed, as at inference.

    Returns:
      ``{module_path: {site: state}}``; parameter sites first, in ``named_modules`` order.
      Stacked-expert sites hold states with a leading expert dimension. A warning
      (`qstats.UncalibratedWarning`) names the experts that received no token.

    Raises:
      ValueError: naming the module, when a ``"<parameter>.input"`` site is requested and the
        experts' forward received tokens but made no recognised per-expert matmul with that
        parameter (see `qstats.experts.ExpertInputCapture` for the recognised calls).

    >>> import torch, qstats
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    >>> recipe = qstats.Recipe([qstats.Rule("Linear", sites=("weight", "input"))])
    >>> states = qstats.calibrate(model, [torch.randn(5, 4)], recipe, progress=False)
    >>> sorted(states["2"])
    ['input', 'weight']
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"calibrate expects an nn.Module, got {type(model).__name__}")
    plan = as_plan(recipe, model, "calibrate")
    run = _Calibration(plan, _copy_tree(states), all_experts=bool(all_experts))
    _check_resumed(run.states, plan)
    with torch.no_grad():
        for path, entry in plan.sites.items():
            for site, found in entry.items():
                if found.kind == "parameter":
                    _ParameterSite(run, path, site).observe()
    handles = [handle for hook in _activation_hooks(run) for handle in hook.attach()]
    try:
        seen_batches = _run_batches(run, batches, progress, observation_weight)
    finally:
        run.weight = None
        for handle in handles:
            handle.remove()
    _warn_unobserved(run.states, plan, seen_batches)
    warn_uncovered(run.states, plan.sites)
    return run.states


def _warn_unobserved(states: dict, plan: Plan, seen_batches: int) -> None:
    """Warns (`qstats.UncalibratedWarning`) naming the activation sites the recipe selects that hold
    no state after calibration: `compute_qparams_tree` and `fake_quantized` would leave them out."""
    missing = [
        f"{path}.{site}"
        for path, entry in plan.sites.items()
        for site, found in entry.items()
        if site not in states.get(path, {}) and found.kind != "parameter"
    ]
    if not missing:
        return
    why = (
        "batches was empty"
        if seen_batches == 0
        else "their modules were not called, or not with a floating-point tensor"
    )
    warnings.warn(
        f"qstats.calibrate: {len(missing)} site(s) of the recipe saw no data ({why}) and have no state; "
        f"compute_qparams_tree and fake_quantized leave them out: " + ", ".join(missing),
        UncalibratedWarning,
        stacklevel=3,
    )


def compute_qparams_tree(
    states: Mapping,
    recipe: Union[Recipe, Plan],
    model: Optional[torch.nn.Module] = None,
    *,
    fuse: bool = True,
    **options,
) -> dict:
    """``{path: {site: QParams}}`` for a states tree, with each site's spec and ``qparams_kwargs``
    (``options`` override them). ``recipe`` is a `Recipe` (with its ``model``) or a `Plan`.

    Stacked-expert sites are computed in one call over the expert dimension (`stacked_qparams`); every
    QParams field then has a leading expert dimension and ``calibrated`` is the coverage mask.
    Entries that saw no data follow ``spec.on_uncalibrated``: ValueError naming the module and site
    for ``"raise"``, scale 1 and zero point 0 with ``calibrated`` False for ``"fallback"``.

    ``fuse`` (default True): two-level (NVFP4, `TensorGroup`) weights of sibling projections that
    inference engines run as one matmul (q/k/v, gate/up: `qstats.fused.FUSED_LAYER_NAMES`) share
    one global scale, that of their concatenated weights (`qstats.fused_qparams`), as
    llm-compressor links their observers and as vLLM needs (it keeps one global scale per fused
    matmul). A warning names a group whose members are not all such weights under one spec; their
    global scales then stay their own.

    Activation sites whose scales come at run time (`qstats.recipe.runtime_scaled`: per-token and
    per-group specs, compressed-tensors' dynamic activations) get None: nothing is calibrated
    (`qstats.export` writes them as dynamic, `fake_quantized` computes their scales from each
    tensor). Those of two-level (NVFP4) specs get QParams whose global scale is calibrated (from
    the whole range their state holds; the scale is that of a group reaching it), their group
    scales coming at run time.
    """
    plan = as_plan(recipe, model, "compute_qparams_tree")
    out: dict = {}
    for path, entry in states.items():
        out[path] = {}
        for site, state in entry.items():
            found = plan.site(path, site)
            if found is None:
                raise ValueError(f"compute_qparams_tree: the recipe observes no site {site!r} of module {path!r}")
            out[path][site] = _site_qparams(state, found, f"compute_qparams_tree[{path!r}][{site!r}]", options)
    if fuse:
        _share_global_scales(out, states, plan, options)
    return out


def _site_qparams(state, found, where: str, options: dict) -> Optional[QParams]:
    """The QParams of one site's state under its spec and ``qparams_kwargs`` (``options`` first)."""
    kwargs = {**dict(found.rule.qparams_kwargs), **options}
    if found.runtime and not isinstance(found.spec.granularity, TensorGroup):
        return None  # scales at run time: nothing calibrated
    if found.num_experts:
        qparams = stacked_qparams(state, found.spec, **kwargs)
        check_calibrated(qparams.calibrated, found.spec, where=where)
        return qparams
    try:
        return compute_qparams(state, found.spec, **kwargs)
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None


def _share_global_scales(out: dict, states: Mapping, plan: Plan, options: dict) -> None:
    """`compute_qparams_tree`'s ``fuse``: the weights of each fused group under one global scale."""
    for group in plan.fused_groups:
        found = [plan.site(path, "weight") for path in group]
        two_level = [f is not None and isinstance(f.spec.granularity, TensorGroup) for f in found]
        if not any(two_level):
            continue
        observed = [path in states and "weight" in states[path] for path in group]
        kinds = {(f.spec, f.rule.qparams_kwargs, f.num_experts) for f in found if f is not None}
        if not (all(two_level) and all(observed) and len(kinds) == 1 and not found[0].num_experts):
            warnings.warn(
                f"compute_qparams_tree: {', '.join(group)} run as one matmul in inference engines (vLLM), which "
                "need one NVFP4 (two-level) scheme on all of their weights and one global scale; these are not all "
                "observed under one such spec, so each keeps its own global scale",
                stacklevel=3,
            )
            continue
        kwargs = {**dict(found[0].rule.qparams_kwargs), **options}
        shared = fused_qparams([states[path]["weight"] for path in group], found[0].spec, **kwargs)
        for path, qparams in zip(group, shared):
            out[path]["weight"] = qparams


def runtime_spec(x: torch.Tensor, spec):
    """The spec an activation site whose scales come at run time applies to the tensor ``x``: a
    convention that computes in the observed dtype (compressed-tensors' dynamic scales and
    ``fake_quantize`` run in the activation's own dtype) takes ``x``'s dtype as its
    ``compute_dtype``; other specs are returned as they are."""
    if not spec.convention.computes_in_observed_dtype:
        return spec
    compute = COMPUTE_DTYPE_NAMES.get(x.dtype, spec.compute_dtype)
    return spec if compute == spec.compute_dtype else spec.replace(compute_dtype=compute)


def runtime_qparams(x: torch.Tensor, spec, calibrated: Optional[QParams] = None) -> QParams:
    """The QParams of an activation site whose scales come at run time (`runtime_scaled`) for the
    tensor ``x``: those of ``memoryless_minmax`` over ``x`` under `runtime_spec` ``(x, spec)``
    (compressed-tensors' dynamic per-token and per-group scales, in the activation's dtype), under
    ``calibrated``'s global scale for a two-level spec."""
    spec = runtime_spec(x, spec)
    observer = memoryless_minmax(spec)
    extra = {}
    if calibrated is not None and isinstance(spec.granularity, TensorGroup):
        extra["global_scale"] = calibrated.global_scale
    return compute_qparams(observer.update(observer.init(x), x), spec, **extra)


class _FakeQuantParametrization(torch.nn.Module):
    def __init__(self, qparams: QParams, spec, num_experts: int):
        super().__init__()
        self.qparams = qparams
        self.spec = spec
        self.num_experts = num_experts

    def forward(self, value: torch.Tensor) -> torch.Tensor:
        if self.num_experts:
            return torch.vmap(lambda w, qp: fake_quantize(w, qp, self.spec))(value, self.qparams)
        return fake_quantize(value, self.qparams, self.spec)


class _ActivationFakeQuant:
    """Fake-quantizes an activation site's floating-point tensors (others pass unchanged); for a
    site whose scales come at run time, under the scales of each tensor (`runtime_qparams`)."""

    def __init__(self, qparams: Optional[QParams], spec, runtime: bool):
        self.qparams, self.spec, self.runtime = qparams, spec, runtime

    def __call__(self, x):
        if not _is_float_tensor(x):
            return x
        if self.runtime:
            applied = runtime_spec(x, self.spec)
            return fake_quantize(x, runtime_qparams(x, applied, self.qparams), applied)
        return fake_quantize(x, self.qparams, self.spec)


@contextlib.contextmanager
def fake_quantized(model: torch.nn.Module, qparams: Mapping, recipe: Union[Recipe, Plan]):
    """Context manager: ``model`` computes with fake-quantized parameters and activations.

    Parameter sites get a ``torch.nn.utils.parametrize`` parametrization calling
    `qstats.fake_quantize` (straight-through gradient, usable for QAT); ``input``/``output``/
    ``q``/``k``/``v`` sites get forward hooks that fake-quantize the tensor. Everything is removed
    on exit, leaving the float parameters unchanged. Per-expert activation sites of stacked experts
    are not applied (they would need the experts' own forward). Activation sites whose scales come
    at run time (`qstats.recipe.runtime_scaled`; their qparams may be None) compute them from each
    tensor, as compressed-tensors' dynamic activations do: a ``memoryless_minmax`` of the tensor
    under the site's spec, two-level (NVFP4) group scales under the calibrated global scale.
    """
    plan = as_plan(recipe, model, "fake_quantized")
    handles: list = []
    parametrized: list = []
    try:
        for path, entry in qparams.items():
            if path not in plan.modules:
                raise ValueError(f"fake_quantized: the model has no module {path!r}")
            for site, qp in entry.items():
                _fake_quantize_site(plan, path, site, qp, handles, parametrized)
        yield model
    finally:
        for handle in handles:
            handle.remove()
        for module, site in reversed(parametrized):
            parametrize.remove_parametrizations(module, site, leave_parametrized=False)


def _fake_quantize_site(plan: Plan, path: str, site: str, qp, handles: list, parametrized: list) -> None:
    """Applies one site of `fake_quantized`: a parametrization of a parameter site (recorded in
    ``parametrized``), a hook replacing an activation site's tensor (recorded in ``handles``)."""
    found = plan.site(path, site)
    if found is None:
        raise ValueError(f"fake_quantized: the recipe observes no site {site!r} of module {path!r}")
    if qp is None and not found.runtime:
        raise ValueError(f"fake_quantized: qparams[{path!r}][{site!r}] is None; its spec needs QParams")
    module = plan.modules[path]
    if found.kind == "parameter":
        parametrization = _FakeQuantParametrization(qp, found.spec, found.num_experts)
        parametrize.register_parametrization(module, site, parametrization, unsafe=True)
        parametrized.append((module, site))
        return
    if found.num_experts:  # per-expert activations: they would need the experts' own forward
        return
    quantize = _ActivationFakeQuant(qp, found.spec, found.runtime)
    hooked = plan.hooked_module(path, site)
    if found.kind == "input":  # the tensor calibrate observed (`_input_tensor`)

        def pre_hook(module, args, kwargs):
            return _replace_input_tensor(args, kwargs, quantize)

        handles.append(hooked.register_forward_pre_hook(pre_hook, with_kwargs=True))
    elif found.kind == "output":  # the tensor calibrate observed (`_first_tensor`), also inside a tuple

        def post_hook(module, args, output):
            return _replace_first_tensor(output, quantize)[0]

        handles.append(hooked.register_forward_hook(post_hook))
    else:  # q/k/v: the child projection's output

        def projection_hook(child, args, output):
            return quantize(output)

        handles.append(hooked.register_forward_hook(projection_hook))
