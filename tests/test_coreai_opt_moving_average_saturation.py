"""`qstats.coreai_opt.moving_average_minmax` on bf16/fp16 batches at their dtype's largest value:
coreai_opt's running range, stepped in the input's dtype, can round past it to Inf (bf16 with
``c = 0.9``, fp16 with ``c = 1/3``); qstats' stays at the dtype's largest value, and its qparams are
coreai_opt's arithmetic on that saturated range, never the uncalibrated fallback (scale 1).

Reference: Apple coreai_opt 0.4.0's ``MovingAverageQParamsCalculator`` (its running range, and its
``_compute_scale_zero_point_minval`` applied to that range clamped to the dtype's largest value).
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


# (bf16 int8 symmetric is left out: a peak at bf16's largest value puts code -128 past float32, where
# qstats clips the scale, docs/differences.md "Ranges near the float32 limit")
@pytest.mark.parametrize("input_dtype,constant,dtype,qscheme", [
    (torch.bfloat16, 0.9, torch.uint8, "asymmetric"), (torch.bfloat16, 0.9, torch.float8_e4m3fn, "symmetric"),
    (torch.float16, 1 / 3, torch.int8, "symmetric"), (torch.float16, 1 / 3, torch.float8_e4m3fn, "symmetric"),
], ids=str)
def test_a_step_rounding_past_the_largest_value_saturates(input_dtype, constant, dtype, qscheme):
    largest = torch.finfo(input_dtype).max
    coreai_spec = QuantizationSpec(dtype=dtype, qscheme=qscheme, qparam_calculator_cls="moving_average")
    calculator = QuantizationComponentFactory.create_qparams_calculator(coreai_spec, CompressionTargetTensor.ACTIVATION)
    calculator.averaging_constant = constant
    spec = qstats.QuantSpec.from_coreai_opt(coreai_spec, target="activation", input_dtype=input_dtype)
    obs = qstats.coreai_opt.moving_average_minmax(spec, constant)
    batches = [torch.tensor([largest, -1.0]), torch.tensor([largest, -2.0])]
    state = obs.init(batches[0].to(input_dtype))
    for x in batches:
        x = x.to(input_dtype)
        calculator(x)
        state = obs.update(state, x)
    assert calculator.running_max.isinf().all()  # coreai_opt's average rounded past the largest value
    saturated = calculator.running_max.clamp(max=largest)
    scale, zero_point, _ = calculator._compute_scale_zero_point_minval(x, calculator.running_min, saturated)
    qp = qstats.compute_qparams(state, spec)
    assert float(state.max_val) == largest and bool(qp.calibrated.all())
    assert torch.equal(qp.scale.reshape(scale.shape).to(scale.dtype), scale)
    if zero_point is not None:
        assert torch.equal(qp.zero_point.reshape(zero_point.shape), zero_point)
