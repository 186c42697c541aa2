"""`QuantSpec.from_torchao` of torchao's weight-only ``quantize_`` configs (``Int8WeightOnlyConfig``,
``Float8WeightOnlyConfig``, ``IntxWeightOnlyConfig``) against the weights ``quantize_`` leaves on a
Linear or Conv2d: scales, zero points, codes and dequantized values; other configs are refused,
naming what to pass instead."""

import warnings

import pytest
import torch

import qstats

warnings.filterwarnings("ignore")

quant_api = pytest.importorskip("torchao.quantization")
from torchao.quantization.granularity import PerAxis, PerGroup, PerRow, PerTensor  # noqa: E402
from torchao.quantization.quant_primitives import MappingType  # noqa: E402

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _quantized(module, config, dtype):
    """``module`` in ``dtype``, its float weight, and the tensor ``quantize_(module, config)`` left."""
    module = module.to(dtype)
    weight = module.weight.detach().clone()
    quant_api.quantize_(module, config, filter_fn=lambda m, name: True)
    return weight, module.weight


def _qparams(spec, w):
    observer = qstats.minmax(spec)
    return qstats.compute_qparams(observer.update(observer.init(w), w), spec)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("granularity", (PerRow(), PerTensor(), PerGroup(32)), ids=repr)
def test_int8_weight_only_config_matches_quantize(dtype, granularity):
    torch.manual_seed(0)
    config = quant_api.Int8WeightOnlyConfig(granularity=granularity)
    w, reference = _quantized(torch.nn.Linear(64, 16), config, dtype)
    spec = qstats.QuantSpec.from_torchao(config, input_dtype=dtype)
    qp = _qparams(spec, w)
    assert torch.equal(qp.scale.reshape(reference.scale.shape), reference.scale)
    assert torch.equal(qstats.quantize(w, qp, spec).to(torch.int8), reference.qdata)
    assert torch.equal(qstats.fake_quantize(w, qp, spec), reference.dequantize())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("float8_dtype", (torch.float8_e4m3fn, torch.float8_e5m2), ids=str)
@pytest.mark.parametrize("granularity", (PerRow(), PerTensor(), PerGroup(32)), ids=repr)
def test_float8_weight_only_config_matches_quantize(dtype, float8_dtype, granularity):
    torch.manual_seed(1)
    config = quant_api.Float8WeightOnlyConfig(weight_dtype=float8_dtype, granularity=granularity)
    w, reference = _quantized(torch.nn.Linear(64, 16), config, dtype)
    spec = qstats.QuantSpec.from_torchao(config, input_dtype=dtype)
    qp = _qparams(spec, w)
    assert torch.equal(qp.scale.reshape(reference.scale.shape), reference.scale)
    assert torch.equal(qstats.quantize(w, qp, spec).view(torch.uint8), reference.qdata.view(torch.uint8))
    assert torch.equal(qstats.fake_quantize(w, qp, spec), reference.dequantize())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("weight_dtype", (torch.int2, torch.int4, torch.int8), ids=str)
@pytest.mark.parametrize("mapping", (MappingType.SYMMETRIC, MappingType.ASYMMETRIC, MappingType.SYMMETRIC_NO_CLIPPING_ERR),
                         ids=lambda m: m.name)
@pytest.mark.parametrize("granularity", (PerAxis(0), PerGroup(32)), ids=repr)
@pytest.mark.parametrize("conv", (False, True), ids=("linear", "conv2d"))
def test_intx_weight_only_config_matches_quantize(dtype, weight_dtype, mapping, granularity, conv):
    torch.manual_seed(2)
    config = quant_api.IntxWeightOnlyConfig(weight_dtype=weight_dtype, granularity=granularity, mapping_type=mapping)
    module = torch.nn.Conv2d(64, 8, 3) if conv else torch.nn.Linear(64, 8)
    w, reference = _quantized(module, config, dtype)
    spec = qstats.QuantSpec.from_torchao(config, shape=w.shape, input_dtype=dtype)
    qp = _qparams(spec, w)
    assert torch.equal(qp.scale.reshape(reference.scale.shape), reference.scale)
    assert torch.equal(qp.zero_point.reshape(reference.zero_point.shape).to(torch.int8), reference.zero_point)
    assert torch.equal(qstats.quantize(w, qp, spec).to(torch.int8), reference.qdata)
    assert torch.equal(qstats.fake_quantize(w, qp, spec), reference.dequantize())


@pytest.mark.parametrize("scale_dtype", (torch.bfloat16, torch.float16), ids=str)
def test_intx_weight_only_config_scale_dtype(scale_dtype):
    torch.manual_seed(3)
    config = quant_api.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32), scale_dtype=scale_dtype)
    w, reference = _quantized(torch.nn.Linear(64, 8), config, torch.float32)
    spec = qstats.QuantSpec.from_torchao(config, shape=w.shape)
    qp = _qparams(spec, w)
    assert torch.equal(qp.scale.reshape(reference.scale.shape).to(scale_dtype), reference.scale)
    assert torch.equal(qstats.quantize(w, qp, spec).to(torch.int8), reference.qdata)
    assert torch.equal(qstats.fake_quantize(w, qp, spec), reference.dequantize())


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("dynamic", (True, False))
def test_nvfp4_weight_only_config_matches_quantize(dtype, dynamic):
    inference = pytest.importorskip("torchao.prototype.mx_formats.inference_workflow")
    torch.manual_seed(4)
    config = inference.NVFP4WeightOnlyConfig(use_dynamic_per_tensor_scale=dynamic)
    w, reference = _quantized(torch.nn.Linear(64, 32), config, dtype)
    spec = qstats.QuantSpec.from_torchao(config, input_dtype=dtype)
    assert torch.equal(qstats.fake_quantize(w, _qparams(spec, w), spec), reference.dequantize(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_int8_dynamic_activation_intx_weight_config_as_its_refusal_says(dtype):
    """Int8DynamicActivationIntxWeightConfig is refused, naming the two specs that give its weights
    (quantize_'s) and its activations (IntxUnpackedToInt8Tensor's per-token int8 quantization)."""
    intx = pytest.importorskip("torchao.quantization.quantize_.workflows.intx.intx_unpacked_to_int8_tensor")
    torch.manual_seed(5)
    config = quant_api.Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(32))
    with pytest.raises(ValueError, match="IntxWeightOnlyConfig.*act_mapping_type, granularity=PerToken"):
        qstats.QuantSpec.from_torchao(config)
    w, reference = _quantized(torch.nn.Linear(64, 8), config, dtype)
    weights = quant_api.IntxWeightOnlyConfig(weight_dtype=config.weight_dtype, granularity=config.weight_granularity,
                                             mapping_type=config.weight_mapping_type, scale_dtype=config.weight_scale_dtype)
    spec = qstats.QuantSpec.from_torchao(weights, shape=w.shape, input_dtype=dtype)
    assert torch.equal(qstats.fake_quantize(w, _qparams(spec, w), spec), reference.dequantize())
    x = torch.randn(2, 5, 64).to(dtype) * 3
    spec = qstats.QuantSpec.from_torchao(torch.int8, mapping_type=config.act_mapping_type, granularity=quant_api.PerToken(),
                                         zero_point_dtype=torch.int8, input_dtype=dtype)
    expected = intx._apply_int8_act_asym_per_token_quant_dequant(x)
    assert torch.equal(qstats.fake_quantize(x, _qparams(spec, x), spec), expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("granularity", (PerRow(), PerTensor()), ids=repr)
def test_int8_dynamic_activation_int8_weight_config_as_its_refusal_says(dtype, granularity):
    """Int8DynamicActivationInt8WeightConfig is refused; the QuantizeTensorToInt8Kwargs its refusal
    names give quantize_'s weights and, as the weight's act_quant_kwargs, its activations."""
    int8 = pytest.importorskip("torchao.quantization.quantize_.workflows.int8.int8_tensor")
    torch.manual_seed(6)
    config = quant_api.Int8DynamicActivationInt8WeightConfig(granularity=granularity)
    with pytest.raises(ValueError, match="QuantizeTensorToInt8Kwargs"):
        qstats.QuantSpec.from_torchao(config)
    w, reference = _quantized(torch.nn.Linear(64, 8), config, dtype)
    spec = qstats.QuantSpec.from_torchao(int8.QuantizeTensorToInt8Kwargs(granularity=granularity), input_dtype=dtype)
    assert torch.equal(qstats.fake_quantize(w, _qparams(spec, w), spec), reference.dequantize())
    x = torch.randn(2, 5, 64).to(dtype) * 3
    kwargs = reference.act_quant_kwargs
    spec = qstats.QuantSpec.from_torchao(kwargs, input_dtype=dtype)
    expected = int8.Int8Tensor.from_hp(x, kwargs.granularity, mapping_type=kwargs.mapping_type).dequantize()
    assert torch.equal(qstats.fake_quantize(x, _qparams(spec, x), spec), expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mapping", (MappingType.SYMMETRIC, MappingType.ASYMMETRIC), ids=lambda m: m.name)
def test_int8_static_activation_config_as_its_refusal_says(dtype, mapping):
    """Int8StaticActivationInt8WeightConfig is refused; the activation spec its refusal names
    (get_act_quant_kwargs) calibrated over batches gives Int8Tensor's qparams of all of them."""
    int8 = pytest.importorskip("torchao.quantization.quantize_.workflows.int8.int8_tensor")
    config = quant_api.Int8StaticActivationInt8WeightConfig(
        act_quant_scale=torch.ones(1), granularity=PerTensor(), act_mapping_type=mapping)
    with pytest.raises(ValueError, match="get_act_quant_kwargs"):
        qstats.QuantSpec.from_torchao(config)
    kwargs = config.get_act_quant_kwargs()
    spec = qstats.QuantSpec.from_torchao(kwargs, input_dtype=dtype)
    batches = [(torch.randn(4, 64, generator=torch.Generator().manual_seed(i)) * (i + 1) + i).to(dtype) for i in range(3)]
    observer = qstats.minmax(spec)
    state = observer.init(batches[0])
    for batch in batches:
        state = observer.update(state, batch)
    qp = qstats.compute_qparams(state, spec)
    reference = int8.Int8Tensor.from_hp(torch.cat(batches), kwargs.granularity, mapping_type=mapping)
    assert torch.equal(qp.scale.reshape(reference.scale.shape), reference.scale)
    if mapping == MappingType.ASYMMETRIC:
        assert torch.equal(qp.zero_point.reshape(reference.zero_point.shape).to(torch.int8), reference.zero_point)


def test_configs_of_activations_and_weights_are_refused_naming_the_kwargs_objects():
    with pytest.raises(ValueError, match="QuantizeTensorToInt8Kwargs"):
        qstats.QuantSpec.from_torchao(quant_api.Int8DynamicActivationInt8WeightConfig())
    with pytest.raises(ValueError, match="QuantizeTensorToFloat8Kwargs"):
        qstats.QuantSpec.from_torchao(quant_api.Float8DynamicActivationFloat8WeightConfig())
    with pytest.raises(ValueError, match="Int4WeightOnlyConfig"):
        qstats.QuantSpec.from_torchao(quant_api.Int4WeightOnlyConfig())


def test_config_arguments_are_not_overridden():
    with pytest.raises(ValueError, match="granularity"):
        qstats.QuantSpec.from_torchao(quant_api.Int8WeightOnlyConfig(), granularity=PerTensor())
    with pytest.raises(ValueError, match="shape="):
        qstats.QuantSpec.from_torchao(quant_api.IntxWeightOnlyConfig())


def test_intx_weight_only_config_of_another_qparams_algorithm_is_refused():
    # HQQ_SCALE_ONLY chooses its scales by an optimisation over the weight, not choose_qparams_affine's range
    intx = pytest.importorskip("torchao.quantization.quantize_.workflows.intx.intx_choose_qparams_algorithm")
    config = quant_api.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32),
                                            intx_choose_qparams_algorithm=intx.IntxChooseQParamsAlgorithm.HQQ_SCALE_ONLY)
    with pytest.raises(ValueError, match="HQQ_SCALE_ONLY is not supported"):
        qstats.QuantSpec.from_torchao(config, shape=(8, 64))
