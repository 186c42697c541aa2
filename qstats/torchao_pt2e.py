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

from torchao.quantization.pt2e import ObserverBase as _TorchAOObserverBase
from torchao.quantization.pt2e.observer import _with_args, _with_callable_args

from .torch_ao import QstatsObserver

__all__ = ["QstatsPT2EObserver"]


class QstatsPT2EObserver(QstatsObserver, _TorchAOObserverBase):
    """`QstatsObserver` (same arguments, state and qparams) that torchao's ``prepare_pt2e`` and
    ``convert_pt2e`` recognise as an observer. ``with_args`` makes torchao's partial wrapper,
    which ``prepare_pt2e`` fills with the ``QuantizationSpec``'s dtype, range and qscheme; it
    passes ``ch_axis`` only to classes named ``PerChannel...``, so give ``ch_axis`` to
    ``with_args`` here (default 0)."""

    with_args = classmethod(_with_args)
    with_callable_args = classmethod(_with_callable_args)
