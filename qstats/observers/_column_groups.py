"""An observer of the groups of features of an activation, each reduced over all its rows.

A two-level (`TensorGroup`, NVFP4) activation whose group scales come at run time has one
calibrated parameter: its global scale. llm-compressor 0.14 observes such an input per group of
``group_size`` features (``flatten_for_calibration``: ``[tokens, groups, group_size]``): its
``minmax`` averages each group's extremes over the batches, its ``mse`` searches each group's range,
and the global scale comes from the largest group. `column_groups` gives an observer that view:
the state of ``observer`` (built for ``PerAxis(1)`` of ``[rows, groups, group_size]``) holds one
entry per group of features, whatever the number of rows (tokens) of each batch.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ._base import Observer, row_mask
from .kit import check_observable

__all__ = ["column_groups"]


def column_groups(observer: Observer, group_size: int) -> Observer:
    """``observer`` seeing each tensor ``x`` (``[..., features]``) as ``[rows, features // group_size,
    group_size]``, its rows all the leading dimensions; build ``observer`` for ``PerAxis(1)`` of that
    view (one state entry per group of features). A per-observation ``weight`` (a prefix of ``x``'s
    shape, as `qstats.calibrate`'s padding masks) masks the rows it covers (`row_mask`: the wrapped
    observer reads it as a keep mask, as every observer reads its weight). The observer's ``spec`` is
    None: its state holds statistics of groups of features, whose qparams under ``observer.spec`` (per
    group of the view) are no quantization parameters of ``x`` (the site's spec reads them).

    >>> import torch, qstats
    >>> from qstats.observers._column_groups import column_groups
    >>> spec = qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(1))
    >>> obs = column_groups(qstats.minmax(spec), 2)
    >>> x = torch.tensor([[[1.0, -2.0, 3.0, 0.5]], [[0.0, 4.0, -1.0, 0.0]]])  # [batch, tokens, features]
    >>> obs.update(obs.init(x), x).max_val
    tensor([4., 3.])

    Raises:
      ValueError: ``group_size`` is not a positive int, or does not divide the features of ``x``;
        a ``weight`` that is not a prefix of ``x``'s shape.
      TypeError: ``observer`` is not an Observer; a ``weight`` that is not a tensor (`row_mask`).
    """
    if not isinstance(observer, Observer):
        raise TypeError(f"column_groups: expected an Observer, got {type(observer).__name__}")
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
        raise ValueError(f"column_groups: group_size must be a positive int, got {group_size!r}")
    name = observer.name

    def view(x: torch.Tensor, where: str) -> torch.Tensor:
        check_observable(x, where)
        if x.ndim == 0 or x.shape[-1] % group_size:
            raise ValueError(f"{where}: inputs of shape {tuple(x.shape)}: groups of {group_size} features need a "
                             f"last dimension that {group_size} divides")
        return x.reshape(math.prod(x.shape[:-1]), x.shape[-1] // group_size, group_size)

    def init_fn(x: torch.Tensor):
        return observer.init(view(x, f"{name}.init"))

    def update_fn(state, x: torch.Tensor, weight: Optional[torch.Tensor] = None):
        where = f"{name}.update"
        return observer.update(state, view(x, where), row_mask(x, weight, where))

    return observer._replace(init=init_fn, update=update_fn, spec=None)
