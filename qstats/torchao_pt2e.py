"""qstats observers in torchao's PT2E flow (``torchao.quantization.pt2e``: ``prepare_pt2e``,
``convert_pt2e``).

torchao's PT2E recognises observers by its own ``ObserverBase``, a copy of torch.ao's, so the
`qstats.torch_ao.QstatsObserver` of this module derives from both; use it as the
``observer_or_fake_quant_ctr`` of a ``QuantizationSpec``:

    QuantizationSpec(dtype=torch.int8, quant_min=-128, quant_max=127, qscheme=torch.per_tensor_affine,
                     observer_or_fake_quant_ctr=QstatsPT2EObserver.with_args(dtype=torch.qint8))

Importing this module imports torchao.
"""

from __future__ import annotations

import torch
from torchao.quantization.pt2e import ObserverBase as _TorchAOObserverBase
from torchao.quantization.pt2e.observer import _with_args, _with_callable_args

from .observers.fixed import FixedQParamsState, PlaceholderState
from .observers.minmax import minmax
from .torch_ao import QstatsObserver

__all__ = ["QstatsPT2EObserver", "QstatsPT2EPerChannelObserver"]

_NOT_GIVEN = object()  # a qscheme not passed, told apart from prepare_pt2e's None


class QstatsPT2EObserver(QstatsObserver, _TorchAOObserverBase):
    """`QstatsObserver` (same arguments, state and qparams) that torchao's ``prepare_pt2e`` and
    ``convert_pt2e`` recognise as an observer. ``with_args`` makes torchao's partial wrapper,
    which ``prepare_pt2e`` fills with the ``QuantizationSpec``'s dtype, range and qscheme; it
    passes ``ch_axis`` only to classes named ``PerChannel...``, so give ``ch_axis`` to
    ``with_args`` here (default 0), or use `QstatsPT2EPerChannelObserver`. With ``spec=``, the
    ``QuantizationSpec``'s dtype, range, per-tensor/per-channel qscheme and ``ch_axis`` must agree
    with the spec (`QstatsObserver`'s ValueError otherwise: the converted graph would quantize as the
    spec says, not as the quantizer annotated); a torchao ``ZeroPointDomain.FLOAT`` spec is refused, as by
    `QstatsObserver` (its zero point is in the input's units, the graph's in code units). A
    ``QuantizationSpec`` without a qscheme (``qscheme=None`` passed) is refused as torchao's min/max,
    moving-average and histogram observers refuse it; placeholders and fixed qparams take it, as
    torchao's."""

    with_args = classmethod(_with_args)
    with_callable_args = classmethod(_with_callable_args)

    _default_qscheme = None  # QstatsObserver's: torch.ao's per_tensor_affine

    def __init__(self, observer=minmax, spec=None, *, qscheme=_NOT_GIVEN, **kwargs) -> None:
        chosen = qscheme
        if qscheme is _NOT_GIVEN:  # with spec=, None: the spec decides
            chosen = self._default_qscheme if spec is None else None
        super().__init__(observer, spec, qscheme=chosen, **kwargs)
        if qscheme is None and self.spec is not None and spec is None and (
                self._state_type not in (PlaceholderState, FixedQParamsState)):
            # QstatsObserver reads None as torch.ao's default, per_tensor_affine (per tensor for a PerChannel class)
            raise ValueError(
                f"{type(self).__name__}: qscheme None (a QuantizationSpec without qscheme): give it one "
                "(torch.per_tensor_affine, torch.per_channel_symmetric, ...), as torchao's observers require"
            )


class QstatsPT2EPerChannelObserver(QstatsPT2EObserver):
    """`QstatsPT2EObserver` to which ``prepare_pt2e`` passes the ``QuantizationSpec``'s ``ch_axis``
    (it does so for classes named ``PerChannel...`` only): a per-channel ``QuantizationSpec`` with
    ``ch_axis=1`` reduces along axis 1, as torchao's ``PerChannelMinMaxObserver`` does (the plain
    class, not given ``ch_axis``, takes axis 0). Built without a qscheme (nor ``spec=``) it quantizes
    per channel, affine, as torchao's ``PerChannelMinMaxObserver()``."""

    _default_qscheme = torch.per_channel_affine

    def __init__(self, observer=minmax, spec=None, *, ch_axis=None, **kwargs) -> None:
        # a per-tensor QuantizationSpec passes ch_axis=None
        super().__init__(observer, spec, **kwargs, **({} if ch_axis is None else dict(ch_axis=ch_axis)))
