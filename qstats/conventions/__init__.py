"""Library conventions: how torch.ao, compressed-tensors and torchao compute qparams and codes.

Libraries that agree on a format still differ in their arithmetic: torch.ao floors the scale at
``eps`` before the zero point, compressed-tensors replaces zero scales afterwards and computes in
the observed weight's dtype, torchao computes in the input's dtype and has its own float zero
point. A `QuantSpec` holds one `Convention` (``QuantSpec(convention="compressed_tensors")``
looks it up by name), whose methods `compute_qparams`, `quantize` and `fake_quantize` call:

- ``"torch_ao"`` (default, `TorchAOConvention`): torch.ao observers and fake-quant kernels;
- ``"compressed_tensors"`` (`CompressedTensorsConvention`): compressed-tensors'
  ``calculate_qparams`` and ``fake_quantize``, as llm-compressor calls them;
- ``"torchao"`` (`TorchaoConvention`): torchao's affine, MX, NVFP4 and float8 arithmetic.

`Convention` (``default.py``) is the protocol and the arithmetic they share. Each convention's
module also holds the constructor of specs from its library's arguments
(`QuantSpec.from_torch_ao`, `from_compressed_tensors`, `from_torchao`).
"""

from .compressed_tensors import CompressedTensorsConvention
from .default import Convention
from .torch_ao import TorchAOConvention
from .torchao import TorchaoConvention

__all__ = [
    "Convention",
    "CompressedTensorsConvention",
    "TorchAOConvention",
    "TorchaoConvention",
    "NAMES",
    "lookup",
]

_BY_NAME = {c.name: c for c in (TorchAOConvention(), CompressedTensorsConvention(), TorchaoConvention())}
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
