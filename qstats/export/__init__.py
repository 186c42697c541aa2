"""Export calibrated qparams as a compressed-tensors checkpoint that vLLM and transformers load.

`compressed_tensors(model, qparams, path, specs)` writes ``path/model.safetensors`` and
``path/config.json``; the tensor layout, formats and refusals are in docs/export.md.
Modules: `checkpoint` (the writer), `config` (quantization args, formats, config groups),
`linear`, `experts` (stacked experts), `attention` (q/k/v scales), `scales`, `packing`.
"""

from .checkpoint import compressed_tensors as compressed_tensors
from .config import FORMATS as FORMATS
from .config import quantization_args as quantization_args

__all__ = ["compressed_tensors", "quantization_args"]
