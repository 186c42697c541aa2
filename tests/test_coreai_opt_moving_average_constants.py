"""coreai_opt's moving average at the ends of its averaging constant: `qstats.coreai_opt.moving_average_minmax`
equals its ``MovingAverageQParamsCalculator`` for constants 0 (the first batch's range kept), 1 (the
latest batch's), 1/3, 1e-8 and 0.999, over float32, bf16 and fp16 batches; a constant coreai_opt
takes outside [0, 1] (it extrapolates) is refused by `recipe_from_coreai_opt` itself, naming the
module, site and spec class, not later by `Recipe.resolve` without them."""

import warnings

import pytest
import torch
from torch import nn

import qstats
import qstats.coreai_opt

pytest.importorskip("coreai_opt")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from coreai_opt.config.spec import CompressionTargetTensor
    from coreai_opt.quantization import ExecutionMode, ModuleQuantizerConfig, Quantizer, QuantizerConfig
    from coreai_opt.quantization.spec.factory import QuantizationComponentFactory
    from coreai_opt.quantization.spec.spec import QuantizationSpec


def _batches(dtype):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(4, 32, generator=g) * (1 + i) + (i - 2)).to(dtype) for i in range(8)]


@pytest.mark.parametrize("constant", [0.0, 1.0, 1 / 3, 1e-8, 0.999])
@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("qscheme", ["symmetric", "asymmetric"])
def test_averaging_constants_at_the_ends_are_coreai_opts(constant, input_dtype, qscheme):
    coreai_spec = QuantizationSpec(dtype=torch.int8, qscheme=qscheme, qparam_calculator_cls="moving_average")
    calculator = QuantizationComponentFactory.create_qparams_calculator(coreai_spec, CompressionTargetTensor.ACTIVATION)
    calculator.averaging_constant = constant
    spec = qstats.QuantSpec.from_coreai_opt(coreai_spec, target="activation", input_dtype=input_dtype)
    obs = qstats.coreai_opt.moving_average_minmax(spec, averaging_constant=constant)
    batches = _batches(input_dtype)
    state = obs.init(batches[0])
    for x in batches:
        scale, zero_point, minval = calculator(x)
        state = obs.update(state, x)
    qp = qstats.compute_qparams(state, spec)
    assert torch.equal(qp.scale, scale.reshape(()).float())
    assert torch.equal(qp.zero_point, zero_point.reshape(()).to(qp.zero_point.dtype))
    assert torch.equal(qp.minval, minval.reshape(()).float())


class _Extrapolating(QuantizationSpec):
    averaging_constant: float = 1.5


@pytest.mark.parametrize("constant", [1.5, -0.5, float("nan")])
def test_a_constant_outside_0_1_is_refused_by_the_recipe_naming_the_site(constant, single_thread_quiet):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8)).eval()
    spec = _Extrapolating(dtype=torch.int8, qparam_calculator_cls="moving_average", averaging_constant=constant)
    config = QuantizerConfig(execution_mode=ExecutionMode.EAGER, global_config=ModuleQuantizerConfig(
        op_state_spec={}, op_input_spec={0: spec}, op_output_spec={}))
    prepared = Quantizer(model, config).prepare((torch.randn(2, 16),))   # coreai_opt takes it
    assert prepared[0].linear_quantize_input.qparams_calculator.averaging_constant == pytest.approx(constant, nan_ok=True)
    with pytest.raises(ValueError, match=r"recipe_from_coreai_opt: module '0' input \(_Extrapolating\): "
                                         r"averaging_constant must be a number in \[0, 1\]"):
        qstats.coreai_opt.recipe_from_coreai_opt(config, model)
