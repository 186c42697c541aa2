"""`QuantSpec(dtype=torch.int4)` and torch's other sub-byte integer dtypes (int1...int7, uint1...uint7),
the targets torchao and coreai_opt name: their ranges are torchao's, and their qparams and codes equal
the spec named by the string."""

import warnings

import pytest
import torch

import qstats

warnings.filterwarnings("ignore")

SUB_BYTE = [getattr(torch, f"{kind}{bits}") for kind in ("int", "uint") for bits in range(1, 8)]


@pytest.mark.parametrize("dtype", SUB_BYTE, ids=str)
def test_sub_byte_torch_dtypes_are_targets_with_torchao_ranges(dtype):
    from torchao.quantization.quant_primitives import _DTYPE_TO_QVALUE_BOUNDS

    spec = qstats.QuantSpec(dtype=dtype, mapping="asymmetric")
    assert spec.qrange == _DTYPE_TO_QVALUE_BOUNDS[dtype]
    assert spec == qstats.QuantSpec(dtype=str(dtype).replace("torch.", ""), mapping="asymmetric")


@pytest.mark.parametrize("dtype", [torch.int4, torch.uint4, torch.int2], ids=str)
def test_sub_byte_torch_dtype_codes_equal_torchao_quantize_affine(dtype):
    from torchao.quantization.quant_primitives import MappingType, choose_qparams_affine, quantize_affine

    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    spec = qstats.QuantSpec(dtype=dtype, mapping="asymmetric", granularity=qstats.PerGroup(32), convention="torchao",
                            eps=torch.finfo(torch.float32).smallest_normal)
    obs = qstats.minmax(spec)
    qp = qstats.compute_qparams(obs.update(obs.init(x), x), spec)
    scale, zero_point = choose_qparams_affine(x, MappingType.ASYMMETRIC, (1, 32), dtype)
    assert torch.equal(qp.scale, scale) and torch.equal(qp.zero_point, zero_point.reshape(qp.zero_point.shape))
    # torch.int4 tensors cannot be written to: torchao stores such codes in int8 (uint8) with the range
    storage = torch.int8 if spec.is_signed else torch.uint8
    codes = quantize_affine(x, (1, 32), scale, zero_point, storage, *spec.qrange)
    assert torch.equal(qstats.quantize(x, qp, spec).to(torch.int32), codes.to(torch.int32))


@pytest.mark.parametrize("dtype", [torch.uint32, torch.int64, torch.float8_e8m0fnu], ids=str)
def test_other_torch_dtypes_stay_refused(dtype):
    with pytest.raises(ValueError, match=str(dtype)):
        qstats.QuantSpec(dtype=dtype)
