"""Export calibrated quantization parameters as a compressed-tensors checkpoint.

`compressed_tensors(model, qparams, path, specs)` writes ``path/model.safetensors`` and
``path/config.json`` in the layout compressed-tensors (``ModelCompressor``, transformers'
``CompressedTensorsHfQuantizer``) and vLLM load:

==================  =================================  ======================================
site                tensors written                    shapes (compressed-tensors strategy)
==================  =================================  ======================================
``"weight"``        ``<module>.weight`` (codes),       tensor ``(1,)``, channel ``(out, 1)``,
                    ``weight_scale``,                  group ``(out, in // g)``,
                    ``weight_zero_point`` (asym.)      block ``(out // r, in // c)``
``"input"``         ``input_scale``,                   tensor ``(1,)``; per-token and per-group
                    ``input_zero_point`` (asym.)       specs are written as dynamic (no tensor)
``"output"``        ``output_scale``, ...              as ``"input"``
NVFP4 weight        ``weight_packed`` (uint8, two      ``weight_scale`` float8_e4m3fn
(``TensorGroup``)   fp4 codes a byte, low nibble       ``(out, in // 16)``,
                    first), ``weight_scale``,          ``weight_global_scale`` ``(1,)``
                    ``weight_global_scale``
NVFP4 input         ``input_global_scale``             ``(1,)``; group scales are dynamic
MXFP4 / MXFP8       ``weight_packed`` (fp4, as NVFP4)  ``weight_scale`` uint8 biased exponents
weight (e8m0)       or ``weight`` (float8_e4m3fn),     ``b`` of ``2**(b - 127)``,
                    ``weight_scale``                   ``(out, in // 32)``
``"q"``/``"k"``/    ``<attention>.q_scale``,           ``(1,)`` (PerTensor only) in the
``"v"``             ``k_scale``, ``v_scale``           attention module's dtype
==================  =================================  ======================================

Quantized weights are stored as codes the way compressed-tensors' compressors store them:
``int8`` (``int-quantized``, ``naive-quantized``) or dense little-endian bit-packing into int32
``weight_packed`` with ``weight_shape`` (``pack-quantized``; asymmetric group/channel zero points
packed along the output dimension) for integers, ``float8_e4m3fn`` for fp8, packed fp4 for NVFP4
and MXFP4 (``nvfp4-pack-quantized``, ``mxfp4-pack-quantized``), fp8 with uint8 exponents for MXFP8
(``mxfp8-quantized``). The format defaults to the one compressed-tensors itself infers for the
scheme. Every other parameter and buffer of the model is written unchanged.
Scales take the module weight's dtype (as compressed-tensors initialises them), zero points int8
(float8_e4m3fn for asymmetric fp8, compressed-tensors' ``zp_dtype``). NaN, infinite, zero or
negative scales (as stored, after that rounding) raise ValueError.
Zero points of symmetric mappings are not written (compressed-tensors and vLLM do not load them).
MX specs (``scale_dtype="e8m0"``, fp4_e2m1 or fp8_e4m3fn in ``PerGroup(32)``, e.g.
``qstats.preset("mxfp4")`` or ``QuantSpec.from_compressed_tensors`` of compressed-tensors' MXFP4 /
MXFP8 presets) keep their own scale rounding: the exponents stored are qstats' scales exactly.

**Stacked experts.** A fused experts module (``num_experts`` and 3-D ``gate_up_proj`` ``[E, 2I, H]``
and ``down_proj`` ``[E, H, I]``, as transformers' ``Qwen3MoeExperts``, ``MixtralExperts``) with
stacked qparams (leading expert dimension, from `qstats.calibrate`) is unpacked into per-expert
Linear names, the way llm-compressor's ``linearize_moe`` unpacks it (gate rows first):
``<experts>.<e>.gate_proj.weight``, ``up_proj``, ``down_proj`` with their scales. Expert ``e``'s
``gate_proj`` is ``gate_up_proj[e, :I]`` quantized with the rows ``:I`` of the expert's qparams
(per-tensor scales are shared by gate and up). The ``"input"`` (or ``"gate_up_proj.input"``) site
gives ``gate_proj``/``up_proj`` their ``input_scale``, ``"down_proj.input"`` gives ``down_proj``
its own; a dynamic input spec applies to all three. Experts that received no token (fallback
qparams) export the input qparams of the covered expert with the largest scale, since vLLM's
fused MoE applies the largest input scale of all experts to every expert (NVFP4 inputs: the
smallest global scale, the minimum vLLM takes). A projection without qparams is written
unquantized under the same per-expert names. The config targets each projection with
``re:^<experts>\\.\\d+\\.gate_proj$`` (every expert of a module shares the scheme). vLLM's fused
MoE needs one scheme for gate, up and down: a warning says when they differ. Transposed or
interleaved expert layouts (GPT-OSS) and experts with other parameters (biases) raise ValueError.

**KV cache and attention.** ``"k"``/``"v"`` sites of an attention module (outputs of its
``k_proj``/``v_proj``, see `qstats.Recipe`) become ``k_scale``/``v_scale`` and the config's
``kv_cache_scheme``; ``"q"`` sites add ``q_scale`` and a config group targeting the attention
modules (compressed-tensors' attention quantization). compressed-tensors uses one set of args for
q, k and v of the whole model, so their specs must be equal and per tensor. qstats observes the
projection outputs, before any rotary embedding or q/k norm; compressed-tensors and vLLM quantize
the rotated queries and keys, so for rotary models (a warning says so) a ``k``/``q`` scale may
clip; ``v`` is exact.

Integer specs whose range is unsigned (torch.ao ``quint8``) are shifted onto compressed-tensors'
signed range: codes and zero points both move by ``-2**(bits-1)``, which leaves every dequantized
value unchanged. Specs compressed-tensors cannot express raise ValueError naming the field (float
zero points, ``symmetric_no_clipping_err``, e8m0 scales outside MXFP4/MXFP8, non-per-tensor q/k/v).
Two-level specs export as NVFP4 (``nvfp4-pack-quantized``) when they follow compressed-tensors'
convention (``global_scale_formula="range_over_amax"``, as `QuantSpec.from_compressed_tensors`
builds them).

The ``quantization_config`` written into ``config.json`` has one config group per distinct
(weights, input, output) combination, targeting the exact module paths (regexes for unpacked
experts), and ``ignore`` lists the Linear modules left unquantized.
``QuantizationConfig.model_validate(config["quantization_config"])`` accepts it.

Modules: `checkpoint` (`compressed_tensors`, the writer), `config` (`quantization_args`, formats,
config groups), `linear` (Linear weights and scales), `experts` (stacked experts), `attention`
(q/k/v and kv-cache scales), `scales` (stored scales and zero points), `packing` (int and fp4
packing).
"""

from .checkpoint import compressed_tensors as compressed_tensors
from .config import FORMATS as FORMATS
from .config import quantization_args as quantization_args

__all__ = ["compressed_tensors", "quantization_args"]
