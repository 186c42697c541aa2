"""The compressed-tensors convention (``"compressed_tensors"``) and `from_compressed_tensors`.

Reproduces ``compressed_tensors.quantization.utils.calculate_qparams`` and ``fake_quantize``
operation by operation in the observed weight's dtype (``compute_dtype``, set by
``from_compressed_tensors(args, observed_dtype=...)``). Strategies, refused arguments and the
matching granularities are in docs/formats.md; the cases not reproduced on purpose (half-precision
overflow, all-zero float8 ranges, dynamic activations, ``scale_dtype=float32``) in docs/differences.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from .._formats import COMPUTE_DTYPE_NAMES, compute_dtype_name, integer_dtype_holds, rounded_in
from .._granularity import PerBlock, PerGroup, PerHead, PerRow, PerTensor, PerToken, TensorGroup
from .._torch_features import dtype_named, rounded_to
from .default import Convention, check_preserve_zero, saturate
from .._warn import warn

__all__ = ["CompressedTensorsConvention", "from_compressed_tensors"]

_FLOAT_TARGETS = {8: "fp8_e4m3fn", 4: "fp4_e2m1"}


# compressed-tensors 0.19's QuantizationArgs fields (a test keeps this in step with its model_fields)
ARGS_FIELDS = frozenset({"actorder", "block_structure", "dynamic", "group_size", "num_bits", "observer",
                         "observer_kwargs", "scale_dtype", "strategy", "symmetric", "type", "zp_dtype"})


def _checked_args(args):
    """``args``, after TypeError where it is neither QuantizationArgs-like nor a dict of its fields
    (a preset name read as the default int8 spec) and ValueError naming misspelt fields of a mapping."""
    if isinstance(args, Mapping):
        unknown = sorted(set(map(str, args)) - ARGS_FIELDS)
        if unknown:
            raise ValueError(f"from_compressed_tensors: unknown QuantizationArgs fields {unknown}; known: "
                             f"{sorted(ARGS_FIELDS)}")
    elif not hasattr(args, "num_bits"):
        raise TypeError(f"from_compressed_tensors: args must be a QuantizationArgs or a dict of its fields, got "
                        f"{args!r} (for a preset scheme, take its weights/input_activations args)")
    return args


def _field(args, name, default=None):
    return args.get(name, default) if isinstance(args, Mapping) else getattr(args, name, default)


def _enum_value(value):
    return getattr(value, "value", value)


_TRUE = ("1", "true", "t", "yes", "y", "on")
_FALSE = ("0", "false", "f", "no", "n", "off")


def _bool_field(args, name, default):
    """A bool field read as QuantizationArgs (pydantic) parses it: ``"false"``, ``"0"`` or ``0``
    are False (``bool("false")`` is True); ValueError naming the field for anything else."""
    value = _field(args, name, default)
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):  # 1.0 too, not 2 or 0.5
        return bool(value)
    if isinstance(value, str) and value.lower() in _TRUE + _FALSE:  # " true" is refused, as pydantic does
        return value.lower() in _TRUE
    raise ValueError(f"from_compressed_tensors: {name} must be a bool, got {value!r}")


def _int_field(args, name, default):
    """An integer field (``num_bits``, ``group_size``) as QuantizationArgs parses it (``4``, ``4.0``,
    ``"4"``); ValueError naming the field for a fraction (``int(4.5)`` was 4) or anything else."""
    value = _field(args, name, default)
    if value is None or isinstance(value, bool):  # pydantic reads True as 1
        return value if value is None else int(value)
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = None
    if number is None or not number.is_integer():
        raise ValueError(f"from_compressed_tensors: {name} must be an integer, got {value!r}")
    return int(number)


_DTYPE_NAMES = {
    **COMPUTE_DTYPE_NAMES,
    torch.float8_e4m3fn: "float8_e4m3fn",
    torch.uint8: "e8m0",  # MX: uint8 biased exponents (see qstats/_formats.py)
}


def from_compressed_tensors(cls, args, overrides):
    """The ``cls`` (QuantSpec) whose `compute_qparams` equals compressed-tensors'
    ``calculate_qparams`` for ``args`` (see `QuantSpec.from_compressed_tensors`)."""
    args = _checked_args(args)
    num_bits = _int_field(args, "num_bits", 8)
    qtype = str(_enum_value(_field(args, "type", "int"))).lower()
    symmetric = _bool_field(args, "symmetric", True)
    group_size = _int_field(args, "group_size", None)
    strategy = _enum_value(_field(args, "strategy", None))
    if strategy is None:
        # QuantizationArgs' own inference (a dict of fields has not been through it)
        strategy = "tensor" if group_size is None else ("channel" if group_size == -1 else "group")
    strategy = str(strategy).lower()
    if qtype == "int":
        dtype = f"int{num_bits}"
    elif qtype == "float":
        if num_bits not in _FLOAT_TARGETS:
            raise ValueError(f"from_compressed_tensors: float targets of {num_bits} bits are not supported yet")
        dtype = _FLOAT_TARGETS[num_bits]
    else:
        raise ValueError(f"from_compressed_tensors: unknown quantization type {qtype!r}")
    if strategy not in _GRANULARITIES:
        raise ValueError(f"from_compressed_tensors: strategy {strategy!r} is not supported")
    needs = {"group": "group_size", "tensor_group": "group_size", "block": "block_structure"}.get(strategy)
    if needs is not None and _field(args, needs, None) is None:  # QuantizationArgs refuses it too
        raise ValueError(f"from_compressed_tensors: strategy {strategy!r} needs {needs}")
    if isinstance(args, Mapping):  # QuantizationArgs has checked its own fields together
        _check_as_quantization_args(args, strategy, group_size)
    _check_unused_fields(args, strategy, group_size)
    granularity = _GRANULARITIES[strategy](args, group_size)
    # a dtype field; in a dict of fields, also as compressed-tensors serialises it
    # ("torch.float8_e4m3fn"), which QuantizationArgs parses
    scale_dtype = dtype_named(_field(args, "scale_dtype"))
    if scale_dtype is not None and scale_dtype not in _DTYPE_NAMES:
        raise ValueError(
            f"from_compressed_tensors: scale_dtype must be None or one of {sorted(map(str, _DTYPE_NAMES))}, "
            f"got {scale_dtype!r}"
        )
    _check_reproducible(args, num_bits, qtype, symmetric, strategy, scale_dtype)
    _warn_dynamic_static(args, strategy)
    observed_dtype = overrides.pop("observed_dtype", None)
    # llm-compressor observes the weight in its own dtype and compressed-tensors computes the
    # qparams (and stores the scale) in it
    compute_dtype = "float32" if observed_dtype is None else compute_dtype_name(
        observed_dtype, "from_compressed_tensors: observed_dtype")
    fields = dict(
        dtype=dtype,
        mapping="symmetric" if symmetric else "asymmetric",
        granularity=granularity,
        zero_point_domain="int" if qtype == "int" else "none",
        convention="compressed_tensors",
        scale_dtype=_DTYPE_NAMES[scale_dtype] if scale_dtype is not None else "float32",
        on_uncalibrated="fallback",
        compute_dtype=compute_dtype,
    )
    if fields["scale_dtype"] == "e8m0":
        # MX (generate_mx_scales): float 4/8 bits, group 32, uint8 scales
        if not (qtype == "float" and num_bits in (4, 8) and group_size == 32):
            raise ValueError("from_compressed_tensors: uint8 scales are MX scales: float 4/8 bits, group_size 32")
        fields["scale_rounding"] = "round_then_floor"
    if isinstance(granularity, TensorGroup):
        fields["global_scale_formula"] = "range_over_amax"  # NVFP4 (generate_gparam: 448 * 6 / amax)
    return cls(**{**fields, **overrides})  # the overrides win


# granularities of compressed-tensors strategies, as llm-compressor views the tensor: f(args, group_size)
_GRANULARITIES = {
    "tensor": lambda args, group_size: PerTensor(),
    # the weight view (..., rows, 1, cols): one scale per row of the last dimension, also for
    # 3-D weights (PerAxis(0) would give one per leading index)
    "channel": lambda args, group_size: PerRow(),
    "group": lambda args, group_size: PerGroup(int(group_size)),
    "tensor_group": lambda args, group_size: TensorGroup(int(group_size)),
    "block": lambda args, group_size: PerBlock(_block_structure(args), partial=True),
    "token": lambda args, group_size: PerToken(),
    # the attention view of (batch, heads, seq, head_dim): one scale per head
    "attn_head": lambda args, group_size: PerHead(1),
}


def _block_structure(args) -> tuple:
    """``block_structure`` as QuantizationArgs parses it: ``[rows, cols]`` of positive ints, or the
    ``"128x128"`` string older configs hold; ValueError naming the field for anything else."""
    given = value = _field(args, "block_structure")
    if isinstance(value, str):
        try:
            value = [int(part) for part in value.split("x")]
        except ValueError:
            value = None
    if not (isinstance(value, (list, tuple)) and len(value) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
        raise ValueError(f"from_compressed_tensors: block_structure must be [rows, cols] of positive ints (or the "
                         f"string 'RxC'), got {given!r}")
    return tuple(value)


# strategies whose activation specs take their scales at run time (`qstats.recipe.runtime_scaled`)
_RUNTIME_STRATEGIES = ("token", "group", "tensor_group")


def _dynamic(args):
    """``dynamic`` as QuantizationArgs reads it: a bool, or ``"local"`` in any case (DynamicType);
    ValueError naming the field for another string (``"true"``)."""
    value = _enum_value(_field(args, "dynamic", False))
    if isinstance(value, str):
        if value.lower() != "local":
            raise ValueError(f"from_compressed_tensors: dynamic must be a bool or 'local', got {value!r}")
        return "local"
    return _bool_field(args, "dynamic", False)


# the strategies QuantizationArgs takes with dynamic=True
_DYNAMIC_STRATEGIES = ("token", "tensor", "group", "tensor_group")


def _check_as_quantization_args(args, strategy, group_size):
    """ValueError naming the field, for a dict of fields QuantizationArgs refuses (its field and model
    validators), which was read as some spec: static ``token`` strategies, ``dynamic`` with another
    strategy than token/tensor/group/tensor_group (``"local"``: tensor_group only), a ``group_size``
    below -1, and the removed ``actorder`` True, ``"group"`` and ``"dynamic"``."""
    dynamic = _dynamic(args)
    if strategy == "token" and not dynamic:
        raise ValueError("from_compressed_tensors: strategy 'token' needs dynamic=True (compressed-tensors has no "
                         "static token quantization)")
    if dynamic and strategy not in _DYNAMIC_STRATEGIES:
        raise ValueError(f"from_compressed_tensors: dynamic={dynamic!r} needs strategy one of {_DYNAMIC_STRATEGIES}, "
                         f"got strategy {strategy!r}")
    if dynamic == "local" and strategy != "tensor_group":
        raise ValueError(f"from_compressed_tensors: dynamic='local' needs strategy 'tensor_group', got {strategy!r}")
    if group_size is not None and group_size < -1:
        raise ValueError(f"from_compressed_tensors: group_size must be positive (strategy 'group') or -1 (strategy "
                         f"'channel'), got {group_size}")
    actorder = _enum_value(_field(args, "actorder", None))
    if actorder is True or (isinstance(actorder, str) and actorder.lower() in ("group", "dynamic")):
        raise ValueError(f"from_compressed_tensors: actorder={actorder!r} was removed from compressed-tensors; use "
                         "actorder='weight' or None")


def _check_unused_fields(args, strategy, group_size):
    """ValueError for a ``group_size`` or ``block_structure`` the strategy would ignore (a dict of fields
    ``{"strategy": "channel", "group_size": 128}`` gave per-channel scales); QuantizationArgs refuses them."""
    if group_size is not None and group_size > 0 and strategy not in ("group", "tensor_group"):
        raise ValueError(f"from_compressed_tensors: group_size {group_size} needs strategy 'group' or "
                         f"'tensor_group', got strategy {strategy!r}")
    if _field(args, "block_structure", None) is not None and strategy != "block":
        raise ValueError(f"from_compressed_tensors: block_structure needs strategy 'block', got strategy {strategy!r}")


def _warn_dynamic_static(args, strategy):
    """``dynamic=True`` with a strategy (``"tensor"``, ...) whose spec alone is static: a QuantSpec
    says how scales are computed, not when, so the site must be declared dynamic by its Rule."""
    if _dynamic(args) is True and strategy not in _RUNTIME_STRATEGIES:
        warn(
            f"from_compressed_tensors: dynamic=True with strategy {strategy!r}: the QuantSpec computes "
            "scales as compressed-tensors does, but it does not say they are computed at run time; "
            "use it in qstats.Rule(..., dynamic=True) so that calibration gives the site no scale, "
            "fake_quantized takes each tensor's own scale and the export writes it as dynamic "
            "(otherwise the site is calibrated as a static one)",
            UserWarning,
        )


def _check_reproducible(args, num_bits, qtype, symmetric, strategy, scale_dtype):
    """ValueError for arguments compressed-tensors computes in a way qstats does not reproduce
    (or refuses itself when calculating qparams)."""
    if qtype == "float" and num_bits == 4 and not symmetric:
        # calculate_qparams raises NotImplementedError for them
        raise ValueError("from_compressed_tensors: symmetric=False is not supported for float 4-bit targets")
    if strategy == "tensor_group":
        _check_tensor_group(args, num_bits, qtype, scale_dtype)
    zp_dtype = dtype_named(_field(args, "zp_dtype"))
    if zp_dtype is not None and not symmetric:
        # calculate_qparams rounds the zero point to zp_dtype: a float one keeps it fractional, an
        # unsigned or narrow one clips it; qstats rounds it to the target's signed range
        signed = (-(2 ** (num_bits - 1)), 2 ** (num_bits - 1) - 1)
        ok = zp_dtype == torch.float8_e4m3fn if qtype == "float" else integer_dtype_holds(zp_dtype, signed)
        if not ok:
            raise ValueError(
                f"from_compressed_tensors: zp_dtype {zp_dtype!r} is not supported for asymmetric "
                f"{qtype}{num_bits} targets: use a signed integer dtype holding the target's range "
                "(float8_e4m3fn for float targets)"
            )


def _check_tensor_group(args, num_bits, qtype, scale_dtype):
    """ValueError for ``tensor_group`` args other than NVFP4's: fp4 elements under float8_e4m3fn
    group scales, or, for ``dynamic="local"`` activations, unrounded ones (``scale_dtype=None``:
    llm-compressor's ``recipe_nvfp4_fp8_mixed.yaml``; the same global scale, ``generate_gparam``,
    and the run-time group scales kept in float32, as ``calculate_qparams`` rounds none)."""
    if qtype == "float" and num_bits == 4 and scale_dtype == torch.float8_e4m3fn:
        return
    if qtype == "float" and num_bits == 4 and scale_dtype is None:
        if _dynamic(args) == "local":
            return
        raise ValueError(
            "from_compressed_tensors: strategy 'tensor_group' fp4 args without scale_dtype are reproduced for "
            "dynamic='local' activations only: compressed-tensors fake-quantizes such weights with unrounded "
            "group scales, but its NVFP4 checkpoint stores those scales cast to float8_e4m3fn, which the "
            "packed codes were not computed with; give scale_dtype=torch.float8_e4m3fn (NVFP4)"
        )
    # generate_gparam scales by 448 * 6 (the FP8 and FP4 maxima) whatever the element and scale
    # formats; qstats' two-level scales follow the spec's own formats (NVFP4 only)
    raise ValueError(
        "from_compressed_tensors: strategy 'tensor_group' is reproduced for NVFP4 only: "
        f"type='float', num_bits=4, scale_dtype=torch.float8_e4m3fn (got type={qtype!r}, "
        f"num_bits={num_bits}, scale_dtype={scale_dtype!r})"
    )


def check_compressed_tensors_range(spec) -> None:
    """ValueError for a spec whose codes compressed-tensors cannot express: it clamps codes to the signed
    ``[-2**(b-1), 2**(b-1) - 1]`` (or float) range with a symmetric zero point of 0.
    """
    if spec.symmetric_zero_point not in (None, 0):
        raise ValueError(
            f"QuantSpec.symmetric_zero_point {spec.symmetric_zero_point}: compressed-tensors' symmetric zero "
            "point is 0"
        )
    if spec.mapping not in ("symmetric", "asymmetric"):
        raise ValueError(
            f"QuantSpec.mapping {spec.mapping!r}: compressed-tensors computes 'symmetric' and 'asymmetric' "
            "mappings only; use convention='torch_ao' or 'torchao'"
        )
    if not spec.is_signed:
        raise ValueError(
            f"QuantSpec.dtype {spec.dtype!r}: compressed-tensors' integer codes are signed "
            f"([-2**(b-1), 2**(b-1) - 1]); use int{spec.bits}, or convention='torch_ao' or 'torchao'"
        )
    if spec.reduce_range:
        raise ValueError("QuantSpec.reduce_range: compressed-tensors has no reduced range; use convention='torch_ao'")
    if spec.quant_min is not None and tuple(spec.qrange) != spec.dtype_range:  # (float targets have no quant_min)
        lo, hi = spec.dtype_range
        raise ValueError(
            f"QuantSpec.quant_min/quant_max [{spec.quant_min}, {spec.quant_max}]: compressed-tensors' codes "
            f"always span [{lo}, {hi}] for {spec.dtype!r}; use convention='torch_ao' or 'torchao' for a "
            "custom range"
        )


def _zero_point_dtype(spec) -> torch.dtype:
    if spec.is_float:
        return torch.float8_e4m3fn
    return torch.int8 if spec.bits <= 8 else (torch.int16 if spec.bits <= 16 else torch.int32)


def _scale_eps(spec, compute) -> float:
    """compressed-tensors' ``_get_dtype_eps`` of the scale dtype (the computation's when unset)."""
    if spec.scale_dtype == "float8_e4m3fn":
        return 0.125
    if spec.scale_dtype != "float32":
        return float(torch.finfo(getattr(torch, spec.scale_dtype)).eps)
    return float(torch.finfo(compute).eps)


def peak_limit(compute: torch.dtype, half_range: float) -> float:
    """The largest peak (as a float32) whose symmetric scale ``peak / half_range`` stays finite in
    ``compute`` (bfloat16/float16): the dtype's largest value, times ``half_range`` where that is
    below 1. (The float32 limits are `qparams_from_minmax`'s: its ranges arrive clipped.)"""
    return float(torch.tensor(torch.finfo(compute).max * min(1.0, half_range), dtype=torch.float32))


def _largest_in_both(first: torch.dtype, second: torch.dtype) -> float:
    """The largest value both float dtypes hold (bfloat16 and float16: 65280, as bfloat16 rounds
    float16's 65504 up to 65536, past float16)."""
    largest = torch.tensor(min(torch.finfo(first).max, torch.finfo(second).max), dtype=torch.float64)
    for dtype in (first, second):
        rounded = largest.to(dtype)
        if rounded.double() > largest:
            rounded = torch.nextafter(rounded, torch.zeros_like(rounded))
        largest = rounded.double()
    return float(largest)


def _range_in(compute: torch.dtype, min_val, max_val, spec):
    """The range with zero, rounded to ``compute`` (held as float32); in bfloat16/float16 first
    clipped so that the scale stays finite (a symmetric peak, or an asymmetric span, wider than
    the dtype holds)."""
    if compute != torch.float32:
        # an asymmetric span up to the dtype's largest value (half_range 1); a symmetric peak's
        # half range is half the span of codes, rounded to ``compute`` on the host (a meta range
        # cannot be read)
        half_range = 1.0 if spec.mapping == "asymmetric" else float(
            torch.tensor(float(spec.qrange[1] - spec.qrange[0]), dtype=compute) / 2)
        limit = peak_limit(compute, half_range)
        min_val = min_val.clamp(min=-limit)
        max_val = max_val.clamp(max=limit)
    min_val = rounded_in(min_val.float(), compute)
    max_val = rounded_in(max_val.float(), compute)
    min_vals = torch.min(min_val, torch.zeros_like(min_val))
    max_vals = torch.max(max_val, torch.zeros_like(max_val))
    if spec.mapping == "asymmetric" and compute != torch.float32:
        # a span wider than the dtype holds: both ends clipped at half its largest value there
        half = torch.finfo(compute).max / 2
        wide = rounded_in(max_vals - min_vals, compute) == torch.inf
        min_vals = torch.where(wide, min_vals.clamp(min=-half), min_vals)
        max_vals = torch.where(wide, max_vals.clamp(max=half), max_vals)
    return min_vals, max_vals


# --------------------------------------------------------------------------------------------
# quantize / dequantize in compressed-tensors' order and dtypes (``_quantize_dequantize``):
# ``x / scale`` in the promoted dtype of ``x`` and the scale, ``+ zero_point`` (cast to ``x``'s
# dtype), clamp, then round (int) or cast to float8; dequantization in the scale's dtype:
# ``(q - zero_point) * scale``.
class CompressedTensorsConvention(Convention):
    """compressed-tensors' ``calculate_qparams`` and ``fake_quantize``, in the observed dtype
    (``compute_dtype``). Float targets take asymmetric mappings; float zero points are
    compressed-tensors' own (no range check)."""

    name = "compressed_tensors"
    ranges_map_like_torch_ao = True
    computes_in_observed_dtype = True

    def validate(self, spec) -> None:
        # the dtype's own range and zero point 0 only: the default range and zero point checks hold
        check_compressed_tensors_range(spec)
        check_preserve_zero(spec, self)
        if spec.scale_dtype == "float64":
            raise ValueError("QuantSpec.scale_dtype 'float64' is not reproduced for compressed-tensors")
        steps = 2.0**spec.bits - 1
        if not spec.is_float and spec.compute_dtype == "float16" and steps > torch.finfo(torch.float16).max:
            # calculate_qparams divides by the code range 2**bits - 1 in float16, where 65535 is Inf:
            # every scale is 0, replaced by float16's eps, whatever the data
            raise ValueError(
                f"QuantSpec.compute_dtype 'float16': compressed-tensors' code range of {spec.dtype!r} "
                f"({2**spec.bits - 1} steps) overflows float16, so its scale is float16's eps for any data; "
                "observe in float32 or bfloat16, or use int8"
            )
        if spec.mapping == "asymmetric" and not spec.is_float and spec.compute_dtype in ("bfloat16", "float16"):
            # its zero points are computed (clamped to the range) in that dtype: past its integers (bfloat16:
            # 256, float16: 2048) the largest code 2**(b-1) - 1 rounds to 2**(b-1), outside the range, the zero
            # point of every all-negative row or group, which fake_quantize, quantize and dequantize refuse
            qmax = spec.qrange[1]
            rounded_max = float(torch.tensor(float(qmax), dtype=getattr(torch, spec.compute_dtype)))
            if rounded_max != qmax:
                raise ValueError(
                    f"QuantSpec.compute_dtype {spec.compute_dtype!r}: compressed-tensors computes asymmetric "
                    f"{spec.dtype!r} zero points in it, where the largest code {qmax} rounds to {rounded_max:.0f}, "
                    f"outside the range (the zero point of an all-negative row or group); observe in float32, use "
                    f"at most {9 if spec.compute_dtype == 'bfloat16' else 12} bits, or a symmetric mapping"
                )

    def check_lsq(self, spec) -> None:
        if spec.mapping == "asymmetric" and spec.zero_point_domain == "none":
            raise ValueError(
                "lsq: compressed-tensors keeps an asymmetric spec's zero point even with "
                "spec.zero_point_domain='none'; use zero_point_domain='int'"
            )

    def moving_average(self, average, batch, constant, spec, observed_dtype):
        """llm-compressor's ``lerp``: ``average * (1 - constant) + batch * constant``, bit for bit,
        rounded to a bf16/fp16 observed dtype where ``spec.compute_dtype`` is it (llm-compressor
        keeps such inputs' extremes in their dtype); saturated at the float32 limit."""
        rounds = spec.compute_dtype == COMPUTE_DTYPE_NAMES.get(observed_dtype)

        def native(t):  # kept under torch.compile, which drops a plain pair of casts
            return rounded_to(t, observed_dtype) if rounds else t

        moved = native(native(average * (1.0 - constant)) + native(batch * constant))
        limit = torch.finfo(torch.float32).max
        return moved.clamp(-limit, limit)

    def qparams(self, min_val, max_val, spec):
        """``calculate_qparams`` on float32 extremes, computed in ``spec.compute_dtype`` (the observed
        weight's dtype, as llm-compressor). Returns float32 scales holding the compute dtype's values and
        int32 (int targets) or float32 (float targets) zero points. Where compressed-tensors' half
        arithmetic would overflow to an infinite scale, the range is clipped to the largest finite scale.
        """
        compute = getattr(torch, spec.compute_dtype)

        def rounded(t):  # float32 arithmetic, each result rounded as compressed-tensors' ops in compute
            return rounded_in(t, compute)

        # compressed-tensors' calculate_range: the float format's, or the signed range (the spec's own, as
        # `check_compressed_tensors_range` refuses any other), as float tensors
        bit_min, bit_max = (torch.tensor(float(b), device=min_val.device) for b in spec.qrange)
        bit_range = bit_max - bit_min
        min_vals, max_vals = _range_in(compute, min_val, max_val, spec)
        if spec.mapping == "asymmetric":
            scales = rounded(rounded(max_vals - min_vals) / rounded(bit_range))
            zero_points = rounded(rounded(bit_min) - rounded(min_vals / scales))
            zero_points = torch.clamp(zero_points, rounded(bit_min), rounded(bit_max))
        else:
            max_val_pos = torch.max(torch.abs(min_vals), torch.abs(max_vals))
            scales = rounded(max_val_pos / rounded(rounded(bit_range) / 2))
            zero_points = torch.zeros_like(scales)
        if spec.scale_dtype != "float32":
            dtype = getattr(torch, spec.scale_dtype)
            limit = _largest_in_both(dtype, compute)  # saturated where the round trip would overflow
            scales = rounded(rounded_in(scales.clamp(-limit, limit), dtype))
        # where(scales == 0, eps, scales) by arithmetic (scales + 0 is exact; selects are slow on CPU)
        scales = scales + (scales == 0).float() * rounded(torch.tensor(_scale_eps(spec, compute), device=scales.device))
        # an all-zero asymmetric range gives 0 / 0: 0 here, for int8 as torch converts NaN, and for
        # float8 where compressed-tensors keeps NaN (docs/differences.md); infinities are clamped below
        zero_points = torch.nan_to_num(zero_points, nan=0.0)
        zp_dtype = _zero_point_dtype(spec)
        if zp_dtype.is_floating_point:
            zero_points = rounded_in(saturate(zero_points, zp_dtype), zp_dtype)
        else:
            iinfo = torch.iinfo(zp_dtype)
            zero_points = torch.round(torch.clamp(zero_points, iinfo.min, iinfo.max)).to(zp_dtype).to(torch.int32)
        return scales, zero_points

    def codes(self, view, scale, zero_point, spec):
        """``(unclamped, codes)`` of ``view`` (any float dtype) as float32 tensors."""
        compute = getattr(torch, spec.compute_dtype)
        work = torch.promote_types(view.dtype, compute)  # the dtype of compressed-tensors' results
        wide = torch.promote_types(work, torch.float32)

        def rounded(t):
            return rounded_in(t, work)

        scaled = rounded(view.to(wide) / rounded_in(scale.to(wide), compute))
        scaled = rounded(scaled + rounded_in(zero_point.to(wide), view.dtype))
        qmin, qmax = spec.qrange
        if spec.is_float:
            quantized = rounded_in(scaled.clamp(qmin, qmax), spec.float_format.torch_dtype)
            return scaled.float(), quantized.float()
        unclamped = torch.round(scaled)
        return unclamped.float(), rounded(unclamped.clamp(qmin, qmax)).float()

    def dequantize(self, codes, scale, zero_point, spec):
        """float32 values of ``codes``: ``(q - zero_point) * scale`` in the scale's (compute) dtype;
        the product (exact in float32 for bf16/fp16 operands) saturates at the compute dtype's
        largest value where compressed-tensors' overflows to +-Inf."""
        compute = getattr(torch, spec.compute_dtype)
        values = rounded_in(rounded_in(codes.float(), compute) - rounded_in(zero_point.float(), compute), compute)
        product = values * rounded_in(scale.float(), compute)
        return rounded_in(saturate(product, compute), compute)

    def block_scaled(self, view, scale, spec):
        """As compressed-tensors divides ``view`` (bf16, fp16, float32 or float64) by its scale held in
        the observed (compute) dtype: in their type promotion (a float32 input by a bf16 scale in
        float32, a bf16 one in bf16, a float64 one in float64), then adds its zero point (0), which
        makes -0.0 +0 (a tiny negative value still rounds to -0)."""
        compute = getattr(torch, spec.compute_dtype)
        work = torch.promote_types(view.dtype, compute)
        return view.to(work) / scale.to(compute).to(work) + 0.0

    def e8m0_scale(self, amax, spec):
        """compressed-tensors holds the scale in the observed dtype, and replaces one that
        underflows there (below 2**-24 in float16: an all-zero or tiny block) by 1, the eps of its
        uint8 scale dtype. An amax that is no value of that dtype (a range rule's estimate, such as
        moments' ``mean + 4 * std``, or a pinned ``float_range`` end) is rounded to it first, as
        llm-compressor holds the range in it and as `_range_in` rounds the ranges of the other
        formats; one past the dtype saturates to its largest value: its scale was past the dtype
        too, Inf there, and every value came back 0 or NaN."""
        if spec.compute_dtype == "float32":
            return super().e8m0_scale(amax, spec)
        compute = getattr(torch, spec.compute_dtype)
        scale = super().e8m0_scale(rounded_in(amax.float().clamp(max=torch.finfo(compute).max), compute), spec)
        # a scale rounded up past the dtype (int2's rceil scale of 65504 is 2**16) is its largest power of two
        scale = scale.clamp(max=2.0 ** math.floor(math.log2(torch.finfo(compute).max)))
        return torch.where(scale.to(compute) == 0, torch.ones_like(scale), scale)  # underflows
