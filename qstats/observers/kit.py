"""What an observer author needs, in one place (see docs/write_an_observer.md).

- the canonical view of a tensor for a granularity (`canonical_view`, `checked_view`, which also
  checks the state's parameter shape) and of a per-observation weight (`weight_view`; both at
  once, the weight as a bool mask: `masked_view`); the check of what ``init`` and ``update`` are
  given (`check_observable`: a TypeError naming the caller for a non-tensor, a bool or complex one);
- the shared finite reduction (`finite_aminmax`) and its row-first form for masked updates
  (`observe_extremes`);
- state checks (`check_state`, `check_same_shapes`), a batch-weighted mean for merging moving
  averages (`batch_weighted_mean`), the state registry (`register_state`) and the range-rule
  registry (`register_range_rule`, `Range`) that `compute_qparams` reads.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .._granularity import (
    PerAxis,
    PerHead,
    PerTensor,
    canonical_view,
    check_observable,
    checked_view,
    qparam_shape,
    weight_view,
)
from .._qparams import Range, register_range_rule
from .._reductions import finite_aminmax
from .._spec import QuantSpec
from ._base import (
    InitFn,
    MergeFn,
    Observer,
    State,
    UpdateFn,
    batch_weighted_mean,
    check_same_shapes,
    check_state,
    register_state,
    row_mask,
)

__all__ = [
    "InitFn",
    "MergeFn",
    "Observer",
    "State",
    "UpdateFn",
    "Range",
    "batch_weighted_mean",
    "canonical_view",
    "check_observable",
    "check_same_shapes",
    "check_spec",
    "check_state",
    "checked_view",
    "extremes_init",
    "finite_aminmax",
    "masked_view",
    "observe_extremes",
    "qparam_shape",
    "register_range_rule",
    "register_state",
    "weight_view",
]


def check_spec(spec, where: str = "") -> QuantSpec:
    """``spec`` itself, or TypeError when it is not a QuantSpec (the message starts with ``where``,
    the caller's name, when one is given)."""
    if not isinstance(spec, QuantSpec):
        prefix = f"{where}: " if where else ""
        raise TypeError(f"{prefix}expected a QuantSpec, got {type(spec).__name__}")
    return spec


def raises_on_nonfinite(spec, where: str) -> bool:
    """Whether the optional ``spec`` of an observer that depends on no quantization format (None, or a
    QuantSpec of which only ``nonfinite`` is read) says ``nonfinite="raise"``; TypeError naming
    ``where`` for anything else."""
    if spec is not None and not isinstance(spec, QuantSpec):
        raise TypeError(f"{where}: spec must be a QuantSpec or None, got {type(spec).__name__}")
    return spec is not None and spec.nonfinite == "raise"


def extremes_init(cls: type, spec: QuantSpec, name: str = "") -> Callable[[torch.Tensor], tuple]:
    """``init(x)`` for a state class whose first two fields are extremes (``+inf`` and ``-inf``,
    float32) and whose other fields are int64 counts (zero), shaped like ``x``'s parameters.
    ``name`` (the observer's) starts the TypeError of an ``x`` that is no real tensor
    (`check_observable`); without one the error names the state class."""
    spec = check_spec(spec)
    if not (isinstance(cls, type) and issubclass(cls, tuple) and len(getattr(cls, "_fields", ())) >= 2):
        raise TypeError(f"extremes_init expects a NamedTuple class with at least two fields (min, max), got {cls!r}")
    counters = len(cls._fields) - 2
    where = f"{name}.init" if name else f"init of a {cls.__name__}"

    def init_fn(x: torch.Tensor):
        check_observable(x, where)
        shape = qparam_shape(x.shape, spec.granularity)
        return cls(
            torch.full(shape, torch.inf, dtype=torch.float32, device=x.device),
            torch.full(shape, -torch.inf, dtype=torch.float32, device=x.device),
            *(torch.zeros(shape, dtype=torch.int64, device=x.device) for _ in range(counters)),
        )

    return init_fn


def masked_view(x: torch.Tensor, weight: Optional[torch.Tensor], spec: QuantSpec, expected_shape: tuple, where: str):
    """``(view, mask)``: `checked_view` of ``x`` for ``spec`` (its parameter shape checked against
    ``expected_shape``) and the per-observation ``weight`` as a bool keep mask expanded to the view
    (`weight_view`; None without a weight or padding), as `finite_aminmax` and the searches take them."""
    view = checked_view(x, spec.granularity, expected_shape, where)
    mask = weight_view(x, weight, spec.granularity)
    return view, None if mask is None else (mask != 0).expand(view.shape)


def checked_rows(x: torch.Tensor, weight: Optional[torch.Tensor], features: int, where: str) -> Optional[torch.Tensor]:
    """`row_mask` of the input ``x`` of a layer whose last dimension holds the state's ``features``
    (input channels), after TypeError for a tensor no observer reduces (`check_observable`) and
    ValueError naming both when ``x``'s last dimension is not ``features``."""
    check_observable(x, where)
    if x.ndim == 0 or x.shape[-1] != features:
        raise ValueError(f"{where}: inputs of shape {tuple(x.shape)} have {x.shape[-1] if x.ndim else 0} features "
                         f"(input channels, the last dimension), but the state has {features}")
    return row_mask(x, weight, where)


def _row_granularity(x: torch.Tensor, weight: torch.Tensor, granularity):
    """The granularity of one observation row ``x[i]`` (``i`` an index of ``weight``) when the
    parameters do not depend on the rows (per tensor, or per axis along a trailing axis)."""
    if isinstance(granularity, PerTensor):
        return granularity
    if type(granularity) in (PerAxis, PerHead):
        axis = granularity.axis % x.ndim
        if axis >= weight.ndim:
            return PerAxis(axis - weight.ndim)
    return None


def _masked_rows(x: torch.Tensor, weight: torch.Tensor, row_granularity):
    """The row-first reduction: every row's extremes and counts at once, then the rows that
    ``weight`` keeps combined. Exact (min and max of the kept rows' extremes); under
    ``vmap`` over experts with one shared ``x`` and a mask per expert, the rows are reduced once."""
    rows = x.reshape(-1, *x.shape[weight.ndim:])
    view = rows.reshape(rows.shape[0], *canonical_view(rows[0], row_granularity).shape).movedim(0, 1)
    row_min, row_max, row_count, row_nonfinite = finite_aminmax(view)
    keep = (weight.reshape(-1) != 0).reshape(-1, *(1,) * (row_min.ndim - 1))
    return (
        torch.where(keep, row_min, torch.inf).amin(dim=0),
        torch.where(keep, row_max, -torch.inf).amax(dim=0),
        (row_count * keep).sum(dim=0),
        (row_nonfinite * keep).sum(dim=0),
    )


def observe_extremes(
    x: torch.Tensor, weight: Optional[torch.Tensor], spec: QuantSpec, expected_shape: tuple, where: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(min, max, count, nonfinite)`` of ``x`` for ``spec`` over its canonical view, leaving out
    values whose ``weight`` is zero, as `finite_aminmax` with ``spec.nonfinite``. Checks the
    parameter shape against ``expected_shape`` (the state's) with an error naming both."""
    view = checked_view(x, spec.granularity, expected_shape, where)
    if (
        isinstance(weight, torch.Tensor)
        and spec.nonfinite == "ignore"
        and weight.ndim > 0
        and weight.numel() > 0
        and x.numel() > 0  # rows without values: reshaping them to [-1, ...] is ambiguous
        and tuple(weight.shape) == tuple(x.shape[: weight.ndim])
    ):
        row_granularity = _row_granularity(x, weight, spec.granularity)
        if row_granularity is not None:
            return _masked_rows(x, weight, row_granularity)
    return finite_aminmax(view, weight_view(x, weight, spec.granularity), spec.nonfinite)
