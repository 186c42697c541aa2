"""Checks of tensor values that raise a clear ValueError wherever the values are real.

A check of a value needs the value on the host. Written as ops (``torch.library``), a check
runs eagerly, at run time of a ``torch.compile`` graph (the op stays in the graph), and under
``torch.vmap`` (a batching rule), without the caller asking which of them is running.
"""

from __future__ import annotations

import numbers
import operator
from typing import Optional

import torch

from ._ops import op, register_fake, register_vmap

__all__ = ["as_index", "check_available", "check_flag", "check_float_range", "check_floating", "check_real_tensor", "is_integer", "is_real_number",
           "require", "require_calibrated"]


def check_flag(value, name: str, caller: str) -> None:
    """TypeError, after ``caller``, for a ``name`` argument that is not True or False: a string
    ("no", "false") or another truthy object would switch the option on."""
    if not isinstance(value, bool):
        raise TypeError(f"{caller}: {name} must be True or False, got {value!r}")


def is_real_number(value) -> bool:
    """A Python or numpy real number, not a bool (``True`` is no averaging constant or eps): how
    qstats' factories recognise numeric options."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_integer(value) -> bool:
    """A Python or numpy integer, not a bool: how qstats recognises integer options (bins, ranges)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def as_index(value) -> Optional[int]:
    """``value`` as a Python int where it is an integer (``operator.index``: int, numpy or one-element
    integer tensors), not a bool (Python, numpy or torch); None otherwise, for the caller's error."""
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def check_available(device: torch.device, where: str) -> None:
    """ValueError naming ``device`` where this process cannot put tensors on it (no CUDA, a GPU
    index it lacks), before any work that would fail there."""
    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as error:  # AssertionError: torch built without CUDA
        raise ValueError(f"{where}: device {str(device)!r} is not available here, it cannot hold tensors "
                         f"({error})") from None


def check_floating(x, where: str) -> torch.Tensor:
    """``x``, after TypeError where it is not a floating-point tensor (quantizing one and casting
    back would truncate to integers; torch's fake-quant ops refuse them too)."""
    if not (isinstance(x, torch.Tensor) and x.is_floating_point()):
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"{where}: x must be a floating-point tensor, got {got}")
    return x


def check_real_tensor(value, message: str) -> torch.Tensor:
    """``value``, after TypeError ``"<message>, got <what it is>"`` where it is no real tensor (a
    Python number, a bool or complex tensor)."""
    if not isinstance(value, torch.Tensor) or value.dtype == torch.bool or value.is_complex():
        got = f"a {value.dtype} tensor" if isinstance(value, torch.Tensor) else type(value).__name__
        raise TypeError(f"{message}, got {got}")
    return value


@op("require")
def _require(condition: torch.Tensor, message: str) -> torch.Tensor:
    if not bool(condition.all()):
        raise ValueError(message)
    return condition.clone()


@register_fake(_require)
def _(condition, message):
    return torch.empty_like(condition)


def _require_vmap(info, in_dims, condition, message):
    return _require(condition, message), in_dims[0]  # every slice must hold


register_vmap(_require, _require_vmap)


def require(condition: torch.Tensor, message: str) -> torch.Tensor:
    """``condition`` (a bool tensor, copied), after ValueError(``message``) unless it is all True.
    Thread the result into the computation (or discard it in eager code)."""
    return _require(condition, message)


@op("require_calibrated")
def _require_calibrated(calibrated: torch.Tensor, where: str) -> torch.Tensor:
    missing = int((~calibrated).sum())
    if missing:
        raise ValueError(
            f"{where}: {missing} of {calibrated.numel()} quantization parameter(s) saw no finite data "
            "(uncalibrated; so does a reversed range, min_val > max_val, or a float64 end past the float32 "
            "range); observe more data or use QuantSpec(on_uncalibrated='fallback') to get scale 1 "
            "and zero point 0 with a coverage mask in QParams.calibrated"
        )
    return calibrated.clone()


@register_fake(_require_calibrated)
def _(calibrated, where):
    return torch.empty_like(calibrated)


def _require_calibrated_vmap(info, in_dims, calibrated, where):
    """Under vmap (stacked experts) an uncalibrated slice is reported, not raised: the caller
    reads ``QParams.calibrated`` (`qstats.compute_qparams_tree` applies the policy)."""
    return calibrated.clone(), in_dims[0]


register_vmap(_require_calibrated, _require_calibrated_vmap)


def require_calibrated(calibrated: torch.Tensor, where: str) -> torch.Tensor:
    """``calibrated`` (copied), after ValueError naming how many entries are False."""
    return _require_calibrated(calibrated, where)


def check_float_range(float_range, where: str = "compute_qparams") -> tuple:
    """``float_range`` as ``(lo, hi)`` floats or None, after ValueError for what coreai_opt refuses:
    not a pair, an entry that is not a finite real number or None, ``lo > 0``, ``hi < 0``, or
    ``lo >= hi``."""
    if not isinstance(float_range, (tuple, list)) or len(float_range) != 2:
        raise ValueError(f"{where}: float_range must be a pair (lo, hi), got {float_range!r}")
    ends = []
    for name, end in zip(("lo", "hi"), float_range):
        if end is not None and (not is_real_number(end) or not abs(end) <= float(torch.finfo(torch.float32).max)):
            raise ValueError(f"{where}: float_range {name} must be a finite float32 number or None, got {end!r}")
        ends.append(None if end is None else float(end))
    lo, hi = ends
    if lo is not None and lo > 0:
        raise ValueError(f"{where}: float_range lo must be <= 0 (the range contains zero), got {lo!r}")
    if hi is not None and hi < 0:
        raise ValueError(f"{where}: float_range hi must be >= 0 (the range contains zero), got {hi!r}")
    if lo is not None and hi is not None and lo >= hi:
        raise ValueError(f"{where}: float_range needs lo < hi, got ({lo!r}, {hi!r})")
    return lo, hi


def is_instance_named(value, package: str, name: str) -> bool:
    """Whether ``value``'s class, or one of its bases, is the class ``name`` of ``package`` (a
    transformers ``PreTrainedModel``, an llm-compressor ``Modifier``), without importing ``package``."""
    return any(cls.__name__ == name and cls.__module__.startswith(f"{package}.") for cls in type(value).__mro__)
