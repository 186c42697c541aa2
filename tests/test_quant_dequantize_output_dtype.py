"""`dequantize`'s output ``dtype``: floating-point dtypes only, as torchao's ``dequantize_affine``
(an integer dtype truncated every value; a dtype's name failed with AttributeError)."""

import warnings

import pytest
import torch

import qstats

warnings.filterwarnings("ignore")


def _int8_codes():
    from torchao.quantization.quant_primitives import MappingType

    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(0)) * 3
    spec = qstats.QuantSpec.from_torchao(torch.int8, mapping_type=MappingType.ASYMMETRIC)
    obs = qstats.minmax(spec)
    qp = qstats.compute_qparams(obs.update(obs.init(x), x), spec)
    return x, spec, qp, qstats.quantize(x, qp, spec)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16), ids=str)
def test_floating_output_dtypes_equal_torchao_dequantize_affine(dtype):
    from torchao.quantization.quant_primitives import dequantize_affine

    x, spec, qp, codes = _int8_codes()
    reference = dequantize_affine(codes, x.shape, qp.scale, qp.zero_point, torch.int8, output_dtype=dtype)
    assert torch.equal(qstats.dequantize(codes, qp, spec, dtype=dtype), reference)


@pytest.mark.parametrize("dtype", (torch.int32, torch.int8, torch.uint8, torch.bool, torch.complex64, "float32"), ids=str)
def test_non_floating_output_dtypes_are_refused(dtype):
    from torchao.quantization.quant_primitives import dequantize_affine

    x, spec, qp, codes = _int8_codes()
    if isinstance(dtype, torch.dtype):
        with pytest.raises(AssertionError, match="Unsupported output dtype"):
            dequantize_affine(codes, x.shape, qp.scale, qp.zero_point, torch.int8, output_dtype=dtype)
    with pytest.raises(TypeError, match="dequantize: dtype must be a floating-point torch dtype"):
        qstats.dequantize(codes, qp, spec, dtype=dtype)


def test_float64_output_keeps_float64_arithmetic():
    x, spec, qp, codes = _int8_codes()
    expected = (codes.double() - qp.zero_point.double()) * qp.scale.double()
    assert torch.equal(qstats.dequantize(codes, qp, spec, dtype=torch.float64), expected)


HALF_AND_SINGLE = (torch.float32, torch.bfloat16, torch.float16)


@pytest.mark.parametrize("output_dtype", HALF_AND_SINGLE, ids=str)
@pytest.mark.parametrize("input_dtype", HALF_AND_SINGLE, ids=str)
@pytest.mark.parametrize("case", ["int8-symmetric", "uint4-asymmetric", "uint4-tinygemm"])
def test_output_dtypes_other_than_the_inputs_compute_as_dequantize_affine(case, input_dtype, output_dtype):
    """torchao's ``dequantize_affine(output_dtype=...)`` (and its tinygemm one) computes in the output
    dtype: bf16-observed codes asked for in float32 are formed in float32, float32-observed ones asked
    for in bf16 round each step to bf16. qstats computed in the input's dtype and cast the result (up to
    231 of 256 values one bf16/fp16 step off)."""
    from torchao.quantization import granularity as tao_granularity
    from torchao.quantization import quant_primitives as qp_lib

    target, mapping, domain = {
        "int8-symmetric": (torch.int8, qp_lib.MappingType.SYMMETRIC, qp_lib.ZeroPointDomain.INT),
        "uint4-asymmetric": (torch.uint4, qp_lib.MappingType.ASYMMETRIC, qp_lib.ZeroPointDomain.INT),
        "uint4-tinygemm": (torch.uint4, qp_lib.MappingType.ASYMMETRIC, qp_lib.ZeroPointDomain.FLOAT),
    }[case]
    x = (torch.randn(4, 64, generator=torch.Generator().manual_seed(0)) * 3).to(input_dtype)
    block_size = (1, 32)
    spec = qstats.QuantSpec.from_torchao(target, mapping_type=mapping, zero_point_domain=domain,
                                         granularity=tao_granularity.PerGroup(32), shape=tuple(x.shape),
                                         input_dtype=input_dtype)
    obs = qstats.minmax(spec)
    qp = qstats.compute_qparams(obs.update(obs.init(x), x), spec)
    tinygemm = domain == qp_lib.ZeroPointDomain.FLOAT
    choose = qp_lib._choose_qparams_affine_tinygemm if tinygemm else qp_lib.choose_qparams_affine
    scale, zero_point = choose(x, mapping, block_size, target)
    assert torch.equal(qp.scale.reshape(scale.shape), scale.float())
    codes = qstats.quantize(x, qp, spec)
    qmin, qmax = spec.qrange
    if tinygemm:
        reference = qp_lib._dequantize_affine_tinygemm_no_dtype_check(
            codes.to(torch.int32), block_size, scale, zero_point, qmin, qmax, output_dtype)
    else:
        reference = qp_lib._dequantize_affine_no_dtype_check(
            codes.to(torch.int32), block_size, scale, zero_point, qmin, qmax, output_dtype)
    ours = qstats.dequantize(codes, qp, spec, dtype=output_dtype)
    assert ours.dtype == reference.dtype == output_dtype
    assert torch.equal(ours, reference)
