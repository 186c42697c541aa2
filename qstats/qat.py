"""Quantization-aware training as a pure function of (params, states, batch).

`observe_fake_quantize` is one fake-quant point returning ``(y, new_state)``; `prepare(model)`
rewrites a model with ``torch.fx`` so that ``qat.apply(params, state, x, phase=...)`` returns
``(output, new_state)``. States and the `QATPhase` are explicit, never hidden buffers (docs/qat.md).
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import itertools
import operator
from typing import Any, Dict, Mapping, NamedTuple, Optional, Tuple, Union

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import prune
from torch.nn.utils.weight_norm import WeightNorm

from . import distributed
from ._checks import check_flag, check_floating
from ._qparams import check_calibrated, compute_qparams
from ._quant import fake_quantize
from ._spec import QuantSpec
from ._warn import warn
from .experts import expert_count
from .lsq import LSQParams, check_grad_scale, lsq_fake_quantize, lsq_init
from .observers import Observer
from .schedule import QATPhase

__all__ = [
    "BatchNormState",
    "QATModel",
    "QATState",
    "fake_quantize_ste",
    "observe_fake_quantize",
    "prepare",
]

_STE_MODES = ("clipped", "identity")
# the layers `prepare` can quantize, and the function each computes
_LAYER_FUNCTIONS = {
    nn.Linear: F.linear, nn.Conv1d: F.conv1d, nn.Conv2d: F.conv2d, nn.Conv3d: F.conv3d,
    nn.ConvTranspose1d: F.conv_transpose1d, nn.ConvTranspose2d: F.conv_transpose2d,
    nn.ConvTranspose3d: F.conv_transpose3d, nn.Embedding: F.embedding, nn.EmbeddingBag: F.embedding_bag,
}
_DEFAULT_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
_CONV_TRANSPOSE = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
# the batch norm a layer's output may feed, to fold (prepare's fold_batchnorm): torch.ao's QAT ConvBn1d/2d/3d, LinearBn1d
_FOLDS = {nn.Conv1d: nn.BatchNorm1d, nn.Conv2d: nn.BatchNorm2d, nn.Conv3d: nn.BatchNorm3d, nn.Linear: nn.BatchNorm1d}
# weight-only layers: their inputs are integer ids, never observed (torch.ao's QAT Embedding/EmbeddingBag)
_EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)
# forwards that `prepare` rewrites: a subclass that keeps one is the layer it subclasses
_STOCK_FORWARDS = (*(layer.forward for layer in _LAYER_FUNCTIONS), nn.modules.batchnorm._BatchNorm.forward)
_EXTRA_INPUTS = ("qat_state", "qat_phase", "qat_ranges")  # keyword arguments the rewritten forward takes
# functional calls a traced-through forward makes (a subclass's own forward, `super().forward`): the
# layer type whose ``weight`` they may read, as torch.ao's prepare_qat_fx quantizes functional linear/conv
_FUNCTIONAL_LAYERS = {function: layer for layer, function in _LAYER_FUNCTIONS.items()}
# functional calls that read a parameter or buffer of the model no quantized layer's own forward passes (plain
# parameters, a weight tied to a layer's, a buffer): fake-quantized by the observers of the layer type computing the
# same function (torch.ao's prepare_qat_fx fake-quantizes their weight and input); torch.matmul is none (torch.ao
# gives its operands no weight observer), nor F.embedding (torch.ao's default backend config quantizes the
# nn.Embedding module only: the call stays in float there, whatever the qconfig)
_PARAMETER_CALLS = {F.linear: nn.Linear, F.conv1d: nn.Conv1d, F.conv2d: nn.Conv2d, F.conv3d: nn.Conv3d,
                    F.conv_transpose1d: nn.ConvTranspose1d, F.conv_transpose2d: nn.ConvTranspose2d,
                    F.conv_transpose3d: nn.ConvTranspose3d}


def _select(flag, if_true, if_false):
    """``if_true if flag else if_false`` for a Python bool, elementwise ``torch.where`` for a bool
    tensor (tensors, or NamedTuples of the same structure: observer states, those with NamedTuples
    nested in them included)."""
    if isinstance(flag, bool):
        return if_true if flag else if_false
    if not isinstance(flag, torch.Tensor) or flag.dtype != torch.bool:
        raise TypeError(f"QATPhase flags must be Python bools or bool tensors, got {flag!r}")
    return _where(flag, if_true, if_false)


def _where(flag: torch.Tensor, if_true, if_false):
    if isinstance(if_true, torch.Tensor):
        return torch.where(flag, if_true, if_false)
    return type(if_true)(*(_where(flag, a, b) for a, b in zip(if_true, if_false)))


def _check_ste(ste: str) -> None:
    if ste not in _STE_MODES:
        raise ValueError(f"ste must be one of {_STE_MODES}, got {ste!r}")


def fake_quantize_ste(x: torch.Tensor, qparams, spec: QuantSpec, ste: str = "clipped") -> torch.Tensor:
    """`qstats.fake_quantize` with a choice of straight-through gradient.

    ``ste="clipped"``: 1 inside the representable range, 0 where clipped (torch.ao's fake quant);
    ``ste="identity"``: 1 everywhere but at ±Inf (0 there: ``x - x.detach()`` would be ``inf - inf``,
    a NaN in the forward where the fake-quantized value is the range's end).
    """
    _check_ste(ste)
    if ste == "clipped":
        return fake_quantize(x, qparams, spec)
    value = fake_quantize(x.detach(), qparams, spec)
    passthrough = x - x.detach()  # 0, with gradient 1
    return value + torch.where(torch.isinf(x.detach()), torch.zeros_like(passthrough), passthrough)


def observe_fake_quantize(
    x: torch.Tensor,
    state,
    observer: Observer,
    phase: QATPhase = QATPhase(),
    *,
    ste: str = "clipped",
    learned: Optional[LSQParams] = None,
    grad_scale="torch_ao",
    qparams_options: Optional[Dict[str, Any]] = None,
) -> Tuple[torch.Tensor, Any]:
    """One QAT fake-quant point: ``(fake_quantized_x, new_state)``. Pure.

    Args:
      x: the weight or activation.
      state: the observer's state for this tensor (``observer.init(x)`` at first).
      observer: a qstats Observer; its ``spec`` is the quantization target.
      phase: `QATPhase`: observe ``x`` (detached), then fake-quantize with the updated state, as
        torch.ao's FakeQuantize; bools branch, bool tensors select with ``torch.where``.
      ste: ``"clipped"`` (0 gradient where clipped, torch.ao's) or ``"identity"`` straight-through gradient.
      learned: optional `LSQParams` to fake-quantize with instead (LSQ/LSQ+).
      grad_scale: gradient scale of the learned range (see `qstats.lsq_grad_factor`).
      qparams_options: keyword options for `compute_qparams` (e.g. a histogram method).

    Raises:
      ValueError: in eager mode, fake-quantizing from a state that saw no data under
        ``on_uncalibrated="raise"`` (in a `prepare`d model, naming the layer).

    >>> import torch, qstats
    >>> obs = qstats.minmax(qstats.QuantSpec(dtype="int8"))
    >>> x = torch.tensor([-1.0, 0.5, 2.0])
    >>> y, state = qstats.observe_fake_quantize(x, obs.init(x), obs)
    >>> state.max_val
    tensor(2.)
    """
    return _observe_fake_quantize(x, state, observer, phase, ste, learned, grad_scale, qparams_options,
                                  "observe_fake_quantize", "observe_fake_quantize")


def _observe_fake_quantize(x, state, observer, phase, ste, learned, grad_scale, qparams_options, where: str,
                           point: str):
    """`observe_fake_quantize`; ``where`` begins the error of a state that saw no data, ``point`` that of an ``x``
    that is no floating-point tensor (a layer's point names the layer)."""
    if not isinstance(observer, Observer):
        raise TypeError(f"observe_fake_quantize: observer must be a qstats Observer, got {type(observer).__name__}")
    if not isinstance(phase, QATPhase):
        raise TypeError(f"observe_fake_quantize: phase must be a QATPhase, got {type(phase).__name__}")
    _check_ste(ste)
    spec = observer.spec
    if phase.fake_quantize is not False:
        if not isinstance(spec, QuantSpec):
            raise TypeError(f"observe_fake_quantize: the {observer.name} observer has no QuantSpec to fake-quantize "
                            f"to (spec={spec!r}); use it with phase.fake_quantize=False, or pass an observer built "
                            "from a QuantSpec")
        check_floating(x, point)
    new_state = state
    if phase.observe is not False:
        new_state = _select(phase.observe, observer.update(state, x.detach()), state)
    if phase.fake_quantize is False:
        return x, new_state
    if learned is not None:
        y = lsq_fake_quantize(x, learned, spec, grad_scale)
    else:
        # computed with the fallback, then checked under ``where``; a tensor flag computes qparams where it
        # then keeps ``x``: a state that saw no data must not raise there
        fallback = spec if spec.on_uncalibrated == "fallback" else spec.replace(on_uncalibrated="fallback")
        qparams = compute_qparams(new_state, fallback, **(qparams_options or {}))
        if isinstance(phase.fake_quantize, bool):
            check_calibrated(qparams.calibrated, spec, where)
        y = fake_quantize_ste(x, qparams, spec, ste)
    return _select(phase.fake_quantize, y, x), new_state


# ------------------------------------------------------------------------------------------------
# Whole models


class BatchNormState(NamedTuple):
    """Running statistics of one batch-norm layer (a QAT state like the observers')."""

    running_mean: torch.Tensor
    running_var: torch.Tensor
    num_batches_tracked: torch.Tensor


class QATState(NamedTuple):
    """Everything a QAT model carries between steps besides its parameters (a pytree).

    Attributes:
      weights: layer name -> observer state of that layer's weight.
      activations: layer name -> observer state of that layer's input activation.
      batchnorm: batch-norm layer name -> `BatchNormState`.
    """

    weights: Dict[str, Any]
    activations: Dict[str, Any]
    batchnorm: Dict[str, BatchNormState]


def _check_extra(state, phase, key: Optional[str] = None) -> QATPhase:
    """The rewritten forward's ``qat_state`` and ``qat_phase`` (None unless given: a bare AttributeError);
    returns layer ``key``'s phase: ``qat_phase``, or its entry where it maps layers to phases
    (`QATModel.apply`'s ``layer_phases``, resolved)."""
    if not isinstance(state, QATState):
        raise TypeError(f"QATModel.module: qat_state must be a QATState (qat.init(x)), got {type(state).__name__}; "
                        "call qat.apply(params, state, x, phase=...)")
    if isinstance(phase, Mapping):
        phase = phase.get(key)
    if not isinstance(phase, QATPhase):
        raise TypeError(f"QATModel.module: qat_phase must be a QATPhase, or a dict of them with an entry for layer "
                        f"{key!r}; got {type(phase).__name__}")
    return phase


class _FakeQuantPoint(nn.Module):
    """Graph node: observe and fake-quantize one tensor, reading and returning its state."""

    def __init__(self, kind: str, key: str, observer: Observer, ste: str, grad_scale, dynamic: bool):
        super().__init__()
        self.kind, self.key, self.observer, self.ste, self.grad_scale = kind, key, observer, ste, grad_scale
        self.dynamic = dynamic  # the batch's own range, whatever the phase (`_dynamic`)

    def forward(self, x, state: QATState, phase: QATPhase, ranges, previous=None):
        # previous: the state returned by this layer's earlier call in the same pass (a module
        # called more than once), so that every call observes into one chained state.
        phase = _check_extra(state, phase, self.key)
        current = getattr(state, self.kind).get(self.key)
        if current is None:  # QATModel.init: size the state on the example input
            return x, self.observer.init(x) if previous is None else previous
        learned = (ranges or {}).get(self.kind, {}).get(self.key)
        if self.dynamic:
            current, previous, phase = self.observer.init(x), None, phase._replace(observe=True)
        point = f"QATModel.apply: the {'weight' if self.kind == 'weights' else 'input'} of layer {self.key!r}"
        uncalibrated = _uncalibrated("QATModel.apply", self.kind, self.key)
        return _observe_fake_quantize(x, current if previous is None else previous, self.observer, phase, self.ste,
                                      learned, self.grad_scale, None, uncalibrated, f"{point} (fake-quantized)")


# what gives a layer's point data before it is fake-quantized or its range learned
_OBSERVE_FIRST = ("observe it first: steps with phase.observe=True (QATSchedule's observe_at before fake_quantize_at), "
                  "or qat.apply on calibration batches with QATPhase(fake_quantize=False)")


def _uncalibrated(where: str, kind: str, key: str) -> str:
    """The start of the error of layer ``key``'s point of ``kind`` whose state saw no data."""
    point = "weight" if kind == "weights" else "input"
    return f"{where}: the {point} of layer {key!r} is fake-quantized from a state that saw no data; {_OBSERVE_FIRST}"


# torchao refuses range learning with is_dynamic: a range learned per row of one batch means nothing to another's
_NO_RANGE_TO_LEARN = ("the activation ranges are dynamic (each batch's own: per row, token or group, or "
                      "dynamic_activations=True), so there is no range to learn (torchao refuses range_learning "
                      "with is_dynamic)")


def _dynamic(observer: Observer, dynamic_activations: bool) -> bool:
    """Whether the activation points are dynamic: each call observes its own input into a fresh state,
    whatever the phase, so the state's shape follows the batch's. Ranges per row (`Granularity.row_wise`)
    always are (torchao's fake quantizers: no other batch has the same rows), every range with
    ``dynamic_activations`` (coreai_opt's "dynamic" calculators, compressed-tensors' dynamic)."""
    granularity = getattr(observer.spec, "granularity", None)
    return dynamic_activations or (granularity is not None and granularity.row_wise())


class _BatchNormPoint(nn.Module):
    """Graph node: batch norm as a pure function of its running statistics."""

    def __init__(self, key: str, module: nn.modules.batchnorm._BatchNorm):
        super().__init__()
        self.key, self.eps, self.momentum = key, module.eps, module.momentum

    def forward(self, x, weight, bias, running_mean, running_var, num_batches_tracked, state: QATState, phase,
                previous=None):
        phase = _check_extra(state, phase, self.key)
        current = state.batchnorm.get(self.key)
        if current is None:  # QATModel.init (a later call of the same layer keeps the first call's state)
            return x, previous or BatchNormState(running_mean.detach().clone(), running_var.detach().clone(),
                                                 num_batches_tracked.clone())
        current = current if previous is None else previous  # a later call of the same layer: chain its statistics
        frozen = phase.freeze_batchnorm
        if isinstance(frozen, torch.Tensor) and x.ndim > 1 and x.shape[0] * x.shape[2:].numel() == 1:
            # a tensor flag computes both sides, and batch statistics of one value per channel are F.batch_norm's
            # ValueError ("when training"), even where the flag freezes it
            raise ValueError(f"QATModel.apply: batch norm {self.key!r} gets one value per channel (input "
                             f"{list(x.shape)}), which only a frozen batch norm normalises, and phase.freeze_batchnorm "
                             "is a tensor, for which both sides are computed; pass freeze_batchnorm=True as a Python "
                             "bool (QATPhase(observe=False, fake_quantize=True, freeze_batchnorm=True))")
        y_eval = y_train = updated = None  # a bool flag computes one side only
        if frozen is not False:
            y_eval = F.batch_norm(x, current.running_mean, current.running_var, weight, bias, False, 0.0, self.eps)
        if frozen is not True:
            y_train = F.batch_norm(x, None, None, weight, bias, True, 0.0, self.eps)
            updated = self._updated(x, current)
        return _select(frozen, y_eval, y_train), _select(frozen, current, updated)

    def _updated(self, x, current: BatchNormState) -> BatchNormState:
        """Running statistics after the batch ``x``, as ``nn.BatchNorm``: an empty batch counts but
        leaves the statistics as they were (their mean and variance would be NaN)."""
        count = current.num_batches_tracked + 1
        if x.numel() == 0:
            return BatchNormState(current.running_mean, current.running_var, count)
        # in float32, float64 for float64 models, as nn.BatchNorm's CPU kernel; its reductions and update
        # round otherwise, so the statistics can differ from it in their last bit (in bfloat16, where it rounds
        # every operation, by a few ulps after many steps: docs/qat.md)
        compute = torch.promote_types(torch.promote_types(x.dtype, current.running_mean.dtype), torch.float32)
        dims = [0] + list(range(2, x.ndim))
        batch_var, batch_mean = torch.var_mean(x.detach().to(compute), dim=dims, correction=1)
        momentum = 1.0 / count.to(compute) if self.momentum is None else self.momentum
        mean, var = (
            (momentum * batch + (1 - momentum) * running.to(compute)).to(running.dtype)
            for batch, running in ((batch_mean, current.running_mean), (batch_var, current.running_var))
        )
        return BatchNormState(mean, var, count)


def _bound_inputs(layer: nn.Module, key: str, node) -> Dict[str, Any]:
    """The call's arguments by the names of the layer's forward (``input``, ConvTranspose's ``output_size``,
    EmbeddingBag's ``offsets`` and ``per_sample_weights``)."""
    try:
        return inspect.signature(type(layer).forward).bind(layer, *node.args, **node.kwargs).arguments
    except TypeError as error:
        raise ValueError(f"qstats.qat.prepare: layer {key!r} ({type(layer).__name__}) is called with arguments its "
                         f"forward does not take: {error}") from error


class _Substituted:
    """``layer`` as its stock forward reads it: ``weight`` (the fake-quantized one) and ``sparse`` replaced,
    every other attribute the layer's as `_layer_parameter` reads it; the layer stays as it is."""

    def __init__(self, layer: nn.Module, weight, sparse: bool):
        self.layer, self.weight, self.sparse = layer, weight, sparse

    def __getattr__(self, name: str):
        return _layer_parameter(self.layer, name)


def _stock_forward(layer: nn.Module, weight, sparse: bool, arguments: Dict[str, Any]):
    """``layer`` computed by the forward of the class of `_LAYER_FUNCTIONS` it is an instance of, with
    ``weight`` and (an embedding's) ``sparse`` in place of its own, running no hook. With
    ``max_norm``, an embedding renorms a copy of ``weight``: F.embedding renorms the rows it looks up in
    place, and ``weight`` is the parameter itself where nothing fake-quantizes it (torch.ao's QAT Embedding
    renorms its fake-quantized copy; the parameter stays as given)."""
    if getattr(layer, "max_norm", None) is not None:
        weight = weight.clone()
    forward = next(cls.forward for cls in _LAYER_FUNCTIONS if isinstance(layer, cls))
    return forward(_Substituted(layer, weight, sparse), **arguments)


# forward pre-hooks that compute a layer's parameter before each call from other attributes:
# torch.nn.utils.prune's (``name_orig * name_mask``) and the deprecated torch.nn.utils.weight_norm's
# (``name_g``, ``name_v``); the rewritten call runs no hook, so `_layer_parameter` computes them as they do


def _computing_hook(layer: nn.Module, name: str):
    """The pruning or weight-norm hook that computes ``layer``'s ``name`` before each call, or None."""
    return next((hook for hook in layer._forward_pre_hooks.values() if _computes(hook) == name), None)


def _computes(hook) -> Optional[str]:
    if isinstance(hook, prune.BasePruningMethod):
        return hook._tensor_name
    return hook.name if isinstance(hook, WeightNorm) else None


def _layer_parameter(layer: nn.Module, name: str):
    """``layer``'s attribute ``name`` (weight, bias, ...) as its forward reads it: where a pruning or weight-norm
    hook computes it (`_computing_hook`), computed as the hook does (the attribute holds the last call's result,
    with no gradient to the hook's parameters): a pruned one as torch.nn.utils.prune's ``apply_mask``
    (``mask * orig``), a weight-normed one with ``torch._weight_norm(v, g, dim)``; a parametrized one is
    computed from its parametrization."""
    hook = _computing_hook(layer, name)
    if hook is None:
        return getattr(layer, name)
    if isinstance(hook, prune.BasePruningMethod):
        orig = getattr(layer, f"{name}_orig")
        return getattr(layer, f"{name}_mask").to(dtype=orig.dtype) * orig
    return torch._weight_norm(getattr(layer, f"{name}_v"), getattr(layer, f"{name}_g"), hook.dim)


def _conv_layout(weight: torch.Tensor, groups: int) -> torch.Tensor:
    """A transposed convolution's weight ``[in, out/groups, *k]`` in the layout of a convolution's,
    ``[out, in/groups, *k]`` (output channel ``g * out/groups + j`` is column ``j`` of group ``g``'s rows),
    so that a weight spec reads as for Conv: ``PerAxis(0)`` is per output channel. Its own inverse."""
    rows, columns, kernel = weight.shape[0], weight.shape[1], weight.shape[2:]
    grouped = weight.reshape(groups, rows // groups, columns, *kernel).transpose(1, 2)
    return grouped.reshape(groups * columns, rows // groups, *kernel)


def _fold_factor(batchnorm: nn.modules.batchnorm._BatchNorm, state: QATState, key: str) -> torch.Tensor:
    """``weight / sqrt(running_var + eps)`` of batch norm ``key``, from its running variance in ``state``
    before this step's update (the module's own at `QATModel.init`), as torch.ao's QAT ConvBn scales the weight."""
    _check_extra(state, QATPhase())
    current = state.batchnorm.get(key)
    running_var = batchnorm.running_var if current is None else current.running_var
    gamma = batchnorm.weight if batchnorm.weight is not None else torch.ones_like(running_var)
    return gamma / torch.sqrt(running_var + batchnorm.eps)


def _folded_weight(weight: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """The weight scaled per output channel by the batch norm's `_fold_factor`."""
    return weight * factor.reshape(-1, *[1] * (weight.ndim - 1))


def _folded_call(layer: nn.Module, x: torch.Tensor, weight: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """The layer's output before its batch norm, computed from the fake-quantized folded ``weight`` as
    torch.ao's QAT ConvBn/LinearBn1d (``_forward_approximate``): without bias, divided by the factor, plus
    the layer's own bias."""
    zero_bias = torch.zeros(weight.shape[0], dtype=x.dtype, device=weight.device)
    y = F.linear(x, weight, zero_bias) if isinstance(layer, nn.Linear) else layer._conv_forward(x, weight, zero_bias)
    shape = (1, -1, *[1] * (weight.ndim - 2))
    y = y / factor.reshape(shape)
    bias = _layer_parameter(layer, "bias")
    return y if bias is None else y + bias.reshape(shape)


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


def _layer_types(layers) -> Tuple[type, ...]:
    """`prepare`'s ``layers`` (one type, a list or a tuple of them) as a tuple of nn.Module subclasses."""
    if isinstance(layers, (type, list)):
        layers = (layers,) if isinstance(layers, type) else tuple(layers)
    if not (isinstance(layers, tuple) and layers and all(isinstance(t, type) and issubclass(t, nn.Module) for t in layers)):
        raise TypeError(f"qstats.qat.prepare: layers must be nn.Module subclasses (Linear, Conv1d/2d/3d, ConvTranspose1d/2d/3d, "
                        f"Embedding, EmbeddingBag), got {layers!r}")
    return layers


def prepare(
    model: nn.Module,
    weight_observer: Union[Observer, Mapping[type, Optional[Observer]], None] = None,
    activation_observer: Union[Observer, Mapping[type, Optional[Observer]], None] = None,
    *,
    layers: Tuple[type, ...] = _DEFAULT_LAYERS,
    ste: str = "clipped",
    grad_scale="torch_ao",
    dynamic_activations: bool = False,
    fold_batchnorm: bool = False,
) -> QATModel:
    """Rewrites ``model`` (with ``torch.fx.symbolic_trace``) for pure QAT; ``model`` is not modified.

    The weight of every layer of a type in ``layers`` (Linear, Conv1d/2d/3d by default; also Embedding,
    EmbeddingBag, ConvTranspose1d/2d/3d) goes through ``weight_observer`` and its input through
    ``activation_observer`` (None: leave that kind in float). So do those of an ``F.linear``/``F.conv1d/2d/3d``
    (``F.conv_transpose1d/2d/3d`` where ``layers`` has ConvTranspose) call given a parameter or buffer of the model
    as its weight outside that layer's own forward (a custom block's ``F.linear(x, self.proj)``, a head tied to an
    embedding), with the observers of the layer type computing that function, in points named after the parameter
    (``qat.parameter_layers``), as torch.ao's ``prepare_qat_fx``; and those of such a call given a weight computed
    in the forward (``F.linear(x, self.a @ self.b)``), in points named after the call's node under the module
    making it (``"block.linear_1"``). F.embedding calls stay in float, as in torch.ao. Each observer may also be a
    mapping ``{layer type: Observer or None}`` (torch.ao's ``QConfigMapping.set_object_type``): a layer takes the observer of the
    first type in the mapping's order that it is an instance of; a layer of no type in it stays in float
    for that kind, as torch.ao gives it the global qconfig, None unless set (a last ``nn.Module: observer``
    entry is ``set_global``). Embeddings are weight-only (their inputs are ids); a transposed convolution's weight is observed in a convolution's layout, ``[out, in/groups, *k]``.
    Batch-norm layers become pure functions of a `BatchNormState`. A layer called several times per
    forward keeps one state per kind (docs/qat.md). Activation ranges per row (per token, group, ...) are
    each batch's own, whatever the phase; ``dynamic_activations=True`` makes every activation range so
    (coreai_opt's "dynamic" calculators), per tensor and per channel too. ``fold_batchnorm=True`` fake-quantizes
    the weight of a Conv1d/2d/3d or Linear that feeds a batch norm scaled by the batch norm's running statistics,
    as torch.ao's QAT ConvBn/LinearBn1d modules (``prepare_qat_fx`` fuses them); the parameters stay separate.

    Raises:
      ValueError: a mapping names a type that matches no type of ``layers``, names a type after one of its
        base classes (that entry would never be used), or gives an embedding type an activation observer.

    >>> import torch, qstats
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    >>> qat = qstats.qat.prepare(
    ...     model,
    ...     weight_observer=qstats.memoryless_minmax(qstats.QuantSpec("int8", granularity=qstats.PerAxis(0))),
    ...     activation_observer=qstats.moving_average_minmax(qstats.QuantSpec("uint8", "asymmetric"), 0.01))
    >>> x = torch.randn(5, 4)
    >>> state = qat.init(x)
    >>> out, state = qat.apply(qat.params(), state, x, phase=qstats.QATPhase())
    >>> sorted(state.activations)
    ['0', '2']
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"qstats.qat.prepare: model must be an nn.Module, got {type(model).__name__}")
    _check_ste(ste)
    check_grad_scale(grad_scale)
    for name, flag in (("dynamic_activations", dynamic_activations), ("fold_batchnorm", fold_batchnorm)):
        check_flag(flag, name, "qstats.qat.prepare")
    layers = _layer_types(layers)
    weight_entries = _observer_entries(weight_observer, layers, "weight_observer")
    activation_entries = _observer_entries(activation_observer, layers, "activation_observer")
    _refuse_embedding_activations(activation_entries)  # a single observer or None names no embedding type
    _refuse_stacked_experts(model)
    _refuse_lazy(model)
    rewriter = _Rewriter(_trace(model, layers), weight_entries, activation_entries, ste, grad_scale, dynamic_activations,
                         fold_batchnorm)
    _warn_float_layers(model, layers, rewriter, rewriter.rewrite(model, layers))
    if not rewriter.quantized:
        named = _float_calls(model, layers, rewriter)
        calls = (f"; its calls {', '.join(named)} read weights held outside such layers that it does not "
                 f"fake-quantize ({_FLOAT_CALLS}): hold each weight in such a layer or as a parameter given as it is to "
                 "F.linear/F.conv1d/2d/3d, or quantize it with qstats.observe_fake_quantize") if named else ""
        raise ValueError(f"qstats.qat.prepare: the model has no layer of the types {[t.__name__ for t in layers]}{calls}")
    activation_observers = rewriter.observers["activations"]  # every quantized layer but embeddings, given one
    if isinstance(activation_observer, Observer) and not activation_observers:
        raise ValueError(
            f"qstats.qat.prepare: an activation_observer is given, but the quantized layers {rewriter.quantized} are "
            "embeddings, whose inputs are integer ids: they are quantized weight-only (as torch.ao's QAT Embedding); "
            "pass activation_observer=None")
    module = rewriter.finish()
    dynamic = [key for key, observer in activation_observers.items() if _dynamic(observer, dynamic_activations)]
    return QATModel(module, weight_observer, activation_observer, rewriter.quantized, rewriter.batchnorms,
                    _aliases(model, module), rewriter.observers["weights"], activation_observers, dynamic,
                    rewriter.folded, rewriter.parameter_calls, rewriter.parameter_groups, rewriter.computed)


def _differing_prefixes(name: str, alias: str) -> Tuple[str, str]:
    """The module paths of ``name`` and ``alias``, two names of one tensor, before the parts they end in
    alike: ``("layers.0", "layers.1")`` for ``"layers.0.sub.w"`` and ``"layers.1.sub.w"``."""
    first, second = name.split("."), alias.split(".")
    while first and second and first[-1] == second[-1]:
        first, second = first[:-1], second[:-1]
    return ".".join(first), ".".join(second)


def _aliases(model: nn.Module, module: nn.Module) -> Dict[str, str]:
    """The names of ``model``'s parameters and buffers that ``module`` lacks, each mapped to the name its
    tensor has in ``module``: a module registered several times (``nn.ModuleList([block] * n)``) is kept by
    torch.fx under its first name only."""
    first = {id(tensor): name for name, tensor in reversed(_named_tensors(module))}  # reversed: the first name wins
    kept = {name for name, _ in _named_tensors(module)}
    return {name: first[id(tensor)] for name, tensor in _named_tensors(model) if name not in kept and id(tensor) in first}


def _named_tensors(module: nn.Module) -> list:
    """``(name, tensor)`` of ``module``'s parameters and buffers, a shared one under each of its names."""
    return [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]


def _refuse_stacked_experts(model: nn.Module) -> None:
    """Stacked experts (``[E, out, in]`` parameters, transformers' fused experts) are no Linear: the
    rewrite would leave them in float, training unquantized. They raise, naming the modules."""
    stacked = [f"{repr(name) if name else 'the model'} ({type(module).__name__}, {count} experts)"
               for name, module in model.named_modules() for count in (expert_count(module),) if count]
    if stacked:
        more = f" and {len(stacked) - 3} more" if len(stacked) > 3 else ""
        raise ValueError(
            f"qstats.qat.prepare: {', '.join(stacked[:3])}{more} hold stacked experts, which prepare does not fake-quantize "
            "(they would train in float); train such a model with qstats.fake_quantized (per-expert qparams, "
            "straight-through gradients; docs/qat.md)")


def _refuse_lazy(model: nn.Module) -> None:
    """Lazy modules (``nn.LazyLinear``, ``nn.LazyConv2d``, ...) whose parameters are not yet materialized have no
    shape to size states on: ValueError naming them (``QATModel.init`` failed later, naming none)."""
    lazy = [f"{repr(name) if name else 'the model'} ({type(module).__name__})" for name, module in model.named_modules()
            if any(nn.parameter.is_lazy(t) for t in (*module.parameters(recurse=False), *module.buffers(recurse=False)))]
    if lazy:
        raise ValueError(f"qstats.qat.prepare: {', '.join(lazy)} have uninitialized (lazy) parameters; run the model "
                         "once on an example input first, which gives them their shapes")


def _functional_owner(model: nn.Module, node, layers) -> Optional[str]:
    """The name of the layer (of a type in ``layers`` and of the kind the function computes) whose own
    ``weight`` parameter ``node`` (an ``F.linear``/``F.convNd`` call) reads in that layer's own forward
    (traced through), or None: a call elsewhere (``F.linear(h, self.head.weight)``) is one of its own, with its
    own points (`_parameter_call`), as torch.ao's prepare_qat_fx gives it fake quants apart from the layer's."""
    weight = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
    if not isinstance(weight, torch.fx.Node) or weight.op != "get_attr":
        return None
    try:
        tensor = model.get_parameter(str(weight.target))
    except AttributeError:  # a buffer or a plain attribute
        return None
    for name in reversed(_module_stack(node)):
        try:
            module = model.get_submodule(name)
        except AttributeError:
            continue
        if (isinstance(module, layers) and isinstance(module, _FUNCTIONAL_LAYERS[node.target])
                and getattr(module, "weight", None) is tensor):
            return name
    return None


def _parameter_call(model: nn.Module, node, layers) -> Optional[str]:
    """The name of the parameter or buffer that ``node``, an ``F.linear``/``F.convNd``/``F.conv_transposeNd`` call
    no layer's own forward makes with its weight (`_functional_owner`), reads as its weight, where the layer type
    computing that function is (a subclass of) a type of ``layers`` and, for a transposed convolution, ``groups`` is
    a Python int (`_call_groups`); None for another call (a computed weight, a plain attribute's or an integer one
    stays in float)."""
    weight = _call_weight(node)
    if _call_kind(node, layers) is None or weight.op != "get_attr":
        return None
    tensor = _model_tensor(model, str(weight.target))  # None: a plain attribute (a tensor constant)
    return str(weight.target) if tensor is not None and tensor.is_floating_point() else None


def _model_tensor(model: nn.Module, name: str) -> Optional[torch.Tensor]:
    """``model``'s parameter or buffer ``name``, or None where ``name`` is neither (a plain attribute)."""
    for get in (model.get_parameter, model.get_buffer):
        try:
            return get(name)
        except AttributeError:  # no such module or attribute, or another kind of attribute
            continue
    return None


def _call_weight(node):
    """The ``weight`` argument of ``node``, an ``F.linear``/``F.convNd``/... call."""
    return node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")


def _call_kind(node, layers) -> Optional[type]:
    """The layer type computing the function of ``node`` (`_PARAMETER_CALLS`), where it is (a subclass of) a type of
    ``layers``, the call's weight is a node of the graph and a transposed convolution's ``groups`` a Python int;
    else None."""
    kind = _PARAMETER_CALLS.get(node.target)
    if kind is None or not any(issubclass(kind, t) for t in layers) or not isinstance(_call_weight(node), torch.fx.Node):
        return None
    return None if issubclass(kind, _CONV_TRANSPOSE) and _call_groups(node) is None else kind


def _module_stack(node) -> list:
    """The paths of the modules whose forwards make ``node``'s call, outermost first."""
    return [entry[0] if isinstance(entry, tuple) else key
            for key, entry in (node.meta.get("nn_module_stack") or {}).items()]


def _model_names(model: nn.Module) -> frozenset:
    """The names of ``model``'s modules, parameters and buffers (`_computed_key` names no point after one)."""
    return frozenset({*dict(model.named_modules()), *dict(_named_tensors(model))})


def _computed_key(node, taken, names: frozenset) -> str:
    """The name of the points of ``node``, a call of a computed weight: its node's name in the traced graph under
    the path of the module whose forward makes it (``"block.linear_1"``), with ``_1``, ``_2``, ... appended where
    that name is in ``names`` (the model's modules, parameters and buffers: `_model_names`) or in ``taken`` (other
    points): a module ``linear`` whose masked weight its parent's forward passes to ``F.linear`` gives the call's
    points ``"linear_1"``."""
    stack = _module_stack(node)
    key = f"{stack[-1]}.{node.name}" if stack and stack[-1] else node.name
    candidates = itertools.chain([key], (f"{key}_{i}" for i in itertools.count(1)))
    return next(name for name in candidates if name not in names and name not in taken)


def _weight_graph(gm: torch.fx.GraphModule, weight) -> Union[torch.fx.GraphModule, str]:
    """A GraphModule computing the node ``weight`` from ``gm``'s parameters and buffers (`QATModel.observed_weight`
    calls it), or what else it reads, for its error: an input of the forward, or the QAT state and phase of a
    fake-quantized layer whose output it is computed from."""
    needed, pending = set(), [weight]
    while pending:
        node = pending.pop()
        if node not in needed:
            needed.add(node)
            pending.extend(node.all_input_nodes)
    inputs = {node.target for node in needed if node.op == "placeholder"}
    if inputs - set(_EXTRA_INPUTS):
        return "the forward's inputs"
    if inputs:
        return "the output of a fake-quantized layer (of the QAT state and phase)"
    graph, copies = torch.fx.Graph(), {}
    for node in gm.graph.nodes:
        if node in needed:
            copies[node] = graph.node_copy(node, copies.__getitem__)
    graph.output(copies[weight])
    return torch.fx.GraphModule(gm, graph, "ComputedWeight")


def _call_groups(node) -> Optional[int]:
    """``groups`` of ``node``, an ``F.conv_transposeNd`` call (its 7th argument), where it is a Python int."""
    groups = node.args[6] if len(node.args) > 6 else node.kwargs.get("groups", 1)
    return groups if isinstance(groups, int) and not isinstance(groups, bool) else None


# the functional calls `prepare` leaves in float, and what torch.ao's prepare_qat_fx does with them
_FLOAT_CALLS = ("F.embedding/F.embedding_bag calls, which torch.ao's prepare_qat_fx leaves in float too; integer "
                "weights, tensor attributes that are no parameter or buffer, transposed convolutions whose groups is "
                "no Python int")


def _float_call(node, layers) -> Optional[Tuple[str, str]]:
    """``node``, an ``F.linear``/``F.convNd``/... call (of a kind a type of ``layers`` computes) that reads no
    quantized layer's own weight, as ``(the path of the module whose forward makes it, a description for
    `prepare`'s warning: "F.conv2d(weight 'w') in 'block'")``. torch.ao's ``prepare_qat_fx`` fake-quantizes such a
    call's weight and input; `prepare` leaves it in float."""
    kind = _FUNCTIONAL_LAYERS[node.target]
    if not any(issubclass(kind, t) or issubclass(t, kind) for t in layers):
        return None
    stack = _module_stack(node)
    caller = stack[-1] if stack else ""
    weight = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
    read = (f"weight {str(weight.target)!r}" if isinstance(weight, torch.fx.Node) and weight.op == "get_attr"
            else "a computed weight")
    return caller, f"F.{getattr(node.target, '__name__', node.target)}({read}) in {repr(caller) if caller else 'the model'}"


def _float_calls(model: nn.Module, layers, rewriter) -> list:
    """The descriptions of `_float_call`'s calls, but those in the forward of a layer that stays in float (a
    traced-through subclass whose own weight it could not find: the layer is named instead)."""
    return [text for caller, text in rewriter.float_calls
            if not (caller and isinstance(model.get_submodule(caller), layers) and caller not in rewriter.quantized)]


# in-place operators a traced forward may apply to a buffer (``self.count += 1``); methods ending in one "_" too
_IN_PLACE = (operator.iadd, operator.isub, operator.imul, operator.itruediv)
# functions that update the running statistics they are given unless told not to: (position, keyword) of that flag
_UPDATES_STATISTICS = {F.batch_norm: (5, "training"), F.instance_norm: (5, "use_input_stats")}


def _buffer_writers(graph: torch.fx.Graph, buffers) -> list:
    """The modules (by the path of the buffer's owner) whose traced forward writes one of ``buffers`` (names) in
    place: ``F.batch_norm``/``F.instance_norm`` updating running statistics it reads from them (a norm module of
    one's own), in-place methods and operators on them. Sorted, each once."""

    def buffer(node) -> Optional[str]:
        return str(node.target) if isinstance(node, torch.fx.Node) and node.op == "get_attr" \
            and str(node.target) in buffers else None

    written = []
    for node in graph.nodes:
        if node.op == "call_function" and node.target in _UPDATES_STATISTICS:
            position, keyword = _UPDATES_STATISTICS[node.target]
            flag = node.args[position] if len(node.args) > position else node.kwargs.get(keyword, False)
            statistics = node.args[1] if len(node.args) > 1 else node.kwargs.get("running_mean")
            written.append(buffer(statistics) if flag is not False else None)
        elif node.args and (node.op == "call_function" and node.target in _IN_PLACE or node.op == "call_method"
                            and node.target.endswith("_") and not node.target.endswith("__")):
            written.append(buffer(node.args[0]))
    return sorted({name.rpartition(".")[0] for name in written if name is not None})


def _warn_float_layers(model: nn.Module, layers, rewriter, hidden) -> None:
    """Names the layers `prepare` could not rewrite: those inside modules torch.fx keeps whole
    (``hidden``: name -> that module's type name), and subclasses with their own forward that torch.fx
    traced through (a weight not passed as is to F.linear/F.convNd, a batch norm's hidden buffers); also
    rewritten layers with hooks (not run; a traced-through layer's ran once on proxies), instance norms
    that track running statistics (buffers updated in place), SyncBatchNorm layers (rewritten to
    batch norms of each rank's own batch) and, with ``fold_batchnorm``, batch norms after a quantized layer that
    were not folded into it."""
    if hidden:
        warn(f"qstats.qat.prepare: {sorted(hidden)} run inside {sorted(set(hidden.values()))}, which torch.fx "
             "does not trace into: they stay in float")
    if rewriter.hooked:
        warn(f"qstats.qat.prepare: layers {rewriter.hooked} have forward or backward hooks, which the rewritten "
             "model does not run (it computes them with F.linear, F.conv, F.batch_norm, ...; torch.nn.utils.prune's "
             "masks are applied)")
    if rewriter.unfolded:
        warn(f"qstats.qat.prepare: fold_batchnorm=True, but batch norms {rewriter.unfolded} are not folded into the "
             "layer before them (folded: a Conv1d/2d/3d or Linear of torch.nn's forward, with a weight observer, whose "
             "output feeds only a batch norm of its dimension tracking running statistics, each called once, and whose "
             "batch norm weight holds no 0, which the folded output is divided by)")
    calls = _float_calls(model, layers, rewriter)
    if calls and rewriter.quantized:  # with no quantized layer, prepare's error names them
        warn(f"qstats.qat.prepare: the calls {', '.join(calls)} read weights held outside the layers it quantizes "
             f"({[t.__name__ for t in layers]}) that it does not fake-quantize ({_FLOAT_CALLS}): they stay in float; "
             "hold the weight in such a layer or as a parameter given as it is to F.linear/F.conv1d/2d/3d, or "
             "quantize it with qstats.observe_fake_quantize")
    if rewriter.traced_hooked:
        warn(f"qstats.qat.prepare: layers {rewriter.traced_hooked} have their own forward, which torch.fx traced "
             "through, and hooks: they ran once while tracing, on torch.fx proxies (what a forward or pre-hook "
             "returns is part of the rewritten model), and the rewritten model does not run them")
    writers = [name for name in _buffer_writers(rewriter.graph, {n for n, _ in rewriter.gm.named_buffers(remove_duplicate=False)})
               if not isinstance(model.get_submodule(name), nn.modules.batchnorm._BatchNorm)]  # named below
    if writers:
        warn(f"qstats.qat.prepare: the forwards of {[name or type(model).__name__ for name in writers]} write their "
             "buffers in place (F.batch_norm's running statistics, in-place ops): they stay buffers, outside the QAT "
             "state, changed by every qat.init and qat.apply (use nn.BatchNorm, which prepare makes pure)")
    floats, buffers, instance, synced = [], [], [], []
    for name, module in model.named_modules():
        if type(module).forward in _STOCK_FORWARDS or name in hidden or any(name.startswith(f"{h}.") for h in hidden):
            continue
        tracked = getattr(module, "track_running_stats", False)
        if isinstance(module, layers) and name not in rewriter.quantized and name not in rewriter.computed_callers:
            floats.append(name or type(module).__name__)
        elif isinstance(module, nn.SyncBatchNorm) and name in rewriter.batchnorms:
            synced.append(name or type(module).__name__)
        elif tracked and isinstance(module, nn.modules.batchnorm._BatchNorm) and name not in rewriter.batchnorms:
            buffers.append(name or type(module).__name__)
        elif tracked and isinstance(module, nn.modules.instancenorm._InstanceNorm):
            instance.append(name or type(module).__name__)
    if floats:
        warn(f"qstats.qat.prepare: {floats} have their own forward, which does not pass self.weight as is to "
             "F.linear/F.conv/F.conv_transpose/F.embedding: they stay in float (quantize them with qstats.observe_fake_quantize)")
    if buffers:
        warn(f"qstats.qat.prepare: batch norms {buffers} have their own forward: their running statistics stay "
             "buffers updated in place, outside the QAT state")
    if instance:
        warn(f"qstats.qat.prepare: instance norms {instance} track running statistics: they stay buffers updated "
             "in place by every training-mode call, outside the QAT state")
    if synced:
        warn(f"qstats.qat.prepare: SyncBatchNorm layers {synced} become batch norms of each rank's own batch: they "
             "normalise with its statistics and keep its running statistics (SyncBatchNorm's are all ranks'; "
             "qat.sync does not merge them)")


def _extra(state, phase, ranges) -> Dict[str, Any]:
    return dict(zip(_EXTRA_INPUTS, (state, phase, ranges)))


class _Tracer(torch.fx.Tracer):
    """torch.fx's tracer, with subclasses of the quantized layers and of batch norm that keep
    their stock forward as leaves (fx traces through modules defined outside torch.nn, which
    left a subclassed Linear in float)."""

    def __init__(self, layers: Tuple[type, ...]):
        super().__init__()
        self.layers = tuple(layers) + (nn.modules.batchnorm._BatchNorm,)
        # (the exception, the path of the innermost registered module whose forward raised it) for `_trace`; an
        # exception a forward caught (an optional path tried) is replaced by the next one, so it names no module
        self.failure = None

    def call_module(self, m: nn.Module, forward, args, kwargs):
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception as error:
            # the innermost module's handler sees an exception first; an outer one names it where that module is
            # not registered (held in a plain list)
            if self.failure is None or self.failure[0] is not error or self.failure[1] is None:
                try:
                    self.failure = (error, self.path_of_module(m))
                except NameError:
                    self.failure = (error, None)
            raise

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if isinstance(m, self.layers) and type(m).forward in _STOCK_FORWARDS:
            return True
        return super().is_leaf_module(m, module_qualified_name)


def _trace(model: nn.Module, layers: Tuple[type, ...]) -> torch.fx.GraphModule:
    attributes = {module: dict(vars(module)) for module in model.modules()}
    tracer = _Tracer(layers)
    try:
        graph = tracer.trace(model)
        return torch.fx.GraphModule(tracer.root, graph, type(model).__name__)
    except Exception as error:  # data-dependent control flow, unsupported Python in forward
        where = f"{type(model).__name__}.forward"
        failed_in = tracer.failure[1] if tracer.failure is not None and tracer.failure[0] is error else None
        if failed_in:  # a submodule's forward: named, the root's alone would not say which
            where += f", in the forward of {failed_in!r} ({type(model.get_submodule(failed_in)).__name__})"
        raise TypeError(f"qstats.qat.prepare: torch.fx cannot trace {where} ({type(error).__name__}: {error}); make "
                        "the traced part free of data-dependent control flow, or quantize it with "
                        "qstats.observe_fake_quantize directly") from error
    finally:
        _restore_attributes(attributes)


def _restore_attributes(attributes: Dict[nn.Module, Dict[str, Any]]) -> None:
    """Undoes what tracing wrote into the model's modules: hooks of traced-through modules run on proxies
    (torch.nn.utils.prune's sets ``module.weight`` to one), which left the model holding torch.fx Proxies
    (``torch.save(model)`` failed, ``module.weight`` computed nothing) until its next call."""
    for module, before in attributes.items():
        for name, value in list(vars(module).items()):
            if isinstance(value, torch.fx.Proxy):
                if name in before:
                    object.__setattr__(module, name, before[name])
                else:
                    delattr(module, name)


def _observer_entries(given, layers: Tuple[type, ...], name: str) -> tuple:
    """``given`` (one Observer, None, or a mapping ``{layer type: Observer or None}``) as
    ``((layer type, observer), ...)`` in matching order; one Observer or None serves every layer.

    Raises:
      TypeError: a key that is no ``nn.Module`` subclass, a value that is no Observer or None.
      ValueError: a key that is neither a type of ``layers`` (or a subclass of one) nor a base class of
        one (it would match no layer it quantizes); a key after one of its base classes (the earlier key
        matches every such layer first, so the entry would never be used).
    """
    if given is None or isinstance(given, Observer):
        return ((nn.Module, given),)
    if not isinstance(given, Mapping):
        raise TypeError(f"qstats.qat.prepare: {name} must be a qstats Observer, None, or a mapping "
                        f"{{layer type: Observer or None}}, got {type(given).__name__}")
    entries = tuple(given.items())
    for i, (key, observer) in enumerate(entries):
        if not (isinstance(key, type) and issubclass(key, nn.Module)):
            raise TypeError(f"qstats.qat.prepare: {name} has the key {key!r}; its keys must be layer types "
                            "(nn.Linear, nn.Embedding, ...)")
        if observer is not None and not isinstance(observer, Observer):
            raise TypeError(f"qstats.qat.prepare: {name}[{key.__name__}] must be a qstats Observer or None, "
                            f"got {type(observer).__name__}")
        if not any(issubclass(key, t) or issubclass(t, key) for t in layers):
            raise ValueError(f"qstats.qat.prepare: {name} names {key.__name__}, which is no type of layers="
                             f"{[t.__name__ for t in layers]} nor a base class of one, so it would match no layer; "
                             f"add {key.__name__} to layers= or remove it from {name}")
        earlier = next((k for k, _ in entries[:i] if issubclass(key, k)), None)
        if earlier is not None:
            raise ValueError(f"qstats.qat.prepare: {name} names {key.__name__} after {earlier.__name__}: layers match "
                             f"the first type they are an instance of, so every {key.__name__} would take "
                             f"{earlier.__name__}'s observer; put {key.__name__} first")
    return entries


def _observer_of(entries: tuple, layer: nn.Module) -> Optional[Observer]:
    """The observer of the first entry whose type ``layer`` is an instance of; None (float) if none is."""
    return next((observer for key, observer in entries if isinstance(layer, key)), None)


def _refuse_embedding_activations(entries: tuple) -> None:
    """A mapping key that names an embedding type with an activation observer: its input is ids."""
    named = [key.__name__ for key, observer in entries if observer is not None and issubclass(key, _EMBEDDINGS)]
    if named:
        raise ValueError(f"qstats.qat.prepare: activation_observer maps {named} to an observer, but embeddings are "
                         "quantized weight-only (their inputs are integer ids, as torch.ao's QAT Embedding); map them "
                         "to None or leave them out")


class _Rewriter:
    """Rewrites a traced graph for `prepare`: quantized layers and batch norms become calls of
    pure points that take the QAT state, phase and ranges (new placeholders) and return the new
    state, which the graph's output carries beside the model's."""

    def __init__(self, gm, weight_entries, activation_entries, ste, grad_scale, dynamic_activations: bool,
                 fold_batchnorm: bool = False):
        self.gm, self.graph = gm, gm.graph
        self.fold_batchnorm = fold_batchnorm
        self.folded = {}  # layer -> the batch norm folded into its weight (`_fold_partner`)
        self.unfolded = []  # batch norms after a quantized layer that could not be folded into it
        self.float_calls = []  # (caller, description) of F.linear/F.convNd/... calls of a weight no quantized layer holds
        self.calls = collections.Counter(node.target for node in self.graph.nodes if node.op == "call_module")
        self.entries = {"weights": weight_entries, "activations": activation_entries}  # `_observer_entries`
        self.observers = {"weights": {}, "activations": {}}  # layer -> the observer of its point of that kind
        self.ste, self.grad_scale, self.dynamic_activations = ste, grad_scale, dynamic_activations
        placeholders = [node for node in self.graph.nodes if node.op == "placeholder"]
        if not placeholders:
            raise ValueError("qstats.qat.prepare: the model's forward takes no inputs")
        # keyword arguments with defaults, after the model's own (some of which may have defaults,
        # or be *args) and before a **kwargs
        varkw = placeholders[-1] if str(placeholders[-1].target).startswith("**") else None
        for name in _EXTRA_INPUTS:
            with self.graph.inserting_before(varkw) if varkw is not None else self.graph.inserting_after(placeholders[-1]):
                placeholders.append(self.graph.placeholder(name, default_value=None))
        self.state, self.phase, self.ranges = placeholders[-3:]
        self.new_states = {"weights": {}, "activations": {}, "batchnorm": {}}  # layer -> its latest state node
        self.quantized, self.batchnorms = [], []
        self.hooked = []  # replaced layers with forward hooks, which the rewritten model does not run (`_note_hooks`)
        self.traced_hooked = []  # traced-through layers with hooks: run once on proxies while tracing, then never
        self.weights = {}  # layer -> its fake-quantized weight (a module called twice reuses it)
        self.parameter_calls = {}  # parameter -> the layer type of the F.linear/conv calls reading it
        self.parameter_groups = {}  # parameter -> groups of the F.conv_transposeNd calls reading it
        self.computed = {}  # point of a call of a computed weight -> `_weight_graph` of that weight
        self.computed_callers = set()  # the modules whose forwards make them
        self.points = 0  # numbers the submodules of the points

    def rewrite(self, model: nn.Module, layers: Tuple[type, ...]) -> Dict[str, str]:
        """Rewrites every call of a layer of ``layers`` (and every F.linear/conv/... of such a layer's own weight in
        a traced-through forward) and of a batch norm; returns the layers inside modules that torch.fx keeps
        whole (torch.nn's Transformer layers): name -> that module's type name."""
        hidden, names = {}, _model_names(model)  # the names a computed weight's points must not take
        for node in list(self.graph.nodes):
            if node.op == "call_function" and node.target in _FUNCTIONAL_LAYERS:
                owner = _functional_owner(model, node, layers)
                parameter = _parameter_call(model, node, layers) if owner is None else None
                if owner is not None:  # a traced-through forward passing a layer's own weight to F.linear/conv
                    self.quantize_functional(node, owner, model.get_submodule(owner))
                elif parameter is not None:  # a parameter or buffer, one tied to a layer's weight
                    self.quantize_parameter_call(node, parameter, _PARAMETER_CALLS[node.target])
                elif _call_kind(node, layers) is not None:  # a computed weight
                    key = _computed_key(node, self.quantized, names)
                    self.computed[key] = _weight_graph(self.gm, _call_weight(node))
                    self.computed_callers.add(key.rpartition(".")[0])
                    self.quantize_parameter_call(node, key, _PARAMETER_CALLS[node.target])
                else:
                    self.float_calls.extend(filter(None, [_float_call(node, layers)]))
            if node.op != "call_module":
                continue
            layer = self.gm.get_submodule(node.target)
            if isinstance(layer, layers):
                self.quantize_layer(node, layer)
            elif isinstance(layer, nn.modules.batchnorm._BatchNorm):
                self.pure_batchnorm(node, layer)
            else:
                hidden.update((f"{node.target}.{name}", type(layer).__name__) for name, child in layer.named_modules()
                              if name and isinstance(child, layers))
        return hidden

    def _point(self, kind: str, key: str, module: nn.Module, args: tuple):
        """Adds ``module`` as a submodule, calls it with ``args`` and the state layer ``key``'s earlier
        call returned (None at first: a layer called again chains one state); returns the value node and
        records the new state's."""
        name = f"qat_{kind.rstrip('s')}_{self.points}"  # qat_weight_0, qat_activation_1, qat_batchnorm_2
        self.points += 1
        self.gm.add_submodule(name, module)
        result = self.graph.call_module(name, (*args, self.new_states[kind].get(key)))
        value = self.graph.call_function(operator.getitem, (result, 0))
        self.new_states[kind][key] = self.graph.call_function(operator.getitem, (result, 1))
        return value

    def _fake_quantized(self, kind: str, key: str, value):
        observer = self.observers[kind].get(key)
        if observer is None:
            return value
        dynamic = kind == "activations" and _dynamic(observer, self.dynamic_activations)
        point = _FakeQuantPoint(kind, key, observer, self.ste, self.grad_scale, dynamic)
        return self._point(kind, key, point, (value, self.state, self.phase, self.ranges))

    def _resolve(self, key: str, layer: nn.Module) -> None:
        """Records layer ``key``'s observers (`_observer_of`); an embedding has no activation point."""
        for kind, entries in self.entries.items():
            observer = _observer_of(entries, layer)
            if observer is not None and not (kind == "activations" and isinstance(layer, _EMBEDDINGS)):
                self.observers[kind][key] = observer

    def _quantized_inputs(self, node, key: str, layer: nn.Module, x, weight):
        """Fake-quantized (input, weight) nodes of one call of layer ``key``, inserted before ``node``;
        ``weight()`` makes the weight's node the first time the layer is met. An embedding's input (ids)
        stays as it is."""
        if key not in self.quantized:
            self._resolve(key, layer)
            self.quantized.append(key)
        if key in self.observers["weights"] and not layer.weight.is_floating_point():
            raise TypeError(f"qstats.qat.prepare: layer {key!r} ({type(layer).__name__}) has a {layer.weight.dtype} "
                            "weight; only floating-point weights can be fake-quantized")
        if not isinstance(layer, _EMBEDDINGS):
            x = self._fake_quantized_input(node, key, layer, x)
        with self.graph.inserting_before(node):
            if key not in self.weights:  # the same weight: observed once per pass
                self.weights[key] = self._fake_quantized_weight(key, layer, weight())
        return x, self.weights[key]

    def _fake_quantized_input(self, node, key: str, layer: nn.Module, x):
        """The fake-quantized input node of one call. A convolution padded otherwise than with zeros whose own
        forward is traced through gives ``F.pad`` then ``F.convNd``: its input is observed and fake-quantized
        before the padding, as a stock one's (whose forward pads the fake-quantized input),
        as torch.ao observes the module's input (the padding copies values, so the codes are the same; an
        observer that counts values, a histogram, sees each once)."""
        padded = (isinstance(layer, nn.modules.conv._ConvNd) and getattr(layer, "padding_mode", "zeros") != "zeros"
                  and isinstance(x, torch.fx.Node) and x.op == "call_function" and x.target is F.pad
                  and len(x.users) == 1 and len(x.args) > 0)
        with self.graph.inserting_before(x if padded else node):
            quantized = self._fake_quantized("activations", key, x.args[0] if padded else x)
        if not padded:
            return quantized
        x.update_arg(0, quantized)
        return x

    def _fake_quantized_weight(self, key: str, layer: nn.Module, weight):
        """A transposed convolution's weight is observed and fake-quantized in a convolution's layout
        (`_conv_layout`), so that its per-channel ranges are per output channel."""
        if not isinstance(layer, _CONV_TRANSPOSE):
            return self._fake_quantized("weights", key, weight)
        return self._fake_quantized_transposed(key, weight, layer.groups)

    def _fake_quantized_transposed(self, key: str, weight, groups: int):
        """Transposed convolution weight ``weight`` fake-quantized in a convolution's layout, returned in its own."""
        if key not in self.observers["weights"]:
            return weight
        conv = self.graph.call_function(_conv_layout, (weight, groups))
        return self.graph.call_function(_conv_layout, (self._fake_quantized("weights", key, conv), groups))

    def _dense_gradient(self, key: str, layer: nn.Module, sparse) -> bool:
        """Whether an embedding built with ``sparse=True`` computes a dense weight gradient: its weight is
        fake-quantized, whose straight-through gradient is elementwise over the whole weight (torch.ao's
        is sparse, of the same values)."""
        dense = bool(sparse) and key in self.observers["weights"] and isinstance(layer, _EMBEDDINGS)
        if dense:
            warn(f"qstats.qat.prepare: embedding {key!r} has sparse=True; the gradient of its fake-quantized weight "
                 "is dense (the same values as torch.ao's sparse one)")
        return dense

    def quantize_layer(self, node, layer) -> None:
        key = str(node.target)
        if not isinstance(layer, tuple(_LAYER_FUNCTIONS)):
            raise TypeError(f"qstats.qat.prepare: cannot quantize a {type(layer).__name__}; supported: Linear, "
                            "Conv1d/2d/3d, ConvTranspose1d/2d/3d, Embedding, EmbeddingBag (layer "
                            f"{key!r} is a {type(layer).__name__})")
        given = _bound_inputs(layer, key, node)
        self._note_hooks(key, layer)
        batchnorm = self._fold_partner(node, key, layer)
        with self.graph.inserting_before(node):  # the layer itself (functional_call swaps its tensors)
            module = self.graph.get_attr(key)
            if batchnorm is not None:  # its weight scaled by the batch norm's factor, as torch.ao's QAT ConvBn
                factor = self.graph.call_function(_fold_factor, (self.graph.get_attr(batchnorm), self.state, batchnorm))

        def weight():
            parameter = self.graph.call_function(_layer_parameter, (module, "weight"))
            return parameter if batchnorm is None else self.graph.call_function(_folded_weight, (parameter, factor))

        x, weight = self._quantized_inputs(node, key, layer, given["input"], weight)
        sparse = getattr(layer, "sparse", False)
        sparse = sparse and not self._dense_gradient(key, layer, sparse)
        with self.graph.inserting_before(node):
            arguments = {**{name: value for name, value in given.items() if name != "self"}, "input": x}
            replacement = (self.graph.call_function(_stock_forward, (module, weight, sparse, arguments))
                           if batchnorm is None else self.graph.call_function(_folded_call, (module, x, weight, factor)))
        node.replace_all_uses_with(replacement)
        self.graph.erase_node(node)

    def _fold_partner(self, node, key: str, layer: nn.Module) -> Optional[str]:
        """The name of the batch norm to fold layer ``key`` into (``fold_batchnorm``), or None: a Conv1d/2d/3d or
        Linear with a weight observer whose output feeds only a batch norm of its dimension (`_FOLDS`) that tracks
        running statistics of its channels, both called once, as torch.ao's ``fuse_fx`` patterns; unless the batch
        norm's weight holds a 0 (``zero_init_residual``): the folded output is divided by it, NaN in torch.ao's
        QAT ConvBn."""
        folds = [norm for cls, norm in _FOLDS.items() if isinstance(layer, cls)]
        if not (self.fold_batchnorm and folds and _observer_of(self.entries["weights"], layer) is not None
                and len(node.users) == 1 and self.calls[node.target] == 1):
            return None
        user = next(iter(node.users))
        norm = self.gm.get_submodule(user.target) if user.op == "call_module" else None
        if not (isinstance(norm, folds[0]) and type(norm).forward in _STOCK_FORWARDS and user.args[:1] == (node,)
                and norm.track_running_stats and norm.running_var is not None and self.calls[user.target] == 1
                and norm.num_features == layer.weight.shape[0]):
            return None
        if norm.weight is not None and bool((norm.weight == 0).any()):  # the output is divided by it: NaN
            return None
        self.folded[key] = str(user.target)
        return self.folded[key]

    def _note_hooks(self, key: str, layer: nn.Module, traced: bool = False) -> None:
        """Records a layer whose call the rewrite replaces (``traced``: whose forward torch.fx traced
        through) and that has hooks other than those `_layer_parameter` computes (pruning, weight norm): the
        rewritten model does not run them."""
        pre_hooks = [h for h in layer._forward_pre_hooks.values() if _computes(h) is None]
        hooks = pre_hooks or layer._forward_hooks or layer._backward_hooks or layer._backward_pre_hooks
        noted = self.traced_hooked if traced else self.hooked
        if hooks and key not in noted:
            noted.append(key)

    def quantize_functional(self, node, key: str, layer: nn.Module) -> None:
        """An ``F.linear``/``F.convNd``/``F.embedding``/... call reading layer ``key``'s weight (a
        traced-through forward) takes the fake-quantized input and weight; its other arguments stay."""
        positions = {"input": 0, "weight": 1}
        given = {name: node.args[i] if len(node.args) > i else node.kwargs[name] for name, i in positions.items()}
        self._note_hooks(key, layer, traced=True)
        x, weight = self._quantized_inputs(node, key, layer, given["input"], lambda: given["weight"])
        updates = {"input": x, "weight": weight}
        if node.target in (F.embedding, F.embedding_bag):  # F.embedding's sparse is its 7th argument, embedding_bag's 8th
            i = positions["sparse"] = 6 if node.target is F.embedding else 7
            if self._dense_gradient(key, layer, node.args[i] if len(node.args) > i else node.kwargs.get("sparse", False)):
                updates["sparse"] = False
        for name, value in updates.items():
            if len(node.args) > positions[name]:
                node.update_arg(positions[name], value)
            else:
                node.update_kwarg(name, value)

    def quantize_parameter_call(self, node, key: str, kind: type) -> None:
        """An ``F.linear``/``F.convNd``/``F.conv_transposeNd`` call of parameter or buffer ``key``
        (`_parameter_call`) takes its input and weight fake-quantized by the observers of layer type ``kind`` (the
        mapping's first entry that ``kind`` is a subclass of), in points of its own named ``key``; its other
        arguments stay. A transposed convolution's weight is observed in a convolution's layout (`_conv_layout`,
        with the first call's ``groups``), as a ConvTranspose layer's. Calls of one parameter share its points, as
        a layer called twice."""
        if key not in self.quantized:
            for point, entries in self.entries.items():
                observer = next((observer for t, observer in entries if issubclass(kind, t)), None)
                if observer is not None:
                    self.observers[point][key] = observer
            self.quantized.append(key)
            self.parameter_calls[key] = kind
            if issubclass(kind, _CONV_TRANSPOSE):
                self.parameter_groups[key] = _call_groups(node)
        given = [node.args[i] if len(node.args) > i else node.kwargs[name] for i, name in enumerate(("input", "weight"))]
        with self.graph.inserting_before(node):
            x = self._fake_quantized("activations", key, given[0])
            if key not in self.weights:  # the same weight: observed once per pass
                groups = self.parameter_groups.get(key)
                self.weights[key] = (self._fake_quantized("weights", key, given[1]) if groups is None
                                     else self._fake_quantized_transposed(key, given[1], groups))
        for i, (name, value) in enumerate((("input", x), ("weight", self.weights[key]))):
            if len(node.args) > i:
                node.update_arg(i, value)
            else:
                node.update_kwarg(name, value)

    def pure_batchnorm(self, node, layer) -> None:
        key = str(node.target)
        source = node.args[0] if node.args else None  # a quantized layer's output it was not folded into: named
        if (self.fold_batchnorm and key not in self.folded.values() and isinstance(source, torch.fx.Node)
                and source.op == "call_function" and (source.target is _stock_forward or source.target in _FUNCTIONAL_LAYERS)
                and key not in self.unfolded):
            self.unfolded.append(key)
        if not layer.track_running_stats:  # normalises with each batch's statistics and updates none: pure as it is
            return
        if layer.running_mean is None:
            raise ValueError(f"qstats.qat.prepare: batch norm {key!r} tracks running statistics but has none "
                             "(running_mean is None)")
        if key not in self.batchnorms:
            self.batchnorms.append(key)
        self._note_hooks(key, layer)
        with self.graph.inserting_before(node):
            args = [self.graph.get_attr(f"{key}.{name}") if getattr(layer, name) is not None else None
                    for name in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")]
            point = _BatchNormPoint(key, layer)
            y = self._point("batchnorm", key, point, (node.args[0], *args, self.state, self.phase))
        node.replace_all_uses_with(y)
        self.graph.erase_node(node)

    def finish(self) -> torch.fx.GraphModule:
        output = next(node for node in self.graph.nodes if node.op == "output")
        output.args = ((output.args[0], self.new_states),)
        self.graph.lint()
        self.gm.recompile()
        return self.gm
