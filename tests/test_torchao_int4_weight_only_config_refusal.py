"""`QuantSpec.from_torchao(Int4WeightOnlyConfig())` is refused (its packed layouts quantize with their own
kernels), naming the spec of each layout whose qparams qstats reproduces: tinygemm's
(``TILE_PACKED_TO_4D``, ``Int4TilePackedTo4dTensor.from_hp``) and ``PLAIN_INT32``'s
(``Int4PlainInt32Tensor``). Those layouts need CUDA / XPU, so the reference is the torchao functions they
call, with the arguments they pass, on bf16/fp16 weights of rows of zeros, constant rows and huge values."""

import warnings

import pytest
import torch

import qstats

warnings.filterwarnings("ignore")

quant_api = pytest.importorskip("torchao.quantization")
primitives = pytest.importorskip("torchao.quantization.quant_primitives")
from torchao.quantization.granularity import PerGroup  # noqa: E402
from torchao.quantization.quant_primitives import MappingType, ZeroPointDomain  # noqa: E402


def _weight(dtype):
    w = torch.randn(17, 256, generator=torch.Generator().manual_seed(0))
    # huge values within the dtype, halved: an fp16 span past 65504 is torchao's Inf scale (differences.md)
    w[0], w[1], w[2], w[3] = 0.0, 0.5, -2.0, w[3] * (1e30 if dtype == torch.bfloat16 else 1e3)
    return w.to(dtype)


def _qparams(spec, w):
    observer = qstats.minmax(spec)
    return qstats.compute_qparams(observer.update(observer.init(w), w), spec)


def test_refusal_names_the_spec_of_each_layout_it_can_give():
    with pytest.raises(ValueError, match="TILE_PACKED_TO_4D.*ZeroPointDomain.FLOAT.*PLAIN_INT32.*eps=1e-6"):
        qstats.QuantSpec.from_torchao(quant_api.Int4WeightOnlyConfig())


@pytest.mark.parametrize("group_size", (32, 128, 256))
def test_tile_packed_to_4d_spec_matches_tinygemm_arithmetic(group_size):
    w, block = _weight(torch.bfloat16), (1, group_size)
    # Int4TilePackedTo4dTensor.from_hp's calls (bf16 weights only)
    scale, zero_point = primitives._choose_qparams_affine_tinygemm(
        w, mapping_type=MappingType.ASYMMETRIC, block_size=block, target_dtype=torch.int32, quant_min=0, quant_max=15,
        scale_dtype=w.dtype, zero_point_dtype=w.dtype)
    codes = primitives._quantize_affine_tinygemm(w, block, scale, zero_point, torch.int32, quant_min=0, quant_max=15)
    values = primitives._dequantize_affine_tinygemm(codes, block, scale, zero_point, torch.int32, 0, 15, output_dtype=w.dtype)
    spec = qstats.QuantSpec.from_torchao(torch.uint4, mapping_type=MappingType.ASYMMETRIC,
                                         zero_point_domain=ZeroPointDomain.FLOAT, granularity=PerGroup(group_size),
                                         input_dtype=torch.bfloat16)
    qp = _qparams(spec, w)
    assert torch.equal(qp.scale.reshape(scale.shape), scale.float())
    assert torch.equal(qp.zero_point.reshape(zero_point.shape), zero_point.float())
    assert torch.equal(qstats.quantize(w, qp, spec).int(), codes)
    assert torch.equal(qstats.fake_quantize(w, qp, spec), values)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("group_size", (32, 256))
def test_plain_int32_spec_matches_choose_qparams_affine(dtype, group_size):
    w, block = _weight(dtype), (1, group_size)
    if dtype == torch.float16:  # fp16's 1 / eps overflows: torchao's zeros become NaN codes (differences.md)
        w[0] = 0.01
    # Int4PlainInt32Tensor.from_hp's calls
    scale, zero_point = primitives.choose_qparams_affine(w, MappingType.ASYMMETRIC, block, torch.int32, 0, 15, 1e-6,
                                                         None, torch.int32)
    codes = primitives.quantize_affine(w, block, scale, zero_point, torch.int32, 0, 15)
    values = primitives.dequantize_affine(codes, block, scale, zero_point, torch.int32, 0, 15, output_dtype=dtype)
    spec = qstats.QuantSpec.from_torchao(torch.int32, mapping_type=MappingType.ASYMMETRIC, quant_min=0, quant_max=15,
                                         eps=1e-6, granularity=PerGroup(group_size), input_dtype=dtype)
    qp = _qparams(spec, w)
    assert torch.equal(qp.scale.reshape(scale.shape), scale.float())
    assert torch.equal(qp.zero_point.reshape(zero_point.shape), zero_point)
    assert torch.equal(qstats.quantize(w, qp, spec).int(), codes)
    assert torch.equal(qstats.fake_quantize(w, qp, spec), values)
