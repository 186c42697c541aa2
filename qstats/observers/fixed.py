"""Fixed and pass-through observers (torch.ao FixedQParamsObserver, PlaceholderObserver,
NoopObserver, RecordingObserver).

`fixed_qparams` gives constant qparams (`sigmoid_qparams`, `tanh_qparams`: torch.ao's presets);
`placeholder` / `noop` keep no statistics (``compute_qparams`` refuses them, as torch.ao);
`recording` keeps a bounded bottom-k sample of the values, so its memory is fixed and its merge exact.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import NamedTuple, Optional

import torch

from .._granularity import PerTensor, check_observable, check_shape, qparam_shape, weight_view
from .._qparams import NoStatistics, QParams, register_range_rule
from .._spec import QuantSpec
from .._checks import is_integer, require
from .._torch_features import bitcast
from ._base import Observer, check_merge_states, check_state, kept_dtypes, register_state
from .kit import check_spec, raises_on_nonfinite

__all__ = [
    "FixedQParamsState",
    "PlaceholderState",
    "RecordingState",
    "fixed_qparams",
    "sigmoid_qparams",
    "tanh_qparams",
    "placeholder",
    "noop",
    "recording",
    "recorded_values",
]


@register_state
class FixedQParamsState(NamedTuple):
    """``scale``/``zero_point``: the constant parameters (float32 / int64 or float32 for the float
    zero-point domain, ``qparam_shape``);
    ``count``: values seen (int64 scalar)."""

    scale: torch.Tensor
    zero_point: torch.Tensor
    count: torch.Tensor


@register_state
class PlaceholderState(NamedTuple):
    """No statistics; ``count``: values seen (int64 scalar)."""

    count: torch.Tensor


@register_state
class RecordingState(NamedTuple):
    """Bounded sample: ``keys`` (int64, ascending; ``int64 max`` marks an empty slot), ``values``
    (float32, same order), ``count``: values seen (int64 scalar)."""

    keys: torch.Tensor
    values: torch.Tensor
    count: torch.Tensor


_FLAT = PerTensor()


def _count(x, weight):
    if weight is None:
        return torch.tensor(x.numel(), dtype=torch.int64, device=x.device)
    return (weight_view(x, weight, _FLAT) != 0).sum()


def _check_held(scale, scale_t: torch.Tensor, spec: QuantSpec) -> None:
    """ValueError unless every scale is a value of ``spec.scale_dtype`` (QParams' scales are)."""
    if spec.scale_dtype == "e8m0":
        if not bool((torch.frexp(scale_t).mantissa == 0.5).all()):
            raise ValueError(f"fixed_qparams: scale {scale!r} is not a power of two (an e8m0 scale)")
        return
    held = scale_t.to(getattr(torch, spec.scale_dtype)).float()
    if not torch.equal(held, scale_t):
        raise ValueError(f"fixed_qparams: scale {scale!r} is not a {spec.scale_dtype} value (it rounds to "
                         f"{held.tolist()}); pass that, or a spec with scale_dtype='float32'")


def _check_finite_steps(scale, scale_t: torch.Tensor, zero_t: torch.Tensor, spec: QuantSpec) -> None:
    """As QuantSpec.eps: ``1 / scale`` finite (0 * Inf made fake_quantize NaN at zero), and the values
    the convention gives the end codes finite (they dequantized to +-Inf): ``(q - zero_point) * scale``,
    or torchao's float zero point in the input's units."""
    qmin, qmax = spec.qrange
    ends = torch.tensor([qmin, qmax], dtype=torch.float32)
    values = spec.convention.dequantize(ends, scale_t.float().unsqueeze(-1), zero_t.unsqueeze(-1), spec)
    if not bool(torch.isfinite(1.0 / scale_t).all()) or not bool(torch.isfinite(values.float()).all()):
        raise ValueError(
            f"fixed_qparams: scale {scale!r} is out of range: 1 / scale and the values of the end codes {qmin} and "
            f"{qmax} (zero point {zero_t.tolist()}) must be finite in float32"
        )


def _constant(value, name: str, dtype=None) -> torch.Tensor:
    """``value`` (a real number, a sequence of them or a real tensor) as a tensor detached from any
    graph, a one-element one as a scalar (torch.ao's per-tensor scale and zero point have shape
    [1]); TypeError naming ``name`` for anything else (a string, None, a bool, a complex number,
    an int past int64), where torch's own error would not say which argument it was."""
    try:
        tensor = torch.as_tensor(value, dtype=dtype)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        tensor = None
    if tensor is None or tensor.dtype == torch.bool or tensor.is_complex():
        raise TypeError(f"fixed_qparams: {name} must be a real number (one torch holds) or a tensor of them, "
                        f"got {value!r}")
    return (tensor.reshape(()) if tensor.numel() == 1 else tensor).detach()


def fixed_qparams(spec: QuantSpec, scale, zero_point=0) -> Observer:
    """Constant quantization parameters (torch.ao ``FixedQParamsObserver``).

    ``scale`` and ``zero_point`` are numbers or tensors of the spec's parameter shape; the state holds
    them and counts the values seen; ``scale`` must be a value of ``spec.scale_dtype``. Laws: all hold
    exactly (merge keeps the constants, adds counts; states of other constants do not merge).

    >>> import torch, qstats
    >>> obs = qstats.sigmoid_qparams()
    >>> qstats.compute_qparams(obs.init(torch.zeros(3)), obs.spec).scale
    tensor(0.0039)
    """
    check_spec(spec, "fixed_qparams")
    # one-element tensors as scalars (`_constant`): torch.ao's per-tensor ones have shape [1]
    scale_t = _constant(scale, "scale", torch.float32)
    zero_t = _constant(zero_point, "zero_point")
    if not bool(torch.isfinite(scale_t).all()) or not bool((scale_t > 0).all()):
        raise ValueError(f"fixed_qparams: scale must be positive and finite, got {scale!r}")
    qmin, qmax = spec.qrange
    _check_held(scale, scale_t, spec)
    if spec.is_float and not bool((zero_t == 0).all()):
        # float formats' codes have no zero point: quantize would ignore this one
        raise ValueError(f"fixed_qparams: zero_point must be 0 for the float target {spec.dtype!r} (its codes have no "
                         f"zero point), got {zero_point!r}")
    if spec.zero_point_domain == "float":
        zero_t = zero_t.to(torch.float32)
        if not bool(torch.isfinite(zero_t).all()):
            raise ValueError(f"fixed_qparams: zero_point must be finite, got {zero_point!r}")
    else:
        if zero_t.is_floating_point() and not bool((zero_t == zero_t.round()).all()):
            raise ValueError(f"fixed_qparams: zero_point must be an integer for the int domain, got {zero_point!r}")
        zero_t = zero_t.to(torch.int64)
        if not bool(((zero_t >= qmin) & (zero_t <= qmax)).all()):
            raise ValueError(f"fixed_qparams: zero_point {zero_point!r} is outside the range [{qmin}, {qmax}]")
    _check_finite_steps(scale, scale_t, zero_t, spec)

    def init_fn(x: torch.Tensor) -> FixedQParamsState:
        check_observable(x, "fixed_qparams.init")
        shape = qparam_shape(x.shape, spec.granularity)
        try:
            s = scale_t.to(x.device).expand(shape).clone()
            z = zero_t.to(x.device).expand(shape).clone()
        except RuntimeError:
            raise ValueError(
                f"fixed_qparams: scale of shape {tuple(scale_t.shape)} and zero_point of shape {tuple(zero_t.shape)} "
                f"do not fit the quantization parameter shape {tuple(shape)}"
            ) from None
        return FixedQParamsState(s, z, torch.zeros((), dtype=torch.int64, device=x.device))

    def update_fn(state, x: torch.Tensor, weight: Optional[torch.Tensor] = None) -> FixedQParamsState:
        check_state(state, FixedQParamsState, "fixed_qparams.update")
        check_observable(x, "fixed_qparams.update")
        if x.numel() == 0:
            return state
        # the constants do not depend on x, but a tensor they could not quantize is a mistake
        check_shape(x.shape, spec.granularity, state.scale.shape, "fixed_qparams.update")
        return kept_dtypes(state, state._replace(count=state.count + _count(x, weight)), "fixed_qparams.update")

    def merge_fn(a, b) -> FixedQParamsState:
        check_merge_states(a, b, FixedQParamsState, "fixed_qparams.merge")
        same = require((a.scale == b.scale) & (a.zero_point == b.zero_point), "fixed_qparams.merge: the states hold "
                       "different constants (scale, zero_point): they come from different fixed_qparams observers")
        return a._replace(scale=torch.where(same, a.scale, b.scale), count=a.count + b.count)

    return Observer(init_fn, update_fn, merge_fn, exact=True, spec=spec, name="fixed_qparams",
                    state_type=FixedQParamsState)


def _zero_point_at(spec: QuantSpec, scale: float, low: float) -> float:
    """The float zero point that dequantizes code ``qmin`` to ``low``, in the convention's units
    (codes for torch.ao, the input's for torchao): dequantization is affine in the zero point."""
    qmin = torch.tensor([float(spec.qrange[0])])
    scale_t = torch.tensor([scale])
    at_zero, at_one = (float(spec.convention.dequantize(qmin, scale_t, torch.tensor([z]), spec)) for z in (0.0, 1.0))
    return (low - at_zero) / (at_one - at_zero) + 0.0  # + 0.0: no negative zero


def _preset(spec: Optional[QuantSpec], low: float, name: str) -> Observer:
    """Constants mapping ``[low, 1)`` onto the spec's codes, as torch's quantized sigmoid and tanh
    kernels choose them: quint8 ``1/256, 0`` and ``2/256, 128``; qint8 ``1/256, -128`` and ``2/256, 0``.
    Integer codes with a zero point spread over the interval from ``qmin`` (an odd number of codes, as
    narrow int8's 255, centred on zero: ``2/255, 0``, half a step off at either end); without one
    (``zero_point_domain="none"``) the scale is ``1 / (qmax + 1)``; float formats take the power of
    two that puts 1 below their largest value (fp8 e4m3: torch's ``1/256`` and ``2/256``)."""
    spec = spec if spec is not None else QuantSpec(dtype="uint8", mapping="asymmetric")
    check_spec(spec, name)
    span = 1.0 - low
    qmin, qmax = spec.qrange
    if spec.is_float:
        return fixed_qparams(spec, span * 2.0 ** -math.floor(math.log2(qmax)), 0)._replace(name=name)
    if spec.zero_point_domain == "none":
        if low < 0 <= qmin:
            raise ValueError(f"{name}: the codes [{qmin}, {qmax}] of {spec.dtype!r} without a zero point hold no "
                             f"negative value; use a signed target or zero_point_domain='int'")
        return fixed_qparams(spec, 1.0 / (qmax + 1), 0)._replace(name=name)
    scale = span / (qmax - qmin + 1)
    if spec.zero_point_domain == "float":
        return fixed_qparams(spec, scale, _zero_point_at(spec, scale, low))._replace(name=name)
    # the codes below zero, exactly: half of an odd count rounds down, so that [-1, 1) is clipped by half
    # a step at either end (round() took 127.5 codes of narrow int8 to 128: 1.5 steps off at the top)
    below_zero = math.floor(Fraction(-low) / Fraction(span) * (qmax - qmin + 1))
    return fixed_qparams(spec, scale, qmin + below_zero)._replace(name=name)


def sigmoid_qparams(spec: Optional[QuantSpec] = None) -> Observer:
    """torch.ao's preset for outputs in ``[0, 1)``: scale ``1/256``, zero point 0, quint8 ``[0, 255]``.
    A spec of other integer codes spreads them over ``[0, 1)``: int8 ``1/256, -128``, as torch's
    quantized sigmoid gives qint8 tensors; uint4 ``1/16, 0``."""
    return _preset(spec, 0.0, "sigmoid_qparams")


def tanh_qparams(spec: Optional[QuantSpec] = None) -> Observer:
    """torch.ao's preset for outputs in ``[-1, 1)``: scale ``2/256``, zero point 128, quint8 ``[0, 255]``.
    A spec of other integer codes spreads them over ``[-1, 1)``: int8 ``2/256, 0``, as torch's
    quantized tanh gives qint8 tensors; uint4 ``2/16, 8``."""
    return _preset(spec, -1.0, "tanh_qparams")


def _placeholder(spec: Optional[QuantSpec], name: str) -> Observer:
    if spec is not None:
        check_spec(spec, name)

    def init_fn(x: torch.Tensor) -> PlaceholderState:
        if not isinstance(x, torch.Tensor):  # any tensor, as update counts any (a bool mask's values too)
            raise TypeError(f"{name}.init: expected a tensor, got {type(x).__name__}")
        return PlaceholderState(torch.zeros((), dtype=torch.int64, device=x.device))

    def update_fn(state, x: torch.Tensor, weight: Optional[torch.Tensor] = None) -> PlaceholderState:
        check_state(state, PlaceholderState, f"{name}.update")
        if not isinstance(x, torch.Tensor):  # _count reads x.numel()
            raise TypeError(f"{name}.update: expected a tensor, got {type(x).__name__}")
        return kept_dtypes(state, PlaceholderState(state.count + _count(x, weight)), f"{name}.update")

    def merge_fn(a, b) -> PlaceholderState:
        check_merge_states(a, b, PlaceholderState, f"{name}.merge")
        return PlaceholderState(a.count + b.count)

    return Observer(init_fn, update_fn, merge_fn, exact=True, spec=spec, name=name, state_type=PlaceholderState)


def placeholder(spec: Optional[QuantSpec] = None) -> Observer:
    """torch.ao ``PlaceholderObserver``: carries the spec (e.g. for dynamic quantization) and
    collects no statistics; `compute_qparams` raises TypeError."""
    return _placeholder(spec, "placeholder")


def noop(spec: Optional[QuantSpec] = None) -> Observer:
    """torch.ao ``NoopObserver``: no statistics, no quantization parameters."""
    return _placeholder(spec, "noop")


_EMPTY_KEY = torch.iinfo(torch.int64).max


def _hash_keys(bits: torch.Tensor) -> torch.Tensor:
    """Injective int64 keys of 32-bit patterns: a 30-bit mix (multiply/xor-shift) above the
    pattern itself, so that distinct values never tie."""
    pattern = bits.to(torch.int64) & 0xFFFFFFFF
    mixed = (pattern * 0x9E3779B1) & 0xFFFFFFFF
    mixed = mixed ^ (mixed >> 15)
    mixed = (mixed * 0x85EBCA77) & 0xFFFFFFFF
    mixed = mixed ^ (mixed >> 13)
    return ((mixed >> 2) << 32) | pattern


def recording(spec: Optional[QuantSpec] = None, capacity: int = 4096) -> Observer:
    """A bounded sample of observed values (torch.ao ``RecordingObserver``, without unbounded memory).

    Keeps the ``capacity`` finite values with the smallest hash keys: all of them while fewer were
    seen, afterwards a fixed-size pseudo-random sample. Equal values share a key, so they are kept
    or dropped together, except copies past the last kept slot (five 1.0s under ``capacity=3`` keep
    three). `recorded_values(state)` returns them. NaN/Inf are left out, or raise ValueError under
    ``spec.nonfinite="raise"`` (the only field of the optional spec it reads). Laws: all exact.
    """
    raise_on_nonfinite = raises_on_nonfinite(spec, "recording")
    if not (is_integer(capacity) and capacity >= 1):
        raise ValueError(f"recording: capacity must be a positive int, got {capacity!r}")
    capacity = int(capacity)  # np.int64(100) too

    def init_fn(x: torch.Tensor) -> RecordingState:
        check_observable(x, "recording.init")
        keys = torch.full((capacity,), _EMPTY_KEY, dtype=torch.int64, device=x.device)
        values = torch.zeros((capacity,), dtype=torch.float32, device=x.device)
        return RecordingState(keys, values, torch.zeros((), dtype=torch.int64, device=x.device))

    def keep_smallest(keys, values):
        order = torch.argsort(keys, stable=True)[:capacity]
        return torch.gather(keys, -1, order), torch.gather(values, -1, order)

    def update_fn(state, x: torch.Tensor, weight: Optional[torch.Tensor] = None) -> RecordingState:
        check_state(state, RecordingState, "recording.update")
        check_observable(x, "recording.update")
        if x.numel() == 0:
            return state
        flat = x.detach().reshape(-1).to(torch.float32)
        # +0.0 and -0.0 compare equal; give them one key so equal values always tie
        flat = torch.where(flat == 0, torch.zeros_like(flat), flat)
        include = torch.isfinite(flat)
        if weight is not None:
            kept = weight_view(x, weight, _FLAT).reshape(-1) != 0
            include = include & kept
        if raise_on_nonfinite:  # eagerly, under vmap and compile; threaded through the kept values
            seen = torch.ones_like(include) if weight is None else kept
            include = include & require(include | ~seen, "recording.update: the observed tensor holds a NaN or "
                                        "Inf and the spec says nonfinite='raise'")
        keys = _hash_keys(bitcast(flat, torch.int32))
        keys = torch.where(include, keys, torch.full_like(keys, _EMPTY_KEY))
        keys, values = keep_smallest(torch.cat([state.keys, keys]), torch.cat([state.values, flat]))
        values = torch.where(keys == _EMPTY_KEY, torch.zeros_like(values), values)
        return kept_dtypes(state, RecordingState(keys, values, state.count + include.sum()), "recording.update")

    def merge_fn(a, b) -> RecordingState:
        check_merge_states(a, b, RecordingState, "recording.merge")
        keys, values = keep_smallest(torch.cat([a.keys, b.keys]), torch.cat([a.values, b.values]))
        return RecordingState(keys, values, a.count + b.count)

    return Observer(init_fn, update_fn, merge_fn, exact=True, spec=spec, name="recording", state_type=RecordingState)


def recorded_values(state: RecordingState) -> torch.Tensor:
    """The kept values (eager only: the number kept is data-dependent)."""
    check_state(state, RecordingState, "recorded_values")
    return state.values[state.keys != _EMPTY_KEY]


@register_range_rule(FixedQParamsState)
def _fixed_rule(state: FixedQParamsState, spec: QuantSpec, **options) -> QParams:
    if options:  # constants: no method or k to choose (the rule's own TypeError named _fixed_rule())
        raise TypeError(f"compute_qparams: a FixedQParamsState takes no options, got {sorted(options)}")
    calibrated = torch.ones(state.scale.shape, dtype=torch.bool, device=state.scale.device)
    global_scale = torch.ones((), dtype=torch.float32, device=state.scale.device)
    zero_point = state.zero_point if state.zero_point.is_floating_point() else state.zero_point.to(torch.int32)
    return QParams(state.scale, zero_point, global_scale, calibrated)


def _refuse(state, spec, **options):
    raise NoStatistics(
        f"compute_qparams: a {type(state).__name__} has no statistics to compute quantization parameters from "
        "(placeholder/noop/recording observers, as torch.ao's, do not calculate qparams)"
    )


register_range_rule(PlaceholderState)(_refuse)
register_range_rule(RecordingState)(_refuse)
