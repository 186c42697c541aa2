"""Learnable quantization ranges: LSQ (learned scale) and LSQ+ (learned scale and offset).

`lsq_fake_quantize(x, params, spec)` fake-quantizes ``x`` with a scale and zero point that are
ordinary tensors, trained by the same optimizer as the weights. Forward and gradients equal torch.ao's
``_LearnableFakeQuantize`` kernels, in plain differentiable torch ops (vmap, grad and compile work);
the forward is computed in the spec's convention, as `fake_quantize` (torch.ao's for ``"torch_ao"``).
Gradients and refused specs: docs/qat.md. The gradient of a per-tensor zero point uses the forward's
rounding where torch's backward differs: docs/differences.md.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Union

import torch

from ._checks import check_floating, is_real_number, require
from ._granularity import broadcast_to_view, canonical_view, from_canonical_view, in_layout_of
from ._qparams import QParams, _with_minval_of_codes, compute_qparams
from ._spec import QuantSpec

__all__ = ["LSQParams", "lsq_init", "lsq_fake_quantize", "lsq_grad_factor", "lsq_qparams"]


class LSQParams(NamedTuple):
    """Learnable range of one tensor: float32 ``scale`` and ``zero_point`` of shape
    ``qparam_shape`` (train them like weights)."""

    scale: torch.Tensor
    zero_point: torch.Tensor


def lsq_init(state, spec: QuantSpec, **options) -> LSQParams:
    """Learnable range initialised from any observer state (through `compute_qparams`).

    >>> import torch, qstats
    >>> spec = qstats.QuantSpec(dtype="int4")
    >>> obs = qstats.minmax(spec)
    >>> x = torch.tensor([-1.0, 2.0])
    >>> qstats.lsq_init(obs.update(obs.init(x), x), spec).scale
    tensor(0.2667)
    """
    _check_spec(spec)
    qparams = compute_qparams(state, spec, **options)
    return LSQParams(qparams.scale.float().clone(), qparams.zero_point.float().clone())


def _check_spec(spec) -> None:
    if not isinstance(spec, QuantSpec):
        raise TypeError(f"expected a QuantSpec, got {type(spec).__name__}")
    if spec.is_float:
        raise ValueError(f"lsq: learnable ranges need an integer target, got spec.dtype={spec.dtype!r}")
    # LSQ's gradients are torch.ao's, for codes clamp(round(x * (1 / scale)) + zero_point, *spec.qrange), the
    # zero point in code units; its forward is the convention's (`fake_quantize`'s: its order of operations,
    # compute and scale dtypes). Specs whose parameters mean something else are refused: `lsq_init` would
    # hand LSQ a range it reads differently.
    spec.convention.check_lsq(spec)


def check_grad_scale(grad_scale) -> bool:
    """ValueError unless ``grad_scale`` is ``"torch_ao"``, ``"per_parameter"``, None or a positive,
    finite float; True for a float."""
    if is_real_number(grad_scale) and 0 < grad_scale < math.inf:
        return True
    if grad_scale is not None and grad_scale not in ("torch_ao", "per_parameter"):
        raise ValueError(
            f"grad_scale must be 'torch_ao', 'per_parameter', None or a positive, finite float, got {grad_scale!r}"
        )
    return False


def lsq_grad_factor(x_numel: int, params_numel: int, spec: QuantSpec, grad_scale) -> float:
    """The factor applied to the range gradients.

    ``grad_scale``: ``"torch_ao"`` (``1 / sqrt(numel(x) * qmax)``, torch.ao's ``use_grad_scaling=True``),
    ``"per_parameter"`` (``1 / sqrt(numel(x) / numel(scale) * qmax)``, the LSQ paper), ``None`` (1) or a
    positive, finite float.
    """
    if check_grad_scale(grad_scale):
        return float(grad_scale)
    if grad_scale is None or x_numel == 0:  # an empty tensor sends no gradient to its range
        return 1.0
    qmax = spec.qrange[1]
    if qmax <= 0:
        raise ValueError(
            f"grad_scale={grad_scale!r} divides by sqrt(numel * qmax), but spec.dtype={spec.dtype!r} has "
            f"qrange {tuple(spec.qrange)} (qmax {qmax}); pass grad_scale=None or a positive float"
        )
    if grad_scale == "torch_ao":
        return 1.0 / math.sqrt(x_numel * qmax)
    return 1.0 / math.sqrt(x_numel / max(params_numel, 1) * qmax)


def lsq_qparams(params: LSQParams, spec: QuantSpec) -> QParams:
    """The learned range as `QParams` (detached), to quantize or export with: the values
    `lsq_fake_quantize`'s forward uses, as torch.ao's ``_LearnableFakeQuantize.calculate_qparams``:
    scales below ``spec.eps`` raised to it, zero points rounded and clamped to ``spec.qrange`` (int32;
    float32 as learned with ``zero_point_domain="float"``); symmetric specs take their fixed zero point.
    Scales stay float32 (not rounded to ``spec.scale_dtype``).

    Raises:
      ValueError: where a scale, or a zero point the spec learns, is NaN or Inf (a diverged
        training step); torch.ao's module returns them as they are (a NaN zero point as int64's minimum).

    >>> import torch, qstats
    >>> spec = qstats.QuantSpec(dtype="uint8", mapping="asymmetric")
    >>> qstats.lsq.lsq_qparams(qstats.LSQParams(torch.tensor(-0.5), torch.tensor(260.4)), spec)[:2]
    (tensor(1.1921e-07), tensor(255, dtype=torch.int32))
    """
    _check_spec(spec)
    if not (isinstance(params, LSQParams) and all(isinstance(t, torch.Tensor) for t in params)):
        raise TypeError(f"lsq_qparams: params must be LSQParams of tensors, got {params!r}")
    if params.scale.shape != params.zero_point.shape:
        raise ValueError(f"lsq_qparams: params.scale has shape {tuple(params.scale.shape)}, params.zero_point "
                         f"{tuple(params.zero_point.shape)}; they must be equal")
    scale, zero_point = _forward_values(params, spec)
    finite = require(torch.isfinite(scale) & torch.isfinite(zero_point),
                     "lsq_qparams: params holds a NaN or Inf scale or zero point (a diverged training step); "
                     "there is no range to quantize with")
    scale = torch.where(finite, scale, torch.ones_like(scale))  # threads the check
    float_zero_point = _learns_zero_point(spec) and spec.zero_point_domain == "float"
    zero_point = zero_point.clone() if float_zero_point else zero_point.to(torch.int32)
    calibrated = torch.ones_like(scale, dtype=torch.bool)
    return _with_minval_of_codes(QParams(scale, zero_point, scale.new_tensor(1.0), calibrated), spec)


def _learns_zero_point(spec: QuantSpec) -> bool:
    return spec.mapping == "asymmetric" and spec.zero_point_domain != "none"


def _forward_values(params: LSQParams, spec: QuantSpec) -> tuple:
    """The scale and zero point the forward uses (detached, float32): the scale raised to
    ``spec.eps``; a learned integer zero point rounded and clamped to ``spec.qrange``, a float one
    as it is; else the spec's fixed zero point."""
    scale = params.scale.detach().float().clamp(min=spec.eps)
    if not _learns_zero_point(spec):
        fixed = 0 if spec.zero_point_domain == "none" else spec.zero_point_of_symmetric
        return scale, torch.full_like(scale, float(fixed))
    zero_point = params.zero_point.detach().float()
    if spec.zero_point_domain == "int":
        zero_point = torch.round(zero_point).clamp(*spec.qrange)
    return scale, zero_point


def _zero_gradient(t: torch.Tensor) -> torch.Tensor:
    """0 in value, with gradient 1 with respect to ``t`` where it is finite (0 where it is infinite:
    ``inf - inf`` would make the forward NaN where it reads a -Inf scale as eps, an infinite zero
    point as the range's end, as torch's kernels)."""
    value = t.detach()
    return torch.where(torch.isfinite(value), t - value, torch.zeros_like(value))


def _checked_view(x: torch.Tensor, params, spec) -> torch.Tensor:
    """``x`` in the canonical view of ``spec.granularity``, once ``spec`` and ``params`` fit it."""
    _check_spec(spec)
    if not isinstance(params, LSQParams):
        raise TypeError(f"lsq_fake_quantize: params must be LSQParams, got {type(params).__name__}")
    view = canonical_view(check_floating(x, "lsq_fake_quantize"), spec.granularity)
    expected = tuple(view.shape[1:-1])
    for name, value in zip(LSQParams._fields, params):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"lsq_fake_quantize: params.{name} must be a tensor, got {type(value).__name__}")
        if tuple(value.shape) != expected:
            raise ValueError(
                f"lsq_fake_quantize: params.{name} has shape {tuple(value.shape)} but a tensor of shape "
                f"{tuple(x.shape)} with {type(spec.granularity).__name__} needs {expected}"
            )
    return view


def lsq_fake_quantize(
    x: torch.Tensor,
    params: LSQParams,
    spec: QuantSpec,
    grad_scale: Union[str, float, None] = "torch_ao",
) -> torch.Tensor:
    """Fake-quantizes ``x`` with a learnable range; gradients as torch.ao's learnable fake quant.

    Args:
      x: the tensor to fake-quantize (any float dtype; computed in float32, returned in its dtype).
      params: `LSQParams` of shape ``qparam_shape(x.shape, spec.granularity)``; scales below
        ``spec.eps`` are raised to it in the forward (as torch.ao), the gradient still reaches them.
      spec: an integer QuantSpec; asymmetric mappings learn the zero point, symmetric ones fix it.
      grad_scale: see `lsq_grad_factor`.

    Returns:
      The fake-quantized tensor, shape, dtype and memory layout of ``x``.

    >>> import torch, qstats
    >>> spec = qstats.QuantSpec(dtype="int4")
    >>> params = qstats.LSQParams(torch.tensor(0.5, requires_grad=True), torch.tensor(0.0))
    >>> qstats.lsq_fake_quantize(torch.tensor([0.3, 9.0]), params, spec).detach()
    tensor([0.5000, 3.5000])
    """
    view = _checked_view(x, params, spec)
    qmin, qmax = spec.qrange
    factor = lsq_grad_factor(x.numel(), params.scale.numel(), spec, grad_scale)

    scale_value, zero_point_value = (broadcast_to_view(t) for t in _forward_values(params, spec))

    v = view.float()
    v_value = v.detach()
    inv_scale = 1.0 / scale_value
    unclamped, codes = spec.convention.codes(view.detach(), scale_value, zero_point_value, spec)  # as fake_quantize
    inside = (unclamped >= qmin) & (unclamped <= qmax)
    out = spec.convention.dequantize(codes, scale_value, zero_point_value, spec)

    # Gradient coefficients (values, detached), torch.ao's kernel term by term. A NaN value counts as
    # clipped below, as torch's backward (its NaN code would make the range gradients NaN even where the
    # value is selected away and its upstream gradient is 0).
    clipped = codes.nan_to_num(nan=qmin)  # NaN codes: NaN values (or a NaN range, its output NaN anyway)
    scale_coefficient = torch.where(inside, (out - v_value) * inv_scale, clipped - zero_point_value) * factor
    passthrough = torch.where(inside, _zero_gradient(v), torch.zeros_like(v_value))
    out = out + passthrough + _zero_gradient(broadcast_to_view(params.scale.float())) * scale_coefficient
    if _learns_zero_point(spec):
        zero_point_coefficient = torch.where(inside, torch.zeros_like(scale_value), -scale_value) * factor
        out = out + _zero_gradient(broadcast_to_view(params.zero_point.float())) * zero_point_coefficient
    return in_layout_of(x, from_canonical_view(out, spec.granularity, x.shape).to(x.dtype))
