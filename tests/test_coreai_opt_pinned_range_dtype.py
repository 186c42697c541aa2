"""coreai_opt specs whose ``float_range`` pins both ends, for bf16/fp16 inputs.

Reference: Apple coreai_opt 0.4.0's ``StaticQParamsCalculator`` / ``MovingAverageQParamsCalculator``:
with both ends pinned it builds the range as float32 tensors and computes the scale, zero point and
minval in float32 whatever the input's dtype (with one end or none pinned, in the input's dtype).
``QuantSpec.from_coreai_opt(spec, input_dtype=dtype)`` of such a spec, the dtype a user passes for
every site of a bf16 model, must give coreai_opt's float32 qparams.
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
TARGETS = [(torch.int8, "symmetric", None), (torch.uint8, "asymmetric", None), (torch.int4, "symmetric_with_clipping", None),
           (torch.int8, "symmetric", torch.float8_e8m0fnu), (torch.float8_e4m3fn, "symmetric", None),
           (torch.float4_e2m1fn_x2, "symmetric", None)]


def _coreai_spec(dtype, qscheme, scale_dtype, float_range, kind="static"):
    extra = {} if scale_dtype is None else {"scale_dtype": scale_dtype}
    return QuantizationSpec(dtype=dtype, qscheme=qscheme, float_range=list(float_range), qparam_calculator_cls=kind,
                            granularity={"type": "per_tensor"}, **extra)


@pytest.mark.parametrize("float_range", [(-1.0, 1.0), (-0.3, 1.9999999), (-0.7, 0.1)], ids=str)
@pytest.mark.parametrize("input_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("dtype,qscheme,scale_dtype", TARGETS, ids=str)
def test_both_ends_pinned_compute_in_float32(dtype, qscheme, scale_dtype, input_dtype, float_range):
    coreai_spec = _coreai_spec(dtype, qscheme, scale_dtype, float_range)
    fake_quantizer = QuantizationComponentFactory.create_fake_quantizer(coreai_spec, CompressionTargetTensor.ACTIVATION)
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(0)).to(input_dtype)
    expected = fake_quantizer(x)
    scale, zero_point, minval = fake_quantizer.calculate_qparams()

    for given in (coreai_spec, coreai_spec.model_dump()):
        spec = qstats.QuantSpec.from_coreai_opt(given, target="activation", input_dtype=input_dtype)
        obs = qstats.memoryless_minmax(spec)
        qp = qstats.compute_qparams(obs.update(obs.init(x), x), spec, float_range=float_range)
        assert torch.equal(qp.scale.reshape(scale.shape), scale)
        if zero_point is not None:
            assert torch.equal(qp.zero_point.reshape(zero_point.shape), zero_point)
            assert torch.equal(qp.minval.reshape(minval.shape), minval)
        assert torch.equal(qstats.fake_quantize(x, qp, spec), expected)


@pytest.mark.parametrize("float_range", [(None, 1.9999999), (-0.3, None), (None, None)], ids=str)
def test_one_end_or_none_pinned_keeps_the_inputs_dtype(float_range):
    coreai_spec = _coreai_spec(torch.int8, "symmetric", None, float_range)
    spec = qstats.QuantSpec.from_coreai_opt(coreai_spec, target="activation", input_dtype=torch.bfloat16)
    assert spec.compute_dtype == "bfloat16"
    calculator = QuantizationComponentFactory.create_qparams_calculator(coreai_spec, CompressionTargetTensor.ACTIVATION)
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(1)).bfloat16()
    scale = calculator(x)[0]
    obs = qstats.memoryless_minmax(spec)
    qp = qstats.compute_qparams(obs.update(obs.init(x), x), spec, float_range=float_range)
    assert scale.dtype == torch.bfloat16 and torch.equal(qp.scale.reshape(scale.shape), scale.float())


def test_moving_average_with_both_ends_pinned():
    coreai_spec = _coreai_spec(torch.uint8, "asymmetric", None, (-0.3, 1.9999999), kind="moving_average")
    calculator = QuantizationComponentFactory.create_qparams_calculator(coreai_spec, CompressionTargetTensor.ACTIVATION)
    spec = qstats.QuantSpec.from_coreai_opt(coreai_spec, target="activation", input_dtype=torch.bfloat16)
    obs = qstats.coreai_opt.moving_average_minmax(spec, calculator.averaging_constant)
    state = obs.init(torch.empty(4, 32, dtype=torch.bfloat16))
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        x = torch.randn(4, 32, generator=g).bfloat16()
        scale, zero_point, minval = calculator(x)
        state = obs.update(state, x)
        qp = qstats.compute_qparams(state, spec, float_range=(-0.3, 1.9999999))
        assert torch.equal(qp.scale.reshape(scale.shape), scale) and torch.equal(qp.minval.reshape(minval.shape), minval)


@pytest.mark.parametrize("qscheme", ["symmetric", "asymmetric"])
def test_float64_input_with_both_ends_pinned(qscheme):
    """coreai_opt's float64 scales come from a float64 range; with both ends pinned its range, and
    so its qparams, are float32: qstats' float32 spec gives them and coreai_opt's fake quantization."""
    coreai_spec = QuantizationSpec(dtype=torch.int8, qscheme=qscheme, float_range=[-2.0, 3.0], qparam_calculator_cls="static",
                                   granularity={"type": "per_channel", "axis": 0})
    fake_quantizer = QuantizationComponentFactory.create_fake_quantizer(coreai_spec, CompressionTargetTensor.WEIGHT)
    x = torch.randn(16, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(3)) * 2
    expected = fake_quantizer(x)
    scale, zero_point, minval = fake_quantizer.calculate_qparams()
    with pytest.raises(ValueError, match="input_dtype"):
        qstats.QuantSpec.from_coreai_opt(coreai_spec, input_dtype=torch.float64)
    spec = qstats.QuantSpec.from_coreai_opt(coreai_spec)
    obs = qstats.memoryless_minmax(spec)
    qp = qstats.compute_qparams(obs.update(obs.init(x), x), spec, float_range=(-2.0, 3.0))
    assert scale.dtype == torch.float32 and torch.equal(qp.scale, scale.reshape(-1))
    assert torch.equal(qp.zero_point, zero_point.reshape(-1)) and torch.equal(qp.minval, minval.reshape(-1))
    ours = qstats.fake_quantize(x, qp, spec)
    assert ours.dtype == torch.float64 and torch.equal(ours, expected)
