"""Export calibrated qparams as a compressed-tensors checkpoint that vLLM and transformers load.

`compressed_tensors(model, qparams, path, specs)` writes ``path/model.safetensors`` (or shards, with
``max_shard_size``), ``path/config.json`` and a generating model's ``generation_config.json``; the
tensor layout, formats and refusals are in docs/export.md.
`compressed_tensors_layerwise` writes the same tensors for a model on the meta device, read from
its checkpoint one decoder layer at a time (a shard per layer, or shards of ``max_shard_size``).
Modules: `checkpoint` (the writer), `config` (quantization args, formats, config groups),
`linear`, `experts` (stacked experts), `attention` (q/k/v scales), `scales`, `packing`, `_categories`
(`ExportWarning`, the category of the export's warnings, and its `UnloadedExpertsWarning`).
"""

from ._categories import ExportWarning as ExportWarning
from ._categories import UnloadedExpertsWarning as UnloadedExpertsWarning
from .checkpoint import compressed_tensors as compressed_tensors
from .config import FORMATS as FORMATS
from .config import quantization_args as quantization_args
from .layerwise import compressed_tensors_layerwise as compressed_tensors_layerwise

__all__ = ["FORMATS", "ExportWarning", "UnloadedExpertsWarning", "compressed_tensors", "compressed_tensors_layerwise",
           "quantization_args"]
