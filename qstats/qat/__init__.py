"""Quantization-aware training as a pure function of (params, states, batch).

`observe_fake_quantize` is one fake-quant point returning ``(y, new_state)``; `prepare(model)`
rewrites a model with ``torch.fx`` so that ``qat.apply(params, state, x, phase=...)`` returns
``(output, new_state)``. States and the `QATPhase` are explicit, never hidden buffers (docs/qat.md).

The modules: ``_points`` (`observe_fake_quantize`, `QATState`, the fake-quant and batch-norm points, batch-norm
folding), ``_model`` (`QATModel`), ``_prepare`` (`prepare`), ``_trace`` (torch.fx tracing and the questions the
rewrite asks of the graph), ``_rewrite`` (the graph rewrite), ``_layers`` (the quantized layer types and how a
rewritten call computes one).
"""

import typing

from ._model import QATModel as QATModel
from ._points import BatchNormState as BatchNormState
from ._points import QATState as QATState
from ._points import fake_quantize_ste as fake_quantize_ste
from ._points import observe_fake_quantize as observe_fake_quantize
from ._prepare import prepare as prepare

# pickles name these classes by the module users import them from, as when qstats.qat was one module: a state
# saved with torch.save loads with torch.load(weights_only=True), which looks classes up by that name. The
# states' field annotations are evaluated first, where they were written: typing.get_type_hints evaluates a
# string annotation in the module named by __module__, which does not hold the names they use (Dict, torch)
for _state in (BatchNormState, QATState):
    _state.__annotations__ = typing.get_type_hints(_state)
BatchNormState.__module__ = QATState.__module__ = QATModel.__module__ = __name__
del _state

__all__ = [
    "BatchNormState",
    "QATModel",
    "QATState",
    "fake_quantize_ste",
    "observe_fake_quantize",
    "prepare",
]
