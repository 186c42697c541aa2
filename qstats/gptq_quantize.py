"""GPTQ as a pure function: a layer's weight, its input Hessian state and a spec -> the quantized weight.

`gptq(weight, hessian_state, spec)` returns ``(fake_quantized_weight, codes, qparams)`` and never
modifies its inputs. It follows llm-compressor 0.14's ``quantize_weight`` operation by operation
(float32, dead columns zeroed, relative dampening, Cholesky factor of the inverse Hessian, column
blocks with lazy error propagation, activation ordering ``"static"`` = ``"weight"``), so that on the
same weights, Hessians and quantization parameters its codes equal llm-compressor's up to float32
rounding. A bfloat16/float16 weight needs a spec computing in its dtype for that
(``observed_dtype=weight.dtype``: llm-compressor's scales and dequantization are in it); a compressed-tensors
spec computing in another dtype warns. It is written for one ``[out, in]`` weight in plain torch ops and runs under
``torch.vmap``; a stacked ``[E, out, in]`` weight with a stacked state (`qstats.stacked_observer`)
is vmapped over its experts.

Quantization parameters: ``qparams`` when given (any qstats statistic of the weight:
min/max, mse, histogram, through `compute_qparams`; llm-compressor 0.14 passes its weight observer's
min/max ones). Without them, PerGroup specs (not TensorGroup) without activation ordering take each group's min/max
from the running (error-updated) weight at the start of the column block where the group starts,
as the original GPTQ; other specs take the min/max of the weight itself.

A weight whose Hessian saw no row falls back to round-to-nearest (`UncalibratedWarning`), as does
one whose dampened Hessian is not positive definite (a UserWarning; llm-compressor records those
modules) or whose inverse's Cholesky factor fails in float32 (the same warning; llm-compressor raises
there). A Hessian that left rows out as non-finite (`HessianState.nonfinite`) warns, naming them.
A NaN or Inf in the Hessian sum or the weight (a float64 weight's values past float32's range too:
GPTQ computes in float32), or in ``qparams`` a NaN, Inf, zero or
negative scale or global scale or a NaN or Inf zero point, is a ValueError. Input columns that
never saw a non-zero value (zero diagonal) quantize to zero, as llm-compressor. A Hessian past
float32's Cholesky range (largest diagonal above 2^64 or below 2^-64) is scaled by a power of 4
first, a dead column's diagonal with it, which changes no code. Activation ordering ``"group"`` (groups in activation order, written
with a ``g_idx``) was removed from compressed-tensors 0.19 and llm-compressor 0.14; it is refused.
"""

from __future__ import annotations

from typing import Optional

import torch

from ._ops import op, register_fake, register_vmap
from ._granularity import PerAxis, PerBlock, PerGroup, PerRow, PerTensor, qparam_shape
from ._qparams import QParams, compute_qparams
from ._quant import _cap, _checked_zero_point, _codes_float, _dequantize_view
from ._formats import COMPUTE_DTYPE_NAMES, store_codes
from ._spec import QuantSpec
from .experts import UncalibratedWarning
from .observers.hessian import HessianState, checked_hessian_state, normalized_hessian
from .observers.kit import check_spec
from .observers.minmax import minmax
from ._warn import warn
from ._checks import is_integer, require

__all__ = ["gptq"]

_ACTORDERS = (None, "static", "weight")


def _experts(flags: torch.Tensor, name: str, first: int) -> str:
    """Who ``flags`` names: the weight ``name`` (a 0-d flag, a 2-D weight's), or the experts it marks,
    numbered from ``first`` (a chunk of a stack: ``name[first:first + E]``)."""
    if flags.ndim == 0:
        return name
    where = [first + expert for expert in flags.reshape(-1).nonzero().flatten().tolist()]
    among = f"{flags.numel()}" if first == 0 else f"experts {first}-{first + flags.numel() - 1}"
    return f"{'' if name == 'the layer' else name + ' '}experts {where} ({len(where)} of {among})"


@op("check_gptq_inputs")
def _check_inputs(count: torch.Tensor, nonfinite: torch.Tensor, total: torch.Tensor,
                  weight: torch.Tensor, name: str, first: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager checks (one op, so they run under vmap and compile): a non-finite Hessian sum or weight
    raises ValueError; a Hessian that saw no row warns (round-to-nearest), and one that left rows
    out (``nonfinite``) warns naming them. Returns the counts and whether a stack's Hessians are
    all equal (every expert on every token: factored once)."""
    # the weight as the column loop computes it, in float32: a float64 value past float32's range is
    # Inf there (narrower dtypes keep their finiteness, uncopied; the Hessian sum is scaled into range
    # first, `_factorable_hessian`)
    computed = weight.to(torch.float32) if weight.dtype == torch.float64 else weight
    for what, value, past in (("Hessian sum", total, f" (a {total.dtype} sum past its range: observe the inputs with "
                                                     "qstats.hessian(dtype=torch.float64))"),
                              ("weight", computed, " (or float64 values past float32's range, in which GPTQ "
                               "computes)")):
        bad = ~torch.isfinite(value).flatten(start_dim=value.ndim - 2).all(dim=-1)
        if bad.any():
            raise ValueError(f"qstats.gptq: the {what} of {_experts(bad, name, first)} holds NaN or Inf{past}")
    _warn_left_out(count, nonfinite, name, first)
    shared = count.ndim == 1 and count.shape[0] > 1 and bool((count == count[:1]).all())
    shared = shared and torch.equal(total, total[:1].expand_as(total))
    return count.clone(), torch.tensor(shared)


def _left_out(rows: int) -> str:
    return (f"{rows} row{'s' * (rows != 1)} holding a NaN or Inf, or a value whose square passes the Hessian's dtype "
            "(|x| above 1.8e19 in float32: observe with qstats.hessian(dtype=torch.float64))")


def _warn_left_out(count: torch.Tensor, nonfinite: torch.Tensor, name: str, first: int) -> None:
    """Warns where a Hessian saw no row (round-to-nearest, `UncalibratedWarning`), and where it left
    rows out as non-finite (llm-compressor's Hessian turns NaN there and its GPTQ rounds to nearest)."""
    if (count == 0).any():
        unseen = (count == 0) & (nonfinite > 0)
        why = f" (it left out {_left_out(int(nonfinite[unseen].sum()))})" if unseen.any() else ""
        warn(
            f"qstats.gptq: the Hessian of {_experts(count == 0, name, first)} saw no input row{why}; those weights are "
            "quantized by round-to-nearest with their quantization parameters",
            UncalibratedWarning,
        )
    partly = (count > 0) & (nonfinite > 0)
    if partly.any():
        warn(
            f"qstats.gptq: the Hessian of {_experts(partly, name, first)} left out {_left_out(int(nonfinite[partly].sum()))}; "
            "GPTQ uses the other rows",
            UserWarning,
        )


@register_fake(_check_inputs)
def _(count, nonfinite, total, weight, name, first):
    return torch.empty_like(count), torch.empty((), dtype=torch.bool)


def _check_inputs_vmap(info, in_dims, count, nonfinite, total, weight, name, first):
    moved = [value.expand(info.batch_size, *value.shape) if dim is None else value.movedim(dim, 0)
             for value, dim in zip((count, nonfinite, total, weight), in_dims)]
    return (_check_inputs(*moved, name, first)[0], torch.tensor(False)), (0, None)  # one message naming every expert


register_vmap(_check_inputs, _check_inputs_vmap)


@op("warn_unfactored_hessian")
def _warn_unfactored(failed: torch.Tensor, name: str, first: int) -> torch.Tensor:
    """Warns where a seen Hessian, dampened, is not positive definite, or its inverse is not in
    float32's Cholesky (llm-compressor records the first and raises torch's LinAlgError on the second)."""
    if failed.any():
        warn(
            f"qstats.gptq: the dampened Hessian of {_experts(failed, name, first)} is not positive definite, or too "
            "ill-conditioned to invert, in float32; those weights are quantized by round-to-nearest (raise "
            "dampening, or calibrate on more rows)",
            UserWarning,
        )
    return failed.clone()


@register_fake(_warn_unfactored)
def _(failed, name, first):
    return torch.empty_like(failed)


register_vmap(_warn_unfactored, lambda info, in_dims, failed, name, first:
              (_warn_unfactored(failed.movedim(in_dims[0], 0), name, first), 0))


def _column_groups(spec: QuantSpec, shape) -> Optional[list]:
    """The quantization parameter column of every weight column (None: one per row or tensor) of an
    ``[..., rows, columns]`` weight."""
    granularity, columns = spec.granularity, shape[-1]
    if isinstance(granularity, PerGroup):  # TensorGroup (NVFP4) too: its global scale is one per weight
        if columns % granularity.group_size:
            raise ValueError(f"gptq: {columns} input columns are not a multiple of the group size "
                             f"{granularity.group_size} (llm-compressor 0.14's weight observers refuse them too)")
        return [column // granularity.group_size for column in range(columns)]
    if isinstance(granularity, PerTensor) or granularity in (PerAxis(0), PerAxis(-2), PerRow(-1), PerRow(1)):
        return None  # one set per tensor or per output row; PerRow(0) would be one per input column
    if isinstance(granularity, PerBlock) and len(granularity.block_shape) == 2:
        block_columns = granularity.block_shape[1]  # smaller edge blocks allowed (partial=True)
        if block_columns >= columns:
            return None  # blocks of whole rows (a fused gate_up_proj's per-projection scales)
        return [column // block_columns for column in range(columns)]  # FP8 block (llm-compressor's BLOCK)
    raise ValueError(f"gptq: granularity {granularity!r} is not supported on a weight of shape {tuple(shape)} "
                     "(PerTensor, PerRow() / PerAxis(0), PerGroup, TensorGroup, 2-D PerBlock)")


def _column_parameters(param: torch.Tensor, spec: QuantSpec, groups: Optional[list], shape,
                       perm: Optional[torch.Tensor]):
    """``(rows_param, index)``: column ``j``'s parameter is ``rows_param[..., index[j]]`` (``[..., rows]``,
    or ``[..., 1]`` per tensor), from one per tensor ``[...]``, per row ``[..., rows]`` or per group
    ``[..., rows, groups]`` (a 2-D PerBlock's ``[..., rows / block rows, groups]`` repeated over each
    block's rows); gathered per column where activation ordering permutes the groups."""
    *batch, rows, columns = shape
    if isinstance(spec.granularity, PerBlock) and param.ndim >= 2 and param.shape[-2] != rows:
        param = param.repeat_interleave(spec.granularity.block_shape[0], dim=-2)[..., :rows, :]
    if groups is None:  # per tensor, per row or per block of rows: one column of row parameters
        return param.reshape(*batch, -1, 1), [0] * columns
    rows_param = param.reshape(*batch, rows, param.shape[-1])  # [..., rows, groups] (-1 is ambiguous for 0 rows)
    if perm is None:
        return rows_param, groups
    column_groups = torch.gather(torch.tensor(groups, device=perm.device).expand(perm.shape), -1, perm)
    return torch.gather(rows_param, -1, column_groups.unsqueeze(-2).expand(*batch, rows, columns)), list(range(columns))


def _permute_columns(x: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """``x[..., perm]`` with one permutation per leading index (as llm-compressor gathers)."""
    return torch.gather(x, -1, perm.unsqueeze(-2).expand(x.shape))


def _inverse_hessian_factor(hessian: torch.Tensor, dampening: float, usable: torch.Tensor, shared: int = 0,
                            fill: Optional[torch.Tensor] = None, label: tuple = ("the layer", 0)):
    """llm-compressor's ``factorize_hessian``: dead columns get diagonal ``fill`` (``[...]``; None: 1,
    llm-compressor's, in the units of a Hessian `_factorable_hessian` scaled), the diagonal gains
    ``dampening * mean(diag)`` (both written into ``hessian``, a buffer of the caller's), then the
    upper Cholesky factor of the inverse. Where it fails or the Hessian is not ``usable``: the
    identity (round-to-nearest). ``shared`` > 0: ``hessian`` ``[1, in, in]`` stands for that many
    experts (the warning names them all, as ``label``: `_experts`' name and first expert)."""
    eye = torch.eye(hessian.shape[-1], dtype=hessian.dtype, device=hessian.device)
    diagonal = torch.diagonal(hessian, dim1=-2, dim2=-1)  # written in place: `_gptq_core`'s own tensor
    dead = diagonal == 0
    diagonal.add_(dead.to(hessian.dtype) if fill is None else torch.where(dead, fill[..., None], 0.0))
    # the mean of a contiguous copy, as llm-compressor's torch.mean(torch.diag(H)): a mean over the
    # strided view sums in another order and may differ in its last bit (and so may a code)
    diagonal.add_(dampening * torch.mean(diagonal.contiguous(), dim=-1, keepdim=True))
    lower, info = torch.linalg.cholesky_ex(hessian, check_errors=False)
    factored = (usable & (info == 0))[..., None, None]
    # LAPACK's factors are column-major: the identity is taken in that layout (eye.mT) so that the
    # selection runs in one order, and the factor made row-major once for the column loop's row reads
    inverse = torch.cholesky_inverse(torch.where(factored, lower, eye.mT))
    upper, info = torch.linalg.cholesky_ex(inverse, upper=True, check_errors=False)
    factored = factored & (info == 0)[..., None, None]
    failed = usable & ~factored[..., 0, 0]
    _warn_unfactored(failed.expand(shared) if shared else failed, *label)
    return torch.where(factored, upper, eye.mT).contiguous(), dead & usable[..., None]


def _minmax_qparams(weight: torch.Tensor, spec: QuantSpec) -> QParams:
    observer = minmax(spec)
    return compute_qparams(observer.update(observer.init(weight), weight), spec)


def _quantize_column(column, scale, zero_point, global_scale, spec):
    """``(fake-quantized values, float codes)`` of one weight column under per-row parameters: the
    codes `qstats.quantize` gives those values (a float format's -0 is +0 under compressed-tensors'
    convention, as in the checkpoint llm-compressor writes of its GPTQ'd weight)."""
    _, codes = _codes_float(column, scale, zero_point, spec, global_scale)
    values = _dequantize_view(codes, scale, zero_point, spec, global_scale)
    if spec.is_float:
        _, codes = _codes_float(values, scale, zero_point, spec, global_scale)
    # in the column's dtype (float zero points dequantize in float64: the error update is float32)
    return values.to(column.dtype), codes


def _running_qparams(rest, start, stop, group_size, spec, found):
    """Appends the min/max parameters of the groups starting in columns ``[start, stop)``, from the
    weight as it is at the block's start (``rest``: its columns from ``start``); returns every group's
    so far as ``[..., rows, groups]``."""
    first, last = -(-start // group_size), -(-stop // group_size)
    if last > first:
        fresh = _minmax_qparams(rest[..., first * group_size - start: last * group_size - start], spec)
        found.append(fresh)
    return torch.cat([qp.scale for qp in found], dim=-1), torch.cat([qp.zero_point for qp in found], dim=-1).float()


def _joined(found: list) -> QParams:
    """The groups' parameters of every block as one QParams (one global scale: 1, one per expert
    for ``[..., out, in]`` weights, as `compute_qparams` under vmap and `_check_qparams` expect)."""
    joined = QParams(*(field[0] if name == "global_scale" or field[0] is None else torch.cat(field, dim=-1)
                       for name, field in zip(QParams._fields, zip(*found))))
    return joined._replace(global_scale=joined.global_scale.expand(joined.scale.shape[:-2]).contiguous())


def _blocks(weight, inverse, scale, zero_point, index, global_scale, spec, block_size, running):
    """The column loop: quantize each column, spread its error over the block's later columns, then
    the block's error over the following columns (section 3.4 of arXiv:2203.07259), in
    llm-compressor's order of float operations. Column ``j`` uses
    ``scale[..., index[j]]``; ``running`` (the group size) computes group parameters per block."""
    columns = weight.shape[-1]
    quantized, codes, found = [], [], []  # columns of the result; running group parameters
    rest = weight
    for start in range(0, columns, block_size):
        stop = min(start + block_size, columns)
        if running is not None:
            scale, zero_point = _running_qparams(rest, start, stop, running, spec, found)
        block, block_inverse = rest[..., : stop - start].clone(), inverse[..., start:stop, start:stop]  # local
        errors = []
        for i in range(stop - start):
            column = block[..., i]
            k = index[start + i]
            q, code = _quantize_column(column, scale[..., k], zero_point[..., k], global_scale, spec)
            error = (column - q) / block_inverse[..., i, i, None]
            # in place on the local copy; the product rounded, then subtracted, as llm-compressor's
            # W1[:, :, i:] -= e * h
            block[..., i:].sub_(error[..., None] * block_inverse[..., i, None, i:])
            quantized.append(q)
            codes.append(code)
            errors.append(error)
        rest = rest[..., stop - start:] - torch.stack(errors, dim=-1) @ inverse[..., start:stop, stop:]
    running_qparams = None if running is None else _joined(found)
    # one contiguous copy each: [..., columns, rows] -> [..., rows, columns]
    return (torch.stack(quantized, dim=-2).transpose(-1, -2).contiguous(),
            torch.stack(codes, dim=-2).transpose(-1, -2).contiguous(), running_qparams)


def _factorable_hessian(total: torch.Tensor, count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hessian, fill)``: `normalized_hessian` in float32, times a power of 4 where its largest
    diagonal lies outside ``[2^-64, 2^64]`` (a float64 sum whose mean passes float32's range, or
    inputs of 1e-10 and less), which brings it near 1: float32's Cholesky factors would overflow or
    underflow there. ``fill`` ``[...]`` is that power of 4 (1 inside the range), the diagonal a dead
    column gets: llm-compressor's 1 in the unscaled Hessian's units, so that the dampening (relative
    to the mean diagonal, dead columns included) and so GPTQ's codes do not depend on the factor;
    a dead column counts as a diagonal of 1 in choosing it. Inside the range the Hessian is
    llm-compressor's, bit for bit."""
    mean = normalized_hessian(total, count, dtype=torch.promote_types(total.dtype, torch.float32))  # float64 kept
    diagonal = torch.diagonal(mean, dim1=-2, dim2=-1)
    peak = torch.where((diagonal == 0).any(dim=-1), diagonal.amax(dim=-1).clamp(min=1.0), diagonal.amax(dim=-1))
    peak = peak.double()
    outside = (peak > 2.0**64) | ((peak < 2.0**-64) & (peak > 0))
    _, exponent = torch.frexp(torch.where(outside, peak.clamp(max=2.0**1000), 1.0))  # 1 = 0.5 * 2^1
    factor = torch.ldexp(torch.ones_like(peak), -(exponent // 2))  # exact
    half = factor.to(mean.dtype)[..., None, None]
    mean = mean * half  # twice: the power of 4 itself may not be a float32 number
    # with a dead column the factor is at most 1; a fill below float32's normal range (a Hessian of
    # 1e20 and more) is negligible beside the diagonal either way, kept positive so that an
    # undampened dead column still factors
    fill = (factor * factor).clamp(min=torch.finfo(torch.float32).tiny, max=1.0).to(torch.float32)
    return (mean * half).to(torch.float32), fill


def _ordered_factor(total, count, dampening, actorder, shared: int, label: tuple):
    """``(column order or None, inverse Hessian factor, dead columns)`` of Hessian sums ``[..., in, in]``.
    ``shared`` > 0: the ``shared`` Hessians of a stack are equal and factored once (the same bits)."""
    if shared:
        total, count = total[:1], count[:1]
    hessian, fill = _factorable_hessian(total, count)
    perm = None
    if actorder is not None:
        perm = torch.argsort(torch.diagonal(hessian, dim1=-2, dim2=-1), dim=-1, descending=True)
        hessian = _permute_columns(_permute_columns(hessian, perm).transpose(-1, -2), perm).transpose(-1, -2)
    inverse, dead = _inverse_hessian_factor(hessian, dampening, count > 0, shared, fill, label)
    if shared:
        perm = None if perm is None else perm.expand(shared, -1)
        inverse, dead = inverse.expand(shared, -1, -1), dead.expand(shared, -1)
    return perm, inverse, dead


def _gptq_core(weight, total, count, qparams, spec, block_size, dampening, actorder, shared: int, label: tuple):
    """GPTQ of ``[..., out, in]`` weights with ``[..., in, in]`` Hessian sums: one batched loop
    over columns (no host reads; in-place writes on its own buffers only; runs under vmap)."""
    groups = _column_groups(spec, weight.shape)
    work = weight.to(torch.float32)
    running = None
    if qparams is None and type(spec.granularity) is PerGroup and actorder is None:
        running = spec.granularity.group_size
    elif qparams is None:
        one = lambda w: _minmax_qparams(w, spec)  # noqa: E731  (per expert: a per-tensor range is)
        qparams = torch.vmap(one)(work) if work.ndim == 3 else one(work)
    perm, inverse, dead = _ordered_factor(total, count, dampening, actorder, shared, label)
    if perm is not None:
        work = _permute_columns(work, perm)
    work = torch.where(dead[..., None, :], torch.zeros_like(work), work)
    global_scale = torch.ones((), device=weight.device) if qparams is None else qparams.global_scale[..., None]
    scale = zero_point = None
    index = groups
    if qparams is not None:
        scale, index = _column_parameters(qparams.scale, spec, groups, work.shape, perm)
        # an integer zero point off the spec's range is a ValueError, as in fake_quantize (exact: integers)
        checked = _checked_zero_point(qparams.zero_point, spec, "gptq")
        zero_point, _ = _column_parameters(checked.float(), spec, groups, work.shape, perm)
    quantized, codes, running_qparams = _blocks(work, inverse, scale, zero_point, index, global_scale, spec,
                                                block_size, running)
    if perm is not None:
        inverse_perm = torch.argsort(perm, dim=-1)
        quantized, codes = _permute_columns(quantized, inverse_perm), _permute_columns(codes, inverse_perm)
    if running_qparams is not None:
        qparams = running_qparams
    # saturated at the weight dtype's largest finite value (fp16/bf16 edges), as fake_quantize
    return _cap(quantized, weight.dtype, spec).to(weight.dtype), store_codes(codes, spec), qparams


def gptq(weight: torch.Tensor, hessian_state: HessianState, spec: QuantSpec, block_size: int = 128,
         dampening: float = 0.01, actorder: Optional[str] = None, qparams: Optional[QParams] = None, *,
         name: Optional[str] = None, first_expert: int = 0):
    """GPTQ of a linear weight given the `qstats.hessian` state of its inputs.

    Args:
      weight: ``[out, in]``, or ``[E, out, in]`` stacked experts with a stacked state (each field
        ``[E, ...]``) and stacked ``qparams``: one batched column loop for all experts (equal to
        ``torch.vmap`` of the 2-D call, which works too).
      hessian_state: the `qstats.hessian` state of the layer's inputs.
      spec: the weight's QuantSpec (`QuantSpec.from_compressed_tensors(args)` for llm-compressor's
        rounding); PerTensor, PerRow / PerAxis(0) / PerAxis(-2), PerGroup, TensorGroup (NVFP4) or
        2-D PerBlock (smaller edge blocks allowed).
      block_size: columns per block of lazy error propagation (llm-compressor's ``block_size``).
      dampening: fraction of the mean diagonal added to the diagonal (``dampening_frac``).
      actorder: None, or ``"static"`` (= ``"weight"``): columns in decreasing Hessian diagonal,
        quantization parameters unchanged (llm-compressor 0.14's only activation ordering).
      qparams: the weight's quantization parameters; None: see the module docstring.
      name: what the warnings and errors call the weight (its parameter's name); None: "the layer".
      first_expert: the number of ``weight[0]``'s expert in the warnings and errors (a slice of a stack).

    Returns:
      ``(fake_quantized, codes, qparams)``: the GPTQ'd weight in ``weight``'s dtype (no gradient:
      a parameter may be passed as it is), its codes (`qstats.quantize`'s dtype) and the
      quantization parameters they use.

    >>> import torch, qstats
    >>> x, w = torch.randn(256, 64), torch.randn(32, 64)
    >>> obs = qstats.hessian()
    >>> spec = qstats.QuantSpec(dtype="int4", granularity=qstats.PerGroup(32))
    >>> w_q, codes, qp = qstats.gptq(w, obs.update(obs.init(x), x), spec)
    >>> codes.shape, qp.scale.shape
    (torch.Size([32, 64]), torch.Size([32, 2]))
    """
    result = gptq_unwarned(weight, hessian_state, spec, block_size, dampening, actorder, qparams, name=name,
                           first_expert=first_expert)
    _warn_compute_dtype(weight, spec)  # after the checks: ``spec`` is a QuantSpec and ``weight`` a tensor
    return result


def gptq_unwarned(weight: torch.Tensor, hessian_state: HessianState, spec: QuantSpec, block_size: int = 128,
                  dampening: float = 0.01, actorder: Optional[str] = None, qparams: Optional[QParams] = None, *,
                  name: Optional[str] = None, first_expert: int = 0):
    """`gptq` without its compute-dtype warning (`gptq_layerwise` warns once for all its weights)."""
    hessian_state = checked_hessian_state(hessian_state, "gptq")  # its type first: the shape checks read it
    _check_arguments(weight, hessian_state, spec, block_size, dampening, actorder)
    _check_qparams(qparams, weight, spec)
    actorder = None if actorder is None else "static"
    if name is not None and (not isinstance(name, str) or not name):
        raise TypeError(f"gptq: name must be a non-empty str, got {name!r}")
    if type(first_expert) is not int or first_expert < 0:
        raise TypeError(f"gptq: first_expert must be an int >= 0, got {first_expert!r}")
    label = ("the layer" if name is None else name, first_expert)
    count, same = _check_inputs(hessian_state.count, hessian_state.nonfinite, hessian_state.total, weight, *label)

    if qparams is not None:  # no autograd graph through the column loop (it would hold every column's tensors)
        qparams = _checked_scales(QParams(*(None if field is None else field.detach() for field in qparams)))
    return _gptq_core(weight.detach(), hessian_state.total.detach(), count, qparams, spec, int(block_size),
                      float(dampening), actorder, weight.shape[0] if weight.ndim == 3 and bool(same) else 0, label)


def computes_off_dtype(spec: QuantSpec, dtype: torch.dtype) -> bool:
    """Whether ``spec`` computes the qparams of a bfloat16/float16 weight in another dtype than the
    weight's, where llm-compressor computes them (and GPTQ dequantizes) in the weight's. MX (e8m0)
    scales are powers of two: the same, and dequantized exactly, in either dtype."""
    return (dtype in (torch.bfloat16, torch.float16) and spec.compute_dtype != COMPUTE_DTYPE_NAMES[dtype]
            and spec.scale_dtype != "e8m0")


def _warn_compute_dtype(weight: torch.Tensor, spec: QuantSpec) -> None:
    """Warns where a bfloat16/float16 weight's compressed-tensors spec computes in another dtype:
    llm-compressor's observer computes its scales in the weight's dtype and its GPTQ dequantizes each
    column in the scales' dtype, so on the same scale values the codes drift from its (a fifth of
    int8 codes, a few in a hundred of int4 ones) unless the spec has ``observed_dtype=weight.dtype``."""
    if spec.convention.computes_in_observed_dtype and computes_off_dtype(spec, weight.dtype):
        wanted = COMPUTE_DTYPE_NAMES[weight.dtype]
        warn(f"qstats.gptq: a {wanted} weight under a compressed-tensors spec that computes in {spec.compute_dtype}: "
             f"llm-compressor computes its scales and dequantizes GPTQ's columns in {wanted}; for its codes pass "
             f"QuantSpec.from_compressed_tensors(args, observed_dtype=torch.{wanted})", UserWarning)


def _check_qparams(qparams, weight, spec) -> None:
    """Shapes of given ``qparams`` against those ``spec`` gives ``weight`` (per expert for ``[E, out, in]``)."""
    if qparams is None:
        return
    if not isinstance(qparams, QParams):
        raise TypeError(f"gptq: qparams must be a QParams (qstats.compute_qparams) or None, got {type(qparams).__name__}")
    _column_groups(spec, weight.shape)  # an unsupported granularity is named first
    experts = tuple(weight.shape[:-2])
    per_weight = experts + qparam_shape(weight.shape[-2:], spec.granularity)
    for field, expected in (("scale", per_weight), ("zero_point", per_weight), ("global_scale", experts)):
        got = getattr(qparams, field)
        if got is None or tuple(got.shape) != expected:
            raise ValueError(f"gptq: qparams.{field} of shape {None if got is None else tuple(got.shape)} does not "
                             f"fit {spec.granularity!r} on a weight of shape {tuple(weight.shape)} "
                             f"(expected {expected})")


def _checked_scales(qparams: QParams) -> QParams:
    """ValueError (eagerly and under vmap) where a given scale or global scale is NaN, Inf, zero or
    negative, or a float zero point NaN or Inf: the column loop would carry the NaN or Inf along the whole row
    through the error updates. Returns ``qparams``, the check threaded through the scale."""
    good = torch.isfinite(qparams.scale) & (qparams.scale > 0)
    if qparams.zero_point.is_floating_point():
        good = good & torch.isfinite(qparams.zero_point)
    good = require(good, "gptq: qparams holds a NaN, Inf, zero or negative scale, or a NaN or Inf zero point")
    global_scale = qparams.global_scale  # NVFP4's second level: a NaN or zero one made every value NaN
    good_global = require(torch.isfinite(global_scale) & (global_scale > 0),
                          "gptq: qparams holds a NaN, Inf, zero or negative global scale")
    return qparams._replace(scale=torch.where(good, qparams.scale, torch.ones_like(qparams.scale)),
                            global_scale=torch.where(good_global, global_scale, torch.ones_like(global_scale)))


def _check_arguments(weight, state, spec, block_size, dampening, actorder) -> None:
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point() or weight.ndim not in (2, 3):
        raise ValueError(f"gptq: weight must be a floating [out, in] or [E, out, in] tensor, got "
                         f"{getattr(weight, 'shape', type(weight).__name__)}")
    if weight.shape[-1] == 0:
        raise ValueError(f"gptq: a weight of shape {tuple(weight.shape)} has no input column (GPTQ runs over them)")
    expected = (*weight.shape[:-2], weight.shape[-1], weight.shape[-1])
    if tuple(state.total.shape) != expected:
        raise ValueError(f"gptq: a Hessian of shape {tuple(state.total.shape)} does not fit a weight of shape "
                         f"{tuple(weight.shape)} (expected {expected})")
    check_spec(spec, "gptq")
    check_options(block_size, dampening, actorder, "gptq")


def check_options(block_size, dampening, actorder, where: str) -> None:
    """ValueError for a GPTQ option out of its domain (``gptq_layerwise`` checks them up front)."""
    if not is_integer(block_size) or block_size < 1:  # a numpy integer too, as llm-compressor's range() takes it
        raise ValueError(f"{where}: block_size must be a positive int, got {block_size!r}")
    try:
        number = float(dampening)  # a Python, numpy or 0-d torch number
    except (TypeError, ValueError, RuntimeError):
        number = float("nan")
    if not 0 <= number < float("inf"):
        raise ValueError(f"{where}: dampening must be a finite non-negative number, got {dampening!r}")
    check_actorder(actorder, where)


def check_actorder(actorder, where: str) -> None:
    """ValueError for an ``actorder`` other than None, ``"static"`` and ``"weight"``: ``"group"``, its alias
    ``"dynamic"`` (any case) and True (once ``"group"``) are named, as compressed-tensors refuses them."""
    if actorder is True or (isinstance(actorder, str) and actorder.lower() in ("group", "dynamic")):
        raise ValueError(f"{where}: actorder={actorder!r} (groups in activation order with a g_idx) was removed from "
                         "compressed-tensors 0.19 and llm-compressor 0.14; use 'static' (= 'weight') or None")
    if actorder not in _ACTORDERS:
        raise ValueError(f"{where}: actorder must be one of {_ACTORDERS}, got {actorder!r}")
