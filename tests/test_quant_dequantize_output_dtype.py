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
