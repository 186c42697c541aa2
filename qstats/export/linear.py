"""Linear layers of the checkpoint: quantized weights (codes, packed per format), scales, zero points.

An `Entry` is a module of the model or one projection of one stacked expert; `write_linear` writes
its tensors and returns its scheme ``{site: QuantizationArgs fields}``.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .._qparams import QParams
from .._quant import quantize
from .._spec import QuantSpec
from ..calibration import float_weight
from .config import allowed_formats, code_offset, default_format, fail, quantization_args
from .packing import pack_fp4, pack_int32, signed_int8
from .scales import check_qparams, check_scales, qparam_shape, scale_dtype, zero_point

__all__ = ["Entry", "linear_entry", "static_site", "write_linear", "write_qparams"]

_LINEAR_SITES = ("weight", "input", "output")


class Entry(NamedTuple):
    """One Linear of the checkpoint: a real module, or one projection of one stacked expert.

    Attributes:
      path: the checkpoint's module path.
      weight: the float weight ``[out, in]``, or None.
      dtype: the dtype compressed-tensors gives this module's scales.
      sites: ``{site: (QParams or None, QuantSpec, where, dynamic)}``; dynamic: scales at run time.
      experts: ``(experts module path, projection)`` for unpacked experts, else None.
    """

    path: str
    weight: Optional[torch.Tensor]
    dtype: torch.dtype
    sites: dict
    experts: Optional[tuple] = None


class _Site(NamedTuple):
    """One site of an Entry as it is written: QParams (scales as stored), spec, args, where,
    code offset and the prefix of its tensors' names."""

    qp: QParams
    spec: QuantSpec
    args: dict
    where: str
    offset: int
    prefix: str


def linear_entry(path: str, module: torch.nn.Module, sites: dict, specs: dict, dynamic=frozenset()) -> Entry:
    """The Entry of a Linear (or Embedding) module of the model with ``sites`` ``{site: QParams}``;
    ``dynamic``: its activation sites whose scales come at run time."""
    if not isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
        fail(path, f"a {type(module).__name__}; compressed-tensors quantizes Linear and Embedding modules")
    for site in sites:
        if site not in _LINEAR_SITES:
            fail(f"{path}/{site}", f"site {site!r} is not exportable (weight, input, output and q/k/v are)")
    entry_sites = {site: (qp, specs.get(site), f"{path}/{site}", site in dynamic)
                   for site, qp in sites.items()}
    weight = float_weight(module)
    return Entry(path, weight, scale_dtype(weight), entry_sites)


def write_linear(entry: Entry, format: Optional[str], tensors: dict, dropped: set, log: dict) -> dict:
    """Writes the tensors of one Linear (real or unpacked expert) into ``tensors`` (the float
    weights it replaces into ``dropped``); returns its scheme ``{site: QuantizationArgs fields}``."""
    scheme: dict = {}
    prefix = entry.path + "." if entry.path else ""
    _, input_spec, input_where, input_dynamic = entry.sites.get("input", (None,) * 4)
    input_args = input_spec and quantization_args(input_spec, "input", input_where, input_dynamic)
    for site, (qp, spec, where, dynamic) in entry.sites.items():
        if spec is None:
            raise ValueError(f"export.compressed_tensors: no spec for {where}")
        args = quantization_args(spec, site, where, dynamic)
        group, weight = args["group_size"], entry.weight
        if site == "input" and group and weight is not None and weight.dim() == 2 and weight.shape[1] % group:
            fail(where, f"group_size {group} of the input does not divide the layer's {weight.shape[1]} "
                 "input features")
        scheme[site] = args
        if site != "weight" and not spec.is_float and spec.convention.name != "compressed_tensors":
            log["activation_rounding"].append(where)
        if args["dynamic"] is True:
            continue  # dynamic activations (weights never are): scales at run time, nothing written
        written = static_site(qp, spec, args, site, where, entry.dtype, prefix, log)
        module_format = (format or default_format(args, input_args)) if site == "weight" else None
        if site == "weight":
            _write_weight(entry, written, module_format, tensors, dropped)
        write_qparams(written, site, entry.dtype, module_format, tensors, log)
    return scheme


def _log_compute_dtype(spec: QuantSpec, dtype: torch.dtype, where: str, log: dict) -> None:
    """Logs a compressed-tensors spec computing its qparams in another dtype than a float32,
    bfloat16 or float16 module's (a recipe built with ``observed_dtype=torch.bfloat16`` on a model
    loaded in float32 too), or any on a float64 module (qstats computes in float32 at most):
    llm-compressor computes them in the module's dtype, so the checkpoint differs from its (NVFP4
    scales too, with no rounding warning)."""
    if not spec.convention.computes_in_observed_dtype:
        return
    if dtype == torch.float64:
        log["float64"].append(where)
    elif (dtype in (torch.float32, torch.bfloat16, torch.float16)
          and spec.compute_dtype != str(dtype).removeprefix("torch.")):
        log["compute_dtype"].append(where)


def static_site(qp, spec: QuantSpec, args: dict, site: str, where: str, dtype: torch.dtype, prefix: str,
                log: dict) -> _Site:
    """A site whose scales the checkpoint holds, its QParams checked. Scales are stored in the
    module's ``dtype`` (as compressed-tensors does); codes are computed with the stored scales so the
    checkpoint is self-consistent (a rounding is logged). Two-level and MX args keep theirs. A spec
    computing in another dtype than llm-compressor (the module's) is logged (`_log_compute_dtype`)."""
    _log_compute_dtype(spec, dtype, where, log)
    qp = check_qparams(qp, where, args)
    offset = code_offset(spec, where)
    if args["strategy"] != "tensor_group" and args.get("scale_dtype") != "torch.uint8":
        stored = qp.scale.to(dtype)
        check_scales(stored, where, f"{site} scales in {dtype}")
        if not torch.equal(stored.float(), qp.scale.float()):
            log["rounded"].append(where)
            qp = qp._replace(scale=stored.float())
    return _Site(qp, spec, args, where, offset, prefix)


def _write_weight(entry: Entry, site: _Site, module_format: str, tensors: dict, dropped: set) -> None:
    """The weight's codes in ``module_format``: fp4 packed two a byte, fp8, int32 words of packed
    integers (with ``weight_shape``) or int8."""
    args, where, prefix = site.args, site.where, site.prefix
    if module_format not in allowed_formats(args):
        fail(where, f"format {module_format!r} cannot hold {args['type']} weights of strategy {args['strategy']!r}")
    weight = entry.weight
    if weight is None or weight.dim() != 2:
        fail(where, f"weights of shape {None if weight is None else tuple(weight.shape)} are not exportable "
             "(2-D Linear weights are)")
    scale = site.qp.scale
    if scale.dim() > 0 and scale.shape[0] != weight.shape[0] and args["strategy"] == "channel":
        fail(where, f"{scale.shape[0]} channel scales for a weight with {weight.shape[0]} rows")
    nonfinite = int((~torch.isfinite(weight)).sum())
    if nonfinite:  # a NaN has no code, and an Inf would be saved as the grid's end
        fail(where, f"{nonfinite} of {weight.numel()} weights are NaN or infinite; a checkpoint needs finite weights")
    try:
        codes = _positive_zero(quantize(weight, site.qp, site.spec), weight, site.spec)
    except ValueError as error:  # qparams of another shape (another module's, a transposed weight)
        fail(where, f"{error} (a weight of shape {tuple(weight.shape)})")
    if site.spec.dtype == "fp4_e2m1":  # NVFP4 / MXFP4
        if weight.shape[1] % 2:
            fail(where, f"fp4 packs two values per byte; {weight.shape[1]} columns is odd")
        tensors[prefix + "weight_packed"] = pack_fp4(codes)
        dropped.add(prefix + "weight")
    elif site.spec.is_float:
        tensors[prefix + "weight"] = codes.to(torch.float8_e4m3fn)
    elif module_format == "pack-quantized":
        tensors[prefix + "weight_packed"] = pack_int32(signed_int8(codes, site.offset), args["num_bits"])
        tensors[prefix + "weight_shape"] = torch.tensor(weight.shape)
        dropped.add(prefix + "weight")
    else:
        tensors[prefix + "weight"] = signed_int8(codes, site.offset)


def _positive_zero(codes: torch.Tensor, weight: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Float codes of the weights that are -0.0 made +0: llm-compressor compresses with the zero
    point compressed-tensors registers (zeros, also for symmetric args) added to ``weight / scale``,
    and -0.0 + 0 is +0 (a tiny negative weight still rounds to -0). fp4 codes carry their sign in
    bit 3; integer codes have no -0."""
    if not spec.is_float:
        return codes
    negative_zero = (weight == 0) & torch.signbit(weight)
    return torch.where(negative_zero, torch.zeros_like(codes), codes)


def write_qparams(site: _Site, name: str, dtype, module_format, tensors: dict, log: dict) -> None:
    """The scales (and zero points) of a static site: e8m0 exponents for MX, global and fp8 group
    scales for two-level specs (the global scale alone for a locally dynamic NVFP4 input), else
    scales in ``dtype`` and int8 (or packed) zero points."""
    qp, args, where, key = site.qp, site.args, site.where, f"{site.prefix}{name}"
    # a locally dynamic (NVFP4) input writes only its global scale, calibrated by any token
    calibrated = qp.calibrated.any() if args["dynamic"] == "local" else qp.calibrated.all()
    if not bool(calibrated):
        log["uncalibrated"].append(where)
    if args.get("scale_dtype") == "torch.uint8":  # MX
        tensors[f"{key}_scale"] = _e8m0_exponents(qp.scale, where)
        return
    if args["strategy"] == "tensor_group":
        global_scale = qp.global_scale.reshape(1).to(torch.float32).clone()
        check_scales(global_scale, where, "global scales")
        tensors[f"{key}_global_scale"] = global_scale
        if args["dynamic"] != "local":
            group_scales = qp.scale.to(torch.float8_e4m3fn).clone()
            check_scales(group_scales, where, "float8_e4m3fn group scales")
            tensors[f"{key}_scale"] = group_scales
        return
    shape = qparam_shape(qp.scale, args["strategy"], where)
    tensors[f"{key}_scale"] = qp.scale.reshape(shape).to(dtype).clone()
    zero = zero_point(qp, args, site.offset, shape, where)
    if zero is not None:
        if name == "weight" and args["strategy"] in ("group", "channel") and module_format == "pack-quantized":
            zero = pack_int32(zero.t(), args["num_bits"]).t().contiguous()  # along the output dimension
        tensors[f"{key}_zero_point"] = zero


def _e8m0_exponents(scale: torch.Tensor, where: str) -> torch.Tensor:
    """uint8 biased exponents ``b`` of power-of-two (e8m0) scales ``2**(b - 127)``."""
    check_scales(scale, where)
    mantissa, exponent = torch.frexp(scale.float())
    biased = exponent - 1 + 127
    if not bool(((mantissa == 0.5) & (biased >= 0) & (biased <= 254)).all()):
        fail(where, "e8m0 (MX) scales must be powers of two 2**k with -127 <= k <= 127")
    return biased.to(torch.uint8)
