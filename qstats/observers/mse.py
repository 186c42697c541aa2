"""MSE range search as a streaming, mergeable state (llm-compressor's MSE observers, ModelOpt's
MseCalibrator).

The state accumulates, per quantization parameter, ``sum |fake_quantize(x) - x| ** norm`` for every
shrink factor of a reference range, so ``compute_qparams`` takes the argmin over all data instead
of averaging per-batch choices. ``mode="moving_average"`` reproduces llm-compressor's per-batch
``mse`` observer. See docs/observers.md and docs/differences.md.
"""

from __future__ import annotations

import dataclasses
import math

from typing import NamedTuple, Optional

import torch

from .._ops import op, register_fake, register_vmap
from .._granularity import PerGroup, TensorGroup, check_observable, qparam_shape
from .._checks import check_real_tensor, is_integer, is_real_number, require
from .._qparams import Range, qparams_from_minmax, register_range_rule
from .._quant import _codes_float, _dequantize_view
from .._reductions import finite_aminmax
from .._spec import QuantSpec
from .._torch_features import rounded_to
from ._base import Observer, check_merge_states, check_state, kept_dtypes, register_state
from .kit import check_spec, extremes_init, masked_view
from .minmax import check_averaging_constant, merge_moving_extremes

__all__ = ["MSEState", "MovingAverageMSEState", "mse", "shrink_factors", "candidate_losses", "checked_patience",
           "stopped_per_part", "searched_per_part"]


@register_state
class MSEState(NamedTuple):
    """Accumulated candidate losses. ``min_val``/``max_val``: the reference range (``+inf``/``-inf``
    until set); ``loss``: float64 ``(*qparam_shape, C)``; ``factors``: the C shrink factors (the
    columns of ``loss``); ``count``/``nonfinite``: values seen and left out."""

    approx_fields = ("loss",)  # float sums: laws compare them to tolerance

    min_val: torch.Tensor
    max_val: torch.Tensor
    loss: torch.Tensor
    factors: torch.Tensor
    count: torch.Tensor
    nonfinite: torch.Tensor


@register_state
class MovingAverageMSEState(NamedTuple):
    """llm-compressor ``mse``: moving average of per-batch MSE-optimal ranges."""

    min_val: torch.Tensor
    max_val: torch.Tensor
    batches: torch.Tensor
    count: torch.Tensor
    nonfinite: torch.Tensor


def shrink_factors(maxshrink: float, grid: float, steps: Optional[int] = None) -> list:
    """``[max(1 - i / grid, 0) for i in range(steps)]`` with ``steps = int(maxshrink * grid)`` by
    default. A factor past zero (``steps > grid``: ``imatrix_mse``'s ``int(maxshrink * grid) + 1``
    steps with ``grid < 1``) is 0: compressed-tensors clamps such a flipped range ``(p * min, p * max)``
    to hold zero, which is the zero range; as a flipped range it read as uncalibrated (scale 1)."""
    if steps is None:
        steps = int(maxshrink * grid)
    return [max(1.0 - i / grid, 0.0) for i in range(steps)]


def search_spec(spec: QuantSpec) -> QuantSpec:
    """The spec the candidates are scored with: ``spec`` itself, or for a two-level (TensorGroup,
    NVFP4) spec its groups with float32 scales and no global scale, as llm-compressor's mse searches
    (its ``nvfp4_expanded_mse`` too; the global scale cancels out of float32 block scales).
    ``compute_qparams(state, spec)`` then takes the global scale from the chosen ranges' absmax."""
    if isinstance(spec.granularity, TensorGroup):
        return dataclasses.replace(spec, granularity=PerGroup(spec.granularity.group_size), scale_dtype="float32")
    return spec


def check_search_args(spec, maxshrink, grid, norm, steps, where: str = "mse") -> None:
    """TypeError / ValueError naming a bad option of an MSE search: ``steps`` a positive int or None,
    and then the candidates ``int(maxshrink * grid)`` at least one."""
    check_spec(spec, where)
    if not (is_real_number(maxshrink) and 0 <= maxshrink <= 1):
        raise ValueError(f"{where}: maxshrink must be in [0, 1], got {maxshrink!r}")
    for name, value in (("grid", grid), ("norm", norm)):
        if not (is_real_number(value) and 0 < value < math.inf):
            raise ValueError(f"{where}: {name} must be a positive finite number, got {value!r}")
    if steps is not None:
        # True was one candidate and 2.5 a TypeError from range(); 0 blamed maxshrink * grid
        if not (is_integer(steps) and steps >= 1):
            raise ValueError(f"{where}: steps must be a positive int (the number of candidates) or None, got {steps!r}")
        return
    count = int(maxshrink * grid)
    if count < 1:
        raise ValueError(f"{where}: int(maxshrink * grid) must be at least 1 candidate, got {count} "
                         f"(maxshrink={maxshrink}, grid={grid})")


_CHUNK = 1 << 18  # elements per chunk: temporaries stay small and are reused by the allocator


def _chunk_slices(size: int, step: int) -> list:
    step = max(1, step)
    return [slice(start, start + step) for start in range(0, size, step)]


def candidate_losses(view, mask, importance, lo, hi, factors, spec: QuantSpec, norm: float,
                     rounded: bool = False):
    """``sum |fq(x) - x| ** norm`` over dims (0, -1) of a canonical view for every candidate range
    ``(p * lo, p * hi)``; returns float64 ``(*qparam_shape, C)``. ``mask`` (bool, False leaves a
    value out) and ``importance`` (float) broadcast against the view. Non-finite values (float64
    ones past float32's range too, as `finite_aminmax` counts them) count as zeros (which quantize
    without error). ``rounded``: the candidates of bf16/fp16 inputs computed natively are rounded
    to the input's dtype (`_candidate`). The view is processed in chunks of about 2**18 values."""
    v = view.detach()
    compute_dtype = v.dtype if v.dtype in (torch.float32, torch.float64) else torch.float32
    # bf16/fp16 inputs under a spec that computes in their dtype (compressed-tensors with
    # observed_dtype): quantized from their own values and dequantized to it, as compressed-tensors'
    # fake_quantize does. Other specs accumulate half-precision inputs in float32.
    native = v.dtype if _computes_natively(spec, v.dtype) else None
    # finite as the range reduction counts them (`finite_aminmax`): a float64 value past float32's
    # range is left out and counted in ``nonfinite``, so its error must not decide the search either
    finite = torch.isfinite(v.to(torch.float32))
    v = torch.where(finite, v.to(compute_dtype), torch.zeros((), dtype=compute_dtype, device=v.device))
    if mask is not None:
        v = torch.where(mask, v, torch.zeros_like(v))
    # zero quantizes to itself unless the zero point is a float: only then mask the error, of the
    # masked-out values and of the non-finite ones (zeros above) alike
    error_mask = None
    if spec.zero_point_domain == "float":
        error_mask = finite if mask is None else (mask & finite)
    params = tuple(v.shape[1:-1])
    observations, group = v.shape[0], v.shape[-1]
    num_params = math.prod(params)
    v = v.reshape(observations, num_params, group)
    weights = None if importance is None else importance.expand(view.shape).reshape(observations, num_params, group)
    keep = None if error_mask is None else error_mask.expand(view.shape).reshape(observations, num_params, group)
    calibrated = torch.ones(lo.shape, dtype=torch.bool, device=lo.device)
    to = native if rounded else None
    candidates = [qparams_from_minmax(*_candidate(lo, hi, p, to), spec, calibrated=calibrated) for p in factors]
    scales = [qp.scale.float().reshape(1, num_params, 1) for qp in candidates]
    zero_points = [qp.zero_point.reshape(1, num_params, 1) for qp in candidates]
    every = slice(None)
    if v.numel() <= _CHUNK:  # one chunk, decided without the sizes' values: torch.compile keeps one graph
        chunks = [(every, every, every)]
    elif num_params > 1:
        chunks = [(every, cut, every) for cut in _chunk_slices(num_params, _CHUNK // (observations * group))]
    else:
        chunks = [(every, every, cut) for cut in _chunk_slices(group, _CHUNK // observations)]
    # compressed-tensors specs on bf16/fp16 inputs, without an importance: the error of every value
    # in the input's dtype and its sum rounded to it once, as llm-compressor's MSE observers form them
    native_error = native is not None and importance is None
    rows = [_chunk_losses(v, index, scales, zero_points, weights, keep, spec, norm, native, native_error)
            for index in chunks]  # per chunk: (C, params in chunk)
    total = torch.cat(rows, dim=-1) if num_params > 1 else torch.stack(rows, dim=0).sum(0)
    if native_error:  # the float32 sums rounded once to the input's dtype, where they fit it
        narrow = total.to(torch.float32).to(native)
        total = torch.where(narrow.isfinite(), narrow.to(torch.float64), total)
    return total.transpose(0, 1).reshape(*params, len(factors))


def _candidate(lo: torch.Tensor, hi: torch.Tensor, p: float, dtype: Optional[torch.dtype]):
    """The candidate range ``(lo * p, hi * p)``, rounded to ``dtype`` where given: llm-compressor's
    ``mse`` forms a bf16/fp16 input's candidates in its dtype and keeps them so, and a candidate
    rounded across an exponent boundary takes another MX (e8m0) scale than the unrounded one."""
    if dtype is None:
        return lo * p, hi * p
    return rounded_to(lo * p, dtype), rounded_to(hi * p, dtype)  # rounded_to: kept under torch.compile


def _computes_natively(spec: QuantSpec, dtype: torch.dtype) -> bool:
    """True for bf16/fp16 inputs under a spec whose convention computes in the observed dtype
    (compressed-tensors: ``from_compressed_tensors(args, observed_dtype=...)``), whose mse search
    llm-compressor runs in the input's dtype."""
    return (
        spec.convention.computes_in_observed_dtype
        and dtype in (torch.bfloat16, torch.float16)
        and spec.compute_dtype == str(dtype).removeprefix("torch.")
    )


def _chunk_losses(v, index, scales, zero_points, weights, keep, spec, norm, native, native_error):
    """``candidate_losses`` of one chunk of the view: ``(C, params in chunk)`` float64. ``native``
    (bf16/fp16 inputs): codes computed and dequantized in that dtype; ``native_error``: the error formed
    in it too, as llm-compressor's observers do, so their choice holds bit for bit.
    """
    part = v[index]
    code_input = part if native is None else part.to(native)  # exact: the values came from native
    weights = None if weights is None else weights[index]
    keep = None if keep is None else keep[index]
    losses = []
    for scale_all, zero_all in zip(scales, zero_points):
        scale, zero_point = scale_all[:, index[1]], zero_all[:, index[1]]
        _, codes = _codes_float(code_input, scale, zero_point, spec)
        dequantized = _dequantize_view(codes, scale, zero_point, spec)
        if native is not None:
            dequantized = dequantized.to(native)
        difference = dequantized - code_input if native_error else dequantized.to(part.dtype) - part
        losses.append(_error_sum_op(difference, weights, keep, norm, native_error))
    return torch.stack(losses, dim=0)


def _error_total(d, weights, keep, norm: float, as_float32: bool) -> torch.Tensor:
    error = d * d if norm == 2.0 else d.abs().pow(norm)
    if weights is not None:
        error = error * weights
    if keep is not None:
        error = torch.where(keep, error, torch.zeros_like(error))
    return error.sum(dim=(0, -1), dtype=torch.float32 if as_float32 else None).to(torch.float64)


@op("error_sum")
def _error_sum_op(difference: torch.Tensor, weights: Optional[torch.Tensor], keep: Optional[torch.Tensor],
                  norm: float, native_error: bool) -> torch.Tensor:
    """``sum |difference| ** norm`` over dims (0, -1) as float64, formed in ``difference``'s dtype
    (summed in float32 for ``native_error``); where that sum overflows (data near 1e16 and beyond)
    the sum formed in float64 replaces it. One op, so that the float64 pass runs only when needed."""
    narrow = _error_total(difference, weights, keep, norm, native_error)
    if difference.dtype == torch.float64 and not native_error:
        return narrow
    finite = narrow.isfinite()
    if bool(finite.all()):  # this op's own host read: the usual case skips the float64 pass
        return narrow
    return torch.where(finite, narrow, _error_total(difference.to(torch.float64), weights, keep, norm, False))


@register_fake(_error_sum_op)
def _(difference, weights, keep, norm, native_error):
    return difference.new_empty(difference.shape[1:-1], dtype=torch.float64)


def _error_sum_vmap(info, in_dims, difference, weights, keep, norm, native_error):
    """The vmapped dimension moves inside the parameter dims (dim 1); every slice in one call."""
    moved = [t if t is None else t.unsqueeze(1) if d is None else t.movedim(d, 1)
             for t, d in zip((difference, weights, keep), in_dims)]
    shape = torch.broadcast_shapes(*(t.shape for t in moved if t is not None))
    return _error_sum_op(moved[0].expand(shape), moved[1], moved[2], norm, native_error), 0


register_vmap(_error_sum_op, _error_sum_vmap)


def _chosen_factor(loss: torch.Tensor, factors: torch.Tensor, patience: Optional[int]) -> torch.Tensor:
    """The shrink factor of the chosen candidate per parameter, float32: the first minimum, optionally
    restricted to the candidates llm-compressor evaluates before its early stop (``patience``: it stops
    at the first step that improves no parameter once ``patience`` such steps ran in a row, so 0 stops
    there as 1 does). ``factors`` is ``[*stack, C]``: the parameters of ``loss`` (``[..., C]``, in order)
    fall into ``prod(stack)`` equal parts, each stopping on its own: a stacked state's experts, and
    the projections of a fused one (`stopped_per_part`)."""
    stack, steps = factors.shape[:-1], loss.shape[-1]
    flat = loss.reshape(*stack, -1, steps)  # (*stack, params, C)
    if patience is not None:
        patience = max(patience, 1)
        running = torch.cummin(flat, dim=-1).values
        previous = torch.cat([torch.full_like(running[..., :1], torch.finfo(torch.float64).max),
                              running[..., :-1]], -1)
        improved = (flat < previous).any(-2)  # (*stack, C)
        order = torch.arange(steps, device=loss.device)
        positions = order.expand_as(improved)
        last_improved = torch.cummax(torch.where(improved, positions, torch.full_like(positions, -1)), -1).values
        stalled = (positions - last_improved) >= patience
        stop = torch.where(stalled, positions, torch.full_like(positions, steps - 1)).amin(-1)  # (*stack,)
        flat = torch.where(order <= stop.unsqueeze(-1).unsqueeze(-1), flat, torch.full_like(flat, torch.inf))
    best = torch.argmin(flat, dim=-1, keepdim=True)
    # a gather, not factors[best]: a 0-dim index would read its value on the host (a graph break)
    chosen = torch.gather(factors.unsqueeze(-2).expand(flat.shape), -1, best)
    return chosen.reshape(loss.shape[:-1]).float()


def stopped_per_part(state: MSEState, parts: int) -> MSEState:
    """``state`` whose search (`compute_qparams`' ``patience``) stops on its own in each of ``parts``
    equal parts of its parameters' leading dimension (the gate and up halves of a stacked
    ``gate_up_proj``, which llm-compressor searches as two Linears); the state of a stack stays one
    per expert. Its losses, ranges and merges are unchanged."""
    factors = state.factors
    return state._replace(factors=factors.unsqueeze(-2).expand(*factors.shape[:-1], parts, factors.shape[-1]))


def searched_per_part(observer: Observer, parts: int) -> Observer:
    """``observer`` whose moving-average search (``mse(spec, mode="moving_average")``, which chooses each
    batch's range in ``update``, early stop included) runs on its own in each of ``parts`` equal parts of
    the input's rows (dimension 0) and of the state's parameters: the gate and up halves of a stacked
    ``gate_up_proj``'s ``[2I, H]`` per expert (wrap it before `qstats.stacked_observer`), which
    llm-compressor searches as two Linears, each with its own ``patience`` stop. Other states are updated
    by ``observer`` as they are (an accumulating `MSEState` stops per part in ``compute_qparams``: see
    `stopped_per_part`); ``init`` and ``merge`` are ``observer``'s. ValueError where the rows or the
    parameters do not split into ``parts`` (a granularity whose parameters do not follow the rows)."""
    if not isinstance(observer, Observer):
        raise TypeError(f"searched_per_part expects an Observer, got {type(observer).__name__}")
    if not (is_integer(parts) and parts >= 1):
        raise ValueError(f"searched_per_part: parts must be a positive int, got {parts!r}")
    parts = int(parts)

    def update_fn(state, x: torch.Tensor, weight: Optional[torch.Tensor] = None):
        check_observable(x, "mse.update")
        if parts == 1 or not isinstance(state, MovingAverageMSEState) or x.numel() == 0:  # an empty batch: no search
            return observer.update(state, x, weight)
        _check_parts(state, x, weight, parts, observer.spec)
        weights = [None] * parts if weight is None else weight.chunk(parts)
        halves = [observer.update(MovingAverageMSEState(*(field.chunk(parts)[i] for field in state)), rows, part)
                  for i, (rows, part) in enumerate(zip(x.chunk(parts), weights))]
        return MovingAverageMSEState(*(torch.cat(fields) for fields in zip(*halves)))

    return observer._replace(update=update_fn)


def _check_parts(state: MovingAverageMSEState, x: torch.Tensor, weight, parts: int, spec: QuantSpec) -> None:
    """ValueError unless ``x``'s rows (and a row ``weight``'s) split into ``parts`` equal parts whose
    parameters (`qparam_shape`) are the state's, split along its leading dimension."""
    shape = tuple(state.min_val.shape)
    rows = x.shape[0] if x.ndim else 0
    part = (rows // parts, *x.shape[1:])
    expected = (shape[0] // parts, *shape[1:]) if shape and shape[0] % parts == 0 else None
    if rows % parts or expected is None or qparam_shape(part, spec.granularity) != expected:
        raise ValueError(
            f"searched_per_part: inputs of shape {tuple(x.shape)} do not split into {parts} parts of rows whose "
            f"quantization parameters ({spec.granularity!r}) split the state's {shape} along its first dimension"
        )
    if weight is not None and (weight.ndim == 0 or weight.shape[0] != rows):
        raise ValueError(f"searched_per_part: weight of shape {tuple(weight.shape)} does not follow the inputs' "
                         f"{rows} rows, which are split into {parts} parts")


def _reference_of(reference, shape, device):
    if reference is None:
        return None
    lo, hi = (reference.min_val, reference.max_val) if hasattr(reference, "min_val") else reference
    lo, hi = (torch.as_tensor(t, dtype=torch.float32, device=device).detach() for t in (lo, hi))
    if lo.shape != tuple(shape) or hi.shape != tuple(shape):
        raise ValueError(
            f"mse: reference of shape {tuple(lo.shape)} does not match the quantization parameter shape {tuple(shape)}"
        )
    if bool(lo.isnan().any() | hi.isnan().any()):  # a NaN bound would read as "no reference", in silence
        raise ValueError("mse: the reference range holds NaN")
    # +inf/-inf (a MinMaxState's unobserved entry) is "no reference yet": the first batch sets it.
    # Any other reversed or infinite range was dropped for the batch's in silence, or read as
    # uncalibrated data in compute_qparams
    unset = (lo == torch.inf) & (hi == -torch.inf)
    bad = ~unset & ((lo > hi) | lo.isinf() | hi.isinf())
    if bool(bad.any()):
        raise ValueError(
            f"mse: the reference range is reversed (min_val > max_val) or infinite (or a float64 bound past "
            f"float32's range) in {int(bad.sum())} of {bad.numel()} entries; give finite (min_val, max_val) "
            "with min_val <= max_val (+inf/-inf, an unobserved MinMaxState entry, is set by the first batch)"
        )
    return lo, hi


class _DefaultPatience:
    """``mse``'s default ``patience``: llm-compressor's 5 in ``mode="moving_average"``, nothing in
    ``"accumulate"`` (where any value given to the factory raises)."""

    def __repr__(self):
        return "5 (moving_average mode)"


_MOVING_AVERAGE_PATIENCE = _DefaultPatience()


class _DefaultConstant(float):
    """``mse``'s default ``averaging_constant``, llm-compressor's 0.01: used in ``mode="moving_average"``;
    ``"accumulate"`` has none (any value given to the factory raises)."""


_AVERAGING_CONSTANT = _DefaultConstant(0.01)


def _expanded(lo: torch.Tensor, hi: torch.Tensor, expand: float):
    """``(lo * expand, hi * expand)``, a finite range kept within half the float32 range (where
    every range is clipped: a wide range times ``expand`` would overflow to an infinite one)."""
    if expand == 1.0:
        return lo, hi
    half = torch.finfo(torch.float32).max / 2
    return (lo * expand).clamp(min=-half), (hi * expand).clamp(max=half)


def _batch_range(lo: torch.Tensor, hi: torch.Tensor, expand: float, spec: QuantSpec, dtype: torch.dtype):
    """A batch's range times ``expand`` (`_expanded`); for bf16/fp16 inputs of a spec computing in
    their dtype rounded to it, as llm-compressor forms ``amin(x) * expand`` in the input's dtype
    (where the rounded value is finite)."""
    lo, hi = _expanded(lo, hi, expand)
    if expand == 1.0 or not _computes_natively(spec, dtype):
        return lo, hi

    def native(t):
        rounded = rounded_to(t, dtype)  # kept under torch.compile, which drops a plain pair of casts
        return torch.where(rounded.isfinite(), rounded, t)

    return native(lo), native(hi)


def mse(spec: QuantSpec, maxshrink: float = 0.2, grid: float = 100, norm: float = 2.4, expand: float = 1.0,
        mode: str = "accumulate", averaging_constant: float = _AVERAGING_CONSTANT, patience=_MOVING_AVERAGE_PATIENCE,
        reference=None, importance: Optional[torch.Tensor] = None, steps: Optional[int] = None) -> Observer:
    """MSE grid search over shrink factors of the observed range, as a mergeable state.

    Args:
      spec: the QuantSpec (granularity, format and qparams arithmetic of the candidates); a two-level
        (NVFP4) spec's candidates have float32 group scales, as llm-compressor's (`search_spec`).
      maxshrink, grid: candidates ``1 - i / grid`` for ``i < int(maxshrink * grid)`` (or ``steps``).
      norm: error exponent (2.4 as llm-compressor).
      expand: factor on the reference range before shrinking (llm-compressor's ``expand``).
      mode: ``"accumulate"`` (losses over all data) or ``"moving_average"`` (llm-compressor's ``mse``).
      averaging_constant: the moving average's constant in [0, 1] (``mode="moving_average"``, default
        0.01; 0 keeps the first batch's search, 1 the latest batch's; given in ``"accumulate"``, it raises).
      patience: early stopping in ``"moving_average"`` mode (default 5); for ``"accumulate"`` pass it
        to ``compute_qparams`` (given here, it raises).
      reference: ``(min_val, max_val)`` tensors (or a MinMaxState) fixing the base range; merges are exact
        (``mode="accumulate"`` only: the moving average raises). Without one, the range of the batches
        seen: a batch past it widens it, and the earlier losses are carried to the wider candidates
        (`_scaled`); merged states carry both losses to the union of their ranges, in any order alike.
        Finite with ``min_val <= max_val`` (ValueError otherwise); ``+inf``/``-inf`` entries are set by
        the first batch.
      importance: a real tensor of finite, non-negative weights broadcastable to the canonical view
        ``(observations, *qparam_shape, group)``, weighting each element's error (ValueError otherwise).
      steps: number of candidates (overrides ``int(maxshrink * grid)``).

    Laws: identity, associativity and commutativity (losses to float tolerance); homomorphism when
    states share the reference (``exact`` with ``reference``, except compressed-tensors specs computing
    in bf16/fp16, whose per-update error sums are rounded as llm-compressor's).
    """
    check_search_args(spec, maxshrink, grid, norm, steps)
    patience = _check_modes(mode, expand, averaging_constant, patience)
    if mode == "moving_average" and reference is not None:  # it was ignored in silence
        raise ValueError("mse: reference applies to mode='accumulate'; mode='moving_average' searches each "
                         "batch's own range, as llm-compressor's mse")
    factors = shrink_factors(maxshrink, grid, steps)
    norm, expand = float(norm), float(expand)
    if importance is not None:
        check_real_tensor(importance, "mse: importance must be a real tensor or None")
    given, spec = spec, search_spec(spec)

    def observe(x, weight, expected, where):
        view, mask = masked_view(x.detach(), weight, spec, expected, where)  # statistics have no gradient
        lo, hi, count, nonfinite = finite_aminmax(view, mask, spec.nonfinite)
        lo, hi = _batch_range(lo, hi, expand, spec, x.dtype)
        return view, mask, _checked_importance(importance, view, where), lo, hi, count, nonfinite

    if mode == "moving_average":
        observer = _moving_average(spec, factors, norm, averaging_constant, patience, observe)
    else:
        observer = _accumulate(spec, factors, norm, expand, reference, observe, grid)
    return observer._replace(spec=given)


def _checked_importance(importance, view: torch.Tensor, where: str):
    """``importance`` after ValueError where it does not broadcast to the canonical ``view`` (naming
    both shapes: torch's expand failed deep inside the search), or holds a negative, NaN or infinite
    weight (a negative one made the search pick the worst candidate, a NaN one the first)."""
    if importance is None:
        return None
    importance = importance.detach()  # a weight of the statistic, not differentiated
    try:
        fits = torch.broadcast_shapes(importance.shape, view.shape) == view.shape
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(f"{where}: importance of shape {tuple(importance.shape)} does not broadcast to the "
                         f"canonical view {tuple(view.shape)} (observations, *quantization parameters, group)")
    ok = require(torch.isfinite(importance) & (importance >= 0),
                 f"{where}: importance holds a negative, NaN or infinite weight; weights must be finite and >= 0")
    return torch.where(ok, importance, torch.zeros_like(importance))


def check_expand(expand, where: str) -> None:
    """ValueError naming ``where`` unless ``expand`` is a finite number of at least 1 (as llm-compressor's
    mse observers refuse it)."""
    if not (is_real_number(expand) and 1.0 <= expand < math.inf):
        raise ValueError(f"{where}: expand must be a finite number of at least 1.0, got {expand!r}")


def _check_modes(mode, expand, averaging_constant, patience):
    """ValueError for bad mode options; the moving average's patience (llm-compressor's 5 by default)."""
    if mode not in ("accumulate", "moving_average"):
        raise ValueError(f"mse: mode must be 'accumulate' or 'moving_average', got {mode!r}")
    check_expand(expand, "mse")
    check_averaging_constant(averaging_constant, "mse")
    if mode == "accumulate" and averaging_constant is not _AVERAGING_CONSTANT:  # it was ignored in silence
        raise ValueError("mse: averaging_constant applies to mode='moving_average'; mode='accumulate' sums the "
                         "losses of all batches (pass mode='moving_average' for llm-compressor's moving average)")
    if mode == "accumulate" and patience is not _MOVING_AVERAGE_PATIENCE:
        raise ValueError(
            "mse: patience applies to mode='moving_average'; in mode='accumulate' the search runs in "
            f"compute_qparams: pass compute_qparams(state, spec, patience={patience!r}) instead"
        )
    if patience is _MOVING_AVERAGE_PATIENCE:
        return 5
    return checked_patience(patience, "mse")


def checked_patience(patience, where: str):
    """``patience`` (a Python int, of a numpy one too) after ValueError unless it is None or a
    non-negative int (not a bool)."""
    if not (patience is None or (is_integer(patience) and patience >= 0)):
        raise ValueError(f"{where}: patience must be a non-negative int or None, got {patience!r}")
    return None if patience is None else int(patience)


def _check_candidates(state: MSEState, candidates: int) -> None:
    """ValueError naming both shapes when a state holds another number of candidates than this
    observer searches (a state of an mse observer with other maxshrink/grid/steps)."""
    expected = (*state.min_val.shape, candidates)
    if tuple(state.factors.shape) != (candidates,) or tuple(state.loss.shape) != expected:
        raise ValueError(
            f"mse.update: the state's loss has shape {tuple(state.loss.shape)} ({state.factors.shape[-1]} "
            f"candidates), but this observer searches {candidates} candidates (loss of shape {expected}); "
            "the state comes from an mse observer with other maxshrink/grid/steps"
        )


def _extent(lo: torch.Tensor, hi: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """What the step of a reference range's candidates grows with, float64: the span holding zero
    for asymmetric mappings, the largest magnitude otherwise (0 for an unset or zero range)."""
    lo, hi = lo.double().clamp(max=0), hi.double().clamp(min=0)
    return hi - lo if spec.mapping == "asymmetric" else torch.maximum(-lo, hi)


class _Carry(NamedTuple):
    """The static tables of `_scaled` for one observer's candidates (``C`` shrink factors ``p``):
    ``sizes`` the positions ``grid * p`` (0 for a zero range), ``growth`` the rounding error's exponent
    (``norm``; 0 for float targets), ``baseline`` ``g(size) / g(size of p = 1)`` with
    ``g(n) = Gamma(n + growth) / Gamma(n)``, ``log_coefficients[i][k]`` ``log C(sizes[i] + k - 1, k)``."""

    sizes: tuple
    growth: float
    norm: float
    baseline: tuple
    log_coefficients: tuple


def _carry_tables(factors: list, grid: float, spec: QuantSpec, norm: float) -> _Carry:
    """`_Carry` of the candidates ``factors`` (``max(1 - i / grid, 0)``) of an observer of ``spec``."""
    sizes = tuple(max(grid - i, 0.0) if p > 0 else 0.0 for i, p in enumerate(factors))
    growth = 0.0 if spec.is_float else norm

    def log_g(n):
        return math.lgamma(n + growth) - math.lgamma(n)

    top = sizes[0]
    baseline = tuple(math.exp(log_g(n) - log_g(top)) if n > 0 else 0.0 for n in sizes)
    coefficients = tuple(tuple(math.lgamma(n + k) - math.lgamma(n) - math.lgamma(k + 1) if n > 0 else 0.0
                               for k in range(len(sizes))) for n in sizes)
    return _Carry(sizes, growth, float(norm), baseline, coefficients)


def _scaled(loss, count, old_lo, old_hi, new_lo, new_hi, spec: QuantSpec, carry: _Carry):
    """``loss`` (``(*P, C)``, the candidates ``p * (old_lo, old_hi)``) carried to the candidates of the
    wider reference ``(new_lo, new_hi)``, by a linear semigroup: carried by a ratio ``r`` and then ``s``
    it equals carried by ``r * s`` (to rounding), so merges of states of any references add in any order.

    Candidate ``p`` of the new reference is ``q = p * r`` of the old one (``r`` the ratio of their
    `_extent`). The table at positions ``n = grid * p`` moves as a Yule process (``n`` grows at rate
    ``n``, a negative binomial after a time ``log r``, mean ``n * r``), whose eigenfunction
    ``g(n) = Gamma(n + norm) / Gamma(n)`` (eigenvalue ``norm``, about ``n ** norm``) models the loss past
    the old range, where the values seen are no longer clipped: rounding error grows as
    ``q ** norm`` (float targets: constant, their error is relative). So the loss above that model
    moves with the process and leaves past ``p = 1``, and the model itself is multiplied by
    ``r ** norm``. At most ``count * extent ** norm`` (every value rounded to zero:
    the one step that is not linear, reached only by a range below about ``1 / qmax`` of the union's).
    Unchanged (bit for bit) where ``r`` is 1 or the old reference is unset or zero."""
    old, new = _extent(old_lo, old_hi, spec), _extent(new_lo, new_hi, spec)
    moved = (old > 0) & (new > old)
    log_r = torch.where(moved, torch.log(new) - torch.log(old), torch.zeros_like(old)).unsqueeze(-1)  # (*P, 1)
    log_stay = -log_r  # log(1 / r): the chance that n has not moved is (1 / r) ** n
    log_move = torch.log(-torch.expm1(-log_r))  # log(1 - 1 / r); -inf where r is 1 (no step taken)
    device = loss.device
    sizes = torch.tensor(carry.sizes, dtype=torch.float64, device=device)
    baseline = torch.tensor(carry.baseline, dtype=torch.float64, device=device)
    at_full = loss[..., :1]
    model = at_full * baseline  # (*P, C): the growth model through the loss at p = 1
    scale = torch.exp(carry.growth * log_r)  # r ** growth; inf past float64, where it is taken only by a positive model
    grown = torch.where(model > 0, model * scale, torch.zeros_like(model))
    above = loss - model  # 0 at p = 1 (exactly: loss[..., 0] - loss[..., 0] * 1.0)
    steps = len(carry.sizes)
    # row i reads rows i - k (k jumps, 0 <= k < i) with chance C(n_i + k - 1, k) (1/r) ** n_i (1 - 1/r) ** k;
    # each k adds to every row it reaches at once; the binomials are multiplied in where they fit float64
    coefficients = torch.tensor(carry.log_coefficients, dtype=torch.float64, device=device)  # [i][k]
    fits = max(max(row) for row in carry.log_coefficients) < 600.0
    stay = torch.exp(sizes * log_stay)  # (*P, C): (1/r) ** n_i
    binomials = torch.exp(coefficients) if fits else None
    carried = grown.clone()
    for k in range(steps - 1):
        move = torch.exp(k * log_move) if k else torch.ones_like(log_move)  # (1 - 1/r) ** k, (*P, 1)
        if fits:
            chance = stay[..., k + 1:] * binomials[k + 1:, k] * move
        else:
            chance = torch.exp(coefficients[k + 1:, k] + sizes[k + 1:] * log_stay + (k * log_move if k else 0.0))
        carried[..., k + 1:] += chance * above[..., 1:steps - k]
    carried = torch.where(sizes > 0, carried, loss)  # a zero range loses the same at every reference
    cap = count.double().unsqueeze(-1) * old.unsqueeze(-1) ** carry.norm
    carried = torch.minimum(carried, cap)
    return torch.where(moved.unsqueeze(-1), carried, loss)


def _accumulate(spec, factors, norm, expand, reference, observe, grid):
    carry = _carry_tables(factors, grid, spec, norm)  # how losses move to a wider reference (`_scaled`)

    def init_fn(x: torch.Tensor) -> MSEState:
        check_observable(x, "mse.init")
        shape = qparam_shape(x.shape, spec.granularity)
        device = x.device
        fixed = _reference_of(reference, shape, device)
        inf = torch.full(shape, torch.inf, dtype=torch.float32, device=device)
        lo, hi = (inf, -inf) if fixed is None else _expanded(*fixed, expand)
        count = torch.zeros(shape, dtype=torch.int64, device=device)
        loss = torch.zeros((*shape, len(factors)), dtype=torch.float64, device=device)
        return MSEState(lo, hi, loss, torch.tensor(factors, dtype=torch.float64, device=device),
                        count, count.clone())

    def update_fn(state: MSEState, x: torch.Tensor, weight: Optional[torch.Tensor] = None) -> MSEState:
        check_state(state, MSEState, "mse.update")
        _check_candidates(state, len(factors))
        check_observable(x, "mse.update")  # before x.numel(): None was an AttributeError
        if x.numel() == 0:
            return state
        view, mask, imp, lo, hi, count, nonfinite = observe(x, weight, state.min_val.shape, "mse.update")
        # the batch's range becomes the reference where none is set yet and the batch saw values, and
        # (no reference given) where the first batches were all zeros: every candidate of a zero
        # reference is the zero range, which clipped all later data to zero (their losses, of zeros, are
        # equal for every candidate, so the choice does not change)
        unset = ~(state.min_val <= state.max_val)
        if reference is None:
            unset = unset | ((state.min_val == 0) & (state.max_val == 0))
        from_batch = unset & (count > 0)
        ref_lo = torch.where(from_batch, lo, state.min_val)
        ref_hi = torch.where(from_batch, hi, state.max_val)
        loss = state.loss
        if reference is None:  # a batch past the reference widens it (the first one's clipped all later data)
            wider = ~unset & (count > 0)
            ref_lo = torch.where(wider, torch.minimum(ref_lo, lo), ref_lo)
            ref_hi = torch.where(wider, torch.maximum(ref_hi, hi), ref_hi)
            loss = _scaled(loss, state.count, state.min_val, state.max_val, ref_lo, ref_hi, spec, carry)
        safe_lo, safe_hi = (torch.where(ref_lo <= ref_hi, t, torch.zeros_like(t)) for t in (ref_lo, ref_hi))
        batch_loss = candidate_losses(view, mask, imp, safe_lo, safe_hi, factors, spec, norm)
        # a state of another observer with as many candidates (grid=50, maxshrink=0.4 against the
        # defaults): this batch's losses went to its other shrink factors' columns in silence
        table = torch.tensor(factors, dtype=state.factors.dtype, device=state.factors.device)
        same = require(state.factors == table, "mse.update: the state searches other shrink factors than this "
                       "observer: it comes from an mse observer with other maxshrink/grid/steps")
        return kept_dtypes(state, MSEState(ref_lo, ref_hi, loss + batch_loss, torch.where(same, state.factors, table),
                                           state.count + count, state.nonfinite + nonfinite), "mse.update")

    def merge_fn(a: MSEState, b: MSEState) -> MSEState:
        check_merge_states(a, b, MSEState, "mse.merge")
        # losses of different shrink factors cannot be added (states of two mse observers)
        same = require(a.factors == b.factors, "mse.merge: the states search different shrink factors: they come "
                       "from mse observers with other maxshrink/grid/steps")
        # the reference is the union of both (+inf/-inf, none set, is the identity of min/max), and each
        # state's losses are carried to its candidates (`_scaled`, a semigroup: carried in one step or in
        # several, by any merge order, they agree to rounding) before they are added
        lo, hi = torch.minimum(a.min_val, b.min_val), torch.maximum(a.max_val, b.max_val)
        loss = (_scaled(a.loss, a.count, a.min_val, a.max_val, lo, hi, spec, carry)
                + _scaled(b.loss, b.count, b.min_val, b.max_val, lo, hi, spec, carry))
        return MSEState(lo, hi, loss, torch.where(same, a.factors, b.factors), a.count + b.count,
                        a.nonfinite + b.nonfinite)

    # bf16/fp16 compressed-tensors specs round each update's error sums to the input's dtype, as
    # llm-compressor forms one batch's: sums of rounded batches are not the rounded sum of all
    exact = reference is not None and spec.compute_dtype == "float32"
    return Observer(init_fn, update_fn, merge_fn, exact=exact, spec=spec, name="mse", state_type=MSEState,
                    options=(("norm", norm), ("expand", expand)))


def _moving_average(spec, factors, norm, constant, patience, observe):
    def update_fn(state, x: torch.Tensor, weight: Optional[torch.Tensor] = None) -> MovingAverageMSEState:
        check_state(state, MovingAverageMSEState, "mse.update")
        check_observable(x, "mse.update")
        if x.numel() == 0:
            return state
        view, mask, imp, lo, hi, count, nonfinite = observe(x, weight, state.min_val.shape, "mse.update")
        seen = count > 0
        base_lo, base_hi = (torch.where(seen, t, torch.zeros_like(t)) for t in (lo, hi))
        # the candidates scored as the state keeps them: rounded to a bf16/fp16 input's dtype
        loss = candidate_losses(view, mask, imp, base_lo, base_hi, factors, spec, norm, rounded=True)
        p = _chosen_factor(loss, torch.tensor(factors, dtype=torch.float64, device=loss.device), patience)
        first = state.batches == 0
        # llm-compressor keeps a bf16/fp16 input's ranges in its dtype: every product and the
        # moving average's sum rounded to it
        natively = _computes_natively(spec, x.dtype)

        def native(t):  # rounded as llm-compressor's half arithmetic, under torch.compile too
            return rounded_to(t, x.dtype) if natively else t

        def averaged(old, base):  # the first batch's range, or the moving average with it
            batch = native(native(base) * p)
            moved = native(native(old * (1.0 - constant)) + native(batch * constant))
            return torch.where(seen, torch.where(first, batch, moved), old)

        return kept_dtypes(state, MovingAverageMSEState(
            averaged(state.min_val, base_lo), averaged(state.max_val, base_hi), state.batches + seen.to(torch.int64),
            state.count + count, state.nonfinite + nonfinite), "mse.update")

    def merge_fn(a, b) -> MovingAverageMSEState:
        check_merge_states(a, b, MovingAverageMSEState, "mse.merge")
        return merge_moving_extremes(a, b)

    # init: +inf/-inf extremes, zero batches and counts
    return Observer(extremes_init(MovingAverageMSEState, spec, "mse"), update_fn, merge_fn,
                    exact=False, spec=spec, name="mse", state_type=MovingAverageMSEState,
                    options=(("norm", norm), ("averaging_constant", constant), ("patience", patience)))


@register_range_rule(MSEState)
def _mse_rule(state: MSEState, spec: QuantSpec, patience: Optional[int] = None, **options) -> Range:
    if options:  # named a private function (``_mse_rule() got an unexpected keyword argument``)
        raise TypeError(f"compute_qparams: an MSEState takes the option patience only, got {sorted(options)}; "
                        "the search's other options (maxshrink=, grid=, norm=) belong to qstats.mse(spec, ...)")
    p = _chosen_factor(state.loss, state.factors, checked_patience(patience, "compute_qparams"))
    calibrated = (state.count > 0) & (state.min_val <= state.max_val)
    return Range(torch.where(calibrated, state.min_val * p, state.min_val),
                 torch.where(calibrated, state.max_val * p, state.max_val), calibrated)


@register_range_rule(MovingAverageMSEState)
def _moving_average_mse_rule(state: MovingAverageMSEState, spec: QuantSpec, **options) -> Range:
    if options:  # the search ran in each update: its options belong to the factory
        raise TypeError(
            f"compute_qparams: a MovingAverageMSEState takes no options, got {sorted(options)}; its search runs "
            "in update, so pass them to qstats.mse(spec, mode='moving_average', ...) (patience=, maxshrink=, grid=)"
        )
    return Range(state.min_val, state.max_val, state.count > 0)
