"""Apple coreai_opt's qparams calculators in qstats terms.

coreai_opt (``coreai_opt.quantization``) computes ``(scale, zero_point, minval)`` with torchao's
``choose_qparams_affine_with_min_max`` (float32 eps) or OCP MX floor e8m0 scales, from a range
its calculators keep:

=======================================  ===============================================
coreai_opt ``qparam_calculator_cls``     qstats observer
=======================================  ===============================================
``"static"`` (weights' default)          `qstats.memoryless_minmax` (the latest tensor)
``"global_minmax"``                      `qstats.minmax`
``"moving_average"`` (activations')      `moving_average_minmax` (here: coreai_opt's EMA)
``"dynamic"`` (activations, stateless)   `qstats.memoryless_minmax`
=======================================  ===============================================

`spec_from_coreai_opt` (``QuantSpec.from_coreai_opt``) gives the spec, ``compute_qparams(state,
spec, float_range=...)`` its ``float_range`` and ``minval``; `qstats.fake_quantize` under that spec is
its fake quantizer (``qformulation="zp"``), `fake_quantize_minval` its ``"minval"`` formulation.
`recipe_from_coreai_opt` turns a whole ``QuantizerConfig`` into the `qstats.Recipe` of a model, and
`schedule_from_coreai_opt` its ``qat_schedule`` into a `qstats.QATSchedule`. coreai_opt is not
imported: its configs, specs and granularities are read by attribute (or dict key).

Known differences, kept on purpose: an e8m0 scale of an all-zero (or below ``2**(p - 126)``, ``p``
the target's largest power of two: 6 for int8, 8 and 15 for fp8 e4m3 and e5m2, 2 for fp4) block is
``2**-127`` in qstats, ``2**-126`` in coreai_opt; a moving average with one ``float_range`` end
pinned keeps that end exactly in qstats, where coreai_opt's EMA of the constant may move it by an
ulp or two.
"""

from __future__ import annotations

import re
from typing import Any, Optional

import torch

from ._checks import check_floating
from ._formats import rounded_in
from .conventions.coreai_opt import _GRANULARITY_KINDS, _check_subclass_fields, block_sizes, block_size
from .conventions.default import saturate
from ._granularity import broadcast_to_view, canonical_view, from_canonical_view
from ._qparams import QParams
from ._quant import fake_quantize
from .recipe import Recipe, Rule
from .schedule import QATSchedule
from ._spec import QuantSpec
from ._warn import warn
from .observers._base import Observer
from .observers.kit import check_spec, extremes_init
from .observers.minmax import memoryless_minmax, minmax
from .observers.minmax import MovingAverageMinMaxState, check_averaging_constant, moving_extremes_update
from .observers.minmax import moving_average_minmax as _torch_ao_average

__all__ = ["spec_from_coreai_opt", "moving_average_minmax", "fake_quantize_minval", "block_size", "recipe_from_coreai_opt",
           "schedule_from_coreai_opt"]


def spec_from_coreai_opt(spec: Any = None, **kwargs) -> QuantSpec:
    """`QuantSpec.from_coreai_opt`: the QuantSpec whose `compute_qparams` (and
    `qstats.compute_minval`) equal coreai_opt's qparams calculators for ``spec`` (a coreai_opt
    ``QuantizationSpec``, a dict of its fields, or the fields as keywords; ``shape=``,
    ``target=``, ``input_dtype=`` as there)."""
    return QuantSpec.from_coreai_opt(spec, **kwargs)


def moving_average_minmax(spec: QuantSpec, averaging_constant: float = 0.01) -> Observer:
    """coreai_opt's ``MovingAverageQParamsCalculator`` range: the moving average of each batch's
    extremes *clamped to contain zero* (``min(batch_min, 0)``, ``max(batch_max, 0)``), stepped as
    ``c * batch + (1 - c) * average`` (the first batch initialises it). Its state is
    `qstats.MovingAverageMinMaxState`, so `compute_qparams`, `qstats.compute_minval` and ``merge``
    are `qstats.moving_average_minmax`'s; only the update differs (qstats' averages the raw
    extremes in the spec convention's arithmetic). bf16/fp16 batches step in their dtype, as
    coreai_opt's running range does, saturated at its largest value (coreai_opt's rounds past it
    to Inf). ``exact=False`` (order-dependent).
    """
    spec = check_spec(spec)
    base = _torch_ao_average(spec, averaging_constant)
    constant = float(averaging_constant)

    def step(average, batch, observed_dtype):
        if observed_dtype not in (torch.bfloat16, torch.float16):
            return saturate(constant * batch + (1 - constant) * average, torch.float32)
        # coreai_opt's running range is held in the input's dtype: each product and the sum round
        def rounded(t):
            return rounded_in(t, observed_dtype)

        # saturated where the rounded sum of two finite extremes passes the dtype's largest value
        # (coreai_opt's becomes Inf: bf16 at its largest value with c = 0.9, fp16 with c = 1/3)
        return saturate(rounded(rounded(constant * batch) + rounded((1 - constant) * average)), observed_dtype)

    def contain_zero(lo, hi):
        return lo.clamp(max=0.0), hi.clamp(min=0.0)

    update_fn = moving_extremes_update(spec, step, "coreai_opt.moving_average_minmax.update", contain_zero)
    init_fn = extremes_init(MovingAverageMinMaxState, spec, "coreai_opt.moving_average_minmax")
    return Observer(init_fn, update_fn, base.merge,
                    exact=False, spec=spec, name="coreai_opt_moving_average_minmax", state_type=base.state_type,
                    options=(("averaging_constant", constant),))


def fake_quantize_minval(x: torch.Tensor, qparams: QParams, spec: QuantSpec) -> torch.Tensor:
    """coreai_opt's fake quantization under ``qformulation="minval"``: codes
    ``clamp(round((x - minval) / scale) + quant_min, quant_min, quant_max)``, values
    ``(q - quant_min) * scale + minval`` (float32, then ``x``'s dtype, saturated at its largest value
    where coreai_opt's is Inf), with `qstats.fake_quantize`'s straight-through gradient.
    `qstats.fake_quantize` is its ``"zp"`` formulation (the default).

    Raises:
      ValueError: a float target or an e8m0 scale (coreai_opt allows ``"minval"`` for integers
        without e8m0 scales only), or ``qparams`` without ``minval`` (saved by an earlier release).
      TypeError: ``x`` is not a floating-point tensor.
    """
    spec = check_spec(spec)
    check_floating(x, "fake_quantize_minval")
    if spec.is_float or spec.scale_dtype == "e8m0" or qparams.minval is None:
        raise ValueError(f"fake_quantize_minval: needs an integer target without e8m0 scales (coreai_opt "
                         f"allows qformulation='minval' for those only) and qparams.minval, got dtype "
                         f"{spec.dtype!r}, scale_dtype {spec.scale_dtype!r} and minval "
                         f"{'None' if qparams.minval is None else 'given'}")
    minval = broadcast_to_view(qparams.minval.float())
    view = canonical_view(x, spec.granularity).float()
    # an entry whose top code lies past half of float32's largest value (peaks beyond 1.7e38) may put
    # x - minval or (q - quant_min) * scale past it (coreai_opt's values are Inf or NaN there): its
    # grid is computed on x / 2 - minval / 2 with scale / 2, then doubled (exact halvings: the same
    # codes and values where both fit)
    top = (spec.qrange[1] - spec.qrange[0]) * qparams.scale.float()
    step = torch.where(top <= torch.finfo(torch.float32).max / 2, 1.0, 2.0)
    codes_at_qmin = qparams._replace(scale=qparams.scale / step,
                                     zero_point=torch.full_like(qparams.zero_point, spec.qrange[0]))
    step, minval = broadcast_to_view(step), minval / broadcast_to_view(step)
    shifted = from_canonical_view(view / step - minval, spec.granularity, x.shape)
    values = (canonical_view(fake_quantize(shifted, codes_at_qmin, spec), spec.granularity) + minval) * step
    # the top code of a range reaching an fp16/bf16 input's largest value lies past it (coreai_opt's
    # +Inf): saturated there, as qstats.fake_quantize, keeping the straight-through gradient (and
    # the sign of a -0.0)
    if x.dtype in (torch.float16, torch.bfloat16):  # for float32 inputs saturate is the identity
        values = values - (values - saturate(values, x.dtype)).detach()
    return from_canonical_view(values, spec.granularity, x.shape).to(x.dtype)


# the modules whose forward is one op coreai_opt's eager quantizer registers, by that op's type
_OP_TYPES = {
    torch.nn.Linear: "linear", torch.nn.Conv1d: "conv1d", torch.nn.Conv2d: "conv2d", torch.nn.Conv3d: "conv3d",
    torch.nn.ConvTranspose1d: "conv_transpose1d", torch.nn.ConvTranspose2d: "conv_transpose2d",
    torch.nn.ConvTranspose3d: "conv_transpose3d", torch.nn.Embedding: "embedding",
    torch.nn.MaxPool2d: "max_pool2d", torch.nn.AdaptiveAvgPool2d: "adaptive_avg_pool2d",
}
# registered ops a module's forward calls as functions: no module site holds their tensors
_FUNCTIONAL_OPS = ("add", "sub", "mul", "matmul")
# coreai_opt's default weight axes (per channel, single-axis per block), by the module's exact type
_WEIGHT_AXES = {torch.nn.Linear: (0, 1), torch.nn.Embedding: (0, 1), torch.nn.Conv1d: (0, 1), torch.nn.Conv2d: (0, 1),
                torch.nn.Conv3d: (0, 1), torch.nn.ConvTranspose1d: (1, 0), torch.nn.ConvTranspose2d: (1, 0),
                torch.nn.ConvTranspose3d: (1, 0)}
_MODULE_LEVEL = ("module_input_spec", "module_output_spec", "module_state_spec")


def recipe_from_coreai_opt(config: Any, model: torch.nn.Module, observed_dtype=None):
    """The `qstats.Recipe` of a coreai_opt ``QuantizerConfig`` on ``model``, as coreai_opt's eager
    ``Quantizer(model, config).prepare`` places its quantizers: each module takes the config of
    the last ``module_name_configs`` pattern fully matching its path or an ancestor's, else of the
    last ``module_type_configs`` entry naming its (or an ancestor's) exact class, else
    ``global_config`` (a None config disables); within it, ``op_type_config[op]`` else the
    config's own ``op_state_spec`` / ``op_input_spec`` / ``op_output_spec`` give the ``weight``
    (``bias``), ``input`` and ``output`` sites of Linear, Conv, ConvTranspose, Embedding, MaxPool2d
    and AdaptiveAvgPool2d modules, under the ``module_*_spec`` of a config such a module matched
    itself; a weight several of them hold (tied) takes, in each, the spec coreai_opt gives its one
    quantizer (`_shared_state_specs`). Specs are `QuantSpec.from_coreai_opt`'s at each weight's shape (axis None resolved per
    module type, as coreai_opt's prepare), observers its calculators' (module docstring;
    ``"dynamic"`` ones give ``Rule(dynamic=True)``: each tensor's own scales at run time),
    ``float_range`` a ``qparams_kwargs`` entry. ``qat_schedule``: `schedule_from_coreai_opt`.

    ``observed_dtype``: the dtype coreai_opt computes each site's qparams in; default the module's
    own floating-point parameters' (the model's first for modules without one).

    Raises:
      ValueError: naming an option a recipe cannot hold: ``op_name_config`` (its names count the
        calls of a forward), module-level specs of other modules, ``kv_cache_quant_configs``,
        activation specs in graph execution mode, conv weights in graph execution mode where a
        BatchNorm of their output channels may follow (coreai_opt folds it into the weight it
        quantizes), parameters inside an ``nn.MultiheadAttention`` in graph execution mode (eager
        mode leaves it float, and so does the recipe), ops called as functions (``add``, ``sub``,
        ``mul``, ``matmul``), a weight or bias computed by a parametrization (weight_norm) that an
        input spec names, ``qformulation="minval"``, per-block activations, a spec field
        qstats does not read, or a moving average's ``averaging_constant`` outside [0, 1]
        (coreai_opt extrapolates with it).
      TypeError: ``config`` is not a ``QuantizerConfig`` (a dict: ``QuantizerConfig.from_dict``).

    Warns:
      UserWarning: naming the parameters of modules outside torch.nn that their configs' state
        specs name (coreai_opt quantizes them where the forward passes them to a registered op,
        which a recipe does not see), and the weights whose blocks do not divide them.

    >>> import torch, qstats.coreai_opt
    >>> from coreai_opt.quantization import QuantizerConfig
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 2))
    >>> [rule.sites for rule in qstats.coreai_opt.recipe_from_coreai_opt(QuantizerConfig.presets.w8(), model).rules]
    [('weight',)]
    """
    _check_config(config)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"recipe_from_coreai_opt: model must be an nn.Module, got {type(model).__name__}")
    dtype_default = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    quantized = list(_quantized_modules(config, model))
    graph = _execution_mode(config) == "graph"
    if graph:
        _check_no_batchnorm_folding(quantized, model)
    groups: dict = {}
    for path, module, _, site_specs in quantized:
        dtype = observed_dtype or next(
            (p.dtype for p in module.parameters(recurse=False) if p.is_floating_point()), dtype_default)
        for site, coreai_spec, target in site_specs:
            rule = _site_rule(path, module, site, coreai_spec, target, dtype, graph)
            if rule is not None:
                groups.setdefault((site, *rule), []).append("re:" + re.escape(path))
    return Recipe([Rule(tuple(paths), sites=(site,), observer=observer, spec=spec, observer_kwargs=observer_kwargs,
                        qparams_kwargs=qparams_kwargs, dynamic=dynamic)
                   for (site, observer, spec, observer_kwargs, qparams_kwargs, dynamic), paths in groups.items()])


def schedule_from_coreai_opt(config: Any, model: torch.nn.Module):
    """The `qstats.QATSchedule` of a coreai_opt ``QuantizerConfig``'s ``qat_schedule`` on ``model``:
    ``enable_observer``, ``enable_fake_quant`` and ``disable_observer`` as ``observe_at``,
    ``fake_quantize_at`` and ``freeze_ranges_at``, with ``quantizer.step()`` after each training
    step. A config without one observes and fake-quantizes from step 0, as coreai_opt does.

    Raises:
      ValueError: the modules ``recipe_from_coreai_opt`` quantizes have different schedules
        (qstats' QAT runs one), naming two of them.
    """
    _check_config(config, "schedule_from_coreai_opt")
    found: dict = {}
    for path, _, module_config, _ in _quantized_modules(config, model, warn_unseen=False):
        schedule = module_config.qat_schedule
        milestones = (0, 0, None) if schedule is None else (
            schedule.enable_observer, schedule.enable_fake_quant, schedule.disable_observer)
        found.setdefault(milestones, path)
    if len(found) > 1:
        (first, one), (second, other) = list(found.items())[:2]
        _refuse(f"modules {one!r} and {other!r} have different qat_schedule milestones (enable_observer, "
                f"enable_fake_quant, disable_observer) {first} and {second}; qstats' QAT follows one schedule",
                "schedule_from_coreai_opt")
    observe, fake_quantize, freeze = next(iter(found), (0, 0, None))
    return QATSchedule(observe_at=observe, fake_quantize_at=fake_quantize, freeze_ranges_at=freeze)


def _quantized_modules(config, model: torch.nn.Module, warn_unseen: bool = True) -> list:
    """``[(path, module, module config, [(site, coreai_opt spec, target)])]`` of the modules of
    ``model`` whose op the config quantizes (``warn_unseen``: warn about parameters coreai_opt
    may quantize where no site holds them)."""
    ops = []  # (path, module, module config, op components, boundary), by coreai_opt's precedence
    unseen: dict = {}  # {path: (class name, parameter names)} of _unseen_parameters
    attention = {inner: path for path, module in model.named_modules()
                 if isinstance(module, torch.nn.MultiheadAttention) for inner, _ in module.named_modules(prefix=path)}
    for path, module, module_config, own, _ in sorted(_module_configs(config, model), key=lambda entry: entry[4]):
        op_type = _OP_TYPES.get(type(module)) or next(
            (op for cls, op in _OP_TYPES.items() if isinstance(module, cls)), None)
        if op_type == "max_pool2d" and module.return_indices:  # F.max_pool2d_with_indices: not registered
            op_type = None
        boundary = module_config if own and any(_active(getattr(module_config, f)) for f in _MODULE_LEVEL) else None
        if op_type is None and boundary is not None:
            _refuse(f"module {path!r} ({type(module).__name__}) has module-level specs, which quantize "
                    "tensors at its boundary wherever its forward sends them; give them to the Linear, Conv, "
                    "Embedding or pooling modules that take them")
        if path in attention:
            _check_attention_parameters(config, path, module, module_config, attention[path])
            continue
        if op_type is None:
            names = _unseen_parameters(module, module_config, boundary)
            if names:
                unseen[path] = (type(module).__name__, names)
            continue
        components = module_config.op_type_config.get(op_type, module_config)
        _check_parametrized_arguments(path, module, components, boundary)
        ops.append((path, module, module_config, components, boundary))
    order = {path: index for index, (path, _) in enumerate(model.named_modules())}
    if warn_unseen:
        _warn_unseen({path: unseen[path] for path in sorted(unseen, key=order.get)})
    shared = _shared_state_specs(ops)
    quantized = [(path, module, module_config, _site_specs(module, components, boundary, shared))
                 for path, module, module_config, components, boundary in ops]
    return sorted([entry for entry in quantized if entry[3]], key=lambda entry: order[entry[0]])


def _check_parametrized_arguments(path: str, module, components, boundary) -> None:
    """ValueError where a parametrized weight or bias (``torch.nn.utils.parametrize``: a tensor its
    parametrization computes, not a parameter) is an argument of the op (1 and 2) that the op's or
    the module's input specs name: coreai_opt quantizes it there as an activation."""
    for name, index in (("weight", 1), ("bias", 2)):
        if name not in getattr(module, "parametrizations", {}):
            continue
        specs = [getattr(boundary, "module_input_spec", None), components.op_input_spec]
        spec = next((spec for found, spec in (_named_spec(index, d) for d in specs) if found), None)
        if spec is not None:
            _refuse(f"module {path!r} ({type(module).__name__}): its {name} is computed by a parametrization "
                    f"(torch.nn.utils.parametrize), and its input spec for argument {index} of the op quantizes it as "
                    "an activation in coreai_opt, which no recipe site holds; remove the parametrization first "
                    "(torch.nn.utils.parametrize.remove_parametrizations(module, name, leave_parametrized=True)) or give "
                    f"op_input_spec {{0: ...}} instead of '*'")


# the registered ops that take a module's parameters: those of the modules with weights (the op_type_config
# entries their state specs are in; those of add, sub, mul and matmul are refused by _check_config)
_PARAMETER_OPS = tuple(_OP_TYPES[cls] for cls in _WEIGHT_AXES)


def _unseen_parameters(module, module_config, boundary) -> list:
    """The parameters of a module outside torch.nn that is not one of the modules a recipe gives
    sites to, which its config's state specs name: coreai_opt quantizes such a parameter where the
    forward passes it to a registered op (``F.linear``, a conv, ``F.embedding``, ``*``, ``+``, ``-``,
    ``@``: an RMSNorm's ``weight * x``), which a recipe does not see (it leaves it float)."""
    if type(module).__module__.startswith("torch."):  # torch.nn's own: their forwards are known
        return []
    configs = [module_config, *(module_config.op_type_config.get(op) for op in _PARAMETER_OPS)]
    spec_dicts = [getattr(boundary, "module_state_spec", None)] + [c.op_state_spec for c in configs if c is not None]
    return [name for name, param in module.named_parameters(recurse=False) if param.is_floating_point()
            and any(_named_spec(name, specs)[1] is not None for specs in spec_dicts)]


def _warn_unseen(unseen: dict) -> None:
    """One warning naming the modules and parameters `_unseen_parameters` found."""
    if unseen:
        listed = ", ".join(f"{path!r} ({kind}) {names}" for path, (kind, names) in list(unseen.items())[:4])
        more = f" and {len(unseen) - 4} more" if len(unseen) > 4 else ""
        warn(f"recipe_from_coreai_opt: modules {listed}{more} hold parameters that their config's state specs name: "
             "coreai_opt quantizes them where the forward passes them to a registered op (F.linear, a conv, "
             "F.embedding, or mul, add, sub, matmul: an RMSNorm's weight * x), which a recipe does not see; left float "
             "(hold them in an nn.Linear, nn.Conv or nn.Embedding, or give those paths None in module_name_configs)",
             UserWarning)


def _check_attention_parameters(config, path: str, module, module_config, attention: str) -> None:
    """Nothing inside an ``nn.MultiheadAttention`` has a site: coreai_opt's eager handler sees its
    forward as one op it does not register (its out_proj's forward never runs) and leaves it float.
    Graph mode quantizes the parameters its decomposed linear ops take under the attention module's
    config, which no module site holds: ValueError where the config quantizes any."""
    if _execution_mode(config) != "graph":
        return
    components = module_config.op_type_config.get("linear", module_config)
    names = [name for name, param in module.named_parameters(recurse=False)
             if param.is_floating_point() and _named_spec(name, components.op_state_spec)[1] is not None]
    if names:
        _refuse(f"module {path!r} ({type(module).__name__}): graph execution mode quantizes {names} where the "
                f"linear ops nn.MultiheadAttention {attention!r} decomposes into take them, under the attention "
                f"module's config, which no module site holds; disable it (module_name_configs {{{attention!r}: "
                "None}) or use execution_mode='eager', which leaves nn.MultiheadAttention float")


def _shared_state_specs(ops: list) -> dict:
    """``{id(parameter): coreai_opt spec or None}`` for each parameter several of ``ops``' modules
    hold (tied weights): coreai_opt quantizes such a tensor once, for every module that uses it,
    under the ``module_state_spec`` of the first owner (in config precedence) whose own names it,
    else the ``op_state_spec`` of the owner of highest precedence (``ops`` are in that order)."""
    owners: dict = {}
    for _, module, _, components, boundary in ops:
        for name, param in module.named_parameters(recurse=False):
            owners.setdefault(id(param), []).append((name, components, boundary))
    shared = {}
    for key, held in owners.items():
        if len(held) > 1:
            named = [_named_spec(name, getattr(boundary, "module_state_spec", None)) for name, _, boundary in held]
            name, components, _ = held[0]
            shared[key] = next((spec for found, spec in named if found),
                               _named_spec(name, components.op_state_spec)[1])
    return shared


def _named_spec(key, specs) -> tuple:
    """``(found, spec)``: the spec ``specs`` (a coreai_opt spec dict) gives tensor ``key``, or
    its ``"*"`` entry; ``found`` False where it names neither."""
    for name in (key, "*"):
        if specs and name in specs:
            return True, specs[name]
    return False, None


def _refuse(what: str, caller: str = "recipe_from_coreai_opt") -> None:
    raise ValueError(f"{caller}: {what}")


def _check_config(config, caller: str = "recipe_from_coreai_opt") -> None:
    """TypeError for what is not a QuantizerConfig, ValueError for options a Recipe cannot hold."""
    if not all(hasattr(config, name) for name in ("global_config", "module_type_configs", "module_name_configs")):
        raise TypeError(f"{caller} expects a coreai_opt QuantizerConfig, got {type(config).__name__} "
                        "(a dict or YAML: QuantizerConfig.from_dict / from_yaml first)")
    if getattr(config, "kv_cache_quant_configs", None):
        _refuse(f"kv_cache_quant_configs {sorted(config.kv_cache_quant_configs)} quantize graph-mode cache "
                "buffers, which no module site holds", caller)
    graph = _execution_mode(config) == "graph"
    scopes = [("global_config", config.global_config)]
    scopes += [(f"module_type_configs[{k!r}]", c) for k, c in config.module_type_configs.items()]
    scopes += [(f"module_name_configs[{k!r}]", c) for k, c in config.module_name_configs.items()]
    for where, module_config in scopes:
        if module_config.op_name_config:
            _refuse(f"{where}.op_name_config {sorted(module_config.op_name_config)}: op names count the calls of "
                    "a traced forward, which a recipe does not see; use module_name_configs", caller)
        for op in _FUNCTIONAL_OPS:
            op_config = module_config.op_type_config.get(op)
            if op_config is not None and any(_active(getattr(op_config, f"op_{kind}_spec"))
                                             for kind in ("input", "output", "state")):
                _refuse(f"{where}.op_type_config[{op!r}]: {op} is called as a function inside a forward; qstats "
                        "observes module sites (weights, inputs, outputs) only", caller)
        if graph and _has_activations(module_config):
            _refuse(f"{where} quantizes activations in graph execution mode, which places them on the exported "
                    "graph (after fused patterns, one per edge); set execution_mode='eager' for module sites", caller)


def _execution_mode(config) -> str:
    return str(getattr(config.execution_mode, "value", config.execution_mode))


# the convs whose weight coreai_opt's graph prepare scales by a following BatchNorm's gamma / sqrt(var + eps)
_BATCHNORM_FOLDED = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.ConvTranspose1d, torch.nn.ConvTranspose2d)


def _check_no_batchnorm_folding(quantized: list, model: torch.nn.Module) -> None:
    """ValueError where graph execution mode may quantize a conv weight with a BatchNorm folded in:
    coreai_opt's graph prepare rewrites conv -> batch_norm so that the weight quantizer observes
    ``weight * gamma / sqrt(running_var + eps)``, which no module site holds. A BatchNorm counts when
    its ``num_features`` equals the conv's ``out_channels`` (the recipe does not see the forward)."""
    norms = {module.num_features: path for path, module in model.named_modules()
             if isinstance(module, torch.nn.modules.batchnorm._BatchNorm)}
    for path, module, _, site_specs in quantized:
        weighted = any(site == "weight" for site, _, _ in site_specs)
        if weighted and isinstance(module, _BATCHNORM_FOLDED) and module.out_channels in norms:
            _refuse(f"graph execution mode folds a BatchNorm that follows a conv into the weight it quantizes "
                    f"(weight * gamma / sqrt(running_var + eps)), which no module site holds: module {path!r} "
                    f"({type(module).__name__}, {module.out_channels} output channels) and BatchNorm "
                    f"{norms[module.out_channels]!r}; fold the batch norms into the convs first "
                    "(torch.nn.utils.fusion.fuse_conv_bn_eval) or set execution_mode='eager'")


def _active(spec_dict) -> bool:
    return bool(spec_dict) and any(spec is not None for spec in spec_dict.values())


def _has_activations(module_config) -> bool:
    configs = [module_config, *module_config.op_type_config.values()]
    return (any(_active(c.op_input_spec) or _active(c.op_output_spec) for c in configs)
            or _active(module_config.module_input_spec) or _active(module_config.module_output_spec))


def _module_configs(config, model: torch.nn.Module) -> list:
    """``[(path, module, module config, own, precedence)]`` as coreai_opt's ``CompressionConfig``
    assigns them: name patterns (last first, full match of any name a module is registered under),
    then exact types (last first), then the global config; a module's config passes to its
    descendants that none of these gave one before (``own`` False: without its module-level specs).
    ``precedence``: the order of assignment, coreai_opt's module priority (0 first)."""
    modules = dict(model.named_modules())
    canonical = {id(module): path for path, module in modules.items()}
    names: dict = {}
    for name, module in model.named_modules(remove_duplicate=False):
        names.setdefault(canonical[id(module)], []).append(name)
    assigned: dict = {}

    def assign(path, module, module_config, own=True):
        if path in assigned:
            return
        assigned[path] = (module_config, own)
        for child in module.children():  # without the module-level specs
            assign(canonical[id(child)], child, module_config, False)

    def fqn(module):
        return f"{type(module).__module__}.{type(module).__qualname__}"

    scopes = [(lambda path, module, p=pattern: any(re.fullmatch(p, n) for n in names[path]), c)
              for pattern, c in reversed(config.module_name_configs.items())]
    scopes += [(lambda path, module, t=key: fqn(module) == t, c) for key, c in reversed(config.module_type_configs.items())]
    scopes.append((lambda path, module: True, config.global_config))
    for matches, module_config in scopes:
        for path, module in reversed(modules.items()):
            if matches(path, module):
                assign(path, module, module_config)
    precedence = {path: index for index, path in enumerate(assigned)}  # coreai_opt's module priority
    return [(path, module, *assigned[path], precedence[path]) for path, module in modules.items()]


def _site_specs(module: torch.nn.Module, components, boundary=None, shared=None) -> list:
    """``[(site, coreai_opt spec, target)]`` of one module under its op's components: its
    parameters by name (``"*"`` for the others; ``shared[id(parameter)]`` for tied ones), its input
    and output as the op's tensor 0 (an Embedding's input is its indices, which coreai_opt leaves);
    the ``module_state_spec`` / ``module_input_spec`` / ``module_output_spec`` of ``boundary`` (the
    config the module matched itself) override them where they name the tensor."""
    def pick(key, *spec_dicts):
        for specs in spec_dicts:  # the first dict naming the tensor (or "*") decides, None included
            found, spec = _named_spec(key, specs)
            if found:
                return spec
        return None

    def own(field):
        return getattr(boundary, field, None) or {}

    out = []
    for name, param in module.named_parameters(recurse=False):
        spec = (shared or {}).get(id(param), pick(name, own("module_state_spec"), components.op_state_spec))
        if spec is not None and param.is_floating_point():
            out.append((name, spec, "weight"))
    for site in ("input", "output"):
        spec = pick(0, own(f"module_{site}_spec"), getattr(components, f"op_{site}_spec"))
        if spec is not None and not (site == "input" and isinstance(module, torch.nn.Embedding)):
            out.append((site, spec, "activation"))
    return out


def _site_rule(path: str, module, site: str, coreai_spec, target: str, dtype, graph=False) -> Optional[tuple]:
    """``(observer factory, QuantSpec, observer_kwargs, qparams_kwargs, dynamic)`` of one site, None
    for a weight whose blocks do not divide it (``graph``: in graph execution mode)."""
    where = f"module {path!r} {site}"
    try:  # before a weight left unquantized returns: a spec subclass's other fields are refused there too
        _check_subclass_fields(coreai_spec)
    except ValueError as error:
        raise ValueError(f"recipe_from_coreai_opt: {where}: {error}") from None
    averaging = getattr(coreai_spec, "averaging_constant", 0.01)  # the moving average's
    formulation = str(getattr(coreai_spec.qformulation, "value", coreai_spec.qformulation))
    if formulation == "minval":
        _refuse(f"{where}: qformulation 'minval' fake-quantizes on another grid than a recipe's (qparams: "
                "QuantSpec.from_coreai_opt; values: qstats.coreai_opt.fake_quantize_minval)")
    granularity = _resolved_granularity(coreai_spec.granularity, module, site, target, where, graph)
    shape = getattr(module, site).shape if target == "weight" else None
    if granularity["type"] == "per_block" and target == "weight" and _blocks_do_not_divide(granularity, shape):
        # coreai_opt's prepare leaves such a tensor unquantized, with a warning
        warn(f"recipe_from_coreai_opt: {where}: block size {granularity['block_size']} does not divide its shape "
             f"{tuple(shape)}; left unquantized, as coreai_opt's prepare leaves it", UserWarning)
        return None
    try:
        spec = QuantSpec.from_coreai_opt(coreai_spec, granularity=granularity, shape=shape, target=target,
                                         input_dtype=dtype)
    except ValueError as error:
        raise ValueError(f"recipe_from_coreai_opt: {where}: {error}") from None
    calculator = coreai_spec.qparam_calculator_cls
    calculator = getattr(calculator, "__name__", calculator)
    if calculator in ("default", "_DefaultQParamsCalculator"):
        calculator = "static" if target == "weight" else "moving_average"
    float_range = tuple(coreai_spec.float_range or (None, None))
    qparams_kwargs = (("float_range", float_range),) if any(end is not None for end in float_range) else ()
    if calculator in ("moving_average", "MovingAverageQParamsCalculator"):
        # coreai_opt steps c * batch + (1 - c) * average with any c; qstats' average needs c in [0, 1]
        constant = check_averaging_constant(averaging, f"recipe_from_coreai_opt: {where} ({type(coreai_spec).__name__})")
        return moving_average_minmax, spec, (("averaging_constant", constant),), qparams_kwargs, False
    if calculator in ("global_minmax", "GlobalMinMaxQParamsCalculator"):
        return minmax, spec, (), qparams_kwargs, False
    # static: the latest tensor; dynamic: each tensor's own, at run time
    return memoryless_minmax, spec, (), qparams_kwargs, calculator in ("dynamic", "DynamicQParamsCalculator")


def _blocks_do_not_divide(granularity: dict, shape) -> bool:
    sizes = block_sizes(granularity, [int(s) for s in shape], "weight")
    return any(b < 1 or s % b for b, s in zip(sizes, shape))


def _resolved_granularity(granularity, module, site: str, target: str, where: str, graph=False) -> dict:
    """``granularity`` as a dict, a weight's axis None resolved as coreai_opt's prepare does (the
    output channel per channel, the input channel per block): by the module's exact type in eager
    mode (its parametrized class's base), by the op its weight feeds in graph mode (a subclass's)."""
    kind = _GRANULARITY_KINDS.get(type(granularity).__name__, getattr(granularity, "type", None))
    fields = {"type": kind, "axis": getattr(granularity, "axis", None)}
    if kind == "per_block":
        fields["block_size"] = granularity.block_size
        if target == "activation":
            _refuse(f"{where}: per-block activations take their blocks from each tensor's shape, which a recipe "
                    "does not hold; use per_tensor or per_channel")
    needs_axis = fields["axis"] is None and (kind == "per_channel" or isinstance(fields.get("block_size"), int))
    if needs_axis and target == "weight":
        axes = None if site != "weight" else _WEIGHT_AXES.get(type(module)) if not graph else next(
            (axes for cls, axes in _WEIGHT_AXES.items() if isinstance(module, cls)), None)
        if axes is None:
            _refuse(f"{where}: granularity {kind} has axis None, which coreai_opt resolves for the weight of "
                    f"{', '.join(cls.__name__ for cls in _WEIGHT_AXES)} only; give the axis")
        fields["axis"] = axes[0] if kind == "per_channel" else axes[1]
    if kind == "per_tensor":
        del fields["axis"]
    return fields
