"""convention="torchao" on edge cases test_compat_torchao.py does not reach, against torchao itself.

Odd shapes (1-d, 3-d, 4-d) with every torchao granularity, negative zeros, constant rows,
subnormals and bf16/fp16 inputs; torchao's own workflows (Int4 tinygemm weight-only at group
sizes 32..256, Int8Tensor per-row activations); and the three fixes: fp16 inputs with an int32
range (torchao's quantize_affine fails), fp16 float8 e8m0 scales that underflow (torchao: 0, NaN
values) and ``QuantizeTensorToNVFP4Kwargs.use_dynamic_per_tensor_scale``.
"""

import warnings

import pytest
import torch
from _torchao_affine import torchao_affine

import qstats

warnings.filterwarnings("ignore")

qp_lib = pytest.importorskip("torchao.quantization.quant_primitives")
from torchao.quantization import granularity as G  # noqa: E402
from torchao.quantization.utils import get_block_size  # noqa: E402

MappingType, ZeroPointDomain = qp_lib.MappingType, qp_lib.ZeroPointDomain
UNSIGNED = (torch.uint1, torch.uint4, torch.uint8)


def _observe(spec, x):
    obs = qstats.minmax(spec)
    return qstats.compute_qparams(obs.update(obs.init(x), x), spec)


def _assert_matches(spec, x, target, mapping, domain, block_size, preserve_zero=True, **kwargs):
    scale, zero_point, codes, values = torchao_affine(x, target, mapping, domain, block_size, preserve_zero, **kwargs)
    qp = _observe(spec, x)
    assert torch.equal(qp.scale.reshape(scale.shape), scale.float())
    if zero_point is not None:
        assert torch.equal(qp.zero_point.reshape(zero_point.shape).to(zero_point.dtype), zero_point)
    assert torch.equal(qstats.quantize(x, qp, spec).to(torch.int64), codes.to(torch.int64))
    out = qstats.fake_quantize(x, qp, spec)
    assert out.dtype == x.dtype and torch.equal(_bits(out), _bits(values))  # the sign of zero too


def _bits(t):
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[t.dtype])


def _edge_inputs(shape, dtype):
    g = torch.Generator().manual_seed(11)
    base = torch.randn(shape, generator=g) * 2
    tiny = torch.finfo(dtype).smallest_normal
    inputs = {
        "random": base,
        "negative_zeros": torch.full(shape, -0.0),
        "mixed_negative_zeros": torch.where(base > 0, base, torch.tensor(-0.0)),
        "constant": torch.full(shape, 3.25),
        "constant_negative": torch.full(shape, -0.7),
        "subnormal": base * tiny * 0.3,
        "one_hot": torch.zeros(shape).index_fill_(-1, torch.tensor([0]), 5.0),
        "integers": torch.round(base * 10),
    }
    return {name: t.to(dtype) for name, t in inputs.items()}


AFFINE_CASES = [  # (mapping, zero-point domain, preserve_zero)
    (MappingType.SYMMETRIC, "INT", True), (MappingType.ASYMMETRIC, "INT", True),
    (MappingType.SYMMETRIC_NO_CLIPPING_ERR, "INT", True), (MappingType.SYMMETRIC, "NONE", True),
    (MappingType.ASYMMETRIC, "FLOAT", True), (MappingType.ASYMMETRIC, "INT", False),
]
SHAPES = [
    ((32,), G.PerTensor()), ((32,), G.PerGroup(8)), ((32,), G.PerRow()), ((32,), G.PerToken()),
    ((2, 3, 16), G.PerTensor()), ((2, 3, 16), G.PerGroup(8)), ((2, 3, 16), G.PerRow()), ((2, 3, 16), G.PerToken()),
    ((2, 3, 16), G.PerAxis(0)), ((2, 3, 16), G.PerAxis(1)), ((2, 3, 16), G.PerBlock((3, 8))),
    ((2, 2, 3, 8), G.PerToken()), ((2, 2, 3, 8), G.PerGroup(4)),
]


@pytest.mark.parametrize("input_dtype", (torch.float32, torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("target", (torch.int8, torch.uint8, torch.int4, torch.uint4, torch.uint1), ids=str)
def test_odd_shapes_and_edge_values_match_torchao(input_dtype, target):
    """1-d, 3-d and 4-d tensors under every torchao granularity, negative zeros, constant and one-hot
    rows, subnormals of the input dtype: qparams, codes and values equal torchao's."""
    for mapping, domain, preserve_zero in AFFINE_CASES:
        if mapping == MappingType.SYMMETRIC_NO_CLIPPING_ERR and target in UNSIGNED:
            continue  # refused (test_compat_torchao)
        if domain == "FLOAT" and target not in UNSIGNED:
            continue
        for shape, granularity in SHAPES:
            spec = qstats.QuantSpec.from_torchao(
                target, mapping_type=mapping, zero_point_domain=getattr(ZeroPointDomain, domain), granularity=granularity,
                input_dtype=input_dtype, **({} if preserve_zero else dict(preserve_zero=False)),
            )
            block_size = get_block_size(shape, granularity)
            for x in _edge_inputs(shape, input_dtype).values():
                _assert_matches(spec, x, target, mapping, domain, block_size, preserve_zero)


@pytest.mark.parametrize("group_size", (32, 64, 128, 256))
@pytest.mark.parametrize("input_dtype", (torch.bfloat16, torch.float16), ids=str)
def test_int4_weight_only_tinygemm_group_sizes(group_size, input_dtype):
    """Int4TilePackedTo4dTensor (Int4WeightOnlyConfig, tinygemm): int32 target in [0, 15],
    ZeroPointDomain.FLOAT, scales and zero points in the weight's dtype."""
    x = torch.randn(8, 512, generator=torch.Generator().manual_seed(group_size)).to(input_dtype)
    x[0, :group_size] = 0.25  # a constant group
    kwargs = dict(quant_min=0, quant_max=15, scale_dtype=input_dtype, zero_point_dtype=input_dtype)
    spec = qstats.QuantSpec.from_torchao(
        torch.int32, mapping_type=MappingType.ASYMMETRIC, zero_point_domain=ZeroPointDomain.FLOAT,
        input_dtype=input_dtype, block_size=(1, group_size), shape=x.shape, **kwargs,
    )
    _assert_matches(spec, x, torch.int32, MappingType.ASYMMETRIC, "FLOAT", (1, group_size), **kwargs)


@pytest.mark.parametrize("input_dtype", (torch.float32, torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("mapping", (MappingType.SYMMETRIC, MappingType.ASYMMETRIC), ids=lambda m: m.name)
def test_int8_tensor_per_row_activation_arguments(input_dtype, mapping):
    """Int8Tensor.from_hp's choose_qparams_affine arguments: int8 zero points, float32 scales and
    float32's eps whatever the input dtype, PerRow of a batched 3-d activation."""
    x = (torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(1)) * 3).to(input_dtype)
    x[1, 2] = 0.0
    kwargs = dict(quant_min=-128, quant_max=127, scale_dtype=torch.float32, zero_point_dtype=torch.int8,
                  eps=torch.finfo(torch.float32).eps)
    spec = qstats.QuantSpec.from_torchao(torch.int8, mapping_type=mapping, input_dtype=input_dtype,
                                         granularity=G.PerRow(), **kwargs)
    _assert_matches(spec, x, torch.int8, mapping, "INT", get_block_size(x.shape, G.PerRow()), **kwargs)


# --------------------------------------------------------------------------------------------
# fixes


def test_float16_inputs_with_an_int32_range_are_refused_as_torchao_fails():
    """torchao's quantize_affine clamps fp16 codes to int32's range and raises; qstats' quantize
    used to raise the same bare RuntimeError after calibration. Now from_torchao refuses it; a
    range that fits float16 matches torchao."""
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(2)).half()
    scale, zero_point = qp_lib.choose_qparams_affine(x, MappingType.SYMMETRIC, (1, 32), torch.int32)
    with pytest.raises(RuntimeError, match="Half"):
        qp_lib.quantize_affine(x, (1, 32), scale, zero_point, torch.int32)
    for mapping in (MappingType.SYMMETRIC, MappingType.ASYMMETRIC):
        with pytest.raises(ValueError, match="float16"):
            qstats.QuantSpec.from_torchao(torch.int32, mapping_type=mapping, input_dtype=torch.float16)
    with pytest.raises(ValueError, match="float16"):
        qstats.QuantSpec(dtype="int32", convention="torchao", compute_dtype="float16")
    for mapping in (MappingType.SYMMETRIC, MappingType.ASYMMETRIC):
        kwargs = dict(quant_min=-1000, quant_max=1000)
        spec = qstats.QuantSpec.from_torchao(torch.int32, mapping_type=mapping, input_dtype=torch.float16,
                                             granularity=G.PerRow(), **kwargs)
        _assert_matches(spec, x, torch.int32, mapping, "INT", (1, 32), **kwargs)


@pytest.mark.parametrize("float8_dtype", (torch.float8_e4m3fn, torch.float8_e5m2), ids=str)
def test_float16_e8m0_scale_that_underflows_is_the_smallest_subnormal(float8_dtype):
    """fp16 rows whose ``amax / max`` underflows to 0 in fp16: torchao's e8m0 scale is 0 and its
    values NaN; qstats' scale used to be 2**-127, which clamps every code to the element maximum
    and flushes the row to 0. It is now fp16's smallest subnormal (as qstats' float32 scales of
    such rows): the values are torchao's quantize/dequantize at that scale, other rows torchao's."""
    x = torch.tensor([[1e-6, -5e-7, 2e-7, 0.0], [1.0, 0.5, -0.25, 0.1], [3e-5, 1e-5, -2e-5, 0.0],
                      [0.0, -0.0, 0.0, 0.0]]).half()
    e8m0 = torch.float8_e8m0fnu
    theirs = qp_lib._choose_scale_float8(x, [1, 4], float8_dtype, e8m0)
    assert theirs[0] == 0 and torch.isnan(qp_lib._dequantize_affine_float8(
        qp_lib._quantize_affine_float8(x, theirs, float8_dtype), theirs, torch.float16)[0]).any()
    underflow = (theirs == 0) & (x.abs().amax(-1, keepdim=True) > 0)  # row 0 (e5m2: row 2 too)
    expected = torch.where(underflow, torch.finfo(torch.float16).tiny * torch.finfo(torch.float16).eps, theirs)  # 2**-24
    spec = qstats.QuantSpec.from_torchao(float8_dtype, granularity=G.PerRow(), scale_dtype=e8m0, input_dtype=torch.float16)
    qp = _observe(spec, x)
    assert torch.equal(qp.scale.reshape(-1)[:3], expected.reshape(-1)[:3])
    assert qp.scale.reshape(-1)[3] > 0  # an all-zero row keeps a positive scale
    values = qp_lib._dequantize_affine_float8(qp_lib._quantize_affine_float8(x[:3], expected[:3], float8_dtype),
                                              expected[:3], torch.float16)
    out = qstats.fake_quantize(x, qp, spec)
    assert torch.equal(out[:3], values) and (out[0, :3] != 0).all() and torch.isfinite(out).all()
    assert torch.equal(out[3], torch.zeros(4, dtype=torch.float16))


@pytest.mark.parametrize("dynamic", (False, True))
def test_nvfp4_kwargs_object_reads_use_dynamic_per_tensor_scale(dynamic):
    """``QuantizeTensorToNVFP4Kwargs(use_dynamic_per_tensor_scale=...)``: torchao's NVFP4 linear
    quantizes activations with ``per_tensor_amax_to_scale(amax)`` when True, with block scales only
    when False (its default) and no static scale. from_torchao used to give two-level scales for both."""
    from torchao.prototype.mx_formats.kernels import unpack_uint4
    from torchao.prototype.mx_formats.nvfp4_tensor import (
        NVFP4Tensor,
        QuantizeTensorToNVFP4Kwargs,
        nvfp4_quantize,
        per_tensor_amax_to_scale,
    )

    config = QuantizeTensorToNVFP4Kwargs(use_dynamic_per_tensor_scale=dynamic)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(3)) * 3
    per_tensor_scale = per_tensor_amax_to_scale(torch.max(torch.abs(x))) if config.use_dynamic_per_tensor_scale else None
    block_scales, packed = nvfp4_quantize(x, config.block_size, per_tensor_scale)
    reference = NVFP4Tensor.to_nvfp4(x, block_size=config.block_size, per_tensor_scale=per_tensor_scale)
    spec = qstats.QuantSpec.from_torchao(config)
    qp = _observe(spec, x)
    assert torch.equal(qp.scale, block_scales.float())
    assert torch.equal(qstats.quantize(x, qp, spec), unpack_uint4(packed).reshape(x.shape))
    assert torch.equal(qstats.fake_quantize(x, qp, spec), reference.dequantize(torch.float32))
    # a static (calibrated) per-tensor scale: per_tensor_scale=True
    assert isinstance(qstats.QuantSpec.from_torchao(config, per_tensor_scale=True).granularity, qstats.TensorGroup)


@pytest.mark.parametrize("input_dtype", (torch.float32, torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("target", (torch.int8, torch.uint8, torch.uint4), ids=str)
def test_zero_point_domain_none_keeps_negative_zeros(input_dtype, target):
    """ZeroPointDomain.NONE adds no zero point: torchao's fake quantization maps -0.0 and small
    negatives to -0.0. qstats' float32 arithmetic added a zero point of 0 (-0.0 + 0 = +0.0), and
    its float16-scale guard replaced zeros by +0.0."""
    x = torch.tensor([[-0.0, 0.0, 1.0, -1.0, -1e-9, 1e-9, -0.0, 2.0]]).to(input_dtype)
    mapping = MappingType.SYMMETRIC
    scale, _ = qp_lib.choose_qparams_affine(x, mapping, (1, 8), target)
    qmin, qmax = qp_lib._get_and_check_qmin_qmax(target, None, None)
    _, values = qp_lib._do_fake_quantize_affine(x, (1, 8), scale, None, target, qmin, qmax,
                                                zero_point_domain=ZeroPointDomain.NONE)
    assert torch.signbit(values[0, 0])
    spec = qstats.QuantSpec.from_torchao(target, mapping_type=mapping, zero_point_domain=ZeroPointDomain.NONE,
                                         input_dtype=input_dtype)
    out = qstats.fake_quantize(x, _observe(spec, x), spec)
    assert torch.equal(_bits(out), _bits(values))
