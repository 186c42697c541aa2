"""`QATModel`: the rewritten model as a pure function of (params, states, batch), and what it derives from
them: states merged across ranks, learnable ranges, observed weights, the float model's state_dict."""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Mapping, Optional, Tuple

import torch
from torch import nn

from .. import distributed
from .._spec import QuantSpec
from ..lsq import LSQParams, lsq_init
from ..schedule import QATPhase
from ._layers import _CONV_TRANSPOSE, _EXTRA_INPUTS, _conv_layout, _layer_parameter, _named_tensors
from ._points import QATState, _OBSERVE_FIRST, _fold_factor, _folded_weight


# torchao refuses range learning with is_dynamic: a range learned per row of one batch means nothing to another's
_NO_RANGE_TO_LEARN = ("the activation ranges are dynamic (each batch's own: per row, token or group, or "
                      "dynamic_activations=True), so there is no range to learn (torchao refuses range_learning "
                      "with is_dynamic)")


class QATModel:
    """A model rewritten for pure QAT (built by `prepare`).

    Attributes:
      module: the ``torch.fx.GraphModule``; ``forward(*inputs, qat_state=, qat_phase=, qat_ranges=)``
        returns ``(output, new_state_dict)``. It shares the original model's parameters and names.
      weight_observer, activation_observer: the observers as given to `prepare` (one Observer, None, or a
        mapping by layer type).
      weight_observers, activation_observers: layer name -> the observer of its weight / input (their specs
        are the targets); a layer left in float for that kind has none.
      layers: names of the layers of the types `prepare` quantizes (one whose observers are both None
        among them, in float); ``activation_layers``: those whose input is fake-quantized (never embeddings,
        whose inputs are integer ids); ``batchnorm_layers``: names of batch-norm layers.
      dynamic_layers: the activation layers whose ranges are each batch's own (`prepare`);
        ``dynamic_activations``: whether every activation layer's are (and there is one).
      folded_layers: layer name -> the batch norm whose running statistics scale its fake-quantized weight
        (``prepare(..., fold_batchnorm=True)``).
      parameter_layers: the points of ``F.linear``/``F.conv1d/2d/3d``/``F.conv_transpose1d/2d/3d`` calls of a
        parameter or buffer outside its layer's own forward (`prepare`), each named after the parameter or buffer
        (``"block.proj"``), and of calls of computed weights, each named after its call (``"block.linear_1"``),
        among ``layers``: name -> the layer type whose observers it takes (``nn.Linear`` for ``F.linear``).
    """

    def __init__(self, module, weight_observer, activation_observer, layers, batchnorm_layers, aliases=None,
                 weight_observers=None, activation_observers=None, dynamic_layers=(), folded_layers=None,
                 parameter_layers=None, parameter_groups=None, computed_weights=None):
        self.module = module
        self.weight_observer = weight_observer
        self.activation_observer = activation_observer
        self.weight_observers = dict(weight_observers or {})
        self.activation_observers = dict(activation_observers or {})
        self.layers = tuple(layers)
        self.activation_layers = tuple(self.activation_observers)
        # the activation points that are dynamic (`_dynamic`: the granularity's, or prepare's flag)
        self.dynamic_layers = tuple(dynamic_layers)
        self.dynamic_activations = bool(self.dynamic_layers) and set(self.dynamic_layers) == set(self.activation_layers)
        self.batchnorm_layers = tuple(batchnorm_layers)
        self.folded_layers = dict(folded_layers or {})  # layer -> the batch norm folded into its weight
        self.parameter_layers = dict(parameter_layers or {})  # parameter -> the layer type of its F.linear/conv calls
        self._parameter_groups = dict(parameter_groups or {})  # parameter -> groups of its F.conv_transposeNd calls
        # point of a call of a computed weight -> a GraphModule computing it, or what else it reads (`_weight_graph`)
        self._computed_weights = dict(computed_weights or {})
        # the model's names of a module registered several times, which ``module`` lacks -> the name it has
        self._aliases = dict(aliases or {})
        # names `apply` takes: parameters (tied ones under every name) and buffers
        self._names = frozenset(name for name, _ in _named_tensors(module)) | frozenset(self._aliases)
        # quantized layer or batch norm -> its module paths in the model (`_module_paths`), which layer_phases name
        self._paths = self._module_paths((*self.layers, *self.batchnorm_layers))

    def params(self) -> Dict[str, torch.Tensor]:
        """The model's parameters by name (the tensors themselves)."""
        return dict(self.module.named_parameters())

    @torch.no_grad()
    def init(self, *example_inputs) -> QATState:
        """Fresh states sized on ``example_inputs`` (one forward pass; nothing is observed).
        Batch-norm states start from the model's running statistics."""
        empty = QATState({}, {}, {})
        _, states = self.module(*example_inputs, **_extra(empty, QATPhase(False, False, False), None))
        return QATState(**states)

    def apply(self, params, state: QATState, *inputs, phase: QATPhase = QATPhase(), ranges=None,
              layer_phases: Optional[Mapping[str, QATPhase]] = None):
        """``(output, new_state)`` of one QAT forward pass; ``params``, ``state`` and buffers are unchanged.

        Args:
          params: parameter name -> tensor (``qat.params()`` or trained copies); missing names: the model's.
          state: the `QATState` from `init` or the previous step.
          *inputs: the model's inputs.
          phase: a `QATPhase` (from a `QATSchedule`).
          ranges: optional learned ranges ``{"weights": {layer: LSQParams}, "activations": {...}}``.
          layer_phases: optional ``{module path: QATPhase}``: the phase of the quantized layers and batch
            norms at or under that path (the longest matching path), as torch.ao's
            ``model.get_submodule(path).apply(disable_fake_quant)`` (or ``disable_observer``, ...) switches
            the fake quantization of one submodule; the other layers follow ``phase``.
        """
        self._check_inputs(params, state, "QATModel.apply")
        if not isinstance(phase, QATPhase):  # a batch norm read phase.freeze_batchnorm: a bare AttributeError
            raise TypeError(f"QATModel.apply: phase must be a QATPhase (schedule(step)), got {type(phase).__name__}")
        self._check_ranges(ranges)
        params = self._canonical(params, "QATModel.apply")
        phases = phase if layer_phases is None else self._layer_phases(phase, layer_phases)
        output, states = torch.func.functional_call(self.module, params, inputs, _extra(state, phases, ranges))
        return output, QATState(**states)

    def _layer_phases(self, phase: QATPhase, layer_phases) -> Dict[str, QATPhase]:
        """Every quantized layer's and batch norm's phase: that of the longest path of ``layer_phases``
        naming it or a module above it (``""``: the whole model), else ``phase``. A path above no such
        layer raises: it would switch nothing."""
        if not isinstance(layer_phases, Mapping):
            raise TypeError(f"QATModel.apply: layer_phases must be a dict {{module path: QATPhase}} or None, got "
                            f"{type(layer_phases).__name__}")
        keys = (*self.layers, *self.batchnorm_layers)
        covered = lambda key, path: path == "" or any(  # noqa: E731
            held == path or held.startswith(path + ".") for held in self._paths[key])
        for path, given in layer_phases.items():
            if not isinstance(path, str) or not isinstance(given, QATPhase):
                raise TypeError(f"QATModel.apply: layer_phases maps module paths (str) to QATPhase, got "
                                f"{path!r}: {type(given).__name__}")
            if not any(covered(key, path) for key in keys):
                raise ValueError(f"QATModel.apply: layer_phases names {path!r}, which holds none of the quantized "
                                 f"layers and batch norms {sorted(keys)}")
        phases = dict.fromkeys(keys, phase)
        for path in sorted(layer_phases, key=len):  # a longer path overrides the paths above it
            phases.update((key, layer_phases[path]) for key in keys if covered(key, path))
        return phases

    def _module_paths(self, keys) -> Dict[str, set]:
        """``{layer: its module paths in the model}``: its own, and the other names of a module the model
        holds several times (`_aliases`, ``nn.ModuleList([block] * n)``), one object that torch.ao's
        ``submodule.apply(...)`` switches through any of them."""
        paths = {key: {key} for key in keys}
        for alias, name in self._aliases.items():
            if name in self.parameter_layers:  # an F.linear/conv call's parameter: its point is named after it
                paths[name].add(alias)
            layer, _, field = name.rpartition(".")
            if layer in paths and alias.endswith(f".{field}"):
                paths[layer].add(alias[: -len(field) - 1])
            # a computed weight's call, named under the module making it: under that module's other names too
            held, other = _differing_prefixes(name, alias)
            paths.update((key, {*paths[key], other + key[len(held):]}) for key in self._computed_weights
                         if held and key.startswith(f"{held}."))
        return paths

    def state_dict(self, params, state: QATState) -> Dict[str, torch.Tensor]:
        """The float model's ``state_dict`` after training (detached tensors), to load into the model with
        ``model.load_state_dict``: ``params`` (a tied parameter given under one of its names fills them all;
        parameters not given keep the model's values) and the batch norms' running statistics from
        ``state.batchnorm`` (the model's own buffers never change). Modules and buffers the forward
        never uses are left out (``module`` lacks them): load with ``strict=False`` then."""
        self._check_inputs(params, state, "QATModel.state_dict")
        params = self._canonical(params, "QATModel.state_dict")
        # a tensor -> the value given under its first name in params (tied ones have several; reversed: the first wins)
        named = reversed(list(self.module.named_parameters(remove_duplicate=False)))
        given = {id(tensor): params[name] for name, tensor in named if name in params}
        buffers = dict(self.module.named_buffers())
        for key, statistics in state.batchnorm.items():  # every name of a shared batch norm's buffers
            for field, value in statistics._asdict().items():
                if f"{key}.{field}" in buffers:
                    given[id(buffers[f"{key}.{field}"])] = value
        result = {name: given.get(id(tensor), params.get(name, tensor)).detach()
                  for name, tensor in self.module.state_dict(keep_vars=True).items()}
        result.update((alias, result[name]) for alias, name in self._aliases.items() if name in result)
        return result

    def observed_weight(self, params, layer: str, state: Optional[QATState] = None) -> torch.Tensor:
        """Layer ``layer``'s weight in ``params`` (the model's if not given; a tied one under any of its names)
        as its weight point observes it: a transposed convolution's in a convolution's layout
        ``[out, in/groups, *k]``, others as they are. After training, ``qat.weight_observers[layer].update(
        state.weights[layer], qat.observed_weight(params, layer))`` observes the trained weight once more, as
        torch.ao's ``convert_fx`` does (a transposed convolution's weight as given would be read per input
        channel, silently where ``in == out / groups``). A layer with a folded batch norm (`folded_layers`) gives
        its weight scaled by that batch norm's ``weight`` in ``params`` and running variance in ``state`` (needed
        then), the weight torch.ao's ``convert_fx`` folds and observes.

        Raises:
          ValueError: ``layer`` has no weight observer, or has a folded batch norm and ``state`` is no `QATState`.
        """
        if layer not in self.weight_observers:
            raise ValueError(f"QATModel.observed_weight: layer {layer!r} has no weight observer; those with one: "
                             f"{sorted(self.weight_observers)}")
        if not isinstance(params, Mapping):
            raise TypeError(f"QATModel.observed_weight: params must be a dict of tensors by parameter name, got "
                            f"{type(params).__name__}")
        if layer in self.folded_layers and not isinstance(state, QATState):
            raise ValueError(f"QATModel.observed_weight: layer {layer!r} has the batch norm "
                             f"{self.folded_layers[layer]!r} folded into its weight, whose running variance is in the "
                             f"QAT state; pass state= (got {type(state).__name__})")
        params = self._canonical(params, "QATModel.observed_weight")
        if layer in self._computed_weights:
            return self._computed_weight(params, layer)
        # read through functional_call: tied parameters and parametrized weights (computed from theirs) as in apply
        reader = _WeightOf(self.module, layer, self.folded_layers.get(layer), layer in self.parameter_layers)
        weight = torch.func.functional_call(reader, {f"model.{name}": value for name, value in params.items()}, (state,))
        if layer in self.parameter_layers:  # an F.linear/conv/conv_transpose call's parameter
            groups = self._parameter_groups.get(layer)
            return weight if groups is None else _conv_layout(weight, groups)
        module = self.module.get_submodule(layer)
        return _conv_layout(weight, module.groups) if isinstance(module, _CONV_TRANSPOSE) else weight

    def _computed_weight(self, params, layer: str) -> torch.Tensor:
        """The weight of the call of a computed weight ``layer`` from ``params`` (and the model's own tensors)."""
        graph = self._computed_weights[layer]
        if isinstance(graph, str):
            raise ValueError(f"QATModel.observed_weight: the weight of {layer!r} is computed from {graph}: "
                             "it has no value outside a forward pass")
        names = {name for name, _ in _named_tensors(graph)}
        weight = torch.func.functional_call(graph, {name: value for name, value in params.items() if name in names}, ())
        groups = self._parameter_groups.get(layer)
        return weight if groups is None else _conv_layout(weight, groups)

    def _canonical(self, params, where: str) -> Dict[str, Any]:
        """``params`` with a shared module's other names (`_aliases`) under the name ``module`` has. They are
        not handed to ``functional_call``: it would set the one module's attribute once per name, and restore
        it so, leaving the value given in the model."""
        if not any(name in self._aliases for name in params):
            return params
        result, given_as = {}, {}
        for name, value in params.items():
            target = self._aliases.get(name, name)
            if target in result and result[target] is not value:
                raise ValueError(f"{where}: params gives {name!r} and {given_as[target]!r}, names of one tensor "
                                 "(a module registered under several names), different values")
            result[target], given_as[target] = value, name
        return result

    def _check_inputs(self, params, state, where: str) -> None:
        """``state`` a `QATState` with the model's keys; ``params`` a dict of the model's names."""
        if not isinstance(state, QATState):
            raise TypeError(f"{where}: state must be a QATState, got {type(state).__name__}")
        for kind, expected in self._state_keys().items():
            got = getattr(state, kind)
            if set(got) != set(expected):
                raise ValueError(f"{where}: state.{kind} has keys {sorted(got)}, the model needs {sorted(expected)}")
        if not isinstance(params, Mapping):
            raise TypeError(f"{where}: params must be a dict of tensors by parameter name, got {type(params).__name__}")
        unknown = sorted(set(params) - self._names)
        if unknown:  # a misspelt or prefixed name was ignored: that tensor never used, never trained
            raise ValueError(f"{where}: params names {unknown}, which the model does not have (see qat.params())")

    def _check_ranges(self, ranges) -> None:
        """Learned ranges must name quantized points: a misspelt kind or layer would be ignored."""
        if ranges is None:
            return
        if not isinstance(ranges, dict):
            raise TypeError(f"QATModel.apply: ranges must be a dict or None, got {type(ranges).__name__}")
        for kind, given in ranges.items():
            if kind not in ("weights", "activations"):
                raise ValueError(f"QATModel.apply: ranges has the key {kind!r}; expected 'weights' and/or 'activations'")
            if not isinstance(given, dict):
                raise TypeError(f"QATModel.apply: ranges[{kind!r}] must be a dict of LSQParams, got {type(given).__name__}")
            expected = self._state_keys()[kind]
            unknown = sorted(set(given) - set(expected))
            if unknown:
                raise ValueError(f"QATModel.apply: ranges[{kind!r}] names {unknown}, but the model fake-quantizes "
                                 f"the {kind} of {sorted(expected)}")
            dynamic = sorted(set(given) & set(self.dynamic_layers)) if kind == "activations" else []
            if dynamic:
                raise ValueError(f"QATModel.apply: ranges[{kind!r}] gives learned ranges of {dynamic}, but "
                                 f"{_NO_RANGE_TO_LEARN}")

    def _state_keys(self) -> Dict[str, tuple]:
        """`QATState` field -> the layers it holds (none for a kind without observer)."""
        return {"weights": tuple(self.weight_observers), "activations": self.activation_layers,
                "batchnorm": self.batchnorm_layers}

    def _static_activation_observers(self) -> dict:
        """layer -> activation observer of the layers whose ranges are not each batch's own."""
        return {key: observer for key, observer in self.activation_observers.items() if key not in self.dynamic_layers}

    def sync(self, state: QATState, group=None, *, weights: bool = False) -> QATState:
        """Merges the activation observer states across the ranks of ``group`` (one
        `qstats.distributed.all_reduce`), so every rank fake-quantizes with and freezes the same ranges.
        Call it on every rank where ``schedule.sync_at(step)``; weight states too with ``weights=True``;
        batch norm and dynamic activation states (`prepare`) are not synchronised.
        Without a process group the state is returned unchanged.
        Which collectives it calls depends on the model only, never on ``state``: a rank whose state is
        not a `QATState` of the model's layers raises its error, and every other rank a ValueError,
        instead of leaving them waiting.
        """
        # layer -> observer of each kind to merge; dynamic states hold one batch's ranges, which no other
        # rank's batch shares
        observers = {"activations": self._static_activation_observers(),
                     "weights": self.weight_observers if weights else {}}
        observers = {kind: by_layer for kind, by_layer in observers.items() if by_layer}
        try:
            self._check_inputs({}, state, "QATModel.sync")
        except (TypeError, ValueError) as error:
            if observers:  # join the first collective with a tree that fails its local check: the others raise
                with contextlib.suppress(TypeError, ValueError):
                    distributed.all_reduce([object()], next(iter(next(iter(observers.values())).values())), group)
            raise error
        merged = {}
        for kind, by_layer in observers.items():
            states = getattr(state, kind)
            reduced = distributed.all_reduce({key: states[key] for key in by_layer}, by_layer, group)
            merged[kind] = {key: reduced.get(key, value) for key, value in states.items()}
        return state._replace(**merged)

    def learnable_ranges(self, state: QATState, weights: bool = False, activations: bool = True):
        """LSQ/LSQ+ ranges initialised from the observer states (detached float32 copies with
        ``requires_grad=True``), in the ``ranges`` format of `apply`, each from its layer's observer's spec.
        Dynamic activation ranges (`prepare`) have none: they are left out, and where every activation
        range is dynamic, ValueError unless ``activations=False``."""
        if activations and self.dynamic_activations:
            raise ValueError(f"QATModel.learnable_ranges: {_NO_RANGE_TO_LEARN}; pass activations=False")
        self._check_inputs({}, state, "QATModel.learnable_ranges")
        kinds = (("weights", weights, self.weight_observers),
                 ("activations", activations, self._static_activation_observers()))
        return {kind: {key: _learnable(getattr(state, kind)[key], observer.spec, f"the {kind[:-1]} of {key!r}")
                       for key, observer in observers.items()}
                for kind, wanted, observers in kinds if wanted and observers}


class _WeightOf(nn.Module):
    """``model``'s layer ``layer``'s weight (``parameter``: its parameter ``layer``) as a forward
    (`QATModel.observed_weight` calls it functionally), scaled as `_folded_weight` where batch norm ``batchnorm``
    is folded into it."""

    def __init__(self, model: nn.Module, layer: str, batchnorm: Optional[str] = None, parameter: bool = False):
        super().__init__()
        self.model, self.layer, self.batchnorm, self.parameter = model, layer, batchnorm, parameter

    def forward(self, state: Optional[QATState]) -> torch.Tensor:
        owner, _, name = self.layer.rpartition(".") if self.parameter else (self.layer, "", "weight")
        weight = _layer_parameter(self.model.get_submodule(owner), name)
        if self.batchnorm is None:
            return weight
        return _folded_weight(weight, _fold_factor(self.model.get_submodule(self.batchnorm), state, self.batchnorm))


def _learnable(state, spec: QuantSpec, where: str) -> LSQParams:
    """`lsq_init` of one point's state as trainable leaves; an uncalibrated state's error names the point
    and what gives it data."""
    try:
        params = lsq_init(state, spec)
    except ValueError as error:
        advice = f"; {_OBSERVE_FIRST}" if "uncalibrated" in str(error) else ""
        raise ValueError(f"QATModel.learnable_ranges: {where}: {error}{advice}") from error
    return LSQParams(*(t.detach().clone().requires_grad_(True) for t in params))


def _differing_prefixes(name: str, alias: str) -> Tuple[str, str]:
    """The module paths of ``name`` and ``alias``, two names of one tensor, before the parts they end in
    alike: ``("layers.0", "layers.1")`` for ``"layers.0.sub.w"`` and ``"layers.1.sub.w"``."""
    first, second = name.split("."), alias.split(".")
    while first and second and first[-1] == second[-1]:
        first, second = first[:-1], second[:-1]
    return ".".join(first), ".".join(second)


def _extra(state, phase, ranges) -> Dict[str, Any]:
    return dict(zip(_EXTRA_INPUTS, (state, phase, ranges)))
