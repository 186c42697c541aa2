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
coreai_opt is not imported: its specs and granularities are read by attribute (or dict key).

Known differences, kept on purpose: an e8m0 scale of an all-zero (or below ``2**(p - 126)``, ``p``
the target's largest power of two: 6 for int8, 8 and 15 for fp8 e4m3 and e5m2, 2 for fp4) block is
``2**-127`` in qstats, ``2**-126`` in coreai_opt; a moving average with one ``float_range`` end
pinned keeps that end exactly in qstats, where coreai_opt's EMA of the constant may move it by an
ulp or two.
"""

from __future__ import annotations

from typing import Any

import torch

from ._checks import check_floating
from .conventions.coreai_opt import block_size, rounded_to_half
from ._granularity import broadcast_to_view, canonical_view, from_canonical_view
from ._qparams import QParams
from ._quant import fake_quantize
from ._spec import QuantSpec
from .observers._base import Observer
from .observers.kit import check_spec, extremes_init
from .observers.minmax import MovingAverageMinMaxState, moving_extremes_update
from .observers.minmax import moving_average_minmax as _torch_ao_average

__all__ = ["spec_from_coreai_opt", "moving_average_minmax", "fake_quantize_minval", "block_size"]


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
    coreai_opt's running range does. ``exact=False`` (order-dependent).
    """
    spec = check_spec(spec)
    base = _torch_ao_average(spec, averaging_constant)
    constant = float(averaging_constant)

    def step(average, batch, observed_dtype):
        if observed_dtype not in (torch.bfloat16, torch.float16):
            return constant * batch + (1 - constant) * average
        # coreai_opt's running range is held in the input's dtype: each product and the sum round
        def rounded(t):
            return rounded_to_half(t, observed_dtype)

        return rounded(rounded(constant * batch) + rounded((1 - constant) * average))

    def contain_zero(lo, hi):
        return lo.clamp(max=0.0), hi.clamp(min=0.0)

    update_fn = moving_extremes_update(spec, step, "coreai_opt.moving_average_minmax.update", contain_zero)
    return Observer(extremes_init(MovingAverageMinMaxState, spec), update_fn, base.merge,
                    exact=False, spec=spec, name="coreai_opt_moving_average_minmax")


def fake_quantize_minval(x: torch.Tensor, qparams: QParams, spec: QuantSpec) -> torch.Tensor:
    """coreai_opt's fake quantization under ``qformulation="minval"``: codes
    ``clamp(round((x - minval) / scale) + quant_min, quant_min, quant_max)``, values
    ``(q - quant_min) * scale + minval`` (float32, then ``x``'s dtype), with `qstats.fake_quantize`'s
    straight-through gradient. `qstats.fake_quantize` is its ``"zp"`` formulation (the default).

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
    shifted = from_canonical_view(view - minval, spec.granularity, x.shape)
    codes_at_qmin = qparams._replace(zero_point=torch.full_like(qparams.zero_point, spec.qrange[0]))
    values = canonical_view(fake_quantize(shifted, codes_at_qmin, spec), spec.granularity) + minval
    return from_canonical_view(values, spec.granularity, x.shape).to(x.dtype)
