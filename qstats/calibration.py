"""Calibrating a torch model: run it over batches inside `qstats.observing`, and use the states.

`calibrate` returns a plain nested dict ``{module_path: {site: state}}`` of NamedTuples of
tensors, ready for `qstats.save`, merges across ranks and `compute_qparams_tree`;
`fake_quantized` makes the model compute with the resulting qparams.
"""

from __future__ import annotations

import collections.abc
import contextlib
import sys
from typing import Any, Callable, Iterable, Mapping, Optional, Union

import torch
from torch.nn.utils import parametrize
from tqdm.auto import tqdm

from ._attention import SiteHooks, attention_sites
from ._checks import check_flag
from ._formats import COMPUTE_DTYPE_NAMES, global_scale_from_amax
from ._granularity import TensorGroup
from ._ops import is_dtensor
from ._qparams import QParams, check_calibrated, compute_qparams, experts_qparams, per_expert_qparams
from ._quant import fake_quantize
from ._sites import is_float_tensor, replace_first_tensor, replace_input_tensor, run_model
from .experts import UncalibratedWarning, linearized_layout_problem, own_parameters, rows_by_expert, stacked_qparams
from .fused import fused_amax
from .observers import memoryless_minmax
from .observers.mse import MSEState, stopped_per_part
from .observation import (ExpertCallHooks, Observing, capture_call, check_observation_weight,
                          check_runtime_group, observing_as, raise_renamed, stop_capture, unrecognised_sites_error)
from .recipe import Plan, Recipe, as_plan, gate_up_halves, stack_shapes
from ._warn import warn

__all__ = ["calibrate", "compute_qparams_tree", "fake_quantized", "runtime_qparams", "runtime_spec"]


def check_batches(batches, caller: str, observation_weight=None) -> None:
    """TypeError when ``batches`` is one batch (a Tensor, a mapping or a string) rather than an
    iterable of batches: iterating it would run the model on its rows, its keys or its characters;
    or when ``observation_weight`` is neither None nor a callable."""
    if observation_weight is not None and not callable(observation_weight):
        got = type(observation_weight).__name__
        raise TypeError(f"{caller}: observation_weight must be a callable(batch) -> tensor or None, got {got}")
    if isinstance(batches, torch.Tensor):
        got = "Tensor"
    elif isinstance(batches, Mapping):
        got = "dict" if type(batches) is dict else f"dict ({type(batches).__name__})"
    elif isinstance(batches, (str, bytes)):  # iterated, the model would be called on each character
        got = type(batches).__name__
    elif not isinstance(batches, collections.abc.Iterable) and not hasattr(type(batches), "__getitem__"):
        # None, a number: Python's own error ("'NoneType' object is not iterable") names no argument
        raise TypeError(f"{caller}: batches must be an iterable of batches, got {type(batches).__name__}")
    else:
        return
    raise TypeError(f"{caller}: batches must be an iterable of batches (got a single {got}); wrap one batch in a list")


# float attributes by which modules drop out (or add noise) while training, with no dropout module:
# transformers' attention (``attention_dropout``, Llama family), BART/Whisper/Marian layers (``dropout``,
# ``activation_dropout``, ``layerdrop``: whole layers skipped), stochastic depth (``drop_prob``:
# transformers' ``*DropPath``, timm's ``DropPath``; LeViT's ``drop_rate``), torch's ``MultiheadAttention``
# (``dropout``) and MoE blocks scaling their hidden states by uniform noise (``jitter_noise``: Mixtral,
# MiniMax, Switch Transformers; ``input_jitter_noise``: PhiMoE; ``moe_jitter_eps``: DBRX's router) or
# sampling their experts (``router_jitter_noise``: PhiMoE's router, whose sparsemixer draws each token's
# experts among those within twice that of its best while training)
_DROPOUT_RATES = ("dropout", "attention_dropout", "activation_dropout", "layerdrop", "drop_prob", "drop_rate",
                  "jitter_noise", "input_jitter_noise", "moe_jitter_eps", "router_jitter_noise")


def _drops_out(module: torch.nn.Module) -> bool:
    """Whether ``module`` behaves differently in training mode: a dropout (p > 0) or batch norm, an
    instance norm tracking running statistics (it updates them and normalises by each instance's),
    ``RReLU`` (random negative slopes), a multi-layer ``RNN``/``LSTM``/``GRU`` with dropout (between
    its layers), or a module holding one of `_DROPOUT_RATES` as a float > 0."""
    kinds = (torch.nn.modules.dropout._DropoutNd, torch.nn.modules.batchnorm._BatchNorm, torch.nn.RReLU)
    if isinstance(module, kinds):
        return getattr(module, "p", 1.0) > 0
    if isinstance(module, torch.nn.modules.instancenorm._InstanceNorm):
        return bool(module.track_running_stats)
    if isinstance(module, torch.nn.RNNBase):  # one layer: torch applies no dropout
        return module.dropout > 0 and module.num_layers > 1
    rates = [getattr(module, name, None) for name in _DROPOUT_RATES]
    return any(isinstance(rate, float) and rate > 0 for rate in rates)


def warn_training_mode(model: torch.nn.Module, caller: str) -> None:
    """Warns naming the first module of `_drops_out` in training mode: calibration would observe
    dropped-out activations (and update batch- or instance-norm running statistics)."""
    for path, module in model.named_modules():
        if module.training and _drops_out(module):
            warn(f"{caller}: module {path!r} ({type(module).__name__}) is in training mode, so the "
                 "statistics observe its training behaviour (dropout, batch statistics, random slopes); call "
                 "model.eval() first")
            return


def batch_weight(observation_weight: Optional[Callable], batch, caller: str) -> Optional[torch.Tensor]:
    """``observation_weight(batch)`` (None without one); TypeError, after ``caller``, where it
    returns something else than a tensor or None, ValueError where it holds a negative, NaN or
    infinite value (`check_observation_weight`)."""
    weight = observation_weight(batch) if observation_weight is not None else None
    if weight is not None and not isinstance(weight, torch.Tensor):
        got = type(weight).__name__
        raise TypeError(f"{caller}: observation_weight(batch) must return a tensor or None, got {got}")
    check_observation_weight(weight, f"{caller}: observation_weight(batch)")
    return weight


COMPILED_BEFORE_HOOKS = (
    "a torch.compile'd model that ran before the observation hooks were registered keeps running its compiled "
    "graph, which calls no hook added later (dynamo does not guard on module hooks); call torch.compiler.reset() "
    "before calibrating, or compile the model without running it first"
)


FULLGRAPH_REFUSES_HOOKS = (
    "a model compiled with fullgraph=True cannot call the observation hooks: they run eagerly "
    "(torch.compiler.disable, a graph break at each observed site), and fullgraph refuses every graph break; "
    "calibrate the model uncompiled (the module a torch.compile wrapper holds) or compiled without fullgraph=True"
)


def _refuses_eager_hooks(error: Exception) -> bool:
    """Whether ``error`` is dynamo refusing to call a ``torch.compiler.disable``'d function (the
    observation hooks) under ``fullgraph=True``; dynamo is loaded wherever a compiled model ran."""
    exc = sys.modules.get("torch._dynamo.exc")
    return exc is not None and isinstance(error, exc.Unsupported) and "torch.compiler.disable" in str(error)


def _run_batches(session: Observing, model, batches: Iterable, progress: bool, observation_weight,
                 fits: Optional[list] = None) -> int:
    """Runs ``model`` (the plan's model, or its compiled wrapper) over ``batches`` inside
    ``session``, with each one's observation weight (``fits``: `Observing.weighted`'s); returns how
    many batches ran."""
    try:  # a DataLoader over an IterableDataset has __len__ but raises TypeError
        total = len(batches)
    except TypeError:
        total = None
    ran = 0
    with torch.no_grad(), tqdm(batches, total=total, unit="batch", desc="qstats.calibrate", disable=not progress) as bar:
        for batch in bar:
            ran += 1
            weight = batch_weight(observation_weight, batch, "calibrate")
            with session.weighted(weight, fits):
                try:
                    run_model(model, batch)
                except Exception as error:
                    if _refuses_eager_hooks(error):
                        raise ValueError(f"calibrate: {FULLGRAPH_REFUSES_HOOKS}") from error
                    raise
    return ran


def calibrate(model: torch.nn.Module, batches: Iterable, recipe: Union[Recipe, Plan],
              states: Optional[Mapping] = None, progress: bool = True,
              observation_weight: Optional[Callable[[Any], Optional[torch.Tensor]]] = None,
              all_experts: bool = False) -> dict:
    """Observer states of ``model`` over ``batches``, per module path and site.

    Args:
      model: an ``nn.Module``, run as is (call ``model.eval()`` first: dropout or batch norm in
        training mode warns), under ``torch.no_grad()``;
        a compiled one (``torch.compile(model)``) runs compiled, each update the eager one (on the
        compiled activations, which can differ from eager's in the last bits). The sites of a
        wrapped model (``torch.compile``, ``DistributedDataParallel``, ``DataParallel``) are named
        by the paths of the bare model it wraps.
      batches: an iterable of batches: a tensor (``model(batch)``), a tuple or list
        (``model(*batch)``) or a mapping (``model(**batch)``).
      recipe: a `Recipe` saying which observer and spec watch which module and site, or its
        `Plan` on ``model`` (``recipe.resolve(model)``).
      states: a states tree returned by an earlier call, to continue from (resume). Its sites are
        not re-initialised and its parameter sites are not observed again, so calibrating ``A``
        then ``B`` from the returned states equals calibrating ``A + B`` at once.
      progress: show a tqdm progress bar (batches and batches per second).
      observation_weight: optional ``callable(batch) -> tensor``, e.g. the attention mask: the
        ``weight`` of activation updates whose tensor starts with its dimensions (or is 2-D, one
        row per entry: the tokens flattened), so padding is not observed; ``"<parameter>.input"``
        rows are traced back to their tokens (a warning says when they cannot be).
      all_experts: per-expert sites of stacked experts observe every token, not only the routed
        ones (llm-compressor's ``moe_calibrate_all_experts``); the model's outputs are unchanged.

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
    check_batches(batches, "calibrate", observation_weight)
    check_flag(all_experts, "all_experts", "calibrate")
    check_flag(progress, "progress", "calibrate")
    plan = as_plan(recipe, model, "calibrate")
    warn_training_mode(plan.model, "calibrate")
    return observe_batches(model, batches, plan, states, progress, observation_weight, all_experts)


def observe_batches(model: torch.nn.Module, batches: Iterable, plan: Plan, states: Optional[Mapping],
                    progress: bool, observation_weight, all_experts: bool, warn_unseen: bool = True,
                    checks_plan: bool = True, fits: Optional[list] = None) -> dict:
    """`calibrate` after its checks and its training-mode warning (`calibrate_layerwise` runs one
    layer at a time through it, having warned of the whole model once); ``warn_unseen`` and
    ``checks_plan``: `observing_as`'s; ``fits``: each batch's `Observing.weighted` counts, appended."""
    with observing_as("calibrate", model, plan, states, all_experts, warn_unseen, checks_plan) as session:
        ran = _run_batches(session, model, batches, progress, observation_weight, fits)
        if ran and not session.calls:  # the model's own forward pre-hook never ran
            raise ValueError(f"calibrate: the model ran {ran} batch(es) but none of its hooks ran: "
                             f"{COMPILED_BEFORE_HOOKS}")
    return session.states


def compute_qparams_tree(states: Mapping, recipe: Union[Recipe, Plan],
                         model: Optional[torch.nn.Module] = None, *, fuse: bool = True, **options) -> dict:
    """``{path: {site: QParams}}`` for a states tree, with each site's spec and ``qparams_kwargs``.

    Args:
      states: a states tree from `calibrate`.
      recipe: a `Recipe` (with ``model``) or a `Plan`.
      fuse: two-level (NVFP4) weights of each fused group (q/k/v, gate/up) share one global
        scale, as vLLM needs (over each member's range under its own observer, as llm-compressor);
        a warning names a group whose specs differ, which keep their own.
      options: override the sites' ``qparams_kwargs``.

    Returns:
      Stacked-expert sites have a leading expert dimension and ``calibrated`` as coverage mask.
      Run-time scaled activation sites (`qstats.recipe.runtime_scaled`) get None, or for a
      two-level spec QParams holding the calibrated global scale.

    Raises:
      ValueError: naming the module and site, for data-less entries under
        ``on_uncalibrated="raise"`` (``"fallback"`` gives scale 1, zero point 0).
      TypeError: ``fuse`` that is not a bool.
    """
    plan = as_plan(recipe, model, "compute_qparams_tree")
    check_flag(fuse, "fuse", "compute_qparams_tree")
    out = qparams_unwarned(states, plan, fuse, options)
    _warn_uncalibrated(out, plan)
    return out


def qparams_unwarned(states: Mapping, plan: Plan, fuse: bool = True, options: Optional[dict] = None) -> dict:
    """`compute_qparams_tree` without its warning of sites that saw no data: for layer-by-layer runs,
    whose user's own call on the whole tree warns once (not once per layer)."""
    options = options or {}
    if not isinstance(states, Mapping) or not all(isinstance(entry, Mapping) for entry in states.values()):
        got = type(states).__name__ if not isinstance(states, Mapping) else "a module entry that is not a dict"
        raise TypeError(f"compute_qparams_tree: states must be a tree {{path: {{site: state}}}} (calibrate's), got {got}")
    out: dict = {}
    for path, entry in states.items():
        out[path] = {}
        for site, state in entry.items():
            found = plan.site(path, site)
            if found is None:
                raise ValueError(f"compute_qparams_tree: the recipe observes no site {site!r} of module {path!r}")
            state = _stopped_per_projection(state, found, plan.modules[path], site)
            out[path][site] = _site_qparams(state, found, f"compute_qparams_tree[{path!r}][{site!r}]", options)
    if fuse:
        _share_global_scales(out, states, plan, options)
    return out


def _warn_uncalibrated(out: dict, plan: Plan) -> None:
    """Warns (`UncalibratedWarning`) naming the sites whose QParams hold entries that saw no data (scale
    1 under ``on_uncalibrated="fallback"``): every activation left out by the observation weight, or only
    NaN/Inf values. Stacked experts aside: `calibrate` names those."""
    names = [f"{path}.{site}" for path, entry in out.items() for site, qparams in entry.items()
             if isinstance(qparams, QParams) and isinstance(qparams.calibrated, torch.Tensor)
             and not plan.site(path, site).num_experts and not bool(qparams.calibrated.all())]
    if names:
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        warn(f"compute_qparams_tree: {len(names)} site(s) saw no calibration data (their observation weight was "
             f"zero everywhere, or their values NaN/Inf only): {shown}; their "
             "quantization parameters follow the spec's on_uncalibrated policy (scale 1, zero point 0, "
             "QParams.calibrated False there)", UncalibratedWarning)


def _site_qparams(state, found, where: str, options: dict) -> Optional[QParams]:
    """The QParams of one site's state under its spec and ``qparams_kwargs`` (``options`` first)."""
    kwargs = {**dict(found.rule.qparams_kwargs), **options}
    if found.runtime and not isinstance(found.spec.granularity, TensorGroup):
        return None  # scales at run time: nothing calibrated
    _check_state_type(state, found, where)
    try:
        qparams = (stacked_qparams if found.num_experts else compute_qparams)(state, found.spec, **kwargs)
    except (ValueError, TypeError) as error:  # named by module and site
        raise_renamed(error, where)
    if found.num_experts:
        check_calibrated(qparams.calibrated, found.spec, where=where)
    return qparams


def _check_state_type(state, found, where: str) -> None:
    """TypeError where ``state`` is QParams, or not of the class the site's observer makes (states
    calibrated under another recipe would give that observer's quantization parameters silently)."""
    expected = found.observer.state_type
    if isinstance(state, QParams):
        raise TypeError(f"{where}: got QParams where a state is expected: pass the states tree calibrate returns")
    if expected is not None and not isinstance(state, expected):
        raise TypeError(f"{where}: the recipe observes this site with {found.observer.name} (states of type "
                        f"{expected.__name__}), got a {type(state).__name__}: compute the quantization parameters "
                        "with the recipe the states were calibrated with")


def _stopped_per_projection(state, found, module: torch.nn.Module, site: str):
    """An mse state of a stacked ``gate_up_proj`` ``[E, 2I, H]`` (gate rows, then up rows) whose
    early stop (``patience``) runs per projection, as llm-compressor's observer on each Linear its
    ``linearize_moe`` makes of it (`stopped_per_part`; one stop for both picked other scales); any
    other state as it is, and one whose quantization parameters do not split into the halves' rows."""
    if (site != "gate_up_proj" or found.kind != "parameter" or not found.num_experts or not isinstance(state, MSEState)
            or linearized_layout_problem(module) is not None):
        return state
    shapes = stack_shapes(module, own_parameters(module))  # a parametrized one's original: no copy
    return stopped_per_part(state, 2) if gate_up_halves(shapes, found.spec.granularity) else state


def _share_global_scales(out: dict, states: Mapping, plan: Plan, options: dict) -> None:
    """`compute_qparams_tree`'s ``fuse``: the weights of each fused group under one global scale."""
    for group in plan.fused_groups:
        found = [plan.site(path, "weight") for path in group]
        two_level = [f is not None and isinstance(f.spec.granularity, TensorGroup) for f in found]
        observed = [path in states and "weight" in states[path] for path in group]
        # no two-level member, or a tree without this group's weights (one layer's, activations only)
        if not any(two_level) or not any(observed):
            continue
        kinds = {(f.spec, f.num_experts) for f in found if f is not None}  # observers may differ
        if not (all(two_level) and all(observed) and len(kinds) == 1 and not found[0].num_experts):
            warn(f"compute_qparams_tree: {', '.join(group)} run as one matmul in inference engines (vLLM), "
                 "which need one NVFP4 (two-level) scheme on all of their weights and one global scale; "
                 "these are not all observed under one such spec, so each keeps its own global scale")
            continue
        # each member's range under its own observer and qparams_kwargs, one global scale over them
        # (llm-compressor fuses q/k/v under minmax and mse observers alike)
        spec = found[0].spec
        members = [(states[path]["weight"], {**dict(f.rule.qparams_kwargs), **options}) for path, f in zip(group, found)]
        amax = torch.stack([fused_amax([state], spec, **kwargs) for state, kwargs in members]).amax()
        shared = global_scale_from_amax(amax, spec)
        for path, (state, kwargs) in zip(group, members):
            out[path]["weight"] = compute_qparams(state, spec, **{**kwargs, "global_scale": shared})


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
    """Fake-quantizes a parameter site's value as the site observes it (`Site.canonical`: stacks as
    the per-expert Linear weights ``[E, out, in]``) and gives it back as the parameter stores it."""

    def __init__(self, qparams: QParams, found, where: str = ""):
        super().__init__()
        self.qparams = qparams
        self.spec = found.spec
        self.site = found
        self.where = where  # "module 'path' parameter 'site'", for errors

    def right_inverse(self, value: torch.Tensor) -> torch.Tensor:
        """Assigning the parametrized tensor (``torch.func.functional_call`` with the model's own
        parameter names does) would copy the value into the original under no_grad: its gradient
        would be lost. (NotImplementedError: registration takes it as the identity.)"""
        raise NotImplementedError(
            f"fake_quantized: {self.where} is fake-quantized through a parametrization and cannot be assigned "
            "(its gradient would be lost); with torch.func.functional_call, pass it under the name the model "
            "gives it inside the context, model.named_parameters()'s 'parametrizations.<name>.original'"
        )

    def forward(self, value: torch.Tensor) -> torch.Tensor:
        stored = value
        value = self.site.canonical(value)
        try:
            if self.site.num_experts:
                qparams = per_expert_qparams(self.qparams, value.shape[0])  # a shared global scale: every expert's
                quantized = self.site.stored(torch.vmap(lambda w, qp: fake_quantize(w, qp, self.spec))(value, qparams))
                # in the parameter's memory layout: a transposed view of a stack stored [E, in, out] (GPT-OSS,
                # Llama 4) made the experts' matmuls round otherwise than the model holding those weights
                return quantized.contiguous() if stored.is_contiguous() else quantized
            return fake_quantize(value, self.qparams, self.spec)
        except (ValueError, TypeError) as error:  # QParams of another shape or spec: named by site
            raise_renamed(error, f"fake_quantized: {self.where}")


def float_weight(module: torch.nn.Module) -> torch.Tensor:
    """``module.weight`` (detached) as the float model computes it: inside `qstats.fake_quantized`, without
    the fake quantization it appends to the weight's parametrizations (the model's own stay), as the
    state dict gives it there. Quantized again, the fake-quantized weight gives -0.0 the +0 code where the
    float weight is a tiny negative value, whose code llm-compressor writes -0 (NVFP4, FP8)."""
    if not parametrize.is_parametrized(module, "weight"):
        return module.weight.detach()
    chain = module.parametrizations["weight"]
    own = [step for step in chain if not isinstance(step, _FakeQuantParametrization)]
    if len(own) == len(chain):
        return module.weight.detach()
    originals = [chain.original] if chain.is_tensor else [getattr(chain, f"original{i}") for i in range(chain.ntensors)]
    with torch.no_grad():
        value = own[0](*originals) if own else originals[0]
        for step in own[1:]:
            value = step(value)
    return value.detach()


def _float_state_dict_hooks(parametrized: list) -> list:
    """Hooks (handles) giving each module whose parameters `fake_quantized` parametrized (those
    without a parametrization of the model's own) the float model's ``state_dict`` keys and order,
    the float values under ``<name>`` instead of ``parametrizations.<name>.original``, and taking
    those keys in ``load_state_dict``: a checkpoint saved inside the context loads into the model."""
    sites, orders = {}, {}
    for module, site, before, order in parametrized:
        if not before:
            sites.setdefault(module, []).append(site)
            orders.setdefault(module, order)  # a module's first registration: its float order
    return [handle for module, names in sites.items()
            for handle in _float_key_hooks(module, names, orders[module])]


def _float_key_hooks(module: torch.nn.Module, names: list, order: list) -> list:
    """The handles of a ``state_dict`` post-hook giving ``module``'s parametrized entries ``names``
    under their float names, its parameters in their float ``order``, and of a ``load_state_dict``
    pre-hook taking the float names as the parametrized entries they are."""
    renamed = {name: f"parametrizations.{name}.original" for name in names}

    def save(module, state_dict, prefix, local_metadata) -> None:
        # this module's entries are the last ones (own tensors, then its children's)
        own = {key: state_dict.pop(key) for key in [key for key in state_dict if key.startswith(prefix)]}
        for name, key in renamed.items():
            if prefix + key in own:
                own[prefix + name] = own.pop(prefix + key)
        parameters = [prefix + name for name in order if prefix + name in own]
        state_dict.update((key, own.pop(key)) for key in parameters)
        state_dict.update(own)

    def load(module, state_dict, prefix, *_) -> None:
        for name, key in renamed.items():
            if prefix + name in state_dict:
                state_dict[prefix + key] = state_dict.pop(prefix + name)

    return [module.register_state_dict_post_hook(save), module.register_load_state_dict_pre_hook(load)]


def _parameter_order(module: torch.nn.Module) -> list:
    """The names of ``module``'s own tensors in its float ``state_dict`` order. A module already
    parametrized (an enclosing `fake_quantized`, whose hooks give back its float names) takes them
    from its ``state_dict``: ``_parameters`` no longer holds the enclosing context's parameters."""
    if not parametrize.is_parametrized(module):
        return list(module._parameters)
    return [key for key in module.state_dict(keep_vars=True) if "." not in key]


def _fake_quantize_activation(x, qparams: Optional[QParams], spec, runtime: bool, where: str):
    """Fake-quantizes an activation site's floating-point tensor ``x`` (others pass unchanged); for
    a site whose scales come at run time, under the scales of ``x`` (`runtime_qparams`)."""
    if not is_float_tensor(x):
        return x
    if runtime:
        check_runtime_group(x.shape, spec, where)
        if not x.numel():  # no values (an expert no token is routed to): no scale to compute
            return x
    try:  # QParams of another shape or spec; a run-time range the spec refuses (nonfinite="raise")
        if not runtime:
            return fake_quantize(x, qparams, spec)
        applied = runtime_spec(x, spec)
        return fake_quantize(x, runtime_qparams(x, applied, qparams), applied)
    except (ValueError, TypeError) as error:
        raise_renamed(error, where)


@contextlib.contextmanager
def fake_quantized(model: torch.nn.Module, qparams: Mapping, recipe: Union[Recipe, Plan]):
    """Context manager: ``model`` computes with fake-quantized parameters and activations.

    Parameter sites become parametrizations (straight-through gradient, usable for QAT);
    activation sites get forward hooks; all are removed on exit. Per-expert activation sites of
    stacked experts quantize each expert's matmul input under that expert's QParams
    (`_ExpertInputs`). Run-time scaled sites compute their scales from each tensor, as
    compressed-tensors' dynamic activations do.
    """
    plan = as_plan(recipe, model, "fake_quantized")
    if not isinstance(qparams, Mapping) or not all(isinstance(entry, Mapping) for entry in qparams.values()):
        raise TypeError("fake_quantized: qparams must be a tree {path: {site: QParams}} (compute_qparams_tree's)")
    handles: list = []
    parametrized: list = []
    attention: dict = {}  # path -> {site: quantize} of transformers attention modules (`SiteHooks`)
    try:
        for path, entry in qparams.items():
            if path not in plan.modules:
                raise ValueError(f"fake_quantized: the model has no module {path!r}")
            expert_sites: dict = {}
            for site, qp in entry.items():
                _fake_quantize_site(plan, path, site, qp, handles, parametrized, expert_sites, attention)
            if expert_sites:
                handles.extend(_ExpertInputs(plan.modules[path], path, expert_sites).attach())
        handles.extend(_float_state_dict_hooks(parametrized))
        hooks = {path: (plan.modules[path], SiteHooks(sites, {site: plan.site(path, site).spec for site in sites}))
                 for path, sites in attention.items()}
        with attention_sites(hooks, "fake_quantized"):
            yield model
    finally:
        for handle in handles:
            handle.remove()
        for module, site, before, order in reversed(parametrized):
            if before:  # the model's own parametrizations of the tensor stay (weight_norm, ...)
                del module.parametrizations[site][before:]
            else:
                parametrize.remove_parametrizations(module, site, leave_parametrized=False)
            # the parameters in their order before (removal re-registers at the end); a module's
            # first parametrization comes last here, so its order before any is the one that stays
            for name in order:
                if name in module._parameters:
                    module._parameters[name] = module._parameters.pop(name)


def _fake_quantize_site(plan: Plan, path: str, site: str, qp, handles: list, parametrized: list,
                        expert_sites: dict, attention: dict) -> None:
    """Applies one site of `fake_quantized`: a parametrization of a parameter site (recorded in
    ``parametrized`` with the number of parametrizations the tensor had before and the module's
    parameter order), a hook replacing an activation site's tensor (recorded in ``handles``); a
    per-expert activation site goes to ``expert_sites`` (site -> (qp, found)), for `_ExpertInputs`,
    a q/k/v site of a transformers attention module to ``attention`` (path -> {site: quantize})."""
    found = plan.site(path, site)
    if found is None:
        raise ValueError(f"fake_quantized: the recipe observes no site {site!r} of module {path!r}")
    if qp is None and not found.runtime:
        raise ValueError(f"fake_quantized: qparams[{path!r}][{site!r}] is None; its spec needs QParams")
    if qp is not None and not isinstance(qp, QParams):  # e.g. the states tree instead of its qparams
        raise TypeError(f"fake_quantized: qparams[{path!r}][{site!r}] is a {type(qp).__name__}, not QParams; "
                        "pass qstats.compute_qparams_tree(states, recipe, model), not the states")
    if found.kind == "parameter":
        parametrized.append(_parametrized(plan.modules[path], site, qp, found, f"module {path!r} parameter {site!r}"))
        return
    if found.num_experts:  # per-expert activations: inside the experts' own forward
        expert_sites[site] = (qp, found)
        return
    where = f"fake_quantized: module {path!r} site {site!r}"

    def quantize(x):
        return _fake_quantize_activation(x, qp, found.spec, found.runtime, where)

    if plan.attention_argument(path, site):
        attention.setdefault(path, {})[site] = quantize
        return
    hooked = plan.hooked_module(path, site)
    if found.kind == "input":  # the tensor calibrate observed (`input_tensor`)
        hook = hooked.register_forward_pre_hook(
            lambda _, args, kwargs: replace_input_tensor(args, kwargs, quantize), with_kwargs=True
        )
    else:  # output, q/k/v (the child projection's output): the tensor calibrate observed
        # (`first_tensor`), also inside a tuple
        hook = hooked.register_forward_hook(lambda _, args, output: replace_first_tensor(output, quantize)[0])
    handles.append(hook)


def _parametrized(module: torch.nn.Module, site: str, qp, found, where: str) -> tuple:
    """``(module, site, before, order)`` of a parameter site of `fake_quantized` made a parametrization
    (`_FakeQuantParametrization`): the number of parametrizations the tensor had before, and the
    module's parameter order (`_parameter_order`). The Parameter itself stays the original."""
    parametrization = _FakeQuantParametrization(qp, found, where)
    before = len(module.parametrizations[site]) if parametrize.is_parametrized(module, site) else 0
    order = _parameter_order(module)  # before registering: it takes the tensor out of the list
    original = module._parameters.get(site)
    if original is not None and original.device.type == "meta":  # the parametrization would compute on it
        raise ValueError(f"fake_quantized: {where} is on the meta device (offloaded by accelerate, or "
                         "never loaded), so it cannot be fake-quantized through a parametrization; load "
                         "the model without offloading")
    if is_dtensor(original):  # FSDP2 swaps the module's parameters, which a parametrization hides from it
        raise ValueError(
            f"fake_quantized: {where} is a DTensor (sharded across ranks by FSDP2's fully_shard, or tensor "
            "parallelism), which a parametrization would fake-quantize shard by shard, not the weight the forward "
            "gathers; fake-quantize the model unwrapped, its full state dict loaded "
            "(torch.distributed.checkpoint.state_dict.get_model_state_dict with full_state_dict=True)"
        )
    if original is not None:  # torch would ``original.set_(original)``: a new grad accumulator, which
        # drops the hooks on the old one (DistributedDataParallel's gradient all-reduce), and inside a
        # torch.func transform (grad, jvp) a mutation of a captured tensor, which it refuses: register an
        # empty stand-in, then put the Parameter itself (and its hooks) in its place
        module._parameters[site] = torch.nn.Parameter(original.new_empty(0), original.requires_grad)
    try:
        parametrize.register_parametrization(module, site, parametrization, unsafe=True)
    finally:
        if original is not None and parametrize.is_parametrized(module, site):
            module.parametrizations[site]._parameters["original"] = original
        elif original is not None:  # registration failed: the stand-in never stays
            module._parameters[site] = original
    return module, site, before, order


class _ExpertInputs(ExpertCallHooks):
    """`fake_quantized`'s per-expert activation sites of one stacked-experts module: during its
    forward, the input rows of each expert's matmul with a stacked parameter ``P`` are fake-quantized
    under that expert's QParams of site ``"input"`` where the rows are the module's input tokens,
    then of site ``"P.input"``, as llm-compressor's linearized per-expert Linears quantize their inputs."""

    def __init__(self, module: torch.nn.Module, path: str, sites: dict):
        super().__init__(module)
        self.path, self.sites = path, sites  # site -> (QParams or None, found)

    def start(self, module, args, kwargs) -> tuple:
        applied: set = set()
        capture, hooks, tokens = capture_call(module, args, kwargs, lambda *found: self.quantize(applied, *found))
        return capture, hooks, applied, tokens is not None

    def finish(self, module, started: tuple, output) -> None:
        capture, hooks, applied, ran = started
        stop_capture(capture, hooks)
        missing = sorted(set(self.sites) - applied)
        if output is not None and ran and missing:
            recognised = "qstats.experts.ExpertInputCapture; \"input\": rows traced to the module's input tokens"
            raise unrecognised_sites_error("fake_quantized", missing, self.path, module, recognised)

    def quantize(self, applied: set, name: str, rows: torch.Tensor, ids, traced: bool) -> torch.Tensor:
        """The rows of a matmul with ``name``: under ``"input"`` where they are the module's input
        tokens, then under ``"<name>.input"`` (both where the recipe has both, as nested modules'
        input sites apply one after the other)."""
        if not rows.is_floating_point():
            return rows
        for site in ("input" if traced else None, f"{name}.input"):
            if site in self.sites:
                applied.add(site)
                rows = self._quantized(site, rows, ids)
        return rows

    def _quantized(self, site: str, rows: torch.Tensor, ids) -> torch.Tensor:
        qp, found = self.sites[site]
        where = f"fake_quantized: module {self.path!r} site {site!r}"

        def quantize(x: torch.Tensor, qparams) -> torch.Tensor:
            return _fake_quantize_activation(x, qparams, found.spec, found.runtime, where)

        if isinstance(ids, int):
            return quantize(rows, experts_qparams(qp, ids))
        if found.runtime and not found.spec.granularity.row_wise():  # scales from each expert's rows
            out = rows.clone()  # rows of no expert (expert-parallel sentinels) stay
            for expert, chosen in rows_by_expert(ids, found.num_experts):
                out[chosen] = quantize(rows[chosen], experts_qparams(qp, expert))
            return out
        inside = (ids >= 0) & (ids < found.num_experts)  # expert-parallel sentinels: no expert's rows
        if not rows.shape[0]:
            return rows
        if qp is None:  # row-wise scales from each row alone: the same for every expert, in one call
            return torch.where(inside[:, None], quantize(rows, None), rows)
        per_row = experts_qparams(qp, ids.clamp(0, found.num_experts - 1))
        quantized = torch.vmap(lambda row, q: quantize(row[None], q)[0])(rows, per_row)
        return torch.where(inside[:, None], quantized, rows)

