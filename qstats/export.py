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
``"input"``         ``input_scale``,                   tensor ``(1,)``; per-token specs are
                    ``input_zero_point`` (asym.)       written as dynamic (no tensor)
``"output"``        ``output_scale``, ...              as ``"input"``
NVFP4 weight        ``weight_packed`` (uint8, two      ``weight_scale`` float8_e4m3fn
(``TensorGroup``)   fp4 codes a byte, low nibble       ``(out, in // 16)``,
                    first), ``weight_scale``,          ``weight_global_scale`` ``(1,)``
                    ``weight_global_scale``
NVFP4 input         ``input_global_scale``             ``(1,)``; group scales are dynamic
==================  =================================  ======================================

Quantized weights are stored as codes the way compressed-tensors' compressors store them:
``int8`` (``int-quantized``, ``naive-quantized``) or dense little-endian bit-packing into int32
``weight_packed`` with ``weight_shape`` (``pack-quantized``; asymmetric group/channel zero points
packed along the output dimension) for integers, ``float8_e4m3fn`` for fp8, packed fp4 for NVFP4.
The format defaults to the one compressed-tensors itself infers for the scheme. Every other
parameter and buffer of the model is written unchanged.
Scales take the module weight's dtype (as compressed-tensors initialises them), zero points int8.
Zero points of symmetric mappings are not written (compressed-tensors and vLLM do not load them).

Integer specs whose range is unsigned (torch.ao ``quint8``) are shifted onto compressed-tensors'
signed range: codes and zero points both move by ``-2**(bits-1)``, which leaves every dequantized
value unchanged. Specs compressed-tensors cannot express raise ValueError naming the field (float
zero points, ``symmetric_no_clipping_err``, MX (e8m0) scales, stacked experts, q/k/v sites). Two-level
specs export as NVFP4 (``nvfp4-pack-quantized``) when they follow compressed-tensors' convention
(``global_scale_formula="range_over_amax"``, as `QuantSpec.from_compressed_tensors` builds them).

The ``quantization_config`` written into ``config.json`` has one config group per distinct
(weights, input, output) combination, targeting the exact module paths, and ``ignore`` lists the
Linear modules left unquantized. ``QuantizationConfig.model_validate(config["quantization_config"])``
accepts it.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any, Mapping, Optional

import torch

from ._granularity import PerAxis, PerBlock, PerGroup, PerRow, PerTensor, PerToken, TensorGroup
from ._qparams import QParams
from ._quant import quantize
from ._spec import QuantSpec

__all__ = ["compressed_tensors", "quantization_args"]

_SITE_PREFIX = {"weight": "weight", "input": "input", "output": "output"}
FORMATS = ("pack-quantized", "int-quantized", "float-quantized", "naive-quantized", "nvfp4-pack-quantized")
_CT_SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _fail(where: str, message: str):
    raise ValueError(f"export.compressed_tensors: {where}: {message}")


def quantization_args(spec: QuantSpec, site: str, where: str = "spec") -> dict:
    """The compressed-tensors ``QuantizationArgs`` fields (a plain dict) equivalent to ``spec``
    for a ``site`` (``"weight"``, ``"input"`` or ``"output"``).

    Raises:
      ValueError: naming the spec field compressed-tensors cannot express.
    """
    if not isinstance(spec, QuantSpec):
        raise TypeError(f"export.compressed_tensors: {where}: expected a QuantSpec, got {type(spec).__name__}")
    two_level = isinstance(spec.granularity, TensorGroup)
    if two_level:
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
    if spec.scale_dtype not in ("float32", "bfloat16", "float16") and not two_level:
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


def _scale_dtype(module: torch.nn.Module) -> torch.dtype:
    weight = getattr(module, "weight", None)
    dtype = weight.dtype if isinstance(weight, torch.Tensor) else torch.float32
    return dtype if dtype in _CT_SCALE_DTYPES else torch.float16


def _check_qparams(qp: Any, where: str) -> QParams:
    if not isinstance(qp, QParams):
        raise TypeError(f"export.compressed_tensors: {where}: expected QParams, got {type(qp).__name__}")
    return qp


def _resolve_specs(specs_or_recipe, qparams, model):
    if hasattr(specs_or_recipe, "specs") and callable(specs_or_recipe.specs):
        return specs_or_recipe.specs(qparams, model)
    if not isinstance(specs_or_recipe, Mapping):
        raise TypeError(
            "export.compressed_tensors: specs must be a qstats.Recipe or a {path: {site: QuantSpec}} tree, "
            f"got {type(specs_or_recipe).__name__}"
        )
    return specs_or_recipe


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
        (any QParams given for it are ignored).
      path: output folder; gets ``model.safetensors`` and ``config.json`` (a transformers model's
        ``config`` is included; an existing ``config.json`` there is extended).
      specs_or_recipe: the `qstats.Recipe` used to calibrate, or a ``{path: {site: QuantSpec}}``
        tree shaped like ``qparams``.
      format: the compressed-tensors format of every group: ``"pack-quantized"`` (integer
        weights packed into int32), ``"int-quantized"``, ``"float-quantized"``,
        ``"naive-quantized"`` (int8/fp8 codes) or ``"nvfp4-pack-quantized"``. Default: what
        compressed-tensors itself infers per group (``int-quantized`` / ``float-quantized`` with
        quantized inputs; ``pack-quantized`` / ``naive-quantized`` for integer / fp8 weights
        only; NVFP4 packed), ``"mixed-precision"`` at top level when groups differ.

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
    dropped: set[str] = set()  # float weights replaced by packed codes
    schemes: dict[str, dict] = {}
    uncalibrated = []
    rounded = []

    for module_path, sites in qparams.items():
        if module_path not in modules:
            raise ValueError(f"export.compressed_tensors: qparams name module {module_path!r}, which the model lacks")
        module = modules[module_path]
        if not isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            _fail(module_path, f"a {type(module).__name__}; compressed-tensors quantizes Linear and Embedding modules")
        module_specs = specs.get(module_path, {}) if isinstance(specs, Mapping) else {}
        scheme: dict[str, Any] = {}
        for site, qp in sites.items():
            where = f"{module_path}/{site}"
            if site not in _SITE_PREFIX:
                _fail(where, f"site {site!r} is not exportable (weight, input and output are)")
            spec = module_specs.get(site) if isinstance(module_specs, Mapping) else None
            if spec is None:
                raise ValueError(f"export.compressed_tensors: no spec for {where}")
            args = quantization_args(spec, site, where)
            if qp is None and args["dynamic"] is True and site != "weight":
                scheme[site] = args  # dynamic activations: nothing calibrated, nothing written
                continue
            qp = _check_qparams(qp, where)
            offset = _code_offset(spec, where)
            prefix = module_path + "." if module_path else ""
            name = _SITE_PREFIX[site]
            if args["strategy"] != "tensor_group" and args["dynamic"] is not True:
                # Scales are stored in the module's dtype (as compressed-tensors does); codes are
                # computed with the stored scales so the checkpoint is self-consistent.
                stored = qp.scale.to(_scale_dtype(module))
                if not torch.equal(stored.float(), qp.scale.float()):
                    rounded.append(where)
                    qp = qp._replace(scale=stored.float())
            if site == "weight" and format is not None:
                nvfp4 = args["strategy"] == "tensor_group"
                packs_ints = format == "pack-quantized" and args["type"] != "int"
                if nvfp4 != (format == "nvfp4-pack-quantized") or packs_ints:
                    _fail(
                        where, f"format {format!r} cannot hold {args['type']} weights of strategy {args['strategy']!r}"
                    )
            if site == "weight":
                weight = module.weight.detach()
                if weight.dim() != 2:
                    _fail(where, f"weights of shape {tuple(weight.shape)} (stacked experts) are not exportable yet")
                if qp.scale.dim() > 0 and qp.scale.shape[0] != weight.shape[0] and args["strategy"] == "channel":
                    _fail(where, f"{qp.scale.shape[0]} channel scales for a weight with {weight.shape[0]} rows")
                codes = quantize(weight, qp, spec)
                if args["strategy"] == "tensor_group":
                    if weight.shape[1] % 2:
                        _fail(where, f"NVFP4 packs two values per byte; {weight.shape[1]} columns is odd")
                    codes = codes.to(torch.uint8)  # fp4 bit codes, sign in bit 3
                    tensors[prefix + "weight_packed"] = codes[:, 0::2] | (codes[:, 1::2] << 4)
                    dropped.add(prefix + "weight")
                elif spec.is_float:
                    tensors[prefix + "weight"] = codes.to(torch.float8_e4m3fn)
                elif _module_format(format, args, sites, module_specs) == "pack-quantized":
                    signed = (codes.to(torch.int16) + offset).to(torch.int8)
                    tensors[prefix + "weight_packed"] = _pack_int32(signed, args["num_bits"])
                    tensors[prefix + "weight_shape"] = torch.tensor(weight.shape)
                    dropped.add(prefix + "weight")
                else:
                    tensors[prefix + "weight"] = (codes.to(torch.int16) + offset).to(torch.int8)
            if args["dynamic"] is True:
                scheme[site] = args
                continue
            if not bool(qp.calibrated.all()):
                uncalibrated.append(where)
            if args["strategy"] == "tensor_group":
                tensors[f"{prefix}{name}_global_scale"] = qp.global_scale.reshape(1).to(torch.float32).clone()
                if args["dynamic"] == "local":
                    scheme[site] = args
                    continue
                tensors[f"{prefix}{name}_scale"] = qp.scale.to(torch.float8_e4m3fn).clone()
                scheme[site] = args
                continue
            shape = _qparam_shape(qp.scale, args["strategy"], where)
            tensors[f"{prefix}{name}_scale"] = qp.scale.reshape(shape).to(_scale_dtype(module)).clone()
            if args["symmetric"] and not bool(((qp.zero_point.float() + offset) == 0).all()):
                _fail(where, "a symmetric spec with a non-zero zero point (symmetric_zero_point) is not expressible")
            if not args["symmetric"]:
                zero_point = (qp.zero_point.reshape(shape).to(torch.int16) + offset).to(torch.int8)
                packed = (
                    site == "weight"
                    and args["strategy"] in ("group", "channel")
                    and _module_format(format, args, sites, module_specs) == "pack-quantized"
                )
                if packed:  # packed along the output dimension, as compressed-tensors does
                    zero_point = _pack_int32(zero_point.t(), args["num_bits"]).t().contiguous()
                tensors[f"{prefix}{name}_zero_point"] = zero_point
            scheme[site] = args
        if scheme:
            schemes[module_path] = scheme

    if rounded:
        warnings.warn(
            f"export.compressed_tensors: scales of {len(rounded)} site(s) were rounded to the model's dtype "
            f"({', '.join(rounded[:4])}, ...); calibrate with a spec whose scale_dtype is that dtype to keep "
            "qstats' and the checkpoint's quantization identical",
            stacklevel=2,
        )
    if uncalibrated:
        warnings.warn(
            f"export.compressed_tensors: {len(uncalibrated)} site(s) hold uncalibrated (fallback) qparams: "
            + ", ".join(uncalibrated[:8]),
            stacklevel=2,
        )

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
        group["targets"].append(module_path)
    formats = {g["format"] for g in groups.values()}
    top_format = formats.pop() if len(formats) == 1 else "mixed-precision"
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
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
    }

    for name, tensor in state_dict.items():
        if name not in tensors and name not in dropped:
            tensors[name] = tensor
    _write(path, tensors, model, quantization_config)
    return quantization_config


def _default_format(weights, inputs) -> str:
    """compressed-tensors' own inference (``infer_module_format``): NVFP4 packs; integer weights
    are ``int-quantized`` with quantized inputs, else ``pack-quantized``; fp8 weights are
    ``float-quantized`` with quantized inputs, else ``naive-quantized``."""
    if weights is None:
        return "dense"
    if weights["strategy"] == "tensor_group":
        return "nvfp4-pack-quantized"
    if weights["type"] == "int":
        if inputs is not None and not (inputs["type"] == "float"):
            return "int-quantized"
        return "pack-quantized"
    return "float-quantized" if inputs is not None else "naive-quantized"


def _module_format(format, weight_args, sites, module_specs) -> str:
    """The format a module's weight is written in (needs its input spec, if any)."""
    if format is not None:
        return format
    inputs = None
    input_spec = module_specs.get("input") if isinstance(module_specs, Mapping) else None
    if "input" in sites and input_spec is not None:
        inputs = quantization_args(input_spec, "input")
    return _default_format(weight_args, inputs)


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
