"""The GPTQ Hessian of a linear layer's inputs: the sum of ``x^T x`` over input rows, and the row count.

`hessian()` observes the *inputs* of a ``Linear`` layer (last dimension ``in_features``). The state
stores the **sum** ``total = sum_rows x^T x`` (float32 by default) and the int64 number of rows,
never a mean, so merges are sums: exact up to float rounding, counts exact.

llm-compressor keeps a running ``H = 2/n * sum x^T x`` (0.14: ``H += 2 x^T x`` then ``H / n`` before
GPTQ; older releases: ``H *= n/(n+m); H += 2/(n+m) x^T x``), where ``n`` counts the *samples* (the
leading dimension of each 3-D or wider input, one per sequence; a 2-D ``[tokens, in]`` input, as an
MoE expert's routed tokens, counts as one), not the rows. Its ``H`` is ``2 / n * state.total``;
`gptq_hessian` gives ``2 / rows * total``. GPTQ's result does not depend on a
positive factor of ``H`` (dampening is relative to its mean diagonal), so the two agree up to float
rounding whatever ``n`` counts, except where ``H`` has dead columns (zero diagonal): both set their
diagonal to 1 before taking the mean, a value that does not scale with ``H``, so with fewer
samples than rows (unless each sample is one row) and small activations its codes may differ by
several percent; given ``gptq_hessian(state)`` they are qstats', and given
``state._replace(count=samples)`` `qstats.gptq` gives llm-compressor's (docs/gptq.md).

A Hessian has no range: `compute_qparams` on a `HessianState` raises TypeError (use `qstats.gptq`).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .._checks import require
from .._gram import add_masked_gram
from .._granularity import check_observable
from .._qparams import register_range_rule
from .._spec import QuantSpec
from ._base import Observer, check_field_dtype, check_same_shapes, check_state, register_state
from .kit import checked_rows, raises_on_nonfinite

__all__ = ["HessianState", "hessian", "gptq_hessian"]


@register_state
class HessianState(NamedTuple):
    """``total``: sum of ``x^T x`` over the rows seen, ``[in, in]`` (float32, or the observer's
    dtype); ``count``: int64 rows summed (a scalar); ``nonfinite``: int64 rows left out because
    they held a NaN, an Inf or a value whose square overflows (a scalar)."""

    approx_fields = ("total",)  # a float sum: the laws compare it to tolerance

    total: torch.Tensor
    count: torch.Tensor
    nonfinite: torch.Tensor


def checked_hessian_state(state, where: str, values: bool = True) -> HessianState:
    """``state`` after the checks of a `HessianState`: its type, int64 tensors ``count`` and
    ``nonfinite`` (numbers of rows: a float count would divide GPTQ's Hessian by a non-integer), and
    with ``values`` a ValueError where one of them is negative (eagerly, under vmap and compile; the
    check is threaded through ``count``). ``update`` and ``merge`` skip the values, a host read."""
    check_state(state, HessianState, where)
    total = state.total
    if not isinstance(total, torch.Tensor) or total.ndim < 2 or total.shape[-1] != total.shape[-2]:
        got = tuple(total.shape) if isinstance(total, torch.Tensor) else type(total).__name__
        raise ValueError(f"{where}: HessianState.total must be a square [..., in, in] tensor, got {got}")
    for name in ("count", "nonfinite"):
        check_field_dtype(state, name, torch.int64, where, " (a number of rows)")
        value = getattr(state, name)
        if value.shape != total.shape[:-2]:  # one count per sum: a stack's [E], else a scalar (it broadcast)
            raise ValueError(f"{where}: HessianState.{name} of shape {tuple(value.shape)} does not fit a total of "
                             f"shape {tuple(total.shape)} (expected {tuple(total.shape[:-2])})")
    if not values:
        return state
    ok = require((state.count >= 0) & (state.nonfinite >= 0),
                 f"{where}: HessianState.count and .nonfinite are numbers of rows; the state holds a negative one")
    return state._replace(count=torch.where(ok, state.count, torch.zeros_like(state.count)))


def _check_sum_dtype(state: HessianState, where: str) -> None:
    """ValueError naming ``total``'s dtype unless float32 or float64: ``update`` sums in the state's
    dtype, so a bfloat16 total (a state converted to save memory) rounded every sum to 8 bits and an
    int64 one truncated the inputs to integers, silently."""
    if state.total.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"{where}: HessianState.total must be a float32 or float64 tensor (the sum is accumulated "
                         f"in its dtype), got {state.total.dtype}")


def hessian(spec: Optional[QuantSpec] = None, *, dtype: torch.dtype = torch.float32) -> Observer:
    """Sum of ``x^T x`` over the rows of a linear layer's inputs (GPTQ's Hessian, unnormalised).

    ``spec`` is accepted so that ``Rule("Linear", sites=("input",), observer=qstats.hessian)`` builds
    it as any observer; a Hessian depends on no quantization format, so only its ``nonfinite``
    policy is read: ``"raise"`` makes ``update`` raise ValueError on a kept row holding a NaN or Inf
    (or a square past ``dtype``) instead of leaving it out (llm-compressor's Hessian turns NaN there).

    ``update(state, x, weight=None)``: ``x`` of shape ``[..., in_features]``; every dimension but
    the last is a row. ``weight`` (shape a prefix of ``x.shape[:-1]``: padding or routing mask)
    leaves out the rows where it is zero and keeps every other row once (a mask: a routing
    probability of 0.3 does not scale its row's ``x^T x``, and ``count`` adds 1). Rows holding a NaN or Inf, or a value whose square
    overflows ``dtype`` (|x| above 1.8e19 in float32), are left out and counted in ``nonfinite``
    (`qstats.gptq` warns, naming them).
    Accumulates in ``dtype`` (float32 or float64) whatever the input dtype; a sum of many rows that
    passes float32's range is Inf (`qstats.gptq` refuses it): use ``dtype=torch.float64`` there
    (`qstats.gptq` scales a mean past float32's range by a power of 4, which changes no code).

    Laws: identity; associativity, commutativity and homomorphism exactly for the counts and up to
    float rounding for ``total``. Under `qstats.stacked_observer` each expert keeps its own
    ``[in, in]`` sum (state ``[E, in, in]``), its routing mask as ``weight``.

    >>> import torch, qstats
    >>> obs = qstats.hessian()
    >>> x = torch.tensor([[1.0, 2.0], [3.0, 0.0]])
    >>> obs.update(obs.init(x), x).total
    tensor([[10.,  2.],
            [ 2.,  4.]])
    """
    raise_on_nonfinite = raises_on_nonfinite(spec, "hessian")
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"hessian: dtype must be torch.float32 or torch.float64, got {dtype}")

    def init_fn(x: torch.Tensor) -> HessianState:
        check_observable(x, "hessian.init")
        if x.ndim == 0:
            raise ValueError("hessian: inputs need at least one dimension (in_features), got shape ()")
        features = x.shape[-1]
        zero = torch.zeros((), dtype=torch.int64, device=x.device)
        return HessianState(torch.zeros(features, features, dtype=dtype, device=x.device), zero, zero.clone())

    def update_fn(state: HessianState, x: torch.Tensor, weight: Optional[torch.Tensor] = None) -> HessianState:
        state = checked_hessian_state(state, "hessian.update", values=False)
        _check_sum_dtype(state, "hessian.update")
        keep = checked_rows(x, weight, state.total.shape[-1], "hessian.update")
        if x.numel() == 0:  # an empty batch leaves the state as it is (a shape test, not a value)
            return state
        rows = x.detach().reshape(-1, x.shape[-1]).to(state.total.dtype)
        finite = torch.isfinite(rows * rows).all(dim=1)  # NaN, Inf, or a square past the dtype's range
        kept = finite if keep is None else finite & keep
        nonfinite = (~finite).sum() if keep is None else ((~finite) & keep).sum()
        if raise_on_nonfinite:  # eagerly, under vmap and compile; threaded through the count
            ok = require(nonfinite == 0, "hessian.update: the inputs hold a row with a NaN or Inf (or a value whose "
                         "square overflows the Hessian's dtype) and the spec says nonfinite='raise'")
            kept = kept & ok
        # total + where(kept, rows, 0).T @ rows; under vmap over experts, each expert's rows only
        return HessianState(add_masked_gram(state.total, rows, kept), state.count + kept.sum(),
                            state.nonfinite + nonfinite)

    def merge_fn(a: HessianState, b: HessianState) -> HessianState:
        a, b = (checked_hessian_state(s, "hessian.merge", values=False) for s in (a, b))
        _check_sum_dtype(a, "hessian.merge")
        check_same_shapes(a, b, "hessian.merge")
        return HessianState(a.total + b.total, a.count + b.count, a.nonfinite + b.nonfinite)

    return Observer(init_fn, update_fn, merge_fn, exact=True, spec=None, name="hessian", shared_rows=True,
                    state_type=HessianState)


def normalized_hessian(total: torch.Tensor, count: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """``2 / count * total`` in ``dtype``, ``total`` ``[..., in, in]`` and ``count`` ``[...]`` (one per
    expert of a stack); zeros where ``count`` is 0. Divided before the (exact) doubling, so that a
    finite float32 sum past half of float32's range does not overflow to Inf; in float32 at least,
    so that a state converted to float16/bfloat16 is divided by its count as llm-compressor's float32
    Hessian is (a count past float16's 65504 was Inf there: a Hessian of zeros, every weight zero)."""
    wide = torch.promote_types(total.dtype, torch.float32)
    return (2.0 * (total.to(wide) / count.clamp(min=1).to(wide)[..., None, None])).to(dtype)


def gptq_hessian(state: HessianState) -> torch.Tensor:
    """``2 / rows * total`` in float32: llm-compressor's normalised Hessian when its sample count
    equals the row count (one row per sample, as inputs ``[rows, 1, in]``; a 2-D input is one sample
    there). Zeros where no row was seen. A stacked state (`qstats.stacked_observer`)
    gives ``[E, in, in]``, each expert divided by its own row count."""
    state = checked_hessian_state(state, "gptq_hessian")
    return normalized_hessian(state.total, state.count)


@register_range_rule(HessianState)
def _no_range(state, spec, **options):
    raise TypeError(
        "compute_qparams: a HessianState has no range (it is GPTQ's input statistic); quantize the "
        "layer's weight with qstats.gptq(weight, state, spec), with qparams from a weight observer"
    )
