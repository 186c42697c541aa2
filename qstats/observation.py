"""Observing a model's forward: hooks that thread each site's state through pure updates.

`observing(model, recipe)` yields an `Observing` session whose ``states`` tree its hooks update on
every forward run inside it; `qstats.calibrate` is a loop of forwards inside it. Per-expert sites
of stacked experts take one masked, vmapped update per experts call.

A compiled model (``torch.compile(model)``, ``model.compile()``) calibrates too: the recipe resolves
on the module the compiled wrapper holds (so sites keep the model's own paths), and the hooks run
eagerly (``torch.compiler.disable``): each site's update is then the eager one, and the hooks'
host-side work (masks, the states dict) makes dynamo neither trace nor recompile per site. The
hooks are made eager where they are registered (`qstats._torch_features.eager`): compile the model
before calibrating it; importing qstats does not import dynamo.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator, Mapping, NamedTuple, Optional, Union

import torch
from torch.nn.utils import parametrize

from ._attention import SiteHooks, attention_sites, site_weight
from ._checks import check_flag, is_instance_named
from ._granularity import PerAxis, PerGroup, PerTensor, qparam_shape
from ._ops import is_dtensor
from ._sites import input_tensor, is_float_tensor, observe_tensor
from ._torch_features import cached_parametrization, compiled, eager, recomputing
from .experts import (ExpertInputCapture, UncalibratedWarning, all_experts_calls, copies_of_tokens,
                      declared_experts, dense_expert_rows, dense_ids, dense_rows_weight, dispatch, ids_mask,
                      own_parameters, parameter_input_site, routed_slots, routing_mask, takes_routing,
                      unstacked_parameter_problem, warn_uncovered)
from .recipe import Plan, Recipe, as_plan
from .tree import assert_same_structure, leaves_with_paths
from ._warn import warn

__all__ = ["observing", "Observing"]


def resumed_states(states: Optional[Mapping], plan: Plan, caller: str) -> dict:
    """A copy (of the tree, not of its states) of resumed ``states``, the equal copies of a shared
    state made one again (`_rejoin_shared_copies`); TypeError, after ``caller``,
    where they are no ``{path: {site: state}}`` tree or None, ValueError naming the first site
    that ``plan`` does not observe."""
    if states is None:
        return {}
    if not isinstance(states, Mapping):
        raise TypeError(f"{caller}: states must be a dict {{path: {{site: state}}}} or None, got {type(states).__name__}")
    copied = {}
    for path, entry in states.items():
        if not isinstance(entry, Mapping):
            raise TypeError(f"{caller}: states[{path!r}] must be a dict {{site: state}}, got {type(entry).__name__}")
        for site in entry:
            if plan.site(path, site) is None:
                raise ValueError(f"{caller}: the given states hold site {site!r} of module {path!r}, which "
                                 "this recipe does not observe in this model")
        copied[path] = dict(entry)
    _rejoin_shared_copies(copied, plan)
    return copied


def _rejoin_shared_copies(states: dict, plan: Plan) -> None:
    """Puts one object under every key of a shared group (`Plan.state_keys`) whose resumed states
    are equal leaf for leaf: one state written under each key and saved (`qstats.save`) or merged
    across ranks comes back as equal copies, which `Plan.share_states` would merge with each other,
    counting every observation of the group twice (a histogram's counts, a hessian's sums)."""
    for owner in dict.fromkeys(plan.shared.values()):
        found = [states.get(path, {}).get(site) for path, site in plan.state_keys(*owner)]
        present = [state for state in found if state is not None]
        if len(present) > 1 and all(_equal_states(present[0], other) for other in present[1:]):
            for path, site in plan.state_keys(*owner):
                if site in states.get(path, {}):
                    states[path][site] = present[0]


def _equal_states(a, b) -> bool:
    """Whether two states have one structure and equal tensor leaves (NaN equal to NaN)."""
    try:
        assert_same_structure(a, b, name="state")  # shapes and dtypes too
    except ValueError:
        return False
    return all(_equal_leaves(x, y) for (_, x), (_, y) in zip(leaves_with_paths(a), leaves_with_paths(b)))


def _equal_leaves(x, y) -> bool:
    if not isinstance(x, torch.Tensor):  # other leaves: compared by `assert_same_structure`
        return True
    if x.device != y.device:
        return False
    if x.is_floating_point():
        return bool(((x == y) | (x.isnan() & y.isnan())).all())
    return torch.equal(x, y)


COMPRESSED_TENSORS_PARTIAL_GROUPS = (
    "compressed-tensors 0.19 cannot run dynamic group activations whose width the group size does not divide "
    "(its forward's compute_dynamic_scales_and_zp raises in unflatten: there is no smaller last group), although "
    "llm-compressor 0.14's oneshot calibrates such a model and writes a checkpoint that compressed-tensors cannot "
    "run; ignore the module or choose a group size that divides its input features"
)


def check_runtime_group(shape, spec, where: str) -> None:
    """ValueError, after ``where``, for a tensor of ``shape`` that the granularity of ``spec`` (a
    site whose scales come at run time) does not fit; for a compressed-tensors group size that does
    not divide the features, it says that compressed-tensors cannot run such activations either."""
    try:
        qparam_shape(shape, spec.granularity)
    except ValueError as error:
        if isinstance(spec.granularity, PerGroup) and spec.convention.name == "compressed_tensors":
            error = f"{error}; {COMPRESSED_TENSORS_PARTIAL_GROUPS}"
        raise ValueError(f"{where}: {error}") from None


def raise_renamed(error: Exception, where: str):
    """Raises ``error`` with ``where`` (the caller, module and site) in front of its message, once.

    An error its type rebuilds from that one message (``ValueError("...")``) is rebuilt, with the
    original's attributes and traceback, from the original. Any other (``UnicodeDecodeError``, an
    observer's own error taking other arguments) is raised itself, keeping its type and traceback,
    with ``where`` as a note (Python 3.11) or, before 3.11, as the RuntimeError it is raised from.
    """
    if str(error).startswith(where) or where in getattr(error, "__notes__", ()):
        raise error
    message = f"{where}: {error}"
    try:
        renamed = type(error)(message)
    except Exception:
        renamed = None
    if renamed is not None and renamed.args == (message,) and str(renamed) == message and error.args == (str(error),):
        renamed.__dict__.update(error.__dict__)
        raise renamed.with_traceback(error.__traceback__) from error
    if _HAS_NOTES:
        error.add_note(where)
    else:  # traceback prints the cause first: "RuntimeError: <where>", then the error itself
        site = RuntimeError(f"{where} (where the error below was raised)")
        site.__cause__, error.__cause__ = error.__cause__, site
    raise error


_HAS_NOTES = hasattr(BaseException, "add_note")  # Python 3.11


def _drop_masked_rows(x: torch.Tensor, weight: Optional[torch.Tensor], spec):
    """On CPU, a 0/1 observation mask whose rows can be dropped without changing the quantization
    parameter shape is applied by selecting the kept rows (the observer then takes its unmasked
    fast path); the statistics are the same as with the mask as ``weight``. Elsewhere (accelerators,
    where selecting rows would synchronise the host, or granularities indexed by rows) the mask is
    passed on as the update's ``weight``."""
    if weight is None or x.device.type != "cpu" or (
            weight.dtype != torch.bool and not bool(((weight == 0) | (weight == 1)).all())):
        return x, weight
    # Selecting rows flattens the masked leading dimensions into one: only valid when the
    # quantization parameters do not depend on those dimensions (they are reduced over), which
    # holds when changing their sizes leaves the qparam shape unchanged (PerAxis(1) on [B, T, H]
    # with T == H would otherwise pass a shape comparison and mix tokens with channels).
    lead, rest = weight.ndim, tuple(x.shape[weight.ndim :])
    try:
        want = qparam_shape(x.shape, spec.granularity)
        for resized in (tuple(size + 1 for size in x.shape[:lead]), (1,) * lead):  # partial blocks: ceil
            if qparam_shape(resized + rest, spec.granularity) != want:
                return x, weight
    except ValueError:
        return x, weight
    # the kept rows in one dimension, after size-1 ones: x's dimensions, so an axis counted from the start
    # (PerAxis(2) of [B, T, heads, head_dim]) still names the same one
    if not lead:  # one weight for the whole tensor (x[weight != 0] would add a dimension in front)
        selected = x if bool(weight != 0) else x[:0]
    else:
        selected = x[weight != 0]
        selected = selected.reshape((1,) * (lead - 1) + tuple(selected.shape))
    if qparam_shape(selected.shape, spec.granularity) != want:
        return x, weight
    return selected, None


def _unstacked_experts_problem(module: torch.nn.Module, site: str, found) -> Optional[str]:
    """Why a site the plan observes as one tensor (not per expert) would mix the experts of an
    experts module whose layout qstats does not stack, or None (`check_experts_layout`)."""
    if found.num_experts:
        return None
    if found.kind == "parameter":
        return unstacked_parameter_problem(module, site)
    if found.kind != "input":
        return None
    attribute, declared = declared_experts(module)
    experts = f"{declared} experts ({attribute})" if declared else "experts"
    if takes_routing(module):  # DBRX's DbrxExperts: the weights in a child
        return (f"its forward takes the routing, but it owns no parameter stacked over its {experts} as "
                "[E, ...], so its 'input' would be one state over every expert's tokens, not per expert (for "
                "one shared state, observe the input of the MoE block that calls it)")
    flat = [name for name in own_parameters(module) if declared and unstacked_parameter_problem(module, name)]
    if flat:  # DBRX's DbrxExpertGLU: called once per expert with slices of its flat parameters
        return (f"its parameters {flat} hold its {experts} unstacked, so its 'input' would be one state over "
                "every expert's rows, not per expert")
    return None


def check_experts_layout(plan: Plan, caller: str = "calibrate") -> None:
    """ValueError naming the first site of an experts module that would be observed as one tensor
    across its experts (`_unstacked_experts_problem`); a warning for a 3+-D parameter of a module that
    declares no expert count (nor is a convolution), observed as one tensor."""
    for path, entry in plan.sites.items():
        module = plan.modules[path]
        for site, found in entry.items():
            problem = _unstacked_experts_problem(module, site, found)
            if problem is not None:
                raise ValueError(f"{caller}: module {path!r} ({type(module).__name__}) site {site!r}: {problem}")
            if found.kind != "parameter" or found.num_experts or declared_experts(module)[1]:
                continue
            value = own_parameters(module)[site]
            if value.ndim >= 3 and not isinstance(module, torch.nn.modules.conv._ConvNd):
                warn(f"{caller}: parameter {site!r} of shape {tuple(value.shape)} of module {path!r} "
                     f"({type(module).__name__}) is observed as one tensor: if it stacks experts, give the "
                     "module an int num_experts attribute equal to its leading dimension to observe it per "
                     "expert")


class _Transposed(NamedTuple):
    """A weight stored transposed: its ``layout`` in words, and whether a spec's groups and blocks run
    along its output features (a Conv1D's; a transposed convolution's run along its kernel)."""

    layout: str
    grouped_across_outputs: bool


def _transposed_layout(module: torch.nn.Module) -> Optional[_Transposed]:
    """How ``module`` stores a weight transposed against the ``[out, in, ...]`` layout in which
    ``PerAxis(0)`` is per output channel (a Linear's, a convolution's, and the layout `qstats.qat`
    observes a transposed convolution's in): transformers' ``Conv1D`` (GPT-2's projections) and
    torch's transposed convolutions; None for any other module."""
    if is_instance_named(module, "transformers", "Conv1D"):
        return _Transposed("[in_features, out_features] (transformers' Conv1D, GPT-2's projections)", True)
    if isinstance(module, torch.nn.modules.conv._ConvTransposeNd):
        return _Transposed("[in_channels, out_channels / groups, *kernel] (a transposed convolution)", False)
    return None


def warn_transposed_weights(plan: Plan, caller: str) -> None:
    """Warns naming the weight sites of modules storing their weight transposed (`_transposed_layout`)
    whose spec reads the stored axes otherwise than per output channel: ``PerAxis(0)``, per output
    channel on a Linear or a convolution, is per input feature there, and a Conv1D's groups and blocks
    run along its output features. ``PerAxis(1)`` gives one scale per output channel (a grouped transposed
    convolution's: per channel of a group, shared by the groups); per tensor, the layout does not matter."""
    found: dict = {}  # (transposed, granularity) -> the paths it reads as stored
    for path, entry in plan.sites.items():
        site, module = entry.get("weight"), plan.modules[path]
        transposed = _transposed_layout(module) if site is not None and site.kind == "parameter" else None
        if transposed is None:
            continue
        granularity = site.spec.granularity
        if isinstance(granularity, PerAxis):  # the input axis; the others as on a Linear or a convolution
            stored = granularity.axis % module.weight.ndim == 0
        else:
            stored = transposed.grouped_across_outputs and not isinstance(granularity, PerTensor)
        if stored:
            found.setdefault((transposed, granularity), []).append(path)
    for (transposed, granularity), paths in found.items():
        more = f" and {len(paths) - 3} more" if len(paths) > 3 else ""
        warn(f"{caller}: the weight of module(s) {', '.join(map(repr, paths[:3]))}{more} is stored transposed, "
             f"{transposed.layout}, and {granularity!r} reads it as stored: PerAxis(0) gives one scale per input "
             "feature, not per output channel as on a Linear or a convolution"
             + (", and groups and blocks run along the output features" if transposed.grouped_across_outputs else "")
             + "; use PerAxis(1) for one scale per output channel")


def weight_of(x: torch.Tensor, weight: torch.Tensor, flattened: bool = False) -> Optional[torch.Tensor]:
    """A batch's observation ``weight`` as the weight of the tensor ``x`` (on its device), or None
    where it does not fit: when ``x`` starts with its dimensions and has more (the features), or
    (``flattened``: tokens of stacked experts; or ``x`` 2-D and the weight 2+-D: tokens flattened)
    has one row per weight entry."""
    prefix = weight.ndim < x.ndim and tuple(x.shape[: weight.ndim]) == tuple(weight.shape)
    # a strict prefix: the weighted dims are tokens, features follow (a pooled [batch, hidden]
    # with hidden == the padded length is not masked over its features); else the tokens
    # flattened: rows of stacked experts, or a 2-D [batch * tokens, features] (MoE blocks' routers
    # and shared experts take ``hidden_states.view(-1, hidden)``)
    flat = (flattened and x.ndim >= 1) or (x.ndim == 2 and weight.ndim >= 2)
    flattened = not prefix and flat and weight.numel() == x.shape[0]
    if not (prefix or flattened):
        return None
    return (weight.reshape(-1) if flattened else weight).to(x.device)


def check_observation_weight(weight, caller: str) -> None:
    """TypeError, after ``caller``, for an observation weight that is neither a tensor nor None; ValueError
    for one holding a negative, NaN or infinite value. A weight is a mask (0 leaves a row out, any other
    value keeps it once), so such values, which every observer would keep as rows, are refused by name."""
    if weight is None:
        return
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{caller}: the observation weight must be a tensor or None, got {type(weight).__name__}")
    if weight.is_complex():
        raise TypeError(f"{caller}: the observation weight must be a real (or bool) tensor, got {weight.dtype}")
    count = int(((weight < 0) | ~torch.isfinite(weight)).sum())  # integers and bools are finite
    if count:
        raise ValueError(f"{caller}: the observation weight of shape {tuple(weight.shape)} holds {count} "
                         "negative, NaN or infinite value(s); it is a mask: 0 leaves a row out, a positive "
                         "value keeps it (once, whatever its size)")


def autocast_off(device: torch.device):
    """A context disabling autocast on ``device`` where it is enabled (a model calibrated inside
    ``torch.autocast``): the hooks' observer updates (``hessian``'s ``X^T X``) then compute in their
    own dtypes, as outside autocast, not in the autocast dtype."""
    try:
        enabled = torch.is_autocast_enabled(device.type)
    except RuntimeError:  # a device type autocast does not know
        return contextlib.nullcontext()
    return torch.autocast(device.type, enabled=False) if enabled else contextlib.nullcontext()


def warn_unfitted(where: str, weight: Optional[torch.Tensor], offered: int, fitted: int) -> None:
    """Warns when a batch's observation ``weight`` was offered to ``offered`` activations and fitted
    none of them: nothing was left out."""
    if weight is not None and offered and not fitted:
        warn(f"{where}: the observation weight of shape {tuple(weight.shape)} fits no observed activation "
             "(it must be a prefix of their shapes with features after it, e.g. (batch, tokens)), so nothing "
             "was left out")


class _Calibration:
    """What the hooks of one `calibrate` call (or `observing` session: ``caller``, which names it in
    errors and warnings) share: the plan, the states tree the call builds and the current batch's
    observation weight (None between batches)."""

    def __init__(self, plan: Plan, states: dict, all_experts: bool = False, caller: str = "calibrate"):
        self.plan = plan
        self.caller = caller
        self.states = states
        self.all_experts = all_experts
        self.weight: Optional[torch.Tensor] = None
        self.weight_use = [0, 0]  # activations offered the current weight, and those it fitted
        self.discarded = 0  # extra experts calls of all_experts in progress: no other site observes inside them

    def weight_for(self, x: torch.Tensor, flattened: bool) -> Optional[torch.Tensor]:
        """The batch's observation weight as the weight of ``x`` (`weight_of`)."""
        if self.weight is None:
            return None
        self.weight_use[0] += 1
        weight = weight_of(x, self.weight, flattened)
        self.weight_use[1] += weight is not None
        return weight

    def experts_weight(self, rows: torch.Tensor, per_expert: Optional[int]) -> Optional[torch.Tensor]:
        """The observation weight of an experts call's input rows ``[N, F]``: the batch's weight per
        token (`weight_for`), or for dense rows ``[E * T, F]`` (``per_expert`` ``T``,
        `qstats.experts.dense_expert_rows`) `dense_rows_weight`, its zero rows left out but with
        ``all_experts`` (every expert observes every row, as llm-compressor's calibration gives it)."""
        if per_expert is None:
            return self.weight_for(rows, flattened=True)
        token_weight = self.weight_for(rows[:per_expert], flattened=True)
        return dense_rows_weight(rows, per_expert, token_weight, routed=not self.all_experts)

    def update(self, path: str, site: str, x: torch.Tensor, weight=None, like: Optional[torch.Tensor] = None):
        """``states[path][site] = observer.update(previous, x, weight)``, ``previous`` starting as
        ``observer.init(like)`` (``like`` defaults to ``x``), written under every key of a shared
        state (`Plan.state_keys`); a ValueError or TypeError (a tensor the spec cannot observe, a
        resumed state of another shape or observer) names the module and site."""
        observer = self.plan.sites[path][site].observer
        keys = self.plan.state_keys(path, site)
        try:
            with autocast_off(x.device):  # a model run under autocast: the observer's own precision
                previous = self.states.get(keys[0][0], {}).get(keys[0][1])
                if previous is None:
                    previous = observer.init(x if like is None else like)
                updated = observer.update(previous, x, weight)
        except (ValueError, TypeError) as error:
            raise_renamed(error, f"{self.caller}: module {path!r} site {site!r}")
        for key_path, key_site in keys:
            self.states.setdefault(key_path, {})[key_site] = updated


class ExpertCallHooks:
    """Hooks around each outermost forward of a stacked-experts module: ``start(module, args,
    kwargs)`` opens what the call needs, ``finish(module, started, output)`` gets it back at the
    end (``output`` None where the forward raised); a subclass defines both. Calls from inside the module's own
    forward are left to the outer call, whose capture sees their matmuls."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.active: list = []  # per call in progress: what `start` returned, None for a nested call

    def attach(self) -> list:
        return [self.module.register_forward_pre_hook(eager(self._enter), with_kwargs=True),
                self.module.register_forward_hook(eager(self._leave), with_kwargs=True, always_call=True)]

    def _enter(self, module, args, kwargs) -> None:
        self.active.append(None if self.active else self.start(module, args, kwargs or {}))

    def _leave(self, module, args, kwargs, output) -> None:
        if not self.active:  # a call whose earlier pre-hook raised
            return
        try:  # calls `finish` makes of the module are nested calls too
            if self.active[-1] is not None:  # not a nested call
                self.finish(module, self.active[-1], output)
        finally:
            self.active.pop()


class _SiteHook:
    """Base of the activation hooks: one site of one module, updated through the calibration."""

    def __init__(self, run: _Calibration, path: str, site: str):
        self.run, self.path, self.site = run, path, site
        self.found = run.plan.sites[path][site]
        self.where = f"{run.caller}: module {path!r} site {site!r}"

    def check_runtime_shape(self, shape) -> None:
        """A site whose scales come at run time (`runtime_scaled`) is observed per tensor, so its
        observer never meets the spec's granularity: the tensor's shape is checked against it here
        (a group size that does not divide the features would otherwise calibrate and export)."""
        if self.found.runtime:
            check_runtime_group(shape, self.found.spec, self.where)


class _ActivationSite(_SiteHook):
    """An ``input``/``output``/``q``/``k``/``v`` site of a module that is not stacked experts: the
    tensor `observe_tensor` finds (or `SiteHooks` hands it), weighted by the batch's observation weight."""

    def attach(self) -> list:
        return [observe_tensor(self.run.plan, self.path, self.site, eager(self.observe))]  # module docstring

    def observe(self, x, weighted: bool = True) -> None:
        """Updates the state with ``x``, weighted by the batch's observation weight where ``weighted``
        (not: the key and value of a cross-attention call, other tokens than the batch's)."""
        if not is_float_tensor(x) or recomputing() or self.run.discarded:
            return
        x = x.detach()
        self.check_runtime_shape(x.shape)
        weight = self.weight_for(x) if weighted else None
        kept, weight = _drop_masked_rows(x, weight, self.found.observer.spec or self.found.spec)
        self.run.update(self.path, self.site, kept, weight, like=x)

    def weight_for(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """The batch's observation weight as the weight of ``x`` (`weight_of`)."""
        return self.run.weight_for(x, flattened=False)


class _AttentionSite(_ActivationSite):
    """A q/k/v site of a transformers attention module: the tensor `SiteHooks` hands it in its spec's
    layout (`qstats._attention.per_head`), weighted by the batch's weight in that layout."""

    def weight_for(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        return site_weight(x, self.found.spec, lambda view: self.run.weight_for(view, flattened=False))


class _RoutedSite(_SiteHook):
    """A per-expert site of stacked experts, observed as rows shared by the experts and a mask."""

    def observe_rows(self, rows: torch.Tensor, mask: torch.Tensor) -> None:
        """One masked update: ``rows [N, ...]`` shared by the experts, ``mask [E, N]`` saying which
        rows each expert observes."""
        self.check_runtime_shape(rows.shape)
        if rows.device.type == "cpu" and not self.found.observer.shared_rows:
            x, weight = dispatch(rows, mask)
        else:  # every expert sees every (masked) row: no host read of the row counts, and
            # min/max observers reduce each row once for all experts
            x, weight = rows.expand(self.found.num_experts, *rows.shape), mask
        self.run.update(self.path, self.site, x, weight)


class _RoutedInputSite(_RoutedSite):
    """The ``"input"`` of stacked experts: the hidden states of each outermost call (`_ExpertSites`),
    each token observed by the experts the routing of the call (`routing_mask`) sends it to (by every
    expert with ``all_experts``), and not where the batch's observation weight is 0; a call passing
    dense per-expert rows instead of a routing (Llama 4) as `_observe_dense`."""

    def observe(self, args, kwargs) -> None:
        x = input_tensor(args, kwargs)
        if not is_float_tensor(x):
            return
        tokens = x.detach().reshape(-1, x.shape[-1])
        mask = routing_mask(args, kwargs, self.found.num_experts, tokens.shape[0])
        if mask is None:
            self._observe_dense(args, kwargs, tokens)
            return
        extra = self.run.weight_for(tokens, flattened=True)
        slots = None if self.run.all_experts else routed_slots(args, kwargs, self.found.num_experts, tokens.shape[0])
        if self.run.all_experts:  # every token observed by every expert
            mask = torch.ones_like(mask)
        elif slots is not None:  # a token listing an expert twice is two rows of its matmul: one per slot
            tokens, mask = tokens.repeat(slots.shape[1] // tokens.shape[0], 1), slots
            extra = None if extra is None else extra.repeat(slots.shape[1] // extra.shape[0])
        if extra is not None:
            mask = mask * (extra != 0).to(mask.dtype)
        self.observe_rows(tokens, mask)

    def _observe_dense(self, args, kwargs, rows: torch.Tensor) -> None:
        """A call without routing that passes dense per-expert rows ``[E * T, hidden]``
        (`qstats.experts.dense_expert_rows`): expert ``e`` observes its block's nonzero rows (the
        tokens routed to it, times their scores), with ``all_experts`` every row of the call."""
        num_experts = self.found.num_experts
        per_expert = dense_expert_rows(self.run.plan.modules[self.path], args, kwargs)
        if per_expert is None:
            raise ValueError(f"{self.run.caller}: cannot find the routing (an integer tensor [tokens, k] of "
                             f"selected experts) in the call of the experts module {self.path!r}, nor does "
                             "it pass dense per-expert rows [E * tokens, hidden] alone: where every expert "
                             "runs on the same tokens, observe the input of the module that calls it (one "
                             "state for all experts)")
        if self.run.all_experts:
            mask = rows.new_ones(num_experts, rows.shape[0], dtype=torch.float32)
        else:
            mask = ids_mask(dense_ids(num_experts, per_expert, rows.device), num_experts)
        weight = self.run.experts_weight(rows, per_expert)
        self.observe_rows(rows, mask if weight is None else mask * (weight != 0).to(mask.dtype))


class _ExpertSites(ExpertCallHooks):
    """The per-expert activation sites of one stacked-experts module, observed once per outermost
    call: its ``"input"`` (`_RoutedInputSite`, where the recipe has it) and its ``"<parameter>.input"``
    sites, from an `ExpertInputCapture` around the forward whose rows are observed under their expert
    ids, weighted by their tokens' observation weight. With ``all_experts``, rows come from extra
    calls routing every token to every expert (`qstats.experts.all_experts_calls`), whose outputs
    are discarded."""

    def __init__(self, run: _Calibration, path: str, routed_input: Optional[_RoutedInputSite], sites: list):
        super().__init__(run.plan.modules[path])
        self.run, self.path, self.routed_input = run, path, routed_input
        self.sites = {site: _RoutedSite(run, path, site) for site in sites}
        self.parameters = {site: parameter_input_site(site) for site in sites}

    def _start(self, module, x, per_expert: Optional[int] = None) -> tuple:
        """Enters a capture for one forward of the experts over the tokens ``x`` (dense per-expert rows,
        ``per_expert`` rows each, where given: `qstats.experts.dense_expert_rows`)."""
        tokens = x.numel() // x.shape[-1] if isinstance(x, torch.Tensor) and x.ndim and x.shape[-1] else 0
        weight = self.run.experts_weight(x.reshape(-1, x.shape[-1]), per_expert) if tokens else None
        names = set(self.parameters.values())
        if weight is not None:  # trace the tokens of the rows: through every stacked parameter
            names |= set(_stacked_names(module))
        capture, handles = expert_capture(module, names, x if weight is not None and x.ndim >= 2 else None)
        return capture, handles, tokens, weight

    def start(self, module, args, kwargs) -> tuple:
        """(capture, parametrization hooks, tokens, observation weight) of the call; with
        all_experts, (None, args, kwargs): observed from extra calls once the call is done; ()
        for a call that observes nothing (no such sites, or a recomputation in backward)."""
        if recomputing() or self.run.discarded:
            return ()
        if self.routed_input is not None:
            self.routed_input.observe(args, kwargs)
        if not self.sites:
            return ()
        if self.run.all_experts:
            return None, args, kwargs
        return self._start(module, input_tensor(args, kwargs), dense_expert_rows(module, args, kwargs))

    def finish(self, module, started: tuple, output) -> None:
        if not started:
            return
        if started[0] is None:
            if output is not None:
                self._observe_all_experts(module, *started[1:])
            return
        stop_capture(*started[:2])
        if output is None:  # the forward raised
            return
        for site, (rows, mask) in self._rows(module, started[0], *started[2:]).items():
            self.sites[site].observe_rows(rows, mask)

    def _observe_all_experts(self, module, args: tuple, kwargs: dict) -> None:
        x = input_tensor(args, kwargs)
        if not is_float_tensor(x):
            return
        num_experts = next(iter(self.sites.values())).found.num_experts
        calls = all_experts_calls(args, kwargs, num_experts, x.numel() // x.shape[-1], module)
        if calls is None:
            raise ValueError(f"{self.run.caller}: all_experts: cannot find the routing (an integer tensor "
                             "[tokens, k] of selected experts) in the call of the experts module "
                             f"{self.path!r}")
        tokens_as: dict = {}  # dtype -> the call's tokens [T, F] in it: what each expert's copy is compared to

        def as_rows(dtype: torch.dtype) -> torch.Tensor:  # converted once per dtype, not per call and site
            if dtype not in tokens_as:
                tokens_as[dtype] = x.detach().reshape(-1, x.shape[-1]).to(dtype)
            return tokens_as[dtype]

        found: dict = {}  # site -> [(rows, mask)] of every call: each expert is in one call only
        for call_args, call_kwargs in calls:
            call_x = input_tensor(call_args, call_kwargs)  # the tokens, or (dense rows) their blocks per expert
            per_expert = dense_expert_rows(module, call_args, call_kwargs)
            capture, handles, tokens, weight = self._start(module, call_x, per_expert)
            self.run.discarded += 1  # the sites of its children observe the model's own forward only
            try:
                with torch.no_grad():  # no hooks of the module: only the capture watches it
                    module.forward(*call_args, **call_kwargs)
            finally:
                self.run.discarded -= 1
                stop_capture(capture, handles)
            for site, rows_mask in self._rows(module, capture, tokens, weight, as_rows).items():
                found.setdefault(site, []).append(rows_mask)
        for site, parts in found.items():  # one update per site: the masks keep each expert's rows
            rows, masks = zip(*parts)
            if any(all(part is shared for part in rows) for shared in tokens_as.values()):  # no copies
                self.sites[site].observe_rows(rows[0], sum(masks))
            else:
                self.sites[site].observe_rows(torch.cat(rows), torch.cat(masks, dim=1))

    def _rows(self, module, capture: ExpertInputCapture, tokens: int, weight, as_rows=None) -> dict:
        """``{site: (rows, mask [E, rows])}`` of the float rows a finished capture holds. With
        ``as_rows(dtype)`` (the call's tokens in a dtype, under ``all_experts``), rows that are each
        expert's copy of the tokens come back as those tokens once."""
        out = {}
        for site, hook in self.sites.items():
            name = self.parameters[site]
            captured = capture.captured(name)
            if captured is None:
                if tokens:
                    raise ValueError(
                        f"{self.run.caller}: site {site!r} of the experts module {self.path!r} "
                        f"({type(module).__name__}): no per-expert matmul with the stacked parameter "
                        f"{name!r} was found in its forward (recognised: F.linear/matmul with a slice "
                        f"{name}[e], bmm with a gathered {name}[ids], grouped_mm over {name})"
                        + unrecognisable_slices_cause(module, [name])
                    )
                continue
            rows, ids = captured
            if not rows.is_floating_point():
                continue
            num_experts = hook.found.num_experts
            experts = None if as_rows is None else copies_of_tokens(rows, ids, as_rows(rows.dtype), num_experts)
            if experts is not None:  # the tokens once, each expert keeping the unweighted-out ones
                rows = as_rows(rows.dtype)
                mask = experts[:, None].float().expand(num_experts, rows.shape[0])
                kept = None if weight is None else weight != 0
            else:
                mask = ids_mask(ids, num_experts)
                named = f"{self.run.caller}: the rows of site {site!r} of the experts module {self.path!r}"
                kept = None if weight is None else kept_rows(capture, name, weight, named)
            out[site] = (rows, mask if kept is None else mask * kept.to(mask.dtype))
        return out


def unrecognised_sites_error(caller: str, missing: list, path: str, module: torch.nn.Module,
                             recognised: str) -> ValueError:
    """The ValueError of ``caller`` (`fake_quantized`, `report`) for input sites ``missing`` of the
    experts module at ``path`` whose per-expert matmul its forward did not make recognisably, with
    the cause where the stacked parameters' layout rules every form out (`unrecognisable_slices_cause`)."""
    return ValueError(
        f"{caller}: site(s) {missing} of the experts module {path!r} ({type(module).__name__}): no per-expert "
        f"matmul taking that input was found in its forward (recognised calls: {recognised})"
        + unrecognisable_slices_cause(module, _stacked_names(module))
    )


def _stacked_names(module: torch.nn.Module) -> list:
    """The names of the parameters ``module`` owns of 3+ dimensions: its stacked experts' weights."""
    return [name for name, p in own_parameters(module).items() if p.ndim >= 3]


def unrecognisable_slices_cause(module: torch.nn.Module, names) -> str:
    """``"; the cause: ..."`` when no per-expert matmul with the stacked parameters ``names`` of
    ``module`` can be recognised whatever its forward does: several experts in one memory (stride 0
    over the expert dim, as ``expand`` makes: ``P[e]`` is the same tensor for every expert), or a
    parameter offloaded by accelerate (meta outside the call, another tensor inside); else ``""``."""
    params = own_parameters(module)
    shared = [name for name in names if name in params and params[name].ndim
              and params[name].shape[0] > 1 and params[name].stride(0) == 0]
    if shared:
        return (f"; the cause: the experts of {shared} share one memory (stride 0 over the expert dimension, "
                "as expand() makes), so no slice of them can be told apart as one expert's; give each expert "
                "its own copy (e.g. torch.nn.Parameter(p.contiguous()))")
    offloaded = [name for name in names if name in params and params[name].device.type == "meta"]
    if offloaded and getattr(module, "_hf_hook", None) is not None:
        return (f"; the cause: {offloaded} are offloaded by accelerate (meta tensors the hook replaces by "
                "other tensors inside each call), so their slices cannot be recognised; load the experts "
                "without offloading")
    return ""


def kept_rows(capture: ExpertInputCapture, name: str, weight: torch.Tensor, rows_named: str) -> torch.Tensor:
    """``[rows]``: 1 where the token a captured row of parameter ``name`` comes from has a nonzero
    observation weight; all ones, with a warning naming ``rows_named``, when the rows cannot be
    traced to their tokens."""
    tokens = capture.row_tokens(name)
    if tokens is None:
        warn(f"{rows_named} could not be traced back to the tokens they come from, so the observation weight "
             "(padding) is not applied to them")
        rows = capture.rows[name]
        return torch.ones(sum(r.shape[0] for r in rows), dtype=torch.bool, device=rows[0].device)
    return weight.reshape(-1).to(tokens.device)[tokens] != 0


def expert_capture(module: torch.nn.Module, names, tokens: Optional[torch.Tensor], replace=None) -> tuple:
    """``(capture, handles)``: an entered `ExpertInputCapture` of ``module``'s parameters ``names``
    (``tokens`` and ``replace`` as there) and the hooks feeding it; leave with `_stop`."""
    params = own_parameters(module)
    capture = ExpertInputCapture({name: params[name] for name in names}, tokens=tokens, replace=replace)
    # inside `qstats.fake_quantized`: each value the forward computes (and slices) is watched, as
    # the parameter's
    found = set(names) & set(module.parametrizations) if parametrize.is_parametrized(module) else ()
    handles = [module.parametrizations[name].register_forward_hook(
        lambda _, args, value, name=name: capture.watch(name, value)) for name in found]
    capture.__enter__()
    for name in found:  # inside parametrize.cached(), a value computed by an earlier call runs no hook
        cached = cached_parametrization(module, name)
        if cached is not None:
            capture.watch(name, cached)
    return capture, handles


def capture_call(module: torch.nn.Module, args, kwargs, replace=None) -> tuple:
    """``(capture, handles, tokens)`` for one call of the stacked-experts ``module``'s forward
    with ``args``/``kwargs``: `expert_capture` of all its stacked parameters, tracing the rows to
    ``tokens``, the call's float input ``[..., hidden]`` (None where it has none)."""
    x = input_tensor(args, kwargs)
    tokens = x if is_float_tensor(x) and x.ndim >= 2 and x.numel() else None
    return (*expert_capture(module, _stacked_names(module), tokens, replace), tokens)


def stop_capture(capture: ExpertInputCapture, handles: list) -> None:
    """Leaves a capture and removes the hooks that fed it."""
    capture.__exit__(None, None, None)
    for handle in handles:
        handle.remove()


def _attention_observers(run: _Calibration) -> dict:
    """``{path: (module, SiteHooks)}`` of the plan's transformers attention modules with q/k/v
    sites (`_activation_hooks` leaves those sites to them); the key and value of a cross-attention
    call are observed without the batch's observation weight, which describes the query's tokens."""
    out = {}
    for path, entry in run.plan.sites.items():
        sites = {site: _AttentionSite(run, path, site) for site in entry if run.plan.attention_argument(path, site)}
        if sites:
            observers = {site: hook.observe for site, hook in sites.items()}
            other_tokens = {site: functools.partial(hook.observe, weighted=False) for site, hook in sites.items()}
            specs = {site: entry[site].spec for site in sites}
            out[path] = (run.plan.modules[path], eager(SiteHooks(observers, specs, other_tokens)))
    return out


def _activation_hooks(run: _Calibration) -> list:
    """One hook object per activation site of the plan (one per stacked-experts module for its
    per-expert sites), in ``named_modules`` order; the q/k/v sites of transformers attention modules
    are `_attention_observers`'."""
    hooks: list = []
    for path, entry in run.plan.sites.items():
        matmul_inputs, routed_input = [], None
        for site, found in entry.items():
            if found.kind == "parameter_input":
                matmul_inputs.append(site)
            elif found.kind == "input" and found.num_experts:
                routed_input = _RoutedInputSite(run, path, site)
            elif run.plan.attention_argument(path, site):
                continue
            elif found.kind != "parameter":
                hooks.append(_ActivationSite(run, path, site))
        if matmul_inputs or routed_input is not None:
            hooks.append(_ExpertSites(run, path, routed_input, matmul_inputs))
    return hooks


def parameter_value(plan: Plan, path: str, site: str, caller: str) -> torch.Tensor:
    """The value of a parameter site, read onto its execution device where accelerate offloads it
    (``cpu_offload``, ``device_map`` with offloading: the module holds a meta tensor, its hook the
    data); ValueError naming it where it is on the meta device with no data behind it. A DTensor (a
    parameter of FSDP2's ``fully_shard`` between forwards, a tensor-parallel one) is read whole, with
    ``full_tensor()``: a collective, so every rank of its mesh reads it, in the same order."""
    module = plan.modules[path]
    if isinstance(getattr(module, site, None), torch.nn.parameter.UninitializedTensorMixin):
        raise ValueError(f"{caller}: parameter {site!r} of module {path!r} ({type(module).__name__}) is not "
                         "initialized yet (a lazy module makes it at its first forward): run the model once on "
                         "one batch first")
    value = plan.parameter(path, site)
    if is_dtensor(value):
        return value.full_tensor()
    if value.device.type != "meta":
        return value
    if getattr(module, "_hf_hook", None) is not None:
        from accelerate.utils import align_module_device  # the hook's own onloading

        with align_module_device(module):
            value = plan.parameter(path, site)  # keeps the onloaded data once the hook offloads again
    if value.device.type == "meta":
        layerwise = ", or qstats.calibrate_layerwise for a model built on meta" if caller != "report" else ""
        raise ValueError(f"{caller}: parameter {site!r} of module {path!r} is on the meta device and holds "
                         f"no data (load the weights first{layerwise})")
    return value


def _observe_parameters(run: _Calibration) -> None:
    """Observes each parameter site once, before the first batch; a resumed state of one is
    checked against the parameter and kept."""
    with torch.no_grad():
        for path, entry in run.plan.sites.items():
            for site, found in entry.items():
                if found.kind != "parameter":
                    continue
                value = parameter_value(run.plan, path, site, run.caller)
                resumed = run.states.get(path, {}).get(site)
                if resumed is None:
                    run.update(path, site, value)
                    continue
                try:
                    assert_same_structure(resumed, found.observer.init(value), name="state")
                except ValueError as error:
                    raise ValueError(f"{run.caller}: the given states[{path!r}][{site!r}] is not a "
                                     f"{found.observer.name} state of that parameter (shape "
                                     f"{tuple(value.shape)}): {error}") from None


class Observing:
    """A calibration in progress (`observing` yields it): ``states`` is the tree the hooks update,
    ``{module_path: {site: state}}``; ``calls`` counts the model's forwards so far."""

    def __init__(self, run: _Calibration):
        self._run = run
        self.calls = 0

    @property
    def states(self) -> dict:
        return self._run.states

    @property
    def plan(self) -> Plan:
        return self._run.plan

    @contextlib.contextmanager
    def weighted(self, weight: Optional[torch.Tensor], fits: Optional[list] = None) -> Iterator[None]:
        """Forwards run inside use ``weight`` (e.g. the attention mask) as the observation weight
        of activation updates whose tensor starts with its dimensions: padding is not observed.
        ``fits``: a list to which ``(activations offered the weight, those it fitted)`` is appended,
        instead of the warning that it fitted none (a caller observing the model in parts adds them up)."""
        check_observation_weight(weight, self._run.caller)
        previous, previous_use = self._run.weight, self._run.weight_use  # a nested `weighted` keeps the outer's
        self._run.weight, self._run.weight_use = weight, [0, 0]
        try:
            yield
        finally:
            offered, fitted = self._run.weight_use
            self._run.weight, self._run.weight_use = previous, previous_use
            if fits is None:
                warn_unfitted(self._run.caller, weight, offered, fitted)
            else:
                fits.append((offered, fitted))

    def _count(self, module, args) -> None:
        if not recomputing():
            self.calls += 1


@contextlib.contextmanager
def observing(model: torch.nn.Module, recipe: Union[Recipe, Plan], states: Optional[Mapping] = None, *,
              all_experts: bool = False) -> Iterator[Observing]:
    """Context manager: every forward of ``model`` run inside updates the recipe's states.

    For users who drive the forward themselves (their own loop, a sequential pipeline);
    `qstats.calibrate` is this plus a loop over batches, and ``states`` / ``all_experts`` mean what
    they mean there. ``model`` may be compiled (``torch.compile(model)``): the recipe resolves on
    the module it wraps, so sites keep the model's own paths. Parameter sites are observed on entry; the hooks are removed on exit, where
    a warning (`qstats.UncalibratedWarning`) names the activation sites that saw no data.

    >>> import torch, qstats
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    >>> recipe = qstats.Recipe([qstats.Rule("Linear", sites=("weight", "input"))])
    >>> with qstats.observing(model, recipe) as session, torch.no_grad():
    ...     for x in torch.randn(3, 5, 4):
    ...         _ = model(x)
    >>> sorted(session.states["0"]), session.calls
    (['input', 'weight'], 3)
    """
    with observing_as("observing", model, recipe, states, all_experts) as session:
        yield session


@contextlib.contextmanager
def observing_as(caller: str, model: torch.nn.Module, recipe: Union[Recipe, Plan], states: Optional[Mapping],
                 all_experts: bool, warn_unseen: bool = True, checks_plan: bool = True) -> Iterator[Observing]:
    """`observing`, its errors and warnings named after ``caller`` (``"calibrate"`` for `qstats.calibrate`);
    ``warn_unseen=False``: without the warnings of sites that saw no data (`warn_unobserved`: a partial
    pass whose caller warns of the whole tree once); ``checks_plan=False``: without the checks of the
    model and the plan alone (`check_experts_layout`, `warn_transposed_weights`), which the caller ran
    once on the whole model's plan (`calibrate_layerwise`, whose passes each observe one layer's part)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{caller} expects an nn.Module, got {type(model).__name__}")
    check_flag(all_experts, "all_experts", caller)
    plan = as_plan(recipe, model, caller)
    resumed = resumed_states(states, plan, caller)
    run = _Calibration(plan, plan.share_states(resumed), all_experts=all_experts, caller=caller)
    if checks_plan:
        check_experts_layout(plan, caller)
        warn_transposed_weights(plan, caller)
    _observe_parameters(run)
    session = Observing(run)
    handles = [plan.model.register_forward_pre_hook(eager(session._count))]
    try:
        handles += [handle for hook in _activation_hooks(run) for handle in hook.attach()]
        with attention_sites(_attention_observers(run), caller):
            yield session
    finally:
        run.weight = None
        for handle in handles:
            handle.remove()
    if warn_unseen:
        warn_unobserved(run.states, plan, session.calls, compiled=compiled(model))


def warn_unobserved(states: dict, plan: Plan, seen_batches: int, compiled: bool = False) -> None:
    """Warns (`qstats.UncalibratedWarning`) naming the activation sites the recipe selects that hold
    no state after calibration over ``seen_batches`` forwards: `compute_qparams_tree` and
    `fake_quantized` would leave them out; then (`warn_uncovered`) the stacked experts that got no token.
    For a ``compiled`` wrapper whose forwards were not seen, it names the graph compiled before the hooks."""
    _warn_missing(states, plan, seen_batches, compiled)
    warn_uncovered(states, plan.sites)


def _warn_missing(states: dict, plan: Plan, seen_batches: int, compiled: bool) -> None:
    missing = [f"{path}.{site}" for path, entry in plan.sites.items() for site, found in entry.items()
               if site not in states.get(path, {}) and found.kind != "parameter"]
    if not missing:
        return
    why = ("the model was not run" if seen_batches == 0
           else "their modules were not called, or not with a floating-point tensor")
    if seen_batches == 0 and compiled:
        why += ("; or, if it was, a torch.compile'd model that ran before the hooks were registered runs a graph "
                "calling no hook added later: call torch.compiler.reset() first")
    warn(f"qstats: {len(missing)} site(s) of the recipe saw no data ({why}) and have no state; "
         f"compute_qparams_tree and fake_quantized leave them out: " + ", ".join(missing),
         UncalibratedWarning)
