"""coreai_opt's eager QAT (``"moving_average"`` activations, ``"static"`` weights, its ``QATSchedule``)
against `qstats.qat.prepare` with ``from_coreai_opt`` specs (``input_dtype=`` the model's) and
`qstats.coreai_opt.moving_average_minmax`: forward and gradients bit for bit, step for step, once the
example input coreai_opt's ``prepare`` observes is observed too (docs/qat.md)."""

import copy
import warnings

import pytest
import torch
from torch import nn

import qstats
import qstats.coreai_opt

pytest.importorskip("coreai_opt")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from coreai_opt.quantization import ExecutionMode, ModuleQuantizerConfig, Quantizer, QuantizerConfig
    from coreai_opt.quantization.config import QATSchedule
    from coreai_opt.quantization.config.quantization_config import OpQuantizerConfig
    from coreai_opt.quantization.spec.spec import QuantizationSpec

CASES = {
    "int8_per_channel": (torch.int8, {"type": "per_channel", "axis": 0}, torch.float32),
    "int4_per_block": (torch.int4, {"type": "per_block", "block_size": [1, 8]}, torch.float32),
    "int8_per_channel_bf16": (torch.int8, {"type": "per_channel", "axis": 0}, torch.bfloat16),
}


def _original(name: str) -> str:
    """The float model's name of a parameter of coreai_opt's parametrized model."""
    return name.replace("parametrizations.weight.original", "weight")


@pytest.mark.parametrize("case", list(CASES))
def test_training_steps_equal_coreai_opts(case, single_thread_quiet):
    weight_dtype, granularity, dtype = CASES[case]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4)).to(dtype)
    activation = QuantizationSpec(dtype=torch.uint8, qscheme="asymmetric", qparam_calculator_cls="moving_average")
    weight = QuantizationSpec(dtype=weight_dtype, qscheme="symmetric", granularity=granularity,
                              qparam_calculator_cls="static")
    linear = OpQuantizerConfig(op_input_spec={0: activation}, op_state_spec={"weight": weight}, op_output_spec={0: None})
    schedule = QATSchedule(enable_observer=0, enable_fake_quant=1, disable_observer=3)
    config = QuantizerConfig(global_config=ModuleQuantizerConfig(op_type_config={"linear": linear}, qat_schedule=schedule),
                             execution_mode=ExecutionMode.EAGER)
    quantizer = Quantizer(copy.deepcopy(model), config)
    example = torch.randn(2, 16, generator=torch.Generator().manual_seed(1)).to(dtype)
    reference = quantizer.prepare((example,))  # observes the example input
    calculator = next(m.qparams_calculator for m in reference.modules()
                      if hasattr(getattr(m, "qparams_calculator", None), "averaging_constant"))
    activation_spec = qstats.QuantSpec.from_coreai_opt(activation, target="activation", input_dtype=dtype)
    weight_spec = qstats.QuantSpec.from_coreai_opt(weight, shape=(8, 16), input_dtype=dtype)
    qat = qstats.qat.prepare(model, qstats.memoryless_minmax(weight_spec),
                             qstats.coreai_opt.moving_average_minmax(activation_spec, calculator.averaging_constant))
    _, state = qat.apply(qat.params(), qat.init(example), example, phase=qstats.QATPhase(fake_quantize=False))
    ours = qstats.QATSchedule(observe_at=0, fake_quantize_at=1, freeze_ranges_at=3)

    def loss_fn(params, state, x, phase):
        out, new_state = qat.apply(params, state, x, phase=phase)
        return out.float().square().mean(), (new_state, out)

    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(2)
    with quantizer.training_mode():
        for step in range(5):
            x = (torch.randn(3, 16, generator=g) * (step + 1)).to(dtype)
            params = {_original(name): p.detach().clone() for name, p in reference.named_parameters()}
            optimizer.zero_grad()
            expected = reference(x)
            expected.float().square().mean().backward()
            grads, (state, out) = torch.func.grad(loss_fn, has_aux=True)(params, state, x, ours(step))
            assert torch.equal(out, expected.detach())
            for name, p in reference.named_parameters():
                assert torch.equal(grads[_original(name)], p.grad)
            optimizer.step()
            quantizer.step()
