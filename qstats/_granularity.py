"""Granularities and the one canonical view every observer reduces over.

`canonical_view(x, granularity)` reshapes a tensor to ``(observations, *qparam_shape, group)``;
observers reduce over dims ``(0, -1)`` and never special-case a granularity. `from_canonical_view`
undoes it, so quantization uses the same view. The table of views is in docs/design.md.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ._checks import is_integer

__all__ = [
    "Granularity",
    "PerTensor",
    "PerAxis",
    "PerGroup",
    "PerBlock",
    "PerToken",
    "PerRow",
    "TensorGroup",
    "PerHead",
    "canonical_view",
    "checked_view",
    "check_observable",
    "from_canonical_view",
    "qparam_shape",
]


class Granularity:
    """Base class of granularities: frozen, hashable configuration, checked at construction."""

    def __post_init__(self) -> None:
        self._take_integers()
        self.validate()

    def _take_integers(self) -> None:
        """A numpy integer field (``np.int64(128)``, read from an array or a config) as the Python int it
        holds, as `QuantSpec` takes its ranges: equal and hashing equal to the spec built with ints."""
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if is_integer(value):
                object.__setattr__(self, field.name, int(value))
            elif isinstance(value, (tuple, list)):
                object.__setattr__(self, field.name, type(value)(int(v) if is_integer(v) else v for v in value))

    def validate(self) -> None:
        pass

    def row_wise(self) -> bool:
        """Whether each row (token) of an activation has its own parameters: a batch's scales are
        then its own, taken at run time (dynamic), since no other batch has the same rows."""
        return False


@dataclasses.dataclass(frozen=True)
class PerTensor(Granularity):
    """One set of quantization parameters for the whole tensor."""


@dataclasses.dataclass(frozen=True)
class PerAxis(Granularity):
    """One set of parameters per index along ``axis`` (torch.ao per-channel, ``ch_axis``)."""

    axis: int = 0

    def validate(self) -> None:
        if not isinstance(self.axis, int) or isinstance(self.axis, bool):
            raise ValueError(f"PerAxis.axis must be an int, got {self.axis!r}")


@dataclasses.dataclass(frozen=True)
class PerHead(PerAxis):
    """One set of parameters per attention head; ``axis`` is the head dimension (default 1)."""

    axis: int = 1


@dataclasses.dataclass(frozen=True)
class PerToken(Granularity):
    """One set per row of the last dimension (per token of an activation; dynamic)."""

    def row_wise(self) -> bool:
        return True


@dataclasses.dataclass(frozen=True)
class PerRow(Granularity):
    """One set per index of every dimension but ``dim``, reduced along ``dim`` (torchao
    ``PerRow(dim)``); the default ``dim=-1`` is one set per row of the last dimension, the view of
    PerToken."""

    dim: int = -1

    def validate(self) -> None:
        if not isinstance(self.dim, int) or isinstance(self.dim, bool):
            raise ValueError(f"PerRow.dim must be an int, got {self.dim!r}")

    def row_wise(self) -> bool:
        return self.dim == -1


@dataclasses.dataclass(frozen=True)
class PerGroup(Granularity):
    """Groups of ``group_size`` consecutive elements along the last dimension."""

    group_size: int = 128

    def validate(self) -> None:
        if not isinstance(self.group_size, int) or isinstance(self.group_size, bool) or self.group_size < 1:
            raise ValueError(f"{type(self).__name__}.group_size must be a positive int, got {self.group_size!r}")

    def row_wise(self) -> bool:
        return True


@dataclasses.dataclass(frozen=True)
class TensorGroup(PerGroup):
    """Two-level scales: per-group local scales under one global scale (NVFP4: group 16)."""

    group_size: int = 16


@dataclasses.dataclass(frozen=True)
class PerBlock(Granularity):
    """Blocks of ``block_shape`` over the last ``len(block_shape)`` dimensions: ``(rows, cols)``
    2-D blocks, or blocks spanning leading dimensions too (torchao's ``block_size``).

    ``partial=True`` (compressed-tensors' convention, as its ``strategy="block"``): a dimension the
    block does not divide ends in a smaller edge block, one set of parameters per
    ``ceil(size / block)``; observers reduce an edge block over its real values only. With
    ``partial=False`` (torchao, which asserts divisibility) such a shape raises ValueError."""

    block_shape: tuple = (128, 128)
    partial: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.block_shape, (tuple, list)):
            object.__setattr__(self, "block_shape", tuple(self.block_shape))
        super().__post_init__()

    def validate(self) -> None:
        ok = isinstance(self.block_shape, tuple) and len(self.block_shape) >= 2 and all(
            isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in self.block_shape
        )
        if not ok:
            raise ValueError(f"PerBlock.block_shape must be two or more positive ints, got {self.block_shape!r}")
        if not isinstance(self.partial, bool):
            raise ValueError(f"PerBlock.partial must be a bool, got {self.partial!r}")

    def row_wise(self) -> bool:
        """Blocks one row tall (torchao's ``(1, 128)`` activations)."""
        return all(b == 1 for b in self.block_shape[:-1])


def _normalize_axis(axis: int, shape, what: str = "PerAxis(axis") -> int:
    if not -len(shape) <= axis < len(shape):
        raise ValueError(f"{what}={axis}) is out of range for a tensor of shape {tuple(shape)}")
    return axis % len(shape)


def _check_divisible(size: int, part: int, what: str, shape, hint: str = "") -> None:
    if size % part != 0:
        raise ValueError(
            f"{what} {part} does not divide dimension {size} of a tensor of shape {tuple(shape)}; "
            f"pad the tensor or choose a divisor{hint}"
        )


def qparam_shape(shape, granularity: Granularity) -> tuple:
    """The shape of the quantization parameters for a tensor of ``shape``."""
    shape = tuple(shape)
    if isinstance(granularity, PerTensor):
        return ()
    if isinstance(granularity, PerAxis):  # shape (): out of range, as in canonical_view
        return (shape[_normalize_axis(granularity.axis, shape)],)
    if isinstance(granularity, (PerToken, PerRow, PerGroup)) and len(shape) == 0:
        raise ValueError(f"{type(granularity).__name__} needs a tensor with at least one dimension, got shape ()")
    if isinstance(granularity, (PerToken, PerRow)):
        dim = _row_dim(granularity, shape)
        return shape[:dim] + shape[dim + 1 :]
    if isinstance(granularity, PerGroup):
        _check_divisible(shape[-1], granularity.group_size, f"{type(granularity).__name__}.group_size", shape)
        return shape[:-1] + (shape[-1] // granularity.group_size,)
    if isinstance(granularity, PerBlock):
        return _block_qparam_shape(shape, granularity)
    raise TypeError(f"unknown granularity {granularity!r}")


def _block_qparam_shape(shape: tuple, granularity: PerBlock) -> tuple:
    """`qparam_shape` of a PerBlock: ``size // block`` per blocked dimension, or
    ``ceil(size / block)`` with ``partial``; ValueError for a block that does not divide a
    dimension otherwise."""
    block = granularity.block_shape
    if len(shape) < len(block):
        raise ValueError(f"PerBlock{block} needs a tensor with at least {len(block)} dimensions, got shape {shape}")
    lead = len(shape) - len(block)
    if not granularity.partial:
        names = ("PerBlock block rows", "PerBlock block cols") if len(block) == 2 else None
        hint = " (compressed-tensors' convention takes smaller edge blocks with PerBlock(..., partial=True); torchao's has none)"
        for i, b in enumerate(block):
            what = names[i] if names else f"PerBlock block size {block} along dimension {lead + i}:"
            _check_divisible(shape[lead + i], b, what, shape, hint)
    return shape[:lead] + tuple(-(-s // b) for s, b in zip(shape[lead:], block))


def _shortfalls(shape, block: tuple) -> list:
    """Per blocked dimension (the last ``len(block)`` of ``shape``), how far its size falls short of a
    multiple of its block: all zeros where every block divides."""
    return [-shape[len(shape) - len(block) + i] % b for i, b in enumerate(block)]


def _padded(x: torch.Tensor, block: tuple) -> torch.Tensor:
    """``x`` with zeros appended to each blocked dimension up to a multiple of its block (``x``
    itself where every block divides); the view of a partial PerBlock."""
    shortfalls = _shortfalls(x.shape, block)
    if not any(shortfalls):
        return x
    return torch.nn.functional.pad(x, [n for short in reversed(shortfalls) for n in (0, short)])


def _row_dim(granularity, shape) -> int:
    """The dimension a PerRow/PerToken reduces along, made non-negative."""
    return _normalize_axis(getattr(granularity, "dim", -1), shape, "PerRow(dim")


def _block_order(lead: int, k: int) -> list:
    """The permutation of ``(*lead, n1, b1, ..., nk, bk)`` to ``(*lead, n1, ..., nk, b1, ..., bk)``."""
    return list(range(lead)) + [lead + 2 * i for i in range(k)] + [lead + 2 * i + 1 for i in range(k)]


def canonical_view(x: torch.Tensor, granularity: Granularity) -> torch.Tensor:
    """Reshapes ``x`` to ``(observations, *qparam_shape, group)`` (a view where possible)."""
    shape = tuple(x.shape)
    if isinstance(granularity, PerTensor):
        return x.reshape(1, math.prod(shape))
    if isinstance(granularity, PerAxis):
        axis = _normalize_axis(granularity.axis, shape)
        return x.reshape(math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1 :]))
    qshape = qparam_shape(shape, granularity)
    if isinstance(granularity, (PerToken, PerRow)):
        dim = _row_dim(granularity, shape)
        return x.movedim(dim, -1).reshape(1, *qshape, shape[dim])
    if isinstance(granularity, PerGroup):
        return x.reshape(1, *qshape, granularity.group_size)
    if isinstance(granularity, PerBlock):
        block = granularity.block_shape
        lead, k = len(shape) - len(block), len(block)
        split = [n for pair in zip(qshape[lead:], block) for n in pair]
        blocks = _padded(x, block).reshape(*shape[:lead], *split).permute(_block_order(lead, k))
        return blocks.reshape(1, *qshape, math.prod(block))
    raise TypeError(f"unknown granularity {granularity!r}")


def checked_view(x: torch.Tensor, granularity: Granularity, expected_shape, where: str) -> torch.Tensor:
    """`canonical_view` of ``x`` for an update of a state whose parameters have shape
    ``expected_shape``; ValueError naming both shapes when they differ."""
    check_observable(x, where)
    check_shape(x.shape, granularity, expected_shape, where)
    return canonical_view(x, granularity)


def check_observable(x: torch.Tensor, where: str) -> None:
    """TypeError for what an observer cannot reduce: a non-tensor, a bool or complex tensor."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{where}: expected a tensor, got {type(x).__name__}")
    if x.dtype == torch.bool or x.is_complex():
        raise TypeError(
            f"{where}: cannot observe a tensor of dtype {x.dtype}; pass real floating-point or integer values"
        )


def check_shape(shape, granularity: Granularity, expected_shape, where: str) -> None:
    """ValueError naming both shapes where a tensor of ``shape`` gives quantization parameters of
    another shape than ``expected_shape`` (and `canonical_view`'s errors for a shape it cannot view),
    from the shape alone (no tensor op)."""
    shape = tuple(shape)
    params = qparam_shape(shape, granularity)
    if params != tuple(expected_shape):
        raise ValueError(
            f"{where}: a tensor of shape {shape} gives quantization parameters of shape {params}, "
            f"but the state has shape {tuple(expected_shape)}" + _axis_hint(granularity)
        )


def _axis_hint(granularity: Granularity) -> str:
    """For `check_shape`: a per-axis state keeps the size of its axis, which batches of activations
    (rows, tokens) change; else ""."""
    if type(granularity) is not PerAxis:
        return ""
    return (f" ({granularity} holds one parameter per index of dimension {granularity.axis}, so every tensor it "
            "observes must have that dimension's size; per feature of activations, whose row count changes from "
            "batch to batch, is PerAxis(-1))")


def from_canonical_view(view: torch.Tensor, granularity: Granularity, shape) -> torch.Tensor:
    """Inverse of `canonical_view`: back to a tensor of ``shape``."""
    shape = tuple(shape)
    if isinstance(granularity, PerBlock):
        block = granularity.block_shape
        lead, k = len(shape) - len(block), len(block)
        qshape = qparam_shape(shape, granularity)
        order = _block_order(lead, k)
        inverse = sorted(range(len(order)), key=order.__getitem__)
        blocks = view.reshape(*qshape, *block).permute(inverse)
        padded = blocks.reshape(*shape[:lead], *(n * b for n, b in zip(qshape[lead:], block)))
        return padded[(..., *(slice(0, size) for size in shape[lead:]))]  # the edge blocks' padding dropped
    if isinstance(granularity, (PerToken, PerRow)):
        dim = _row_dim(granularity, shape)
        return view.reshape(shape[:dim] + shape[dim + 1 :] + (shape[dim],)).movedim(-1, dim)
    return view.reshape(shape)


def in_layout_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``y`` (computed from ``x`` in a canonical view) in ``x``'s memory layout, as torch's fake-quant ops
    keep it: a convolution given a channels_last weight or input in the contiguous layout runs in that layout,
    rounding its output and gradients otherwise (and more slowly). A contiguous ``x`` (the usual case, and
    the only one ``vmap`` reports) takes no copy."""
    if x.is_contiguous():
        return y
    return torch.empty_like(x).copy_(y)


def broadcast_to_view(param: torch.Tensor) -> torch.Tensor:
    """Adds the observation and group dimensions to a ``qparam_shape`` tensor."""
    return param.unsqueeze(0).unsqueeze(-1)


def weight_view(x: torch.Tensor, weight, granularity: Granularity):
    """Broadcasts a per-observation ``weight`` (its shape a prefix of ``x.shape``) into the canonical view
    of ``x`` (None stays None, except for a partial PerBlock: its padding mask); zero weights exclude
    values without changing any shape. ValueError naming both shapes when it does not fit.
    """
    if weight is None:
        return _padding_mask(x, granularity)
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a tensor or None, got {type(weight).__name__}")
    if weight.ndim > x.ndim or tuple(weight.shape) != tuple(x.shape[: weight.ndim]):
        raise ValueError(
            f"weight of shape {tuple(weight.shape)} does not match the leading dimensions of the "
            f"observed tensor of shape {tuple(x.shape)}"
        )
    full = weight.reshape(tuple(weight.shape) + (1,) * (x.ndim - weight.ndim)).expand(x.shape)
    return canonical_view(full, granularity)  # a partial block's padding gets weight 0


def _padding_mask(x: torch.Tensor, granularity: Granularity):
    """None, or for a partial PerBlock whose edge blocks are padded, the bool canonical view that
    is False on the padding: observers reduce an edge block over its real values only."""
    if (not isinstance(granularity, PerBlock) or not granularity.partial
            or x.ndim < len(granularity.block_shape)
            or not any(_shortfalls(x.shape, granularity.block_shape))):
        return None
    return canonical_view(torch.ones(x.shape, dtype=torch.bool, device=x.device), granularity)
