"""llm-compressor 0.14's Hessian sums as a qstats observer, for the tests that compare `gptq_layerwise`
with a plain loop of `qstats.calibrate` and `qstats.gptq`."""

from __future__ import annotations

import math

import qstats


def llm_compressor_hessian(spec=None):
    """`qstats.hessian` of the inputs times sqrt(2) in float32: the sum llm-compressor's
    ``accumulate_hessian`` keeps (``2 x^T x``, rounded as its products round it), which
    `gptq_layerwise` sums too and divides by twice its sample count (here: ``state._replace(total=state.total / 2)``)."""
    base = qstats.hessian()
    return base._replace(update=lambda state, x, weight=None: base.update(state, math.sqrt(2) * x.float(), weight))
