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
"""

from __future__ import annotations

import inspect
import json
import os
import re
import warnings
from typing import Any, Mapping, Optional

import torch

from ._granularity import PerAxis, PerBlock, PerGroup, PerRow, PerTensor, PerToken, TensorGroup
from ._qparams import QParams
from ._quant import quantize
from ._spec import QuantSpec
from .experts import expert_count
from .fused import fused_groups

__all__ = ["compressed_tensors", "quantization_args"]

_SITE_PREFIX = {"weight": "weight", "input": "input", "output": "output"}
_ATTENTION_SITES = ("q", "k", "v")
_EXPERT_SITES = ("gate_up_proj", "down_proj", "input", "gate_up_proj.input", "down_proj.input")
FORMATS = (
    "pack-quantized",
    "int-quantized",
    "float-quantized",
    "naive-quantized",
    "nvfp4-pack-quantized",
    "mxfp4-pack-quantized",
    "mxfp8-quantized",
)
_CT_SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _fail(where: str, message: str):
    raise ValueError(f"export.compressed_tensors: {where}: {message}")


def quantization_args(spec: QuantSpec, site: str, where: str = "spec") -> dict:
    """The compressed-tensors ``QuantizationArgs`` fields (a plain dict) equivalent to ``spec``
    for a ``site`` (``"weight"``, ``"input"``, ``"output"``, or ``"q"``/``"k"``/``"v"`` of an
    attention module). Activations quantized per token (``PerToken``/``PerRow``) or per group
    (``PerGroup``, MX) are dynamic: nothing is calibrated or written for them.

    Raises:
      ValueError: naming the spec field compressed-tensors cannot express.
    """
    if not isinstance(spec, QuantSpec):
        raise TypeError(f"export.compressed_tensors: {where}: expected a QuantSpec, got {type(spec).__name__}")
    two_level = isinstance(spec.granularity, TensorGroup)
    mx = spec.scale_dtype == "e8m0"
    if mx:
        # MXFP4 / MXFP8: fp4 or fp8 elements in groups of 32 under power-of-two (e8m0) scales, stored
        # as uint8 biased exponents (compressed_tensors/compressors/mx_utils.py)
        if spec.dtype not in ("fp4_e2m1", "fp8_e4m3fn") or spec.granularity != PerGroup(32):
            _fail(
                where,
                f"e8m0 (MX) scales export as MXFP4 / MXFP8 only: dtype 'fp4_e2m1' or 'fp8_e4m3fn' with "
                f"PerGroup(32), got dtype {spec.dtype!r} and {spec.granularity!r}",
            )
        qtype = "float"
    elif two_level:
        # NVFP4: fp4 elements in groups, fp8 group scales under one float32 global scale.
        if spec.dtype != "fp4_e2m1" or spec.scale_dtype != "float8_e4m3fn":
            _fail(where, "TensorGroup exports as NVFP4 only: dtype 'fp4_e2m1' with scale_dtype 'float8_e4m3fn'")
        if spec.global_scale_formula != "range_over_amax":
            _fail(
                where,
                f"global_scale_formula {spec.global_scale_formula!r}: compressed-tensors' global scale is "
                "range / amax; use spec.replace(global_scale_formula='range_over_amax')",
            )
        qtype = "float"
    elif spec.is_float:
        if spec.dtype != "fp8_e4m3fn":
            _fail(where, f"dtype {spec.dtype!r}: this export writes float8_e4m3fn elements, or fp4_e2m1 as NVFP4")
        qtype = "float"
    else:
        qtype = "int"
        if spec.bits > 8:
            _fail(where, f"dtype {spec.dtype!r}: compressed-tensors integer checkpoints hold at most 8 bits")
    if spec.mapping in ("symmetric", "narrow"):
        symmetric = True
    elif spec.mapping == "asymmetric":
        symmetric = False
    else:
        _fail(where, f"mapping {spec.mapping!r} has no compressed-tensors equivalent")
    if spec.zero_point_domain == "float":
        _fail(where, "zero_point_domain 'float' has no compressed-tensors equivalent")
    if spec.scale_dtype not in ("float32", "bfloat16", "float16") and not (two_level or mx):
        _fail(where, f"scale_dtype {spec.scale_dtype!r} is not supported by this export yet")
    granularity = spec.granularity
    fields: dict[str, Any] = {
        "num_bits": spec.bits,
        "type": qtype,
        "symmetric": symmetric,
        "group_size": None,
        "strategy": None,
        "block_structure": None,
        "dynamic": False,
        "actorder": None,
        "observer": None,
        "observer_kwargs": {},
    }
    if two_level:
        fields.update(strategy="tensor_group", group_size=granularity.group_size, scale_dtype="torch.float8_e4m3fn")
        if site != "weight":
            fields["dynamic"] = "local"  # group scales at run time under the calibrated global scale
        return fields
    if mx:
        fields.update(strategy="group", group_size=32, scale_dtype="torch.uint8", zp_dtype="torch.uint8")
        if site != "weight":
            fields["dynamic"] = True  # MX activations: group scales at run time (compressed-tensors' MXFP4/MXFP8)
        return fields
    if site in _ATTENTION_SITES:
        if not isinstance(granularity, PerTensor):
            _fail(
                where,
                f"granularity {granularity!r} of a {site!r} site: compressed-tensors' kv-cache and attention "
                "scales are exported per tensor (PerTensor)",
            )
        fields["strategy"] = "tensor"
        return fields
    if site == "weight":
        if isinstance(granularity, PerTensor):
            fields["strategy"] = "tensor"
        elif isinstance(granularity, PerRow) or (isinstance(granularity, PerAxis) and granularity.axis in (0, -2)):
            fields["strategy"] = "channel"
        elif isinstance(granularity, PerGroup):
            fields.update(strategy="group", group_size=granularity.group_size)
        elif isinstance(granularity, PerBlock):
            fields.update(strategy="block", block_structure=list(granularity.block_shape))
        else:
            _fail(where, f"granularity {granularity!r} of a weight has no compressed-tensors strategy")
    else:
        if isinstance(granularity, PerTensor):
            fields["strategy"] = "tensor"
        elif isinstance(granularity, (PerToken, PerRow)):
            fields.update(strategy="token", dynamic=True)
        elif type(granularity) is PerGroup:
            fields.update(strategy="group", group_size=granularity.group_size, dynamic=True)
        else:
            _fail(where, f"granularity {granularity!r} of an activation has no compressed-tensors strategy")
    return fields


def _pack_int32(values: torch.Tensor, num_bits: int) -> torch.Tensor:
    """Dense little-endian packing of signed ``num_bits`` integers (rows of ``values``) into int32
    words, as compressed-tensors' ``pack_to_int32``: value ``e`` of a row, offset to unsigned by
    ``2**(num_bits-1)``, occupies bits ``e*num_bits ... e*num_bits + num_bits - 1`` of the row's
    bit stream; a row takes ``ceil(cols * num_bits / 32)`` words."""
    rows, cols = values.shape
    unsigned = values.to(torch.int64) + (1 << (num_bits - 1))
    padded = -(-cols // 32) * 32
    unsigned = torch.nn.functional.pad(unsigned, (0, padded - cols))
    bits = (unsigned[..., None] >> torch.arange(num_bits, device=values.device)) & 1  # LSB first
    stream = bits.reshape(rows, -1, 32)  # 32 bits per word
    words = (stream << torch.arange(32, device=values.device)).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words[:, : -(-cols * num_bits // 32)]


def _code_offset(spec: QuantSpec, where: str) -> int:
    """Shift from our integer range onto compressed-tensors' signed one."""
    if spec.is_float:
        return 0
    bits = spec.bits
    lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    offset = 0 if spec.is_signed else lo
    qmin, qmax = spec.qrange
    if qmin + offset < lo or qmax + offset > hi:
        _fail(where, f"the integer range [{qmin}, {qmax}] does not fit compressed-tensors' [{lo}, {hi}]")
    return offset


def _qparam_shape(scale: torch.Tensor, strategy: str, where: str) -> tuple:
    if strategy == "tensor":
        if scale.numel() != 1:
            _fail(where, f"per-tensor qparams must hold one scale, got shape {tuple(scale.shape)}")
        return (1,)
    if strategy == "channel":
        if scale.dim() != 1:
            _fail(where, f"per-channel qparams must be 1-D, got shape {tuple(scale.shape)}")
        return (scale.shape[0], 1)
    return tuple(scale.shape)


def _scale_dtype(module: torch.nn.Module, weight: Optional[torch.Tensor] = None) -> torch.dtype:
    weight = getattr(module, "weight", None) if weight is None else weight
    dtype = weight.dtype if isinstance(weight, torch.Tensor) else torch.float32
    return dtype if dtype in _CT_SCALE_DTYPES else torch.float16


def _check_qparams(qp: Any, where: str) -> QParams:
    if not isinstance(qp, QParams):
        raise TypeError(f"export.compressed_tensors: {where}: expected QParams, got {type(qp).__name__}")
    return qp


def _check_scales(values: torch.Tensor, where: str, what: str = "scales") -> None:
    """Refuses to write NaN, infinite, zero or negative scales (compressed-tensors and vLLM divide
    by them): checked on the values as stored, after any rounding to the checkpoint's dtype."""
    values = values.float()
    bad = ~(torch.isfinite(values) & (values > 0))
    if bool(bad.any()):
        sample = values[bad].flatten()[:4].tolist()
        _fail(
            where,
            f"{int(bad.sum())} of {values.numel()} {what} are NaN, infinite, zero or negative as stored "
            f"(e.g. {sample}); a checkpoint needs finite positive scales (a spec eps below the smallest "
            "positive value of the model's dtype underflows to 0)",
        )


def _resolve_specs(specs_or_recipe, qparams, model):
    if hasattr(specs_or_recipe, "specs") and callable(specs_or_recipe.specs):
        return specs_or_recipe.specs(qparams, model)
    if not isinstance(specs_or_recipe, Mapping):
        raise TypeError(
            "export.compressed_tensors: specs must be a qstats.Recipe or a {path: {site: QuantSpec}} tree, "
            f"got {type(specs_or_recipe).__name__}"
        )
    return specs_or_recipe


class _Entry:
    """One Linear of the checkpoint: a real module, or one projection of one stacked expert."""

    __slots__ = ("path", "weight", "dtype", "sites", "experts")

    def __init__(self, path, weight, dtype, sites, experts=None):
        self.path = path  # checkpoint module path
        self.weight = weight  # float weight [out, in], or None
        self.dtype = dtype  # dtype compressed-tensors gives this module's scales
        self.sites = sites  # {site: (QParams or None, QuantSpec, where)}
        self.experts = experts  # (experts module path, projection) for unpacked experts


def _slice_qparams(qp: Optional[QParams], index) -> Optional[QParams]:
    if qp is None:
        return None
    return QParams(*(field[index] for field in qp))


def _fill_uncovered_experts(qp: Optional[QParams], spec: Optional[QuantSpec] = None) -> Optional[QParams]:
    """Per-expert activation qparams where experts that received no token (uncalibrated, holding
    the fallback scale 1) take those of the covered expert with the largest scale. vLLM's fused
    MoE applies the largest input scale of all experts to every expert, so a fallback 1 would
    override every calibrated scale; the largest covered one leaves that maximum unchanged.
    NVFP4 inputs (two-level): an expert is covered when any of its per-token entries is (its
    global scale saw data), and the donor is the covered expert with the smallest global scale
    ``range / amax`` (the largest range): vLLM takes the minimum input global scale over experts.
    ``calibrated`` keeps saying which experts saw no token."""
    if qp is None or qp.scale.dim() < 1:
        return qp
    two_level = spec is not None and isinstance(spec.granularity, TensorGroup)
    per_entry = qp.calibrated.reshape(qp.calibrated.shape[0], -1)
    covered = per_entry.any(-1) if two_level else per_entry.all(-1)
    if bool(covered.all()) or not bool(covered.any()):
        return qp
    if two_level:
        per_expert = -qp.global_scale.reshape(qp.global_scale.shape[0], -1).amax(-1).float()
    else:
        per_expert = qp.scale.reshape(qp.scale.shape[0], -1).amax(-1)
    donor = int(torch.where(covered, per_expert, -torch.inf).argmax())

    def fill(field):
        if field.dim() < 1 or field.shape[0] != covered.shape[0]:
            return field
        keep = covered.reshape(-1, *([1] * (field.dim() - 1)))
        return torch.where(keep, field, field[donor : donor + 1])

    return QParams(fill(qp.scale), fill(qp.zero_point), fill(qp.global_scale), qp.calibrated)


def _row_slice(qp: QParams, spec: QuantSpec, start: int, stop: int, where: str) -> QParams:
    """The qparams of rows ``start:stop`` of a weight whose qparams are ``qp`` (one expert)."""
    granularity = spec.granularity
    if isinstance(granularity, PerTensor):
        return qp
    if isinstance(granularity, PerBlock):
        rows = granularity.block_shape[0]
        if start % rows or stop % rows:
            _fail(where, f"rows {start}:{stop} of the fused weight do not fall on {granularity!r} block boundaries")
        start, stop = start // rows, stop // rows
    return QParams(*(field[start:stop] if field.dim() >= 1 else field for field in qp))


def _expert_entries(
    path: str, module: torch.nn.Module, sites: Mapping, specs: Mapping, num_experts: int, tensors: dict
) -> list:
    """Per-expert Linear entries of a stacked experts module, named as llm-compressor unpacks them.
    A projection without qparams (``gate_up_proj`` or ``down_proj`` not calibrated) is written
    unquantized under the same per-expert names into ``tensors``.

    llm-compressor 0.14 replaces a fused experts module by ``LinearExperts2D``, a ModuleList of
    ``ExpertMLPWithGate`` modules whose Linear children are ``gate_proj``, ``up_proj`` and
    ``down_proj``; ``copy_from_experts_module`` takes ``gate_up_proj[e, :I]`` as ``gate_proj``,
    ``gate_up_proj[e, I:]`` as ``up_proj`` and ``down_proj[e]`` as ``down_proj``
    (llmcompressor/modeling/moe/linear_experts.py). So the checkpoint keys are
    ``<path>.<e>.gate_proj.weight`` etc., which vLLM's fused-MoE loader and transformers'
    conversion mapping (``DecompressExperts``, then a merge into the 3-D parameters) read.
    """
    params = dict(module.named_parameters(recurse=False))
    gate_up, down = params.get("gate_up_proj"), params.get("down_proj")
    unknown = [site for site in sites if site not in _EXPERT_SITES]
    if unknown:
        _fail(f"{path}/{unknown[0]}", f"stacked experts export the sites {_EXPERT_SITES}")
    if gate_up is None or down is None or gate_up.dim() != 3 or down.dim() != 3:
        _fail(path, "stacked experts export needs 3-D gate_up_proj [E, 2I, H] and down_proj [E, H, I] parameters")
    others = sorted(name for name in params if name not in ("gate_up_proj", "down_proj"))
    if others:  # they would be dropped with the fused parameters: no per-expert Linear name holds them
        _fail(path, f"stacked experts with other parameters ({', '.join(others)}) are not exportable yet")
    _, fused_rows, hidden = gate_up.shape
    intermediate = down.shape[2]
    if getattr(module, "is_transposed", False) or fused_rows != 2 * intermediate or down.shape[1] != hidden:
        _fail(
            path,
            f"gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} are not the layout "
            "[E, 2I, H] / [E, H, I] (gate rows first); transposed or interleaved experts are not exportable yet",
        )
    dtype = _scale_dtype(module, gate_up)
    for site, qp in sites.items():
        if qp is not None:
            qp = _check_qparams(qp, f"{path}/{site}")
            if qp.scale.dim() < 1 or qp.scale.shape[0] != num_experts:
                _fail(f"{path}/{site}", f"stacked qparams need a leading expert dimension {num_experts}, "
                      f"got scale of shape {tuple(qp.scale.shape)}")
    # the routed hidden states: "gate_up_proj.input" equals "input"
    input_name = "gate_up_proj.input" if "gate_up_proj.input" in sites else "input"
    input_spec = specs.get(input_name)
    input_dynamic = input_spec is not None and quantization_args(input_spec, "input", path)["dynamic"] is True
    sites = {
        site: _fill_uncovered_experts(qp, specs.get(site)) if site in ("input", "gate_up_proj.input", "down_proj.input")
        else qp
        for site, qp in sites.items()
    }
    entries = []
    for expert in range(num_experts):
        prefix = f"{path}.{expert}"
        inputs = {}
        if input_name in sites:
            inputs["input"] = (_slice_qparams(sites[input_name], expert), input_spec, f"{path}/{input_name}[{expert}]")
        projections = []
        if "gate_up_proj" in sites:
            qp = _slice_qparams(sites["gate_up_proj"], expert)
            spec = specs.get("gate_up_proj")
            weight = gate_up.detach()[expert]
            for name, rows in (("gate_proj", (0, intermediate)), ("up_proj", (intermediate, fused_rows))):
                where = f"{path}/gate_up_proj[{expert}] ({name})"
                part = _row_slice(qp, spec, *rows, where) if spec is not None else qp
                projections.append((name, weight[rows[0] : rows[1]], {"weight": (part, spec, where), **inputs}))
        elif inputs:
            _fail(f"{path}/{input_name}", "input scales of stacked experts need the gate_up_proj weights exported too")
        else:  # unquantized: the float weights, unpacked like the quantized ones
            tensors[f"{prefix}.gate_proj.weight"] = gate_up.detach()[expert, :intermediate]
            tensors[f"{prefix}.up_proj.weight"] = gate_up.detach()[expert, intermediate:]
        if "down_proj.input" in sites and "down_proj" not in sites:
            _fail(f"{path}/down_proj.input", "input scales of down_proj need the down_proj weights exported too")
        if "down_proj" in sites:
            where = f"{path}/down_proj[{expert}]"
            down_sites = {"weight": (_slice_qparams(sites["down_proj"], expert), specs.get("down_proj"), where)}
            if "down_proj.input" in sites:  # the intermediate activation act(gate) * up
                qp = _slice_qparams(sites["down_proj.input"], expert)
                down_sites["input"] = (qp, specs.get("down_proj.input"), f"{path}/down_proj.input[{expert}]")
            elif input_dynamic:  # run-time scales: the same dynamic activation quantization as gate/up
                down_sites["input"] = (None, input_spec, f"{path}/{input_name} (down_proj)")
            projections.append(("down_proj", down.detach()[expert], down_sites))
        else:
            tensors[f"{prefix}.down_proj.weight"] = down.detach()[expert]
        for name, weight, entry_sites in projections:
            entries.append(_Entry(f"{prefix}.{name}", weight, dtype, entry_sites, experts=(path, name)))
    return entries


def compressed_tensors(
    model: torch.nn.Module,
    qparams: Mapping[str, Mapping[str, QParams]],
    path: str,
    specs_or_recipe: Any,
    *,
    format: Optional[str] = None,
) -> dict:
    """Writes ``model`` with ``qparams`` as a compressed-tensors checkpoint in folder ``path``.

    Args:
      model: the calibrated model (its float weights are quantized with ``qparams``).
      qparams: ``{module_path: {site: QParams}}``, e.g. from `qstats.compute_qparams_tree`. A
        dynamic activation site (per-token spec) needs no parameters: its value may be ``None``
        (any QParams given for it are ignored). Stacked experts carry a leading expert dimension;
        ``q``/``k``/``v`` sites of an attention module become its ``q_scale``/``k_scale``/``v_scale``.
      path: output folder; gets ``model.safetensors`` and ``config.json`` (a transformers model's
        ``config`` is included; an existing ``config.json`` there is extended).
      specs_or_recipe: the `qstats.Recipe` used to calibrate, or a ``{path: {site: QuantSpec}}``
        tree shaped like ``qparams``.
      format: the compressed-tensors format of every Linear group: ``"pack-quantized"`` (integer
        weights packed into int32), ``"int-quantized"``, ``"float-quantized"``,
        ``"naive-quantized"`` (int8/fp8 codes), ``"nvfp4-pack-quantized"``,
        ``"mxfp4-pack-quantized"`` or ``"mxfp8-quantized"``. Default: what compressed-tensors
        itself infers per group (``int-quantized`` / ``float-quantized`` with quantized inputs;
        ``pack-quantized`` / ``naive-quantized`` for integer / fp8 weights only; NVFP4 and MX
        by their scales), ``"mixed-precision"`` at top level when groups differ.

    Returns:
      The ``quantization_config`` dict written into ``config.json``.

    Raises:
      ValueError: a site, spec or shape compressed-tensors cannot express (names it).
      TypeError: wrong argument types.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"export.compressed_tensors: model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(qparams, Mapping):
        raise TypeError(
            "export.compressed_tensors: qparams must be a {path: {site: QParams}} dict, "
            f"got {type(qparams).__name__}"
        )
    if format is not None and format not in FORMATS:
        raise ValueError(f"export.compressed_tensors: format must be one of {FORMATS}, got {format!r}")
    specs = _resolve_specs(specs_or_recipe, qparams, model)
    modules = dict(model.named_modules())
    state_dict = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    tensors: dict[str, torch.Tensor] = {}
    dropped: set[str] = set()  # float weights replaced by packed codes or unpacked experts
    schemes: dict[str, dict] = {}
    expert_projection: dict[str, tuple] = {}  # unpacked expert path -> (experts module path, projection)
    attention: dict[str, dict] = {}  # attention module path -> {site: args}
    log = {"uncalibrated": [], "rounded": [], "rotary": []}

    entries = []
    for module_path, sites in qparams.items():
        if module_path not in modules:
            raise ValueError(f"export.compressed_tensors: qparams name module {module_path!r}, which the model lacks")
        module = modules[module_path]
        if not isinstance(sites, Mapping):
            raise TypeError(f"export.compressed_tensors: qparams[{module_path!r}] must be a dict {{site: QParams}}")
        module_specs = specs.get(module_path, {}) if isinstance(specs, Mapping) else {}
        module_specs = module_specs if isinstance(module_specs, Mapping) else {}
        num_experts = expert_count(module)
        if num_experts:
            entries.extend(_expert_entries(module_path, module, sites, module_specs, num_experts, tensors))
            prefix = module_path + "." if module_path else ""
            dropped.update(prefix + name for name, _ in module.named_parameters(recurse=False))
            continue
        kv_sites = {site: qp for site, qp in sites.items() if site in _ATTENTION_SITES}
        if kv_sites:
            attention[module_path] = _write_attention(module_path, module, kv_sites, module_specs, tensors, log)
        linear_sites = {site: qp for site, qp in sites.items() if site not in _ATTENTION_SITES}
        if not linear_sites:
            continue
        if not isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            _fail(module_path, f"a {type(module).__name__}; compressed-tensors quantizes Linear and Embedding modules")
        entry_sites = {}
        for site, qp in linear_sites.items():
            where = f"{module_path}/{site}"
            if site not in _SITE_PREFIX:
                _fail(where, f"site {site!r} is not exportable (weight, input, output and q/k/v are)")
            entry_sites[site] = (qp, module_specs.get(site), where)
        entries.append(_Entry(module_path, module.weight.detach(), _scale_dtype(module), entry_sites))

    for entry in entries:
        scheme = _write_linear(entry, format, tensors, dropped, log)
        if scheme:
            schemes[entry.path] = scheme
            if entry.experts is not None:
                expert_projection[entry.path] = entry.experts

    if log["rounded"]:
        rounded = log["rounded"]
        warnings.warn(
            f"export.compressed_tensors: scales of {len(rounded)} site(s) were rounded to the model's dtype "
            f"({', '.join(rounded[:4])}, ...); calibrate with a spec whose scale_dtype is that dtype to keep "
            "qstats' and the checkpoint's quantization identical",
            stacklevel=2,
        )
    if log["uncalibrated"]:
        uncalibrated = log["uncalibrated"]
        warnings.warn(
            f"export.compressed_tensors: {len(uncalibrated)} site(s) hold uncalibrated (fallback) qparams: "
            + ", ".join(uncalibrated[:8]),
            stacklevel=2,
        )
    if log["rotary"]:
        warnings.warn(
            f"export.compressed_tensors: the q/k scales of {len(log['rotary'])} attention module(s) "
            f"({', '.join(log['rotary'][:4])}) were observed on the projection outputs, before the rotary "
            "embedding (and any q/k norm) the attention applies; compressed-tensors and vLLM quantize the "
            "rotated queries and keys, whose range can be wider",
            stacklevel=2,
        )
    _warn_mixed_experts(schemes, expert_projection)
    _warn_unshared_global_scales(model, qparams, specs)

    # Config groups: one per distinct (weights, input, output) combination.
    groups: dict[str, dict] = {}
    for module_path, scheme in schemes.items():
        weights, inputs, outputs = scheme.get("weight"), scheme.get("input"), scheme.get("output")
        group_format = format or _default_format(weights, inputs)
        key = json.dumps([weights, inputs, outputs, group_format], sort_keys=True)
        group = groups.setdefault(
            key,
            {
                "targets": [],
                "weights": weights,
                "input_activations": inputs,
                "output_activations": outputs,
                "format": group_format,
            },
        )
        target = module_path
        if module_path in expert_projection:
            # every expert of a stacked module shares its scheme: one regex per projection of the
            # module (transformers' get_experts_scheme picks the group whose re: target names experts)
            experts_path, projection = expert_projection[module_path]
            target = rf"re:^{re.escape(experts_path)}\.\d+\.{projection}$"
        if target not in group["targets"]:
            group["targets"].append(target)
    formats = {g["format"] for g in groups.values()}
    top_format = formats.pop() if len(formats) == 1 else ("mixed-precision" if formats else "dense")
    kv_cache_scheme = _attention_config(attention, groups)
    ignore = [
        path
        for path, module in modules.items()
        if isinstance(module, torch.nn.Linear) and path not in schemes and path
    ]
    quantization_config = {
        "quant_method": "compressed-tensors",
        "format": top_format,
        "quantization_status": "compressed",
        "config_groups": {f"group_{i}": group for i, group in enumerate(groups.values())},
        "ignore": ignore,
        "kv_cache_scheme": kv_cache_scheme,
        "global_compression_ratio": None,
    }

    for name, tensor in state_dict.items():
        if name not in tensors and name not in dropped:
            tensors[name] = tensor
    _write(path, tensors, model, quantization_config)
    return quantization_config


def _write_linear(entry: _Entry, format, tensors: dict, dropped: set, log: dict) -> dict:
    """Writes the tensors of one Linear (real or unpacked expert); returns its scheme
    ``{site: QuantizationArgs fields}``."""
    scheme: dict[str, Any] = {}
    prefix = entry.path + "." if entry.path else ""
    input_entry = entry.sites.get("input")
    input_args = None
    if input_entry is not None and input_entry[1] is not None:
        input_args = quantization_args(input_entry[1], "input", input_entry[2])
    for site, (qp, spec, where) in entry.sites.items():
        if spec is None:
            raise ValueError(f"export.compressed_tensors: no spec for {where}")
        args = quantization_args(spec, site, where)
        group = args["group_size"]
        weight = entry.weight
        if site == "input" and group and weight is not None and weight.dim() == 2 and weight.shape[1] % group:
            _fail(where, f"group_size {group} of the input does not divide the layer's {weight.shape[1]} input features")
        if qp is None and args["dynamic"] is True and site != "weight":
            scheme[site] = args  # dynamic activations: nothing calibrated, nothing written
            continue
        qp = _check_qparams(qp, where)
        offset = _code_offset(spec, where)
        name = _SITE_PREFIX[site]
        mx = args.get("scale_dtype") == "torch.uint8"
        if args["strategy"] != "tensor_group" and args["dynamic"] is not True and not mx:
            # Scales are stored in the module's dtype (as compressed-tensors does); codes are
            # computed with the stored scales so the checkpoint is self-consistent.
            stored = qp.scale.to(entry.dtype)
            _check_scales(stored, where, f"{name} scales in {entry.dtype}")
            if not torch.equal(stored.float(), qp.scale.float()):
                log["rounded"].append(where)
                qp = qp._replace(scale=stored.float())
        module_format = (format or _default_format(args, input_args)) if site == "weight" else None
        if site == "weight":
            if module_format not in _allowed_formats(args):
                _fail(where, f"format {format!r} cannot hold {args['type']} weights of strategy {args['strategy']!r}")
            weight = entry.weight
            if weight is None or weight.dim() != 2:
                shape = None if weight is None else tuple(weight.shape)
                _fail(where, f"weights of shape {shape} are not exportable (2-D Linear weights are)")
            if qp.scale.dim() > 0 and qp.scale.shape[0] != weight.shape[0] and args["strategy"] == "channel":
                _fail(where, f"{qp.scale.shape[0]} channel scales for a weight with {weight.shape[0]} rows")
            nonfinite = int((~torch.isfinite(weight)).sum())
            if nonfinite:  # a NaN has no code, and an Inf would be saved as the grid's end
                _fail(where, f"{nonfinite} of {weight.numel()} weights are NaN or infinite; a checkpoint needs finite weights")
            codes = quantize(weight, qp, spec)
            if spec.dtype == "fp4_e2m1":  # NVFP4 / MXFP4: two fp4 bit codes a byte, low nibble first
                if weight.shape[1] % 2:
                    _fail(where, f"fp4 packs two values per byte; {weight.shape[1]} columns is odd")
                codes = codes.to(torch.uint8)  # fp4 bit codes, sign in bit 3
                tensors[prefix + "weight_packed"] = codes[:, 0::2] | (codes[:, 1::2] << 4)
                dropped.add(prefix + "weight")
            elif spec.is_float:
                tensors[prefix + "weight"] = codes.to(torch.float8_e4m3fn)
            elif module_format == "pack-quantized":
                signed = (codes.to(torch.int16) + offset).to(torch.int8)
                tensors[prefix + "weight_packed"] = _pack_int32(signed, args["num_bits"])
                tensors[prefix + "weight_shape"] = torch.tensor(weight.shape)
                dropped.add(prefix + "weight")
            else:
                tensors[prefix + "weight"] = (codes.to(torch.int16) + offset).to(torch.int8)
        if args["dynamic"] is True:
            scheme[site] = args
            continue
        # a locally dynamic (NVFP4) input writes only its global scale, calibrated by any token
        calibrated = qp.calibrated.any() if args["dynamic"] == "local" else qp.calibrated.all()
        if not bool(calibrated):
            log["uncalibrated"].append(where)
        if mx:  # uint8 biased exponents b of the power-of-two scales 2**(b - 127)
            _check_scales(qp.scale, where)
            mantissa, exponent = torch.frexp(qp.scale.float())
            biased = exponent - 1 + 127
            if not bool(((mantissa == 0.5) & (biased >= 0) & (biased <= 254)).all()):
                _fail(where, "e8m0 (MX) scales must be powers of two 2**k with -127 <= k <= 127")
            tensors[f"{prefix}{name}_scale"] = biased.to(torch.uint8)
            scheme[site] = args
            continue
        if args["strategy"] == "tensor_group":
            global_scale = qp.global_scale.reshape(1).to(torch.float32).clone()
            _check_scales(global_scale, where, "global scales")
            tensors[f"{prefix}{name}_global_scale"] = global_scale
            if args["dynamic"] == "local":
                scheme[site] = args
                continue
            group_scales = qp.scale.to(torch.float8_e4m3fn).clone()
            _check_scales(group_scales, where, "float8_e4m3fn group scales")
            tensors[f"{prefix}{name}_scale"] = group_scales
            scheme[site] = args
            continue
        shape = _qparam_shape(qp.scale, args["strategy"], where)
        tensors[f"{prefix}{name}_scale"] = qp.scale.reshape(shape).to(entry.dtype).clone()
        zero_point = _zero_point(qp, args, offset, shape, where)
        if zero_point is not None:
            packed = site == "weight" and args["strategy"] in ("group", "channel") and module_format == "pack-quantized"
            if packed:  # packed along the output dimension, as compressed-tensors does
                zero_point = _pack_int32(zero_point.t(), args["num_bits"]).t().contiguous()
            tensors[f"{prefix}{name}_zero_point"] = zero_point
        scheme[site] = args
    return scheme


def _zero_point(qp: QParams, args: dict, offset: int, shape: tuple, where: str) -> Optional[torch.Tensor]:
    """The zero point compressed-tensors stores: int8, float8_e4m3fn for float args (its
    ``zp_dtype``), None for symmetric args."""
    if args["symmetric"]:
        if not bool(((qp.zero_point.float() + offset) == 0).all()):
            _fail(where, "a symmetric spec with a non-zero zero point (symmetric_zero_point) is not expressible")
        return None
    if args["type"] == "float":
        # compressed-tensors' zp_dtype of float args is float8_e4m3fn (QuantizationArgs), and its
        # calculate_qparams rounds the zero point to it: store that, never an int8 truncation
        zero_point = qp.zero_point.reshape(shape).float()
        stored = zero_point.to(torch.float8_e4m3fn)
        if not torch.equal(stored.float(), zero_point):
            _fail(where, "zero points of float args are stored as float8_e4m3fn; these are not representable")
        return stored
    return (qp.zero_point.reshape(shape).to(torch.int16) + offset).to(torch.int8)


def _write_attention(path: str, module, sites: Mapping, specs: Mapping, tensors: dict, log: dict) -> dict:
    """``q_scale``/``k_scale``/``v_scale`` of an attention module, as compressed-tensors registers
    them (``initialize_attn_qparams``: shape ``(1,)`` for the tensor strategy, in the attention
    module's parameter dtype; zero points ``q_zero_point``... for asymmetric args)."""
    params = list(module.parameters())
    dtype = params[0].dtype if params else torch.float32
    dtype = dtype if dtype in _CT_SCALE_DTYPES else torch.float16
    prefix = path + "." if path else ""
    written = {}
    for site, qp in sites.items():
        where = f"{path}/{site}"
        spec = specs.get(site)
        if spec is None:
            raise ValueError(f"export.compressed_tensors: no spec for {where}")
        args = quantization_args(spec, site, where)
        qp = _check_qparams(qp, where)
        offset = _code_offset(spec, where)
        if not bool(qp.calibrated.all()):
            log["uncalibrated"].append(where)
        stored = qp.scale.to(dtype)
        _check_scales(stored, where, f"{site} scales in {dtype}")
        if not torch.equal(stored.float(), qp.scale.float()):
            log["rounded"].append(where)
        shape = _qparam_shape(qp.scale, "tensor", where)
        tensors[f"{prefix}{site}_scale"] = stored.reshape(shape).clone()
        zero_point = _zero_point(qp, args, offset, shape, where)
        if zero_point is not None:
            tensors[f"{prefix}{site}_zero_point"] = zero_point
        written[site] = args
    if ("k" in written) != ("v" in written):
        _fail(path, "the kv cache quantizes keys and values together: export both 'k' and 'v' sites")
    if "q" in written and "k" not in written:
        _fail(path, "attention (query) quantization needs the 'k' and 'v' sites too (compressed-tensors' "
              "attention scheme quantizes q, k and v alike)")
    distinct = {json.dumps(args, sort_keys=True) for args in written.values()}
    if len(distinct) > 1:
        _fail(path, "compressed-tensors quantizes q, k and v of a model with one set of QuantizationArgs; "
              f"the specs of {sorted(written)} differ")
    if ("q" in written or "k" in written) and _takes_rotary_embedding(module):
        log["rotary"].append(path)
    return written


def _takes_rotary_embedding(module: torch.nn.Module) -> bool:
    """True when the attention module's forward takes transformers' ``position_embeddings``
    (rotary cos/sin applied to q and k after their projections)."""
    try:
        return "position_embeddings" in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


def _attention_config(attention: dict, groups: dict) -> Optional[dict]:
    """The ``kv_cache_scheme`` (k/v sites, one for the whole model) and, for q sites, a config group
    targeting the attention modules (compressed-tensors' attention quantization, whose
    ``input_activations`` quantize q, k and v)."""
    if not attention:
        return None
    distinct = {json.dumps(next(iter(sites.values())), sort_keys=True) for sites in attention.values()}
    if len(distinct) > 1:
        _fail("kv_cache_scheme", "compressed-tensors holds one kv-cache scheme per model; the attention "
              f"modules {sorted(attention)} have different q/k/v specs")
    args = next(iter(next(iter(attention.values())).values()))
    query = [path for path, sites in attention.items() if "q" in sites]
    if query:
        if len(query) != len(attention):
            _fail("kv_cache_scheme", f"q sites on {query} but not on every attention module with k/v sites")
        groups["attention"] = {
            "targets": query,
            "weights": None,
            "input_activations": args,
            "output_activations": None,
            "format": None,
        }
    return dict(args)


def _warn_mixed_experts(schemes: dict, expert_projection: dict) -> None:
    """vLLM's fused-MoE loader needs gate_proj, up_proj and down_proj of an experts module under one
    scheme (``CompressedTensorsMoEMethod.get_moe_method``: "All MoE projections need to have same
    quantization scheme"); warn when they differ, e.g. a static input spec without ``down_proj.input``."""
    by_module: dict = {}
    for path, (experts_path, projection) in expert_projection.items():
        by_module.setdefault(experts_path, {})[projection] = json.dumps(schemes[path], sort_keys=True)
    # a projection without qparams (written unquantized) has no scheme: mixed too
    mixed = [
        path for path, projections in by_module.items() if len(set(projections.values())) > 1 or len(projections) < 3
    ]
    if mixed:
        warnings.warn(
            f"export.compressed_tensors: gate_proj/up_proj and down_proj of {len(mixed)} experts module(s) "
            f"({', '.join(mixed[:4])}) have different schemes (e.g. static input scales for gate_proj/up_proj "
            "but no 'down_proj.input' site, or down_proj left unquantized); compressed-tensors and "
            "transformers load this, vLLM's fused-MoE "
            "loader requires one scheme per experts module",
            stacklevel=3,
        )


def _warn_unshared_global_scales(model: torch.nn.Module, qparams: Mapping, specs: Any) -> None:
    """vLLM runs each fused group (q/k/v, gate/up: `qstats.fused.FUSED_LAYER_NAMES`) as one matmul
    under one global scale (it keeps one of the group's): a warning names the groups whose
    two-level (NVFP4) weights were given different global scales."""
    unshared = []
    for group in fused_groups(model):
        scales = []
        for path in group:
            sites = qparams.get(path)
            module_specs = specs.get(path) if isinstance(specs, Mapping) else None
            if not (isinstance(sites, Mapping) and isinstance(module_specs, Mapping)):
                continue
            qp, spec = sites.get("weight"), module_specs.get("weight")
            if isinstance(qp, QParams) and isinstance(spec, QuantSpec) and isinstance(spec.granularity, TensorGroup):
                scales.append(qp.global_scale.detach().float().reshape(-1))
        if len(scales) > 1 and not all(torch.equal(scales[0], other) for other in scales[1:]):
            unshared.append("/".join(path.rsplit(".", 1)[-1] for path in group) + f" of {group[0].rsplit('.', 1)[0]!r}")
    if unshared:
        warnings.warn(
            f"export.compressed_tensors: {len(unshared)} fused group(s) hold NVFP4 weights under different global "
            f"scales ({', '.join(unshared[:4])}); vLLM runs each group as one matmul with one global scale, which "
            "misreads the others' weights. qstats.compute_qparams_tree shares them (fuse=True, its default); "
            "qstats.fused_qparams does it for a group",
            stacklevel=3,
        )


def _allowed_formats(weight_args: dict) -> tuple:
    if weight_args["strategy"] == "tensor_group":
        return ("nvfp4-pack-quantized",)
    if weight_args.get("scale_dtype") == "torch.uint8":
        return ("mxfp4-pack-quantized",) if weight_args["num_bits"] == 4 else ("mxfp8-quantized",)
    if weight_args["type"] == "int":
        return ("pack-quantized", "int-quantized", "naive-quantized")
    return ("float-quantized", "naive-quantized")


def _default_format(weights, inputs) -> str:
    """compressed-tensors' own inference (``infer_module_format``: the first compressor of its
    priority list that takes the scheme): NVFP4 and MX pack; integer weights are
    ``int-quantized`` with quantized inputs of any type (fp8 too), else ``pack-quantized``; fp8 weights are ``float-quantized`` with quantized inputs, else
    ``naive-quantized``."""
    if weights is None:
        return "dense"
    if weights["strategy"] == "tensor_group":
        return "nvfp4-pack-quantized"
    if weights.get("scale_dtype") == "torch.uint8":  # MX: e8m0 scales as uint8 exponents
        return "mxfp4-pack-quantized" if weights["num_bits"] == 4 else "mxfp8-quantized"
    if weights["type"] == "int":
        if inputs is not None:
            return "int-quantized"
        return "pack-quantized"  # integer weights of up to 8 bits (`quantization_args` refuses wider)
    return "float-quantized" if inputs is not None else "naive-quantized"


def _write(path: str, tensors: dict, model: torch.nn.Module, quantization_config: dict) -> None:
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    # safetensors refuses shared storage (tied weights): give every tensor its own.
    owned = {name: tensor.detach().to("cpu").contiguous().clone() for name, tensor in tensors.items()}
    save_file(owned, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    config_path = os.path.join(path, "config.json")
    config: dict = {}
    if os.path.exists(config_path):
        with open(config_path) as file:
            config = json.load(file)
    model_config = getattr(model, "config", None)
    if model_config is not None and hasattr(model_config, "to_dict"):
        config.update(model_config.to_dict())
    config["quantization_config"] = quantization_config
    with open(config_path, "w") as file:
        json.dump(config, file, indent=2, sort_keys=True, default=str)
