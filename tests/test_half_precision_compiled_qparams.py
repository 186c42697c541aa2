"""bf16/fp16 qparams and fake-quantized values under ``torch.compile`` (inductor's defaults: no
``emulate_precision_casts``) against the reference libraries' eager arithmetic in those dtypes:
torchao's ``choose_qparams_affine`` / ``quantize_affine`` / ``dequantize_affine`` and
``Float8Tensor``, compressed-tensors' ``calculate_qparams`` / ``fake_quantize`` (through
llm-compressor's observer), and coreai_opt's ``StaticQParamsCalculator``. Inductor keeps float32
between fused ops, so each half-precision step must round by itself."""

import warnings

import pytest
import torch

import qstats

warnings.filterwarnings("ignore")

qp_lib = pytest.importorskip("torchao.quantization.quant_primitives")
MappingType, ZeroPointDomain = qp_lib.MappingType, qp_lib.ZeroPointDomain


def _weight(dtype):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(32, 256, generator=g) * torch.rand(32, 1, generator=g) * 0.1 + 0.003 * torch.rand(32, 1, generator=g)
    return w.to(dtype)


def _compiled(spec, w):
    """``(scale, zero_point, fake-quantized w)`` of a compiled minmax observation of ``w``."""
    def run(x):
        observer = qstats.minmax(spec)
        qp = qstats.compute_qparams(observer.update(observer.init(x), x), spec)
        return qp.scale, qp.zero_point, qstats.fake_quantize(x, qp, spec)

    torch.compiler.reset()
    try:
        return torch.compile(run, fullgraph=True)(w)
    finally:
        torch.compiler.reset()


def _assert_equal(ours, scale, zero_point, values):
    assert torch.equal(ours[0].reshape(scale.shape), scale.float())
    if zero_point is not None:
        assert torch.equal(ours[1].reshape(zero_point.shape).float(), zero_point.float())
    assert torch.equal(ours[2], values)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("target, mapping, group", [(torch.int8, MappingType.SYMMETRIC, 256),
                                                    (torch.int4, MappingType.ASYMMETRIC, 32)], ids=str)
def test_torchao_affine_compiled_equals_torchao(dtype, target, mapping, group):
    w = _weight(dtype)
    block = (1, group)
    scale, zero_point = qp_lib.choose_qparams_affine(w, mapping, block, target)
    qmin, qmax = qp_lib._DTYPE_TO_QVALUE_BOUNDS[target]
    codes = qp_lib._quantize_affine_no_dtype_cast(w, block, scale, zero_point, qmin, qmax)
    values = qp_lib._dequantize_affine_no_dtype_check(codes, block, scale, zero_point, qmin, qmax, dtype)
    spec = qstats.QuantSpec.from_torchao(target, mapping_type=mapping, block_size=block, shape=w.shape, input_dtype=dtype)
    _assert_equal(_compiled(spec, w), scale, zero_point, values)


def test_torchao_tinygemm_compiled_equals_torchao():
    """uint4, ZeroPointDomain.FLOAT, groups of 32 on a bf16 weight (Int4WeightOnlyConfig's arithmetic)."""
    w = _weight(torch.bfloat16)
    mapping, block = MappingType.ASYMMETRIC, (1, 32)
    scale, zero_point = qp_lib._choose_qparams_affine_tinygemm(w, mapping, block, torch.uint4)
    codes = qp_lib._quantize_affine_tinygemm_no_dtype_cast(w, block, scale, zero_point, 0, 15)
    values = qp_lib._dequantize_affine_tinygemm_no_dtype_check(codes, block, scale, zero_point, 0, 15, torch.bfloat16)
    spec = qstats.QuantSpec.from_torchao(torch.uint4, mapping_type=mapping, zero_point_domain=ZeroPointDomain.FLOAT,
                                         granularity=qstats.PerGroup(32), input_dtype=torch.bfloat16)
    _assert_equal(_compiled(spec, w), scale, zero_point, values)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
def test_torchao_float8_compiled_equals_float8_tensor(dtype):
    float8 = pytest.importorskip("torchao.quantization.quantize_.workflows.float8.float8_tensor")
    from torchao.quantization.granularity import PerRow

    w = _weight(dtype)
    config = float8.QuantizeTensorToFloat8Kwargs(float8_dtype=torch.float8_e4m3fn, granularity=PerRow())
    reference = float8.Float8Tensor.from_hp(w, float8_dtype=torch.float8_e4m3fn, granularity=PerRow())
    spec = qstats.QuantSpec.from_torchao(config, input_dtype=dtype)
    _assert_equal(_compiled(spec, w), reference.scale, None, reference.dequantize())


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("fields", [dict(num_bits=8, type="int", symmetric=True, strategy="channel"),
                                    dict(num_bits=4, type="int", symmetric=False, strategy="group", group_size=32),
                                    dict(num_bits=8, type="float", symmetric=True, strategy="channel")], ids=str)
def test_compressed_tensors_compiled_equals_compressed_tensors(dtype, fields):
    ct_quantization = pytest.importorskip("compressed_tensors.quantization")
    ct_forward = pytest.importorskip("compressed_tensors.quantization.lifecycle.forward")
    observers = pytest.importorskip("llmcompressor.observers")
    w = _weight(dtype)
    args = ct_quantization.QuantizationArgs(**fields)
    observer = observers.Observer.load_from_registry("memoryless_minmax", base_name="weight", args=args)
    observer(w)
    qparams = observer.get_qparams()
    scale, zero_point = qparams["scale"], qparams["zero_point"]
    values = ct_forward.fake_quantize(w, scale, None if args.symmetric else zero_point, args).to(dtype)
    spec = qstats.QuantSpec.from_compressed_tensors(args, observed_dtype=dtype)
    _assert_equal(_compiled(spec, w), scale, zero_point, values)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
def test_coreai_opt_static_calculator_compiled(dtype):
    """coreai_opt's qparams are torchao's arithmetic of its range in the input's dtype."""
    spec_lib = pytest.importorskip("coreai_opt.quantization.spec.spec")
    from coreai_opt.config.spec import CompressionTargetTensor
    from coreai_opt.quantization.spec.factory import QuantizationComponentFactory

    w = _weight(dtype)
    coreai_spec = spec_lib.QuantizationSpec(dtype=torch.int4, qscheme="asymmetric", qparam_calculator_cls="static",
                                            granularity={"type": "per_block", "axis": 1, "block_size": 32})
    calculator = QuantizationComponentFactory.create_qparams_calculator(coreai_spec, CompressionTargetTensor.WEIGHT)
    scale, zero_point, _ = calculator(w)
    spec = qstats.QuantSpec.from_coreai_opt(coreai_spec, shape=w.shape, input_dtype=dtype)
    compiled = _compiled(spec, w)
    assert torch.equal(compiled[0].reshape(scale.shape), scale.float())
    assert torch.equal(compiled[1].reshape(zero_point.shape), zero_point)
