"""Importance matrix (imatrix): per-input-channel E[x**2] of activations, and the
importance-weighted MSE search for weights (llm-compressor's ``imatrix_mse``).

`imatrix()` observes a linear layer's inputs (a float64 sum of ``x**2`` per input channel and an
int64 row count, so merges are sums); `importance(state)` is ``sum / count``. `imatrix_mse` is
`qstats.mse` on the weight with each error weighted by its input channel's importance; its
difference from llm-compressor on per-tensor specs is in docs/differences.md.
"""

from __future__ import annotations

import operator
from typing import NamedTuple, Optional

import torch

from .._checks import require
from .._granularity import canonical_view, check_observable
from .._qparams import NoStatistics, register_range_rule
from .._spec import QuantSpec
from ._base import Observer, check_field_dtype, check_same_shapes, check_state, register_state
from .kit import checked_rows, raises_on_nonfinite
from .mse import check_expand, check_search_args, mse

__all__ = ["IMatrixState", "imatrix", "importance", "imatrix_mse"]


@register_state
class IMatrixState(NamedTuple):
    """``square_total``: float64 sum of ``x**2`` per input channel; ``count``: int64 rows seen
    (a scalar); ``nonfinite``: non-finite values left out per channel."""

    approx_fields = ("square_total",)  # float sums: laws compare them to tolerance

    square_total: torch.Tensor
    count: torch.Tensor
    nonfinite: torch.Tensor


def _checked(state, where: str) -> IMatrixState:
    """``state`` after the checks of an `IMatrixState`: its type, a float64 ``square_total``, int64
    ``count`` and ``nonfinite``, and shapes that line up (``count`` one per state, ``nonfinite`` one
    per channel); a state of other dtypes or shapes would otherwise change them, or broadcast."""
    check_state(state, IMatrixState, where)
    for name, dtype in (("square_total", torch.float64), ("count", torch.int64), ("nonfinite", torch.int64)):
        check_field_dtype(state, name, dtype, where)
    total = state.square_total
    if total.ndim == 0 or state.count.shape != total.shape[:-1] or state.nonfinite.shape != total.shape:
        raise ValueError(
            f"{where}: IMatrixState fields do not line up: square_total {tuple(total.shape)}, count "
            f"{tuple(state.count.shape)} (expected {tuple(total.shape[:-1])}), nonfinite {tuple(state.nonfinite.shape)}"
        )
    return state


def imatrix(spec: Optional[QuantSpec] = None) -> Observer:
    """Per-input-channel importance ``E[x**2]`` of a layer's input activations.

    ``spec`` is accepted so that ``Rule("Linear", sites=("input",), observer=qstats.imatrix)`` builds
    it as any observer; the importance depends on no quantization format, so only its ``nonfinite``
    policy is read: ``"raise"`` makes ``update`` raise ValueError on a kept NaN or Inf (or a square
    past float64) instead of leaving it out.
    ``update(state, x, weight=None)`` reduces every dimension but the last (``weight`` of shape
    ``x.shape[:-1]``, or a prefix of it, masks rows out). NaN/Inf, and float64 values whose square
    overflows, are left out and counted.
    Laws: identity; the others exactly for ``count``, up to float rounding for ``square_total``.

    >>> import torch, qstats
    >>> obs = qstats.imatrix()
    >>> x = torch.tensor([[1.0, 2.0], [3.0, 0.0]])
    >>> qstats.importance(obs.update(obs.init(x), x))
    tensor([5., 2.], dtype=torch.float64)
    """
    raise_on_nonfinite = raises_on_nonfinite(spec, "imatrix")

    def init_fn(x: torch.Tensor) -> IMatrixState:
        check_observable(x, "imatrix.init")
        if x.ndim == 0:
            raise ValueError("imatrix: activations need at least one dimension (the input channels), got shape ()")
        channels = x.shape[-1]
        zeros = torch.zeros(channels, dtype=torch.float64, device=x.device)
        return IMatrixState(zeros, torch.zeros((), dtype=torch.int64, device=x.device),
                            torch.zeros(channels, dtype=torch.int64, device=x.device))

    def update_fn(state: IMatrixState, x: torch.Tensor, weight: Optional[torch.Tensor] = None) -> IMatrixState:
        state = _checked(state, "imatrix.update")
        keep = checked_rows(x, weight, state.square_total.shape[-1], "imatrix.update")  # on an empty batch too
        if x.numel() == 0:
            return state
        rows = x.detach().reshape(-1, x.shape[-1]).to(torch.float64)
        if keep is None:  # every row
            keep = torch.ones(rows.shape[0], dtype=torch.bool, device=rows.device)
        keep = keep[:, None]  # [rows, 1] against the squares [rows, channels]
        squares = rows * rows
        finite = torch.isfinite(squares)  # NaN, Inf, or a float64 value whose square overflows
        total = torch.where(finite & keep, squares, torch.zeros_like(squares)).sum(0)
        nonfinite = ((~finite) & keep).sum(0)
        if raise_on_nonfinite:  # eagerly, under vmap and compile; threaded through the sum
            ok = require(nonfinite == 0, "imatrix.update: the activations hold a NaN or Inf (or a value whose "
                         "square overflows float64) and the spec says nonfinite='raise'")
            total = torch.where(ok, total, torch.zeros_like(total))
        return IMatrixState(state.square_total + total, state.count + keep.sum(), state.nonfinite + nonfinite)

    def merge_fn(a: IMatrixState, b: IMatrixState) -> IMatrixState:
        a, b = _checked(a, "imatrix.merge"), _checked(b, "imatrix.merge")
        check_same_shapes(a, b, "imatrix.merge")
        return IMatrixState(a.square_total + b.square_total, a.count + b.count, a.nonfinite + b.nonfinite)

    return Observer(init_fn, update_fn, merge_fn, exact=True, spec=None, name="imatrix", state_type=IMatrixState)


def importance(state: IMatrixState) -> torch.Tensor:
    """``E[x**2]`` per input channel over its finite values (float64; zeros before any data).
    A row's NaN/Inf is left out of its channel's sum and, through ``nonfinite``, of the
    channel's count. A stacked state (`qstats.stacked_observer`, ``count`` of shape ``[E]``)
    gives ``[E, channels]``, each expert over its own rows (llama.cpp's per-expert counts)."""
    state = _checked(state, "importance")
    # the row count is per state (per expert when stacked): it lines up with the channels' leading dims
    rows = state.count.unsqueeze(-1) - state.nonfinite
    return state.square_total / rows.clamp(min=1).to(torch.float64)


@register_range_rule(IMatrixState)
def _no_range(state, spec, **options):
    raise NoStatistics(
        "compute_qparams: an IMatrixState has no range (it is the importance of a layer's input channels); "
        "search the layer's weight with it: qstats.imatrix_mse(spec, weight.shape, state)"
    )


def _normalised_importance(state: IMatrixState, weight_shape: tuple) -> torch.Tensor:
    """The importance over its mean (float32, as llm-compressor), expanded to ``weight_shape``; per
    expert for a stacked state (``count`` of shape ``[E]``, a weight ``[E, out, in]``), each expert
    normalised as llm-compressor normalises each expert's own Linear."""
    state = _checked(state, "imatrix_mse")
    lead, channels = tuple(state.count.shape), state.square_total.shape[-1]
    if channels != weight_shape[-1]:
        raise ValueError(
            f"imatrix_mse: the importance has {channels} input channels but the weight of shape "
            f"{weight_shape} has {weight_shape[-1]}"
        )
    if len(weight_shape) < len(lead) + 2 or weight_shape[: len(lead)] != lead:
        raise ValueError(
            f"imatrix_mse: a stacked importance of {lead} experts needs a weight of shape "
            f"{lead} + (out, in), got {weight_shape}"
        )
    imp = importance(state).to(torch.float32)
    # llm-compressor's fallbacks to uniform weights: no rows seen, an importance that is all
    # zeros (every candidate's loss would be 0), or one that is not finite in float32: its float32
    # sums hold a NaN/Inf where an activation was one (qstats left it out and counted it in
    # ``nonfinite``) and overflow where the float32 sum of squares does
    usable = (state.count > 0) & (imp != 0).any(-1) & (state.nonfinite == 0).all(-1)
    usable = usable & torch.isfinite(state.square_total.to(torch.float32)).all(-1)
    imp = imp / (imp.mean(-1, keepdim=True) + torch.finfo(torch.float32).tiny)
    usable = usable & torch.isfinite(imp).all(-1)
    imp = torch.where(usable.unsqueeze(-1), imp, torch.ones_like(imp))
    return imp.reshape(lead + (1,) * (len(weight_shape) - len(lead) - 1) + (channels,)).expand(weight_shape)


def _checked_weight_shape(weight_shape) -> tuple:
    """``weight_shape`` as a tuple of ints: ValueError unless two or more non-negative integers
    (``int()`` truncated 64.5 to 64 and let -1 through to an expand that kept any size)."""
    try:
        given = tuple(weight_shape)
        dims = tuple(operator.index(d) for d in given if not isinstance(d, bool))
        ok = len(dims) == len(given) >= 2 and min(dims) >= 0
    except TypeError:
        ok = False
    if not ok:
        raise ValueError(f"imatrix_mse: weight_shape must have at least two dimensions (out, in), each a "
                         f"non-negative int, got {weight_shape!r}")
    return dims


def _check_own_options(options: dict) -> None:
    """TypeError for an `qstats.mse` option that `imatrix_mse` sets itself (``mse()`` got multiple
    values for it, an error that named neither imatrix_mse nor what to pass instead)."""
    for name, instead in (("steps", "maxshrink and grid (steps = int(maxshrink * grid) + 1, as llm-compressor)"),
                          ("importance", "imatrix_state, an IMatrixState of the layer's inputs")):
        if name in options:
            raise TypeError(f"imatrix_mse: {name} is set by imatrix_mse itself; pass {instead}")


def imatrix_mse(spec: QuantSpec, weight_shape, imatrix_state: Optional[IMatrixState] = None, maxshrink: float = 0.95,
                grid: float = 20, norm: float = 3.0, expand: float = 1.0, **options) -> Observer:
    """Importance-weighted MSE search for a weight of ``weight_shape`` ``(out, in)``, as llm-compressor's
    ``imatrix_mse``.

    Each element's error is multiplied by its column's importance ``E[x_j**2] / mean(E[x**2])``; without
    usable importance data (None, no rows, all zeros, a NaN/Inf activation, a sum of squares past the
    float32 range: llm-compressor's float32 sums are then not finite) the search is uniform, as
    llm-compressor's fallback. Defaults are llm-compressor's (``maxshrink=0.95``, ``grid=20``,
    ``norm=3``); other keyword arguments go to `qstats.mse`. Pass ``patience=5`` to ``compute_qparams``
    for its early stopping. A stacked ``imatrix_state`` (`qstats.stacked_observer` of `imatrix`, one
    per expert) takes a ``weight_shape`` of ``(E, out, in)``: each expert's importance is its own, and
    an expert no token reached searches uniformly (llm-compressor's fallback for its Linear).
    """
    # the spec's TypeError, and a ValueError naming a bad option (before int() below truncates it)
    check_search_args(spec, maxshrink, grid, norm, 1, "imatrix_mse")
    check_expand(expand, "imatrix_mse")  # llm-compressor's imatrix_mse takes expand < 1: docs/differences.md
    _check_own_options(options)
    weight_shape = _checked_weight_shape(weight_shape)
    weights = None
    if imatrix_state is not None:
        full = _normalised_importance(imatrix_state, weight_shape)
        weights = canonical_view(full, spec.granularity)
    steps = max(1, int(maxshrink * grid)) + 1

    def build(importance: torch.Tensor) -> Observer:
        return mse(spec, maxshrink=maxshrink, grid=grid, norm=norm, expand=expand, importance=importance,
                   steps=steps, **options)._replace(name="imatrix_mse")

    base = build(weights)

    def check_input(x: torch.Tensor, where: str) -> None:
        check_observable(x, where)  # before x.device: None was an AttributeError
        # the importance is laid out for the weight's shape; an empty tensor leaves the state as it is
        if weights is not None and x.numel() != 0 and tuple(x.shape) != weight_shape:
            raise ValueError(
                f"{where}: a tensor of shape {tuple(x.shape)} does not match the weight shape {weight_shape} "
                "the importance was given for"
            )

    def init_fn(x: torch.Tensor):
        check_input(x, "imatrix_mse.init")
        return base.init(x)

    def update_fn(state, x: torch.Tensor, weight: Optional[torch.Tensor] = None):
        check_input(x, "imatrix_mse.update")
        if weights is not None:
            return base.update(state, x, weight)
        # llm-compressor's imatrix search forms every error in float32, with importance data or
        # without: a unit importance (on the tensor's device) keeps qstats.mse from forming bf16/fp16
        # errors in their own dtype, as llm-compressor's plain mse observer does
        return build(torch.ones((), dtype=torch.float32, device=x.device)).update(state, x, weight)

    return base._replace(init=init_fn, update=update_fn)
