"""QAT with activation ranges per row, per group or per block (torchao's float8 rowwise QAT, per-group
``IntxFakeQuantizer``s): their parameters are indexed by the batch's own rows, so, as per-token ranges,
they are dynamic: each batch observes its own, over batches of any shape and in frozen phases, as
torchao's fake quantizers (qstats sized the state on the first batch: a batch of another shape raised
a shape error, and a frozen phase would have kept another batch's rows)."""

import copy
import warnings

import pytest
import torch
from torch import nn

import qstats

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_
    from torchao.quantization.granularity import PerGroup
    from torchao.quantization.qat import IntxFakeQuantizeConfig, QATConfig
    from torchao.quantization.quant_primitives import MappingType


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16))


def _float8_rowwise():
    """torchao's float8 rowwise QAT model and qstats' specs of its fake quantizers."""
    reference = _mlp()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_(reference, QATConfig(Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()), step="prepare"))
    spec = qstats.QuantSpec.from_torchao(torch.float8_e4m3fn, granularity=PerRow())
    # torchao's float8 fake quantizer differentiates through its amax scale too (docs/differences.md):
    # its gradients are not compared
    return reference, spec, spec, [(2,), (5,), (3, 4), (1, 7)], False


def _int8_per_group():
    """torchao's per-group int8 activations and int4 weights (its group path takes 2-D inputs)."""
    reference = _mlp()
    activation = IntxFakeQuantizeConfig(torch.int8, group_size=16)
    weight = IntxFakeQuantizeConfig(torch.int4, group_size=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_(reference, QATConfig(activation_config=activation, weight_config=weight, step="prepare"))
    activation_spec = qstats.QuantSpec.from_torchao(torch.int8, mapping_type=MappingType.SYMMETRIC,
                                                    granularity=PerGroup(16))
    weight_spec = qstats.QuantSpec.from_torchao(torch.int4, mapping_type=MappingType.SYMMETRIC,
                                                granularity=PerGroup(16))
    return reference, weight_spec, activation_spec, [(2,), (5,), (1,), (3,)], True


@pytest.mark.parametrize("build", [_float8_rowwise, _int8_per_group], ids=["float8_rowwise", "int8_per_group"])
def test_row_and_group_activation_ranges_are_each_batchs_own_as_torchaos(build):
    reference, weight_spec, activation_spec, shapes, straight_through = build()
    qat = qstats.qat.prepare(_mlp(), qstats.memoryless_minmax(weight_spec), qstats.memoryless_minmax(activation_spec))
    state = qat.init(torch.zeros(*shapes[0], 64))

    def loss_fn(params, state, x, phase):
        out, new_state = qat.apply(params, state, x, phase=phase)
        return out.square().mean(), (new_state, out)

    grad_fn = torch.func.grad(loss_fn, has_aux=True)
    g = torch.Generator().manual_seed(1)
    for shape in shapes:
        x = torch.randn(*shape, 64, generator=g) * 2
        params = {name: p.detach().clone() for name, p in reference.named_parameters()}
        reference.zero_grad()
        expected = reference(x)
        expected.square().mean().backward()
        grads, (state, out) = grad_fn(params, state, x, qstats.QATPhase())
        assert torch.equal(out, expected.detach())
        for name, grad in grads.items():  # torchao's backward multiplies by scale and 1 / scale: ulps apart
            if straight_through:
                torch.testing.assert_close(grad, reference.get_parameter(name).grad, rtol=1e-5, atol=1e-7)
        with torch.no_grad():
            for p in reference.parameters():
                p -= 0.1 * p.grad

    # frozen ranges: the weights' stay (unchanged weights here), the activations' rows are the batch's
    params = {name: p.detach().clone() for name, p in reference.named_parameters()}
    _, state = qat.apply(params, state, torch.randn(*shapes[0], 64, generator=g))
    x = torch.randn(*shapes[1], 64, generator=g) * 3
    with torch.no_grad():
        out, frozen = qat.apply(params, state, x, phase=qstats.QATPhase(observe=False))
        assert torch.equal(out, reference(x))
    assert torch.equal(frozen.weights["0"].max_val, state.weights["0"].max_val)


def test_row_activation_ranges_of_a_compiled_step_follow_the_batch():
    reference, weight_spec, activation_spec, _, _ = _float8_rowwise()
    qat = qstats.qat.prepare(_mlp(), qstats.memoryless_minmax(weight_spec), qstats.memoryless_minmax(activation_spec))
    params = {name: p.detach().clone() for name, p in reference.named_parameters()}
    step = torch.compile(lambda p, s, x, t: qat.apply(p, s, x, phase=qstats.QATSchedule(0, 0, 2)(t)), fullgraph=True)
    state = qat.init(torch.zeros(2, 64))
    g = torch.Generator().manual_seed(2)
    for t, shape in enumerate([(2,), (2,), (2,)]):  # the third step is frozen
        x = torch.randn(*shape, 64, generator=g)
        out, state = step(params, state, x, torch.tensor(t))
        assert torch.equal(out, reference(x).detach())


def test_per_tensor_and_per_channel_activation_ranges_stay_static():
    # torch.ao's observers: a moving average over batches, frozen where the phase says
    spec = qstats.QuantSpec("uint8", "asymmetric")
    qat = qstats.qat.prepare(_mlp(), None, qstats.moving_average_minmax(spec, 0.5))
    state = qat.init(torch.zeros(2, 64))
    _, state = qat.apply(qat.params(), state, torch.ones(2, 64))
    _, frozen = qat.apply(qat.params(), state, torch.full((3, 64), 5.0), phase=qstats.QATPhase(observe=False))
    assert torch.equal(frozen.activations["0"].max_val, state.activations["0"].max_val)
    _, moved = qat.apply(qat.params(), state, torch.full((3, 64), 5.0))
    assert float(moved.activations["0"].max_val) == 3.0  # 1 + 0.5 * (5 - 1)


@pytest.mark.parametrize("granularity", [qstats.PerToken(), qstats.PerRow(), qstats.PerGroup(16), qstats.PerBlock((1, 16))],
                         ids=str)
def test_dynamic_activation_ranges_have_no_range_to_learn(granularity):
    # torchao refuses range learning on dynamic fake quantizers; a learned range per row of one batch
    # would be read against the rows of every other batch
    with pytest.raises(ValueError, match="is_dynamic"):
        IntxFakeQuantizeConfig(torch.int8, "per_token", is_symmetric=False, range_learning=True)
    spec = qstats.QuantSpec("int8", "asymmetric", granularity=granularity)
    weight_spec = qstats.QuantSpec("int8", granularity=qstats.PerAxis(0))
    qat = qstats.qat.prepare(_mlp(), qstats.minmax(weight_spec), qstats.memoryless_minmax(spec))
    x = torch.randn(4, 64)
    _, state = qat.apply(qat.params(), qat.init(x), x)
    with pytest.raises(ValueError, match="dynamic.*activations=False"):
        qat.learnable_ranges(state, weights=True)
    learned = qat.learnable_ranges(state, weights=True, activations=False)
    assert set(learned) == {"weights"}
    qat.apply(qat.params(), state, x, ranges=learned)
    ranges = {"activations": {"0": qstats.lsq_init(state.activations["0"], spec)}}
    with pytest.raises(ValueError, match="dynamic"):
        qat.apply(qat.params(), state, x, ranges=ranges)


def test_dynamic_per_tensor_activations_keep_observing_after_the_freeze_as_coreai_opts():
    # coreai_opt's "dynamic" calculators recompute every forward and ignore disable_observer; its
    # "static" weight calculator freezes (qstats froze both: no way to keep per-tensor ones dynamic)
    pytest.importorskip("coreai_opt")
    from coreai_opt.quantization import ExecutionMode, ModuleQuantizerConfig, Quantizer, QuantizerConfig
    from coreai_opt.quantization.config import QATSchedule
    from coreai_opt.quantization.config.quantization_config import OpQuantizerConfig
    from coreai_opt.quantization.spec.spec import QuantizationSpec

    activation = QuantizationSpec(dtype=torch.int8, qscheme="asymmetric", qparam_calculator_cls="dynamic")
    weight = QuantizationSpec(dtype=torch.int8, qscheme="symmetric", granularity={"type": "per_channel", "axis": 0},
                              qparam_calculator_cls="static")
    linear = OpQuantizerConfig(op_input_spec={0: activation}, op_state_spec={"weight": weight}, op_output_spec={0: None})
    schedule = QATSchedule(enable_observer=0, enable_fake_quant=0, disable_observer=2)
    config = QuantizerConfig(global_config=ModuleQuantizerConfig(op_type_config={"linear": linear}, qat_schedule=schedule),
                             execution_mode=ExecutionMode.EAGER)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4))
    quantizer = Quantizer(copy.deepcopy(model), config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = quantizer.prepare((torch.randn(2, 8),))
    activation_spec = qstats.QuantSpec.from_coreai_opt(activation, target="activation")
    weight_spec = qstats.QuantSpec.from_coreai_opt(weight, shape=(4, 8))
    qat = qstats.qat.prepare(model, qstats.memoryless_minmax(weight_spec), qstats.memoryless_minmax(activation_spec),
                             dynamic_activations=True)
    ours = qstats.QATSchedule(0, 0, 2)
    state = qat.init(torch.zeros(2, 8))
    g = torch.Generator().manual_seed(1)
    with quantizer.training_mode(), torch.no_grad():
        for step in range(5):
            x = torch.randn(3, 8, generator=g) * (step + 1)
            out, new_state = qat.apply(qat.params(), state, x, phase=ours(step))
            assert torch.equal(out, reference(x))
            if step >= 2:  # the weights' range is frozen, the activations' the batch's own
                assert torch.equal(new_state.weights["0"].max_val, state.weights["0"].max_val)
                assert torch.equal(new_state.activations["0"].max_val, x.max())
            state = new_state
            quantizer.step()
    with pytest.raises(TypeError, match="dynamic_activations"):
        qstats.qat.prepare(model, None, qstats.memoryless_minmax(activation_spec), dynamic_activations=None)
