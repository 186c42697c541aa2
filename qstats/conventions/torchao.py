"""The torchao convention (``"torchao"``) and `from_torchao`: torchao's quantization arithmetic.

`from_torchao` maps torchao's affine (``choose_qparams_affine`` and variants), MX (``to_mx``), float8
(``_choose_scale_float8``, ``QuantizeTensorToFloat8Kwargs``) and NVFP4 (``NVFP4Tensor.to_nvfp4``)
arguments, and the weight-only ``quantize_`` configs (``Int8WeightOnlyConfig``,
``Float8WeightOnlyConfig``, ``NVFP4WeightOnlyConfig``, ``IntxWeightOnlyConfig``), onto a QuantSpec;
the arguments accepted are listed in docs/formats.md. torchao is not imported: its enums are read
by name. Where torchao's half-precision arithmetic gives an Inf, NaN or
zero scale, qstats saturates (docs/differences.md).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from .._checks import is_real_number
from .._formats import (COMPUTE_DTYPE_NAMES, E8M0_MIN, biased_exponent, compute_dtype_name, e8m0_to_float,
                        rounded_in)
from .._granularity import Granularity, PerAxis, PerBlock, PerGroup, PerRow, PerTensor, PerToken, TensorGroup
from .._torch_features import torch_dtype
from .default import Convention, round_scale, saturate

__all__ = ["TorchaoConvention", "from_torchao"]

# torchao's enum members, whose lower-case names are qstats'
_MAPPINGS = ("SYMMETRIC", "SYMMETRIC_NO_CLIPPING_ERR", "ASYMMETRIC")
_DOMAINS = ("INT", "FLOAT", "NONE")
_SCALE_MODES = ("FLOOR", "CEIL", "EVEN", "RCEIL")
_MX_ELEMENTS = {
    torch.float8_e4m3fn: "fp8_e4m3fn",
    torch.float8_e5m2: "fp8_e5m2",
    **{name: name for name in ("fp6_e2m3", "fp6_e3m2", "fp4_e2m1", "fp8_e4m3fn", "fp8_e5m2")},
}
if torch_dtype("float4_e2m1fn_x2") is not None:  # torch >= 2.8; the name "fp4_e2m1" works on any torch
    _MX_ELEMENTS[torch_dtype("float4_e2m1fn_x2")] = "fp4_e2m1"
# _choose_scale_float8 / _quantize_affine_float8 targets (torchao's FP8_TYPES)
_FLOAT8 = {getattr(torch, f"float8_{e}"): f"fp8_{e}" for e in ("e4m3fn", "e5m2", "e4m3fnuz", "e5m2fnuz")}
_E8M0 = torch_dtype("float8_e8m0fnu")  # torch >= 2.7
_NVFP4_BLOCK_SCALE_EPS = float(torch.finfo(torch.float8_e4m3fn).tiny)  # torchao E4M3_EPS


def _enum_name(value, names, what):
    """qstats' name of a torchao enum member (or its name, any case), one of ``names``."""
    name = getattr(value, "name", value)
    if isinstance(name, str) and name.upper() in names:
        return name.lower()
    raise ValueError(f"from_torchao: unknown {what} {value!r}; expected one of {sorted(names)}")


# choose_qparams_affine's integer targets (torchao's _DTYPE_TO_QVALUE_BOUNDS); torchao refuses
# every other dtype (uint16, uint32, int64, ...) with "Unsupported dtype"
_AFFINE_TARGETS = frozenset([f"int{b}" for b in range(1, 9)] + [f"uint{b}" for b in range(1, 9)] + ["int16", "int32"])


def _int_target(dtype) -> str:
    """qstats' name of a ``choose_qparams_affine`` integer target (a torch dtype or its name)."""
    name = str(dtype).replace("torch.", "") if isinstance(dtype, torch.dtype) else str(dtype)
    if name in _AFFINE_TARGETS:
        return name
    raise ValueError(
        f"from_torchao: target_dtype {dtype!r} is not a target of torchao's choose_qparams_affine "
        "(torch.int1...int8, uint1...uint8, int16, int32; torchao raises 'Unsupported dtype'); float8 targets "
        "are torch.float8_* dtypes, MX elements (fp4, fp6, fp8) take elem_dtype= and scaling_mode= (to_mx), "
        "NVFP4 nvfp4=True"
    )


def _int_bound(value, name):
    """``quant_min``/``quant_max`` as an int; torchao computes with fractional ones, qstats cannot."""
    if value is None:
        return None
    if is_real_number(value) and float(value).is_integer():
        return int(value)
    raise ValueError(f"from_torchao: {name} must be an integer, got {value!r}")


def _granularity(kwargs) -> Granularity:
    """The qstats granularity of ``granularity=`` (qstats', or torchao's read by its class name), else
    of ``block_size=`` for tensors of ``shape=``, else per tensor."""
    granularity = kwargs.pop("granularity", None)
    block_size = kwargs.pop("block_size", None)
    shape = kwargs.pop("shape", None)
    if granularity is not None and block_size is not None:
        # either one alone chooses the blocks: with both, one of them would be ignored
        raise ValueError(
            f"from_torchao: pass granularity= ({granularity!r}) or block_size= ({tuple(block_size)!r}) with shape=, "
            "not both"
        )
    if isinstance(granularity, Granularity):
        return granularity
    if granularity is not None:
        if type(granularity).__name__ not in _GRANULARITIES:
            raise ValueError(f"from_torchao: unsupported granularity {granularity!r}")
        return _GRANULARITIES[type(granularity).__name__](granularity)
    if block_size is None:
        return PerTensor()
    if shape is None:
        raise ValueError("from_torchao: block_size needs the tensor shape (shape=...) to choose a granularity")
    return _block_size_granularity(tuple(int(b) for b in block_size), tuple(int(s) for s in shape))


# qstats granularities of torchao granularity objects, by class name
_GRANULARITIES = {
    "PerTensor": lambda g: PerTensor(),
    "PerAxis": lambda g: PerAxis(int(g.axis)),
    "PerGroup": lambda g: PerGroup(int(g.group_size)),
    # reduces along ``dim``, one set per index of every other dimension (get_block_size)
    "PerRow": lambda g: PerRow(int(getattr(g, "dim", -1))),
    "PerToken": lambda g: PerToken(),
    # torchao pads a short block_size with leading 1s (get_block_size): leading 1s beyond the
    # last two dimensions are the same granularity; other entries span leading dimensions
    "PerBlock": lambda g: PerBlock(_strip_leading_ones(tuple(int(b) for b in g.block_size))),
}


def _strip_leading_ones(block: tuple) -> tuple:
    block = (1,) * (2 - len(block)) + block
    while len(block) > 2 and block[0] == 1:
        block = block[1:]
    return block


def _block_size_granularity(block_size: tuple, shape: tuple) -> Granularity:
    """The qstats granularity of torchao's ``block_size`` for tensors of ``shape``."""
    if len(block_size) != len(shape):
        raise ValueError(f"from_torchao: block_size {block_size} and shape {shape} differ in length")
    if any(b < 1 or s % b for b, s in zip(block_size, shape)):
        raise ValueError(f"from_torchao: block_size {block_size} does not divide shape {shape} (torchao requires it)")
    if block_size == shape:
        return PerTensor()
    if all(b == 1 for b in block_size[:-1]):
        return PerToken() if block_size[-1] == shape[-1] else PerGroup(block_size[-1])
    if len(shape) >= 2 and all(b == 1 for b in block_size[:-2]):
        return PerBlock(block_size[-2:])
    full = [i for i, (b, s) in enumerate(zip(block_size, shape)) if b == 1 and s != 1]
    if len(full) == 1 and all(b == s for i, (b, s) in enumerate(zip(block_size, shape)) if i != full[0]):
        return PerAxis(full[0])
    return PerBlock(_strip_leading_ones(block_size))  # blocks spanning leading dimensions


def from_torchao(cls, target_dtype, kwargs):
    """The ``cls`` (QuantSpec) whose `compute_qparams` and `quantize` equal torchao's for these
    arguments (see `QuantSpec.from_torchao`)."""
    kwargs = dict(kwargs)
    kind = type(target_dtype).__name__
    if kind.endswith("Config"):  # a quantize_ config (AOBaseConfig)
        return _config_spec(cls, target_dtype, kwargs)
    if kind == "QuantizeTensorToMXKwargs":
        return _mx_spec(cls, target_dtype.elem_dtype, target_dtype.block_size, target_dtype.scaling_mode,
                        kwargs)
    nvfp4_config = kind == "QuantizeTensorToNVFP4Kwargs"
    if nvfp4_config or kwargs.pop("nvfp4", False):
        block_size = target_dtype.block_size if nvfp4_config else kwargs.pop("block_size", 16)
        if block_size != 16:
            raise ValueError(f"from_torchao: NVFP4 needs block_size 16, got {block_size}")
        # the kwargs object's use_dynamic_per_tensor_scale=False (its default): torchao quantizes
        # with block scales only, unless a static (calibrated) scale is given: per_tensor_scale=True
        dynamic = getattr(target_dtype, "use_dynamic_per_tensor_scale", True) if nvfp4_config else True
        return _nvfp4_spec(cls, _per_tensor_scale(kwargs.pop("per_tensor_scale", dynamic)), kwargs)
    if kind in ("QuantizeTensorToInt8Kwargs", "QuantizeTensorToFloat8Kwargs") and target_dtype.granularity is None:
        # Int8Tensor.from_hp / Float8Tensor.from_hp raise "Unsupported Granularity: None"
        raise ValueError(f"from_torchao: {kind} needs a granularity (torchao's from_hp refuses None), got None")
    if kind == "QuantizeTensorToInt8Kwargs":  # Int8Tensor's (Int8DynamicActivationInt8WeightConfig's activations)
        return _int8_tensor_spec(cls, target_dtype, kwargs)
    if kind == "QuantizeTensorToFloat8Kwargs":  # Float8Tensor's (and its activations') arguments
        for name in ("granularity", "hp_value_lb", "hp_value_ub"):
            kwargs.setdefault(name, getattr(target_dtype, name))
        return _float8_spec(cls, target_dtype.float8_dtype, kwargs)
    if isinstance(target_dtype, torch.dtype) and target_dtype in _FLOAT8 and "scaling_mode" not in kwargs:
        if _AFFINE_ONLY.intersection(kwargs):
            raise ValueError(
                f"from_torchao: target_dtype {target_dtype} with choose_qparams_affine's arguments "
                "(mapping_type, zero_point_domain, quant_min, quant_max, eps, zero_point_dtype, preserve_zero): "
                "torchao rounds such float8 codes to integers, which qstats does not emulate; use "
                f"from_torchao({target_dtype}, granularity=, scale_dtype=, input_dtype=) (_choose_scale_float8)"
            )
        return _float8_spec(cls, target_dtype, kwargs)
    if "scaling_mode" in kwargs or "elem_dtype" in kwargs:
        elem = kwargs.pop("elem_dtype", target_dtype)
        return _mx_spec(cls, elem, kwargs.pop("block_size", 32), kwargs.pop("scaling_mode", "FLOOR"), kwargs)
    return _affine_spec(cls, target_dtype, kwargs)


_AFFINE_ONLY = frozenset(
    ("mapping_type", "zero_point_domain", "quant_min", "quant_max", "eps", "zero_point_dtype", "preserve_zero")
)


def _spec(cls, **fields):
    """A torchao-convention ``cls`` (QuantSpec) of ``fields``."""
    return cls(**{"convention": "torchao", "on_uncalibrated": "fallback", **fields})


def _reject_unknown(kwargs):
    if kwargs:
        raise ValueError(f"from_torchao: unexpected arguments {sorted(kwargs)}")


def _reject_unknown_but_layout(kwargs):
    """`_reject_unknown`, after dropping ``is_swizzled_scales`` (``to_mx``,
    ``NVFP4Tensor.to_nvfp4``), which arranges the same scales for a kernel: accepted (a bool) and
    ignored, as ``keepdim`` is."""
    swizzled = kwargs.pop("is_swizzled_scales", False)
    if not isinstance(swizzled, bool):
        raise ValueError(f"from_torchao: is_swizzled_scales must be a bool, got {swizzled!r}")
    _reject_unknown(kwargs)


def _mx_spec(cls, elem_dtype, block_size, scaling_mode, kwargs):
    if elem_dtype not in _MX_ELEMENTS:
        raise ValueError(f"from_torchao: MX elem_dtype must be one of {list(_MX_ELEMENTS)}, got {elem_dtype!r}")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"from_torchao: MX block_size must be a positive int, got {block_size!r}")
    _reject_unknown_but_layout(kwargs)
    return _spec(
        cls,
        dtype=_MX_ELEMENTS[elem_dtype],
        granularity=PerGroup(block_size),
        scale_dtype="e8m0",
        scale_rounding=_enum_name(scaling_mode, _SCALE_MODES, "scaling_mode"),
        zero_point_domain="none",
    )


def _per_tensor_scale(value) -> bool:
    """NVFP4's ``per_tensor_scale=``: True (a global scale computed from the observed amax, as
    ``per_tensor_amax_to_scale``), False or None (block scales only). torchao's ``to_nvfp4`` takes
    the scale itself, a tensor, which a static spec cannot hold: it goes to `compute_qparams`."""
    if value is None or isinstance(value, bool):
        return bool(value)
    raise ValueError(
        f"from_torchao: NVFP4 per_tensor_scale must be True (a global scale amax / (448 * 6) of the observed "
        f"data), False or None (block scales only), got {value!r}; to quantize with a given global scale "
        "(torchao's to_nvfp4(per_tensor_scale=tensor)), pass per_tensor_scale=True here and the tensor to "
        "compute_qparams(state, spec, global_scale=...)"
    )


def _nvfp4_spec(cls, per_tensor_scale, kwargs):
    _reject_unknown_but_layout(kwargs)
    return _spec(
        cls,
        dtype="fp4_e2m1",
        granularity=TensorGroup(16) if per_tensor_scale else PerGroup(16),
        scale_dtype="float8_e4m3fn",
        zero_point_domain="none",
        global_scale_formula="amax_over_range",
        eps=_NVFP4_BLOCK_SCALE_EPS,
    )


def _int8_tensor_spec(cls, config, kwargs):
    """``Int8Tensor.from_hp``'s ``choose_qparams_affine`` arguments for ``config``'s granularity and
    mapping: int8 codes in [-128, 127] (halved by ``reduce_range``), float32 scales, int8 zero points
    and float32's eps, whatever the input dtype (``input_dtype=``, the only other argument)."""
    input_dtype = kwargs.pop("input_dtype", torch.float32)
    _reject_unknown(kwargs)
    qmin, qmax = (-64, 63) if getattr(config, "reduce_range", False) else (-128, 127)
    return _affine_spec(cls, torch.int8, dict(
        granularity=config.granularity,
        mapping_type=config.mapping_type,
        input_dtype=input_dtype,
        quant_min=qmin,
        quant_max=qmax,
        scale_dtype=torch.float32,
        zero_point_dtype=torch.int8,
        eps=torch.finfo(torch.float32).eps,
    ))


def _config_spec(cls, config, kwargs):
    """The weights' spec of a weight-only ``quantize_`` config: ``Int8WeightOnlyConfig`` and
    ``Float8WeightOnlyConfig`` (``input_dtype=``), ``NVFP4WeightOnlyConfig``, ``IntxWeightOnlyConfig``
    (``shape=`` of the 2-d or 4-d weight, as its block size depends on it). Other configs raise,
    naming what to pass."""
    kind = type(config).__name__
    given = set(kwargs) - {"input_dtype", *(("shape",) if kind == "IntxWeightOnlyConfig" else ())}
    if given:  # the config chooses them
        raise ValueError(f"from_torchao: {kind} takes input_dtype= (IntxWeightOnlyConfig: and shape=), not {sorted(given)}")
    if kind == "Int8WeightOnlyConfig":  # Int8Tensor.from_hp(weight, granularity), symmetric
        arguments = SimpleNamespace(granularity=config.granularity, mapping_type="SYMMETRIC", reduce_range=False)
        return _int8_tensor_spec(cls, arguments, kwargs)
    if kind == "Float8WeightOnlyConfig":  # Float8Tensor.from_hp(weight, weight_dtype, granularity)
        return _float8_spec(cls, config.weight_dtype, dict(kwargs, granularity=config.granularity))
    if kind == "IntxWeightOnlyConfig":
        return _intx_weight_only_spec(cls, config, kwargs)
    if kind == "NVFP4WeightOnlyConfig":  # NVFP4Tensor.to_nvfp4, a global scale of the weight's amax or none
        compute_dtype_name(kwargs.pop("input_dtype", torch.float32), "from_torchao: input_dtype")  # float32 math
        return _nvfp4_spec(cls, bool(config.use_dynamic_per_tensor_scale), kwargs)
    hint = _CONFIG_HINTS.get(kind, "choose_qparams_affine's arguments of the tensor it builds")
    raise ValueError(
        f"from_torchao: {kind} quantizes activations and weights, or with its own kernels; from_torchao takes the "
        "weight-only configs Int8WeightOnlyConfig, Float8WeightOnlyConfig, NVFP4WeightOnlyConfig and "
        f"IntxWeightOnlyConfig; for {kind} pass {hint}"
    )


_CONFIG_HINTS = {
    "Int8DynamicActivationInt8WeightConfig": (
        "QuantizeTensorToInt8Kwargs(granularity=, mapping_type=, reduce_range=) with input_dtype=: the weights' "
        "(its weight granularity, MappingType.SYMMETRIC) and the activations' (its act granularity and act_mapping_type)"
    ),
    "Float8DynamicActivationFloat8WeightConfig": (
        "QuantizeTensorToFloat8Kwargs(float8_dtype=, granularity=) with input_dtype=: the weights' (weight_dtype "
        "and its weight granularity) and the activations' (activation_dtype and its activation granularity)"
    ),
    "Int8DynamicActivationIntxWeightConfig": (
        "for its weights IntxWeightOnlyConfig(weight_dtype=, granularity=weight_granularity, mapping_type="
        "weight_mapping_type, scale_dtype=weight_scale_dtype) with shape= and input_dtype=; for its activations "
        "torch.int8 with mapping_type=act_mapping_type, granularity=PerToken(), zero_point_dtype=torch.int8, input_dtype="
    ),
    "Int8StaticActivationInt8WeightConfig": (
        "QuantizeTensorToInt8Kwargs(granularity=, reduce_range=) with input_dtype= for its weights, and "
        "config.get_act_quant_kwargs() with input_dtype= for the activations whose calibrated scale (and zero "
        "point) it takes as act_quant_scale (act_quant_zero_point)"
    ),
    "Int4WeightOnlyConfig": (
        "granularity=PerGroup(config.group_size) and, by int4_packing_format: TILE_PACKED_TO_4D (tinygemm, bf16 weights) "
        "torch.uint4 with mapping_type=MappingType.ASYMMETRIC, zero_point_domain=ZeroPointDomain.FLOAT, "
        "input_dtype=torch.bfloat16; PLAIN_INT32 torch.int32 with mapping_type=MappingType.ASYMMETRIC, quant_min=0, "
        "quant_max=15, eps=1e-6, input_dtype= (the weight's); PLAIN and PRESHUFFLED quantize in mslk kernels, "
        "not emulated"
    ),
    "MXDynamicActivationMXWeightConfig": "QuantizeTensorToMXKwargs(elem_dtype=, block_size=, scaling_mode=)",
    "NVFP4DynamicActivationNVFP4WeightConfig": "nvfp4=True (per_tensor_scale=) or a QuantizeTensorToNVFP4Kwargs",
}


def _intx_weight_only_spec(cls, config, kwargs):
    """``IntxWeightOnlyConfig``: ``IntxUnpackedToInt8Tensor.from_hp`` (int8 zero points) over blocks of one
    group of input channels (2-d weights ``(1, group)``, 4-d conv weights ``(1, group, 1, 1)``), its scales
    cast to ``scale_dtype`` and the codes quantized with them."""
    shape = kwargs.pop("shape", None)
    if shape is None or len(shape) not in (2, 4):
        raise ValueError(f"from_torchao: IntxWeightOnlyConfig needs shape= of the 2-d or 4-d weight, got {shape!r}")
    algorithm = getattr(config, "intx_choose_qparams_algorithm", "AFFINE")
    if getattr(algorithm, "name", algorithm) != "AFFINE":
        raise ValueError(f"from_torchao: IntxWeightOnlyConfig with {algorithm} is not supported (AFFINE only)")
    granularity = config.granularity
    if type(granularity).__name__ == "PerAxis" and granularity.axis == 0:
        group = int(shape[1])  # every input channel: dimension 1 of 2-d and 4-d (conv) weights alike
    elif type(granularity).__name__ == "PerGroup":
        group = int(granularity.group_size)
    else:
        raise ValueError(f"from_torchao: IntxWeightOnlyConfig takes PerGroup or PerAxis(0), got {granularity!r}")
    arguments = dict(kwargs, mapping_type=config.mapping_type, shape=shape, zero_point_dtype=torch.int8,
                     block_size=(1, group) if len(shape) == 2 else (1, group, 1, 1))
    if config.scale_dtype is not None:
        arguments["scale_dtype"] = config.scale_dtype
    return _affine_spec(cls, config.weight_dtype, arguments)


def _float8_spec(cls, float8_dtype, kwargs):
    if float8_dtype not in _FLOAT8:
        raise ValueError(f"from_torchao: float8 dtype {float8_dtype} is not one of {list(_FLOAT8)} (torchao's FP8_TYPES)")
    granularity = _granularity(kwargs)
    scale_dtype = kwargs.pop("scale_dtype", torch.float32)
    input_dtype = kwargs.pop("input_dtype", torch.float32)
    if kwargs.pop("hp_value_lb", None) is not None or kwargs.pop("hp_value_ub", None) is not None:
        raise ValueError("from_torchao: float8 hp_value_lb/hp_value_ub are not supported")
    _reject_unknown(kwargs)
    if scale_dtype is None or scale_dtype not in (torch.float32, _E8M0):
        raise ValueError(f"from_torchao: float8 scale_dtype must be float32 or float8_e8m0fnu, got {scale_dtype}")
    compute = compute_dtype_name(input_dtype, "from_torchao: input_dtype")
    # torchao divides amax / max in the input's dtype, then widens the scale to float32
    scales = (dict(scale_dtype="e8m0", scale_rounding="round") if scale_dtype == _E8M0
              else dict(scale_dtype=compute))
    return _spec(
        cls,
        dtype=_FLOAT8[float8_dtype],
        granularity=granularity,
        zero_point_domain="none",
        eps=float(torch.finfo(torch.float32).tiny),
        compute_dtype=compute,
        **scales,
    )


def _affine_spec(cls, target_dtype, kwargs):
    domain = _enum_name(kwargs.pop("zero_point_domain", "INT"), _DOMAINS, "zero_point_domain")
    mapping = _enum_name(kwargs.pop("mapping_type", "SYMMETRIC"), _MAPPINGS, "mapping_type")
    granularity = _granularity(kwargs)
    input_dtype = kwargs.pop("input_dtype", torch.float32)
    eps = kwargs.pop("eps", None)
    scale_dtype = kwargs.pop("scale_dtype", None) or input_dtype
    quant_min, quant_max = (_int_bound(kwargs.pop(name, None), name) for name in ("quant_min", "quant_max"))
    preserve_zero = kwargs.pop("preserve_zero", None)
    zero_point_dtype = kwargs.pop("zero_point_dtype", None)
    kwargs.pop("keepdim", None)  # the shape of torchao's outputs only
    _reject_unknown(kwargs)
    dtype = _int_target(target_dtype)
    _check_affine(mapping, domain, input_dtype, scale_dtype, preserve_zero)
    if eps is None:
        eps = torch.finfo(input_dtype).smallest_normal
    _check_eps(eps, input_dtype, scale_dtype)
    lo, hi = cls(dtype=dtype).qrange
    qmin = lo if quant_min is None else quant_min
    qmax = hi if quant_max is None else quant_max
    _check_zero_point_dtype(zero_point_dtype, domain, input_dtype, qmin, qmax)
    return _spec(
        cls,
        dtype=dtype,
        mapping=mapping,
        granularity=granularity,
        zero_point_domain=domain,
        quant_min=qmin,
        quant_max=qmax,
        eps=float(torch.tensor(eps, dtype=torch.float32)),
        scale_dtype=_SCALE_DTYPE_NAMES[scale_dtype],
        symmetric_zero_point=int((qmax + qmin + 1) / 2),
        compute_dtype=COMPUTE_DTYPE_NAMES[input_dtype],
        preserve_zero=preserve_zero is not False or domain == "float",
    )


_SCALE_DTYPE_NAMES = {**COMPUTE_DTYPE_NAMES, torch.float64: "float64"}


def _check_affine(mapping, domain, input_dtype, scale_dtype, preserve_zero):
    """ValueError for affine arguments torchao refuses (or has no function for)."""
    if domain == "float" and mapping != "asymmetric":
        raise ValueError("from_torchao: ZeroPointDomain.FLOAT (tinygemm) needs MappingType.ASYMMETRIC")
    if domain == "none" and mapping == "asymmetric":
        raise ValueError("from_torchao: ZeroPointDomain.NONE needs a symmetric mapping")
    compute_dtype_name(input_dtype, "from_torchao: input_dtype")
    if scale_dtype not in _SCALE_DTYPE_NAMES:
        raise ValueError(f"from_torchao: scale_dtype {scale_dtype} is not supported (float32, bfloat16, float16, float64)")
    if preserve_zero is False and domain != "float" and (mapping != "asymmetric" or domain != "int"):
        # _choose_qparams_affine_dont_preserve_zero asserts MappingType.ASYMMETRIC
        raise ValueError("from_torchao: preserve_zero=False needs MappingType.ASYMMETRIC (or ZeroPointDomain.FLOAT)")
    if preserve_zero is True and domain == "float":
        raise ValueError("from_torchao: ZeroPointDomain.FLOAT (tinygemm) does not preserve zero; pass preserve_zero=False")


def _check_eps(eps, input_dtype, scale_dtype):
    """ValueError for an ``eps`` that is no number, or past the input's or the scale's dtype: torchao's
    clamp in an fp16 input raises (overflow), and an fp16 ``scale_dtype`` makes every scale Inf."""
    if not (is_real_number(eps) or (isinstance(eps, torch.Tensor) and eps.numel() == 1 and eps.is_floating_point())):
        raise ValueError(f"from_torchao: eps must be a real number, got {eps!r}")
    for dtype in (input_dtype, scale_dtype):
        if dtype in COMPUTE_DTYPE_NAMES and float(eps) > torch.finfo(dtype).max:
            raise ValueError(
                f"from_torchao: eps {float(eps):g} is past the largest {dtype} ({torch.finfo(dtype).max:g}); "
                "torchao's choose_qparams_affine raises (input dtype) or gives Inf scales (scale_dtype)"
            )


def _exact_integers(dtype: torch.dtype):
    """``(lo, hi)``: the integers ``dtype`` holds exactly (all of them from lo to hi)."""
    if dtype.is_floating_point:
        top = int(2 / torch.finfo(dtype).eps)  # 2 ** (mantissa bits + 1)
        return -top, top
    name = str(dtype).replace("torch.", "")
    if name.startswith(("int", "uint")) and name.lstrip("uint").isdigit() and name not in ("int64", "uint64"):
        bits = int(name.lstrip("uint"))
        return (0, 2**bits - 1) if name.startswith("u") else (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    info = torch.iinfo(dtype)
    return info.min, info.max


def _check_zero_point_dtype(zero_point_dtype, domain, input_dtype, qmin, qmax):
    """torchao casts the zero point to ``zero_point_dtype`` last: accepted where that keeps every
    zero point's value (qstats holds them as int32, or float32 for the float domain)."""
    if zero_point_dtype is None or domain == "none":
        return
    if not isinstance(zero_point_dtype, torch.dtype) or zero_point_dtype == torch.bool or zero_point_dtype.is_complex:
        raise ValueError(f"from_torchao: zero_point_dtype must be a real torch dtype, got {zero_point_dtype!r}")
    if domain == "float":
        # the tinygemm zero point is a value of the input's dtype
        wider = {torch.bfloat16: (torch.float32,), torch.float16: (torch.float32,)}.get(input_dtype, ())
        if zero_point_dtype not in (input_dtype, torch.float64, *wider):
            raise ValueError(
                f"from_torchao: zero_point_dtype {zero_point_dtype} would round ZeroPointDomain.FLOAT zero points "
                f"computed in {input_dtype}; use {input_dtype} (the default) or a wider float dtype"
            )
        return
    lo, hi = _exact_integers(zero_point_dtype)
    if not (lo <= qmin and qmax <= hi):
        raise ValueError(
            f"from_torchao: zero_point_dtype {zero_point_dtype} cannot hold every zero point of the range "
            f"[{qmin}, {qmax}] (torchao would wrap or round them); use torch.int32 (the default)"
        )


# --------------------------------------------------------------------------------------------
# arithmetic
_DTYPE_BY_NAME = {name: dtype for dtype, name in _SCALE_DTYPE_NAMES.items()}
_FLOAT32_MIN_NORMAL = float(torch.finfo(torch.float32).tiny)


def _dtypes(spec):
    """The dtypes torchao computes in: the input's (``compute_dtype``) and the scale's (float32
    for float8 and e8m0 scales)."""
    return getattr(torch, spec.compute_dtype), _DTYPE_BY_NAME.get(spec.scale_dtype, torch.float32)


def _own_arithmetic(spec) -> bool:
    """True where torchao's quantize arithmetic differs from `Convention`'s float32 integer codes:
    the float zero-point domain (tinygemm), bf16/fp16 compute dtypes, and bf16/fp16/float64 scales
    (torchao takes ``1.0 / scale`` in the scale's dtype)."""
    return not spec.is_float and (
        spec.zero_point_domain == "float" or spec.compute_dtype != "float32" or _dtypes(spec)[1] != torch.float32
    )


def _span_scale(low, high, levels: float, compute):
    """``(high - low) / levels`` in ``compute``, as torchao; where the span overflows ``compute``
    (torchao: an Inf scale), ``high / levels - low / levels``, saturated."""
    scale = rounded_in(rounded_in(high - low, compute) / levels, compute)
    spread = rounded_in(high / levels, compute) - rounded_in(low / levels, compute)
    return torch.where(torch.isfinite(scale), scale, saturate(rounded_in(spread, compute), compute))


def _affine_scale(min_val_neg, max_val_pos, spec, compute):
    """torchao's scale of a range (zero included or not) in ``compute``, before the eps floor and
    saturated where torchao's overflows (only int1/uint1 halve their symmetric divisor)."""
    qmin, qmax = spec.qrange
    if spec.mapping == "asymmetric":
        return _span_scale(min_val_neg, max_val_pos, float(qmax - qmin), compute)
    if spec.mapping == "symmetric_no_clipping_err":
        smin = rounded_in(min_val_neg / float(qmin), compute)
        smax = rounded_in(max_val_pos / float(qmax), compute)
        return torch.where(smin > smax, smin, smax)
    peak = torch.max(-min_val_neg, max_val_pos)
    return saturate(rounded_in(peak / (float(qmax - qmin) / 2), compute), compute)


def _kept_scale(scale, dtype):
    """`round_scale` to the scale dtype, its rounding kept under torch.compile too."""
    return rounded_in(round_scale(scale, dtype), dtype)


def _in_dtypes(values, scale, compute, scale_dtype):
    """``(values, scale, work)``: ``values`` rounded to ``compute`` (saturated to it) and ``scale``
    to ``scale_dtype``, both held in ``work``, the float32 (float64 for float64 scales) that
    torchao's ops in those dtypes compute in."""
    work = torch.promote_types(torch.float32, scale_dtype)
    values = rounded_in(saturate(values.to(work), compute), compute)
    return values, rounded_in(scale.to(work), scale_dtype), work


class TorchaoConvention(Convention):
    """torchao's ``choose_qparams_affine`` / ``quantize_affine`` family in its dtypes, and its MX, NVFP4 and
    float8 scale arithmetic; honours ``preserve_zero=False``. Equal to torchao except where its
    half-precision arithmetic overflows: there qstats saturates at the dtype's largest value.
    """

    name = "torchao"
    maps_ranges_without_zero = True
    dequantizes_in_output_dtype = True

    def validate(self, spec) -> None:
        super().validate(spec)
        if spec.zero_point_domain == "float" and spec.mapping != "asymmetric":
            # tinygemm's qparams span [min, max] whatever the mapping: a signed target's codes start at
            # quant_min, so they clipped the upper half of the range (int8: 128 steps off)
            raise ValueError(
                f"QuantSpec.zero_point_domain 'float' with convention={self.name!r} is torchao's tinygemm "
                f"(ZeroPointDomain.FLOAT), which needs mapping 'asymmetric' (MappingType.ASYMMETRIC) and an "
                f"unsigned target; got mapping {spec.mapping!r}"
            )
        if isinstance(spec.granularity, PerBlock) and spec.granularity.partial:
            raise ValueError("convention='torchao': PerBlock(partial=True) is not torchao's: its block size must "
                             "divide the tensor (_get_reduction_params asserts it)")
        limit = torch.finfo(getattr(torch, spec.compute_dtype)).max
        if not spec.is_float and max(-spec.qrange[0], spec.qrange[1]) > limit:
            # torchao clamps the codes to quant_min/quant_max in the input's dtype: RuntimeError
            # "value cannot be converted to type c10::Half without overflow"
            raise ValueError(
                f"convention='torchao': the range {spec.qrange} of {spec.dtype} does not fit "
                f"compute_dtype={spec.compute_dtype!r} (largest {limit:g}); torchao's quantize_affine "
                "fails on such inputs: use input_dtype=torch.float32 / bfloat16 or a narrower quant_min/quant_max"
            )

    def check_lsq(self, spec) -> None:
        if spec.zero_point_domain == "float":
            raise ValueError(
                "lsq: spec.zero_point_domain='float' with spec.convention='torchao' puts the zero point in "
                "the input's units (x = (q - mid_point) * scale + zero_point); learnable ranges need "
                "convention='torch_ao' (a float zero point in code units) or zero_point_domain='int'"
            )

    def qparams(self, min_val, max_val, spec):
        """``(scale, zero_point)`` as torchao's ``choose_qparams_affine`` (INT/NONE domains), its
        ``dont_preserve_zero`` or ``tinygemm`` (FLOAT domain) variants, operation by operation in
        ``spec.compute_dtype``; float32 extremes past a bf16/fp16 compute dtype saturate to it.
        """
        compute, scale_dtype = _dtypes(spec)
        if spec.is_float:  # _choose_scale_float8: amax / max in the input's dtype, held as scale_dtype
            scale, zero_point = super().qparams(min_val, max_val, spec)
            return rounded_in(scale, scale_dtype), zero_point
        # float32 arithmetic, each result rounded to ``compute`` as torchao's ops in it round
        min_val, max_val = (rounded_in(saturate(t, compute), compute) for t in (min_val, max_val))
        qmin, qmax = spec.qrange
        if spec.zero_point_domain == "float":
            scale = rounded_in(torch.clamp(_span_scale(min_val, max_val, float(qmax - qmin), compute), min=spec.eps),
                               compute)
            zero_point = rounded_in(min_val + rounded_in(scale * ((qmax + qmin + 1) / 2), compute), compute)
            return _kept_scale(scale, scale_dtype), saturate(zero_point, compute)
        if spec.preserve_zero:
            min_val = torch.min(min_val, torch.zeros_like(min_val))
            max_val = torch.max(max_val, torch.zeros_like(max_val))
        scale = rounded_in(torch.clamp(_affine_scale(min_val, max_val, spec, compute), min=spec.eps), compute)
        if spec.mapping == "asymmetric":
            codes = torch.round(rounded_in(min_val / scale, compute))
            zero_point = torch.clamp(rounded_in(qmin - codes, compute), qmin, qmax)
        else:
            zero_point = torch.full_like(scale, spec.zero_point_of_symmetric)
        # clamped again as an integer: a bf16/fp16 clamp rounds a wide target's quant_max up (32767
        # to 32768 in bfloat16), a zero point outside the range that quantize refuses
        zero_point = rounded_in(zero_point, compute).to(torch.int32).clamp(qmin, qmax)
        if spec.zero_point_domain == "none":
            zero_point = torch.zeros_like(zero_point)
        return _kept_scale(scale, scale_dtype), zero_point

    def codes(self, view, scale, zero_point, spec):
        """torchao's ``_quantize_affine*_no_dtype_cast`` in its dtypes: the input in
        ``compute_dtype`` (saturated to it), the scale in ``scale_dtype`` (float32 results,
        integer-valued)."""
        if not _own_arithmetic(spec):
            unclamped, codes = super().codes(view, scale, zero_point, spec)
            if spec.is_float or spec.zero_point_domain != "none":
                return unclamped, codes
            # no zero point added (ZeroPointDomain.NONE): a zero code keeps the sign of its input
            # (torchao's round(-0.0 * (1 / scale)) is -0.0, dequantized to -0.0)
            unclamped = torch.copysign(unclamped, view.to(unclamped.dtype))
            return unclamped, unclamped.clamp(*spec.qrange)
        compute, scale_dtype = _dtypes(spec)
        view, scale, work = _in_dtypes(view, scale, compute, scale_dtype)
        promoted = torch.promote_types(compute, scale_dtype)  # the dtype of torchao's results

        def rounded(t):
            return rounded_in(t, promoted)

        qmin, qmax = spec.qrange
        if spec.zero_point_domain == "float":
            mid = rounded_in(scale * ((qmax + qmin + 1) / 2), scale_dtype)
            min_val = saturate(rounded(rounded_in(zero_point.to(work), compute) - mid), compute)
            unclamped = torch.round(rounded(rounded(view - min_val) / scale))
        else:
            scaled = rounded(view * rounded_in(1.0 / scale, scale_dtype))
            if scale_dtype == torch.float16:
                # a float16 scale below 2**-16 (torchao's float32 eps is one) has an infinite
                # reciprocal: torchao's 0 * Inf is NaN there; qstats maps a zero to the zero point's
                # code (no other scale dtype's reciprocal overflows: scales are at least eps)
                scaled = torch.where(view == 0, view * 0, scaled)
            unclamped = torch.round(scaled)
            if spec.zero_point_domain != "none":
                unclamped = rounded(unclamped + zero_point)
        return unclamped.float(), rounded(unclamped.clamp(qmin, qmax)).float()

    def dequantize(self, codes, scale, zero_point, spec):
        """torchao's ``_dequantize_affine*`` with ``output_dtype = compute_dtype`` (as its fake quantization):
        formed exactly in float32/float64, saturated, then rounded to ``compute_dtype``.
        """
        if not _own_arithmetic(spec):
            return super().dequantize(codes, scale, zero_point, spec)
        compute, scale_dtype = _dtypes(spec)
        codes, scale, work = _in_dtypes(codes, scale, compute, scale_dtype)

        def rounded(t):
            return rounded_in(saturate(t, compute), compute)

        if spec.zero_point_domain == "float":
            qmin, qmax = spec.qrange
            dequant = rounded(rounded(codes - (qmax + qmin + 1) / 2) * scale)
            # torchao's in-place sum into the compute (output) dtype: PyTorch forms it in float32 with
            # the zero point as stored (a float32 one is not rounded to a bf16 output first), rounded once
            return rounded(dequant.float() + zero_point.float()).float()
        if spec.zero_point_domain != "none":
            codes = rounded(codes - rounded_in(zero_point.to(work), compute))
        return rounded(codes * scale).float()

    def e8m0_scale(self, amax, spec):
        """Float8 ``float8_e8m0fnu`` scales (``"round"``) of bf16/fp16 inputs as torchao's
        ``_choose_scale_float8``: ``exp2(round(log2(amax / max)))`` with every step in the input's
        dtype (its log2 rounds to it, moving ties); exponents past the e8m0 range saturate, and a
        quotient that underflows to 0 for a nonzero amax is the dtype's smallest subnormal."""
        compute = getattr(torch, spec.compute_dtype)
        if not spec.is_float or spec.scale_rounding != "round" or compute == torch.float32:
            return super().e8m0_scale(amax, spec)
        amax = saturate(amax.float(), compute).to(compute)
        descale = amax / float(spec.float_format.max)
        # a nonzero amax whose quotient underflows to 0 (fp16 below 448 * 2**-25): torchao's scale
        # is 0 (NaN values); qstats' is the dtype's smallest subnormal, as for float32 scales
        smallest = torch.finfo(compute).tiny * torch.finfo(compute).eps
        descale = torch.where((amax > 0) & (descale == 0), torch.full_like(descale, smallest), descale)
        return e8m0_to_float(biased_exponent(torch.round(torch.log2(descale)), spec))

    def block_scaled(self, view, scale, spec):
        """MX (``to_mx``): RCEIL multiplies by the reciprocal (1 for the smallest scale), the
        other modes divide by the scale raised to the smallest normal float32; NVFP4 block scales
        and float8 e8m0 scales (``"round"``) multiply by the reciprocal."""
        if spec.scale_dtype == "e8m0" and spec.scale_rounding == "rceil":
            return view * torch.where(scale == E8M0_MIN, torch.ones_like(scale), 1.0 / scale)
        if spec.scale_dtype == "e8m0" and spec.scale_rounding != "round":
            return view / torch.clamp(scale, min=_FLOAT32_MIN_NORMAL)
        return view * (1.0 / scale)
