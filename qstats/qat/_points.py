"""The fake-quant points: `observe_fake_quantize`, the `QATState` a prepared model carries, the graph nodes
that observe and fake-quantize one tensor or make a batch norm pure, and batch-norm folding."""

from __future__ import annotations

from typing import Any, Dict, Mapping, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .._checks import check_floating
from .._qparams import check_calibrated, compute_qparams
from .._quant import fake_quantize
from .._spec import QuantSpec
from ..lsq import LSQParams, lsq_fake_quantize
from ..observers import Observer
from ..schedule import QATPhase
from ._layers import _layer_parameter


_STE_MODES = ("clipped", "identity")


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
        # computed with the fallback, then checked under ``where`` where it is used: a tensor flag computes
        # qparams also where it then keeps ``x`` (a state that saw no data must not raise there, but must where
        # the flag is True); an empty ``x`` (a layer given no rows, an expert no tokens) has no value to
        # fake-quantize and never raises (torch.ao's FakeQuantize returns it)
        fallback = spec if spec.on_uncalibrated == "fallback" else spec.replace(on_uncalibrated="fallback")
        qparams = compute_qparams(new_state, fallback, **(qparams_options or {}))
        if x.numel() > 0:
            kept = False if isinstance(phase.fake_quantize, bool) else ~phase.fake_quantize  # where x stays float
            checked = check_calibrated(qparams.calibrated | kept, spec, where)
            # threaded into the scale (equal to it: uncalibrated entries have the fallback's 1), so that
            # torch.compile keeps the check: a discarded result was dead code, and compiled steps did not raise
            qparams = qparams._replace(scale=torch.where(checked, qparams.scale, torch.ones_like(qparams.scale)))
        y = fake_quantize_ste(x, qparams, spec, ste)
    return _select(phase.fake_quantize, y, x), new_state




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
        point = (f"{'QATModel.init' if current is None else 'QATModel.apply'}: the "
                 f"{'weight' if self.kind == 'weights' else 'input'} of layer {self.key!r}")
        try:
            return self._forward(x, current, phase, ranges, previous, point)
        except (TypeError, ValueError) as error:
            # an observer's or spec's refusal (a group size that does not divide the layer's width, a state sized on
            # inputs of another shape, an observer without statistics) names the tensor only: the layer too, the
            # exception's type kept (NoStatistics); one naming the layer already is left as it is
            message = error.args[0] if error.args else None
            if isinstance(message, str) and not message.startswith("QATModel."):
                error.args = (f"{point}: {message}", *error.args[1:])
            raise

    def _forward(self, x, current, phase: QATPhase, ranges, previous, point: str):
        if current is None:  # QATModel.init: size the state on the example input
            return x, self.observer.init(x) if previous is None else previous
        learned = (ranges or {}).get(self.kind, {}).get(self.key)
        if self.dynamic:
            current, previous, phase = self.observer.init(x), None, phase._replace(observe=True)
        uncalibrated = _uncalibrated("QATModel.apply", self.kind, self.key)
        return _observe_fake_quantize(x, current if previous is None else previous, self.observer, phase, self.ste,
                                      learned, self.grad_scale, None, uncalibrated, f"{point} (fake-quantized)")


# what gives a layer's point data before it is fake-quantized or its range learned
_OBSERVE_FIRST = ("observe it first: steps with phase.observe=True (QATSchedule's observe_at before fake_quantize_at), "
                  "or qat.apply on calibration batches with QATPhase(fake_quantize=False)")


def _uncalibrated(where: str, kind: str, key: str) -> str:
    """The start of the error of layer ``key``'s point of ``kind`` whose state saw no data."""
    point = "weight" if kind == "weights" else "input"
    return (f"{where}: the {point} of layer {key!r} is fake-quantized from a state that saw no data (no finite "
            f"value: observers leave NaN and +-Inf out, counting them in the state's nonfinite); {_OBSERVE_FIRST}")


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
