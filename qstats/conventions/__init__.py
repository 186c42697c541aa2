"""Library conventions: how torch.ao, compressed-tensors and torchao compute qparams and codes.

A `QuantSpec` holds one `Convention`, looked up by name: ``"torch_ao"`` (default),
``"compressed_tensors"``, ``"torchao"`` or ``"coreai_opt"``; `compute_qparams`, `quantize` and `fake_quantize` call
its methods. `Convention` (``default.py``) is the protocol and the shared arithmetic; each
library's module also holds its ``from_*`` spec constructor. Why conventions: docs/design.md.
"""

from .compressed_tensors import CompressedTensorsConvention
from .coreai_opt import CoreaiOptConvention
from .default import Convention
from .torch_ao import TorchAOConvention
from .torchao import TorchaoConvention

__all__ = [
    "Convention",
    "CompressedTensorsConvention",
    "CoreaiOptConvention",
    "TorchAOConvention",
    "TorchaoConvention",
    "NAMES",
    "lookup",
]

_BY_NAME = {
    c.name: c for c in (TorchAOConvention(), CompressedTensorsConvention(), TorchaoConvention(), CoreaiOptConvention())
}
NAMES = tuple(_BY_NAME)


def lookup(convention) -> Convention:
    """The `Convention` named ``convention`` (a Convention is returned as it is).

    >>> type(lookup("torchao")).__name__
    'TorchaoConvention'
    """
    if isinstance(convention, Convention):
        return convention
    if isinstance(convention, str) and convention in _BY_NAME:
        return _BY_NAME[convention]
    raise ValueError(f"convention must be a Convention or one of {NAMES}, got {convention!r}")
