"""Scales and zero points as compressed-tensors stores them, and the checks that keep a
checkpoint loadable: finite positive scales in the module's dtype, int8 or float8 zero points."""

from __future__ import annotations

from typing import Any, Optional

import torch

from .._qparams import QParams
from .config import fail
from .packing import signed_int8

__all__ = ["check_qparams", "check_scales", "module_dtype", "qparam_shape", "scale_dtype", "zero_point"]

_CT_SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def scale_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype compressed-tensors gives the scales of a module with this weight: the weight's
    (float16 for other dtypes)."""
    return weight.dtype if weight.dtype in _CT_SCALE_DTYPES else torch.float16


def module_dtype(module: torch.nn.Module) -> torch.dtype:
    """The dtype of an attention module's scales: its first parameter's (float16 for others)."""
    first = next(module.parameters(), None)
    return torch.float32 if first is None else scale_dtype(first)


def check_qparams(qp: Any, where: str, args: Optional[dict] = None) -> QParams:
    """``qp``, after TypeError where it is no QParams and, given the site's ``args``, ValueError for QParams
    without a zero point, or two-level args without one global scale (compressed-tensors registers one,
    ``initialize_qparams``): the export failed on them with an error naming no site."""
    if not isinstance(qp, QParams):
        raise TypeError(f"export.compressed_tensors: {where}: expected QParams, got {type(qp).__name__}")
    if args is None:
        return qp
    if qp.zero_point is None:
        fail(where, "qparams without a zero point (QParams.zero_point is None; qstats.compute_qparams gives one "
             "per scale, zeros for symmetric specs)")
    if args["strategy"] == "tensor_group" and (qp.global_scale is None or qp.global_scale.numel() != 1):
        fail(where, f"two-level (NVFP4) qparams need one global scale, got "
             f"{None if qp.global_scale is None else tuple(qp.global_scale.shape)}")
    return qp


def check_scales(values: torch.Tensor, where: str, what: str = "scales") -> None:
    """Refuses to write NaN, infinite, zero or negative scales (compressed-tensors and vLLM divide
    by them): checked on the values as stored, after any rounding to the checkpoint's dtype."""
    values = values.float()
    bad = ~(torch.isfinite(values) & (values > 0))
    if bool(bad.any()):
        sample = values[bad].flatten()[:4].tolist()
        fail(where, f"{int(bad.sum())} of {values.numel()} {what} are NaN, infinite, zero or negative as "
             f"stored (e.g. {sample}); a checkpoint needs finite positive scales (a spec eps below the "
             "smallest positive value of the model's dtype underflows to 0)")


def qparam_shape(scale: torch.Tensor, strategy: str, where: str) -> tuple:
    """The shape compressed-tensors gives the scales of a strategy."""
    if strategy == "tensor":
        if scale.numel() != 1:
            fail(where, f"per-tensor qparams must hold one scale, got shape {tuple(scale.shape)}")
        return (1,)
    if strategy == "channel":
        if scale.dim() != 1:
            fail(where, f"per-channel qparams must be 1-D, got shape {tuple(scale.shape)}")
        return (scale.shape[0], 1)
    return tuple(scale.shape)


def zero_point(qp: QParams, args: dict, offset: int, shape: tuple, where: str) -> Optional[torch.Tensor]:
    """The zero point compressed-tensors stores: int8, float8_e4m3fn for float args (its
    ``zp_dtype``), None for symmetric args."""
    if args["symmetric"]:
        if not bool(((qp.zero_point.float() + offset) == 0).all()):
            fail(where, "a symmetric spec with a non-zero zero point (symmetric_zero_point) is not expressible")
        return None
    if qp.zero_point.squeeze().shape != qp.scale.squeeze().shape:
        # written in the scales' shape, as compressed-tensors registers it: a broadcast or transposed one is not
        fail(where, f"a zero point of shape {tuple(qp.zero_point.shape)} for scales of shape {tuple(qp.scale.shape)}; "
             "compressed-tensors stores one zero point per scale")
    if args["type"] == "float":
        # compressed-tensors' zp_dtype of float args is float8_e4m3fn (QuantizationArgs), and its
        # calculate_qparams rounds the zero point to it: store that, never an int8 truncation
        value = qp.zero_point.reshape(shape).float()
        stored = value.to(torch.float8_e4m3fn)
        if not torch.equal(stored.float(), value):
            fail(where, "zero points of float args are stored as float8_e4m3fn; these are not representable")
        return stored
    value = qp.zero_point.reshape(shape)
    _check_integer_zero_points(value, offset, args["num_bits"], where)
    return signed_int8(value, offset)


def _check_integer_zero_points(value: torch.Tensor, offset: int, num_bits: int, where: str) -> None:
    """Refuses zero points that are not whole numbers of the args' range ``[-2**(b-1), 2**(b-1) - 1]``
    once moved by ``offset``: compressed-tensors' ``calculate_qparams`` rounds and clamps its own to it,
    and the int8 cast (or the int32 packing of ``num_bits`` values) would wrap, truncate or keep a zero
    point its codes cannot reach (107 of int4 args). A weight's were checked by `quantize` (against
    the spec's range); an activation's (static input, kv cache) come here unchecked. Zero points are
    few: checked in float64, no copy of codes."""
    lo, hi = -(2 ** (num_bits - 1)), 2 ** (num_bits - 1) - 1
    moved = value.to(torch.float64) + offset  # a NaN fails every comparison
    bad = ~((moved == moved.round()) & (moved >= lo) & (moved <= hi))
    if bool(bad.any()):
        fail(where, f"{int(bad.sum())} of {value.numel()} zero points are not whole numbers in compressed-tensors' "
             f"{num_bits}-bit range [{lo}, {hi}] once moved by {offset} (e.g. {value[bad][:4].tolist()}); "
             "compressed-tensors' calculate_qparams gives zero points in the args' range")
