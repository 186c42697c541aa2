"""QuantSpec.from_compressed_tensors and the compressed-tensors qparams convention.

Reproduces ``compressed_tensors.quantization.utils.calculate_qparams`` operation by operation
(range always contains zero; the integer range is ``[-2**(b-1), 2**(b-1) - 1]`` held as float32
tensors; no eps floor before the zero point; zero scales become the scale dtype's eps at the end;
zero points are rounded to the zero-point dtype last).
"""

from __future__ import annotations

import torch

from ._granularity import PerAxis, PerBlock, PerGroup, PerTensor, PerToken, TensorGroup

_FLOAT_TARGETS = {8: "fp8_e4m3fn", 4: "fp4_e2m1"}


def _field(args, name, default=None):
    if isinstance(args, dict):
        return args.get(name, default)
    return getattr(args, name, default)


def _enum_value(value):
    return getattr(value, "value", value)


_DTYPE_NAMES = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float8_e4m3fn: "float8_e4m3fn",
    torch.uint8: "e8m0",  # MX: uint8 biased exponents (see qstats/_formats.py)
}


def spec_from_compressed_tensors(cls, args, overrides):
    num_bits = int(_field(args, "num_bits", 8))
    qtype = str(_enum_value(_field(args, "type", "int")))
    symmetric = bool(_field(args, "symmetric", True))
    strategy = _enum_value(_field(args, "strategy", None)) or "tensor"
    group_size = _field(args, "group_size", None)
    if qtype == "int":
        dtype = f"int{num_bits}"
    elif qtype == "float":
        if num_bits not in _FLOAT_TARGETS:
            raise ValueError(f"from_compressed_tensors: float targets of {num_bits} bits are not supported yet")
        dtype = _FLOAT_TARGETS[num_bits]
    else:
        raise ValueError(f"from_compressed_tensors: unknown quantization type {qtype!r}")
    if strategy == "tensor":
        granularity = PerTensor()
    elif strategy == "channel":
        granularity = PerAxis(0)
    elif strategy == "group":
        granularity = PerGroup(int(group_size))
    elif strategy == "tensor_group":
        granularity = TensorGroup(int(group_size))
    elif strategy == "block":
        granularity = PerBlock(tuple(_field(args, "block_structure")))
    elif strategy == "token":
        granularity = PerToken()
    else:
        raise ValueError(f"from_compressed_tensors: strategy {strategy!r} is not supported")
    scale_dtype = _field(args, "scale_dtype", None)
    fields = dict(
        dtype=dtype,
        mapping="symmetric" if symmetric else "asymmetric",
        granularity=granularity,
        zero_point_domain="int" if qtype == "int" else "none",
        convention="compressed_tensors",
        scale_dtype=_DTYPE_NAMES[scale_dtype] if scale_dtype is not None else "float32",
        on_uncalibrated="fallback",
    )
    fields.update(_low_bit_fields(fields, num_bits, qtype, group_size))
    fields.update(overrides)
    return cls(**fields)


def _low_bit_fields(fields, num_bits, qtype, group_size):
    """MX (``generate_mx_scales``: float 4/8 bits, group 32, uint8 scales) and NVFP4
    (``generate_gparam``: ``448 * 6 / amax``) conventions of compressed-tensors."""
    extra = {}
    if fields["scale_dtype"] == "e8m0":
        if not (qtype == "float" and num_bits in (4, 8) and group_size == 32):
            raise ValueError("from_compressed_tensors: uint8 scales are MX scales: float 4/8 bits, group_size 32")
        extra["scale_rounding"] = "round_then_floor"
    if isinstance(fields["granularity"], TensorGroup):
        extra["global_scale_formula"] = "range_over_amax"
    return extra


def _bit_range(spec, device):
    if spec.is_float:
        fmax = spec.float_format.max
        return torch.tensor(-fmax, device=device), torch.tensor(fmax, device=device)
    bit_range = 2.0**spec.bits
    return torch.tensor(-bit_range / 2, device=device), torch.tensor(bit_range / 2 - 1, device=device)


def _zero_point_dtype(spec) -> torch.dtype:
    if spec.is_float:
        return torch.float8_e4m3fn
    return torch.int8 if spec.bits <= 8 else (torch.int16 if spec.bits <= 16 else torch.int32)


def compressed_tensors_qparams(min_val, max_val, spec):
    min_vals = torch.min(min_val, torch.zeros_like(min_val))
    max_vals = torch.max(max_val, torch.zeros_like(max_val))
    bit_min, bit_max = _bit_range(spec, min_vals.device)
    bit_range = bit_max - bit_min
    if spec.mapping == "asymmetric":
        scales = (max_vals - min_vals) / bit_range.to(max_vals.dtype)
        zero_points = bit_min - (min_vals / scales)
        zero_points = torch.clamp(zero_points, bit_min, bit_max)
    else:
        max_val_pos = torch.max(torch.abs(min_vals), torch.abs(max_vals))
        scales = max_val_pos / (bit_range.to(max_val_pos.dtype) / 2)
        zero_points = torch.zeros(scales.shape, device=scales.device, dtype=min_vals.dtype)
    if spec.scale_dtype != "float32":
        dtype = getattr(torch, spec.scale_dtype)
        finfo = torch.finfo(dtype)
        scales = torch.clamp(scales, finfo.min, finfo.max).to(dtype)
    eps = torch.finfo(scales.dtype).eps
    scales = torch.where(scales == 0, torch.tensor(eps, dtype=scales.dtype, device=scales.device), scales)
    zp_dtype = _zero_point_dtype(spec)
    if zp_dtype.is_floating_point:
        finfo = torch.finfo(zp_dtype)
        zero_points = torch.clamp(zero_points, finfo.min, finfo.max).to(zp_dtype).float()
    else:
        iinfo = torch.iinfo(zp_dtype)
        zero_points = torch.round(torch.clamp(zero_points, iinfo.min, iinfo.max)).to(zp_dtype).to(torch.int32)
    return scales.float(), zero_points


def handles_codes(spec) -> bool:
    """Placeholder until the compressed-tensors arithmetic below is complete."""
    return False
