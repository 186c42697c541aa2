"""quantize / dequantize / fake_quantize through the canonical view.

Integer targets follow the spec's convention: ``torch_ao`` multiplies by ``1 / scale`` and rounds
half to even (the arithmetic of ``torch.fake_quantize_per_tensor_affine`` and
``per_channel_affine``, which it equals bit for bit); ``compressed_tensors`` divides by the scale.
Float targets (fp8) divide by the scale, clamp to the format's range and round to nearest even
through the torch dtype.

`fake_quantize` has a straight-through gradient: 1 where the value falls inside the quantized range,
0 where it was clipped (as torch's fake-quant ops).
"""

from __future__ import annotations

import torch

from . import _compat_compressed_tensors, _compat_torch_ao, _compat_torchao, _formats
from ._granularity import broadcast_to_view, canonical_view, from_canonical_view
from ._qparams import QParams
from ._spec import QuantSpec

__all__ = ["quantize", "dequantize", "fake_quantize", "code_dtype"]


def code_dtype(spec: QuantSpec) -> torch.dtype:
    """The torch dtype that holds ``spec``'s codes (smallest integer type, or the fp8 dtype)."""
    if spec.is_float:
        return spec.float_format.torch_dtype or torch.uint8  # uint8 bit codes for fp6/fp4
    qmin, qmax = spec.qrange
    for dtype in (torch.int8, torch.uint8, torch.int16, torch.int32):
        info = torch.iinfo(dtype)
        if info.min <= qmin and qmax <= info.max:
            return dtype
    return torch.int64


def _params(qparams: QParams, view: torch.Tensor):
    if qparams.scale.shape != view.shape[1:-1]:
        raise ValueError(
            f"qparams of shape {tuple(qparams.scale.shape)} do not match the quantization "
            f"parameter shape {tuple(view.shape[1:-1])} of this tensor and granularity"
        )
    scale = broadcast_to_view(qparams.scale.float())
    zero_point = broadcast_to_view(qparams.zero_point)
    return scale, zero_point


def _codes_float(view, scale, zero_point, spec: QuantSpec, global_scale=None):
    """Unclamped and clamped codes as float32 (integer-valued for int targets)."""
    v = view.float()
    if _formats.handles_codes(spec):  # fp6/fp4, e8m0 (MX) and two-level (NVFP4) scales
        return _formats.codes(v, scale, global_scale, spec)
    if _compat_torchao.handles_codes(spec):  # torchao's float zero-point domain, bf16/fp16 arithmetic
        return _compat_torchao.torchao_codes(v, scale, zero_point, spec)
    if _compat_torch_ao.handles_codes(spec):  # torch.ao float zero points and int32 ranges
        return _compat_torch_ao.codes(v, scale, zero_point, spec)
    if _compat_compressed_tensors.handles_codes(spec):  # compressed-tensors' order and dtypes
        return _compat_compressed_tensors.codes(view, scale, zero_point, spec)
    if spec.is_float:
        fmax = spec.float_format.max
        scaled = v / scale
        clamped = scaled.clamp(-fmax, fmax)
        return scaled, clamped.to(spec.float_format.torch_dtype).float()
    qmin, qmax = spec.qrange
    if spec.zero_point_domain == "float":
        unclamped = torch.round(v * (1.0 / scale) + zero_point)
    elif spec.convention == "compressed_tensors":
        unclamped = torch.round(v / scale) + zero_point.float()
    else:
        unclamped = torch.round(v * (1.0 / scale)) + zero_point.float()
    return unclamped, unclamped.clamp(qmin, qmax)


def quantize(x: torch.Tensor, qparams: QParams, spec: QuantSpec) -> torch.Tensor:
    """Codes of ``x``: integers in ``[qmin, qmax]`` (dtype `code_dtype(spec)`) or fp8 values."""
    view = canonical_view(x, spec.granularity)
    scale, zero_point = _params(qparams, view)
    _, codes = _codes_float(view, scale, zero_point, spec, qparams.global_scale)
    codes = from_canonical_view(codes, spec.granularity, x.shape)
    return _formats.store_codes(codes, spec)


def dequantize(codes: torch.Tensor, qparams: QParams, spec: QuantSpec, dtype=torch.float32) -> torch.Tensor:
    """Values of ``codes``: ``(codes - zero_point) * scale`` (``codes * scale`` for floats)."""
    view = canonical_view(codes, spec.granularity)
    scale, zero_point = _params(qparams, view)
    values = view if _compat_torch_ao.handles_codes(spec) else _formats.load_codes(view, spec)  # int32: exact
    out = _dequantize_view(values, scale, zero_point, spec, qparams.global_scale)
    return from_canonical_view(out, spec.granularity, codes.shape).to(dtype)


def _dequantize_view(codes, scale, zero_point, spec, global_scale=None):
    if _formats.handles_codes(spec):
        return _formats.dequantize_values(codes, scale, global_scale, spec)
    if _compat_torchao.handles_codes(spec):
        return _compat_torchao.torchao_dequantize(codes, scale, zero_point, spec)
    if _compat_torch_ao.handles_codes(spec):
        return _compat_torch_ao.dequantize_values(codes, scale, zero_point, spec)
    if _compat_compressed_tensors.handles_codes(spec):
        return _compat_compressed_tensors.dequantize_values(codes, scale, zero_point, spec)
    if spec.is_float:
        return codes * scale
    return (codes - zero_point.float()) * scale


def fake_quantize(x: torch.Tensor, qparams: QParams, spec: QuantSpec) -> torch.Tensor:
    """``dequantize(quantize(x))`` in ``x``'s dtype, with a straight-through gradient.

    The gradient with respect to ``x`` is 1 inside the representable range and 0 where the value
    was clipped. Composes with ``torch.func.grad``, ``vmap`` and ``torch.compile``.
    """
    view = canonical_view(x, spec.granularity)
    scale, zero_point = _params(qparams, view)
    unclamped, codes = _codes_float(view.detach(), scale, zero_point, spec, qparams.global_scale)
    out = _dequantize_view(codes, scale, zero_point, spec, qparams.global_scale)
    if view.requires_grad:
        if spec.is_float:
            fmax = spec.float_format.max
            inside = unclamped.abs() <= fmax
        else:
            qmin, qmax = _compat_torch_ao.gradient_range(spec) if spec.convention == "torch_ao" else spec.qrange
            inside = (unclamped >= qmin) & (unclamped <= qmax)
        passthrough = view.float() - view.float().detach()
        out = torch.where(inside, out + passthrough, out)
    out = from_canonical_view(out, spec.granularity, x.shape)
    return out.to(x.dtype)
