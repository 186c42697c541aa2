"""coreai_opt: `QuantSpec.from_coreai_opt`'s ``target`` and ``input_dtype`` arguments.

Reference: Apple coreai_opt 0.4.0's ``QuantizationComponentFactory.create_qparams_calculator``
with its own ``CompressionTargetTensor`` and ``PerBlockGranularity.get_block_size``.
"""

import warnings

import pytest
import torch

import qstats
import qstats.coreai_opt

warnings.filterwarnings("ignore")

spec_lib = pytest.importorskip("coreai_opt.quantization.spec.spec")
from coreai_opt.config.spec import CompressionTargetTensor  # noqa: E402
from coreai_opt.quantization.spec.factory import QuantizationComponentFactory  # noqa: E402

QuantizationSpec = spec_lib.QuantizationSpec
CONV_WEIGHT = torch.randn(8, 6, 3, 3, generator=torch.Generator().manual_seed(0))
PER_BLOCK = {"type": "per_block", "axis": 1, "block_size": 3}


@pytest.mark.parametrize("target", [CompressionTargetTensor.WEIGHT, CompressionTargetTensor.ACTIVATION], ids=str)
def test_coreai_opts_own_target_enum_is_its_target(target):
    """coreai_opt's CompressionTargetTensor is a plain Enum (WEIGHT != "weight"): it was read as
    an activation, so a conv weight's per-block scales came out per kernel position (8, 2, 3, 3)
    where coreai_opt's are per block (8, 2, 1, 1)."""
    coreai_spec = QuantizationSpec(dtype=torch.int4, qscheme="asymmetric", granularity=PER_BLOCK,
                                   qparam_calculator_cls="static")
    scale, zero_point, minval = QuantizationComponentFactory.create_qparams_calculator(coreai_spec, target)(CONV_WEIGHT)
    granularity = spec_lib.QuantizationSpec(granularity=PER_BLOCK).granularity
    assert qstats.coreai_opt.block_size(PER_BLOCK, CONV_WEIGHT.shape, target) == granularity.get_block_size(
        CONV_WEIGHT.shape, target)

    spec = qstats.QuantSpec.from_coreai_opt(coreai_spec, shape=CONV_WEIGHT.shape, target=target)
    obs = qstats.memoryless_minmax(spec)
    qp = qstats.compute_qparams(obs.update(obs.init(CONV_WEIGHT), CONV_WEIGHT), spec)
    assert qp.scale.numel() == scale.numel()
    assert torch.equal(qp.scale.reshape(scale.shape), scale)
    assert torch.equal(qp.zero_point.reshape(zero_point.shape), zero_point)
    assert torch.equal(qp.minval.reshape(minval.shape), minval)


@pytest.mark.parametrize("target", ["weights", "Weight", "act", None, CompressionTargetTensor.LUT], ids=str)
def test_a_misspelled_target_is_refused_not_read_as_activation(target):
    with pytest.raises(ValueError, match="target must be 'weight' or 'activation'"):
        qstats.QuantSpec.from_coreai_opt(granularity=PER_BLOCK, shape=CONV_WEIGHT.shape, target=target)
    with pytest.raises(ValueError, match="target must be 'weight' or 'activation'"):
        qstats.coreai_opt.block_size(PER_BLOCK, CONV_WEIGHT.shape, target)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_an_input_dtype_without_a_qstats_path_is_named_as_from_coreai_opts(dtype):
    with pytest.raises(ValueError, match="from_coreai_opt: input_dtype must be"):
        qstats.QuantSpec.from_coreai_opt(dtype=dtype, input_dtype=torch.float64)


DTYPES = [torch.int1, torch.int2, torch.int3, torch.int4, torch.int5, torch.int6, torch.int7, torch.int8, torch.int16,
          torch.int32, torch.uint1, torch.uint2, torch.uint3, torch.uint4, torch.uint5, torch.uint6, torch.uint7,
          torch.uint8, torch.uint16, torch.float8_e4m3fn, torch.float8_e5m2, torch.float4_e2m1fn_x2, torch.float16,
          "int3", "int16", "float8_e4m3", "float4_e2m1fn"]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dtypes_are_coreai_opts_supported_dtypes(dtype):
    """A dtype coreai_opt's QuantizationSpec refuses (int16, int3, uint7, ...) was taken as a
    torchao target, a spec with no coreai_opt counterpart; it is refused, naming coreai_opt's."""
    try:
        QuantizationSpec(dtype=dtype)
    except ValueError:
        with pytest.raises(ValueError, match="is not one of coreai_opt's"):
            qstats.QuantSpec.from_coreai_opt(dtype=dtype)
    else:
        qstats.QuantSpec.from_coreai_opt(dtype=dtype)


def _qparams_pair(coreai_spec, x, float_range):
    scale, zero_point, minval = QuantizationComponentFactory.create_qparams_calculator(
        coreai_spec, CompressionTargetTensor.WEIGHT)(x)
    spec = qstats.QuantSpec.from_coreai_opt(coreai_spec, shape=x.shape, input_dtype=x.dtype)
    obs = qstats.memoryless_minmax(spec)
    qp = qstats.compute_qparams(obs.update(obs.init(x), x), spec, float_range=float_range)
    return qp, (scale, zero_point, minval)


def _equal(ours, theirs):
    """Exactly equal values (coreai_opt's bf16/fp16 qparams are qstats' float32 ones)."""
    return theirs is None or torch.equal(ours.reshape(theirs.shape).double(), theirs.double())


@pytest.mark.parametrize("float_range", [(-0.3, None), (None, 0.7), (None, 1.99999), (-1.9999999, None)], ids=str)
@pytest.mark.parametrize("input_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("dtype,scale_dtype", [(torch.int8, torch.float8_e8m0fnu), (torch.float8_e4m3fn, None),
                                               (torch.float8_e4m3fn, torch.float8_e8m0fnu),
                                               (torch.float4_e2m1fn_x2, None)], ids=str)
def test_a_pinned_end_rounds_to_the_inputs_dtype_for_float_and_e8m0_targets(dtype, scale_dtype, input_dtype, float_range):
    """With one float_range end pinned coreai_opt casts the range to the input's dtype before the
    scale: qstats took the float32 end for float targets (fp8 fp16: scale of (-0.3, None) 6.6948e-4,
    coreai_opt's 6.6996e-4) and e8m0 scales (int8 bf16: minval -0.3, coreai_opt's -0.30078125;
    an end of 1.99999 rounds to 2.0 in bf16, an exponent up)."""
    x = (torch.randn(4, 8, generator=torch.Generator().manual_seed(1)) * 0.01).to(input_dtype)
    coreai_spec = QuantizationSpec(dtype=dtype, qscheme="symmetric", granularity={"type": "per_channel", "axis": 0},
                                   float_range=list(float_range), qparam_calculator_cls="static", scale_dtype=scale_dtype)
    qp, (scale, zero_point, minval) = _qparams_pair(coreai_spec, x, float_range)
    assert _equal(qp.scale, scale)
    assert _equal(qp.zero_point, zero_point) and _equal(qp.minval, minval)


def test_minval_fake_quantization_refuses_e8m0_scales_as_coreai_opt():
    """coreai_opt refuses qformulation="minval" with an e8m0 scale; fake_quantize_minval took it."""
    with pytest.raises(ValueError, match="zero-point quantization formulation"):
        QuantizationSpec(dtype=torch.int8, scale_dtype=torch.float8_e8m0fnu, qformulation="minval")
    spec = qstats.QuantSpec.from_coreai_opt(dtype=torch.int8, scale_dtype=torch.float8_e8m0fnu)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
    obs = qstats.minmax(spec)
    qp = qstats.compute_qparams(obs.update(obs.init(x), x), spec)
    with pytest.raises(ValueError, match="without e8m0 scales"):
        qstats.coreai_opt.fake_quantize_minval(x, qp, spec)
