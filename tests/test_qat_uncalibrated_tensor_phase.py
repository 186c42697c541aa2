"""A tensor-step schedule (bool-tensor phase flags: one compiled graph) fake-quantizing a point whose state saw
no data raises the ValueError a Python-int step raises, naming the layer; it fake-quantized silently with the
fallback scale 1 (torch.ao's FakeQuantize, never observed, fake-quantizes with its initial scale 1 too, but
qstats' rule is an error unless the spec declares the fallback: docs/design.md, Bad input)."""

import pytest
import torch
from torch import nn

import qstats

W_SPEC = qstats.QuantSpec("int8", granularity=qstats.PerAxis(0))
A_SPEC = qstats.QuantSpec("uint8", "asymmetric")


def _qat(weight_spec=W_SPEC, activation_spec=A_SPEC):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    return qstats.qat.prepare(model, qstats.memoryless_minmax(weight_spec),
                              qstats.moving_average_minmax(activation_spec, 0.1))


@pytest.mark.parametrize("tensor_step", [False, True])
def test_unobserved_input_raises_under_a_tensor_step_as_under_an_int_step(tensor_step):
    """Ranges frozen from step 0 (``freeze_ranges_at=0``): no step observes, every step fake-quantizes."""
    qat, x = _qat(), torch.randn(3, 4)
    schedule = qstats.QATSchedule(observe_at=0, fake_quantize_at=0, freeze_ranges_at=0)
    step = torch.tensor(0) if tensor_step else 0
    with pytest.raises(ValueError, match=r"QATModel.apply: the input of layer '0' .*saw no data.*phase.observe=True"):
        qat.apply(qat.params(), qat.init(x), x, phase=schedule(step))


def test_tensor_steps_that_do_not_fake_quantize_or_observe_first_do_not_raise():
    qat, x = _qat(), torch.randn(3, 4)
    schedule = qstats.QATSchedule(observe_at=1, fake_quantize_at=2)
    state = qat.init(x)
    for step in range(3):  # step 0: float; 1: observes; 2: fake-quantizes what step 1 observed
        expected, expected_state = qat.apply(qat.params(), state, x, phase=schedule(step))
        out, state = qat.apply(qat.params(), state, x, phase=schedule(torch.tensor(step)))
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
    # independent computation of the last step: the layers by hand from the observed range
    first = qat.module.get_submodule("0")
    x_fq = qstats.fake_quantize(x, qstats.compute_qparams(state.activations["0"], A_SPEC), A_SPEC)
    w_fq = qstats.fake_quantize(first.weight, qstats.compute_qparams(state.weights["0"], W_SPEC), W_SPEC)
    h = torch.relu(nn.functional.linear(x_fq, w_fq, first.bias))
    second = qat.module.get_submodule("2")
    h_fq = qstats.fake_quantize(h, qstats.compute_qparams(state.activations["2"], A_SPEC), A_SPEC)
    w2_fq = qstats.fake_quantize(second.weight, qstats.compute_qparams(state.weights["2"], W_SPEC), W_SPEC)
    torch.testing.assert_close(out, nn.functional.linear(h_fq, w2_fq, second.bias), rtol=0, atol=0)


def test_a_declared_fallback_fake_quantizes_with_scale_one_under_a_tensor_step():
    qat = _qat(*(spec.replace(on_uncalibrated="fallback") for spec in (W_SPEC, A_SPEC)))
    x = torch.randn(3, 4)
    phase = qstats.QATPhase(observe=torch.tensor(False), fake_quantize=torch.tensor(True))
    out, _ = qat.apply(qat.params(), qat.init(x), x, phase=phase)
    expected, _ = qat.apply(qat.params(), qat.init(x), x, phase=qstats.QATPhase(observe=False, fake_quantize=True))
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_compiled_steps_raise_for_an_unobserved_point_and_equal_eager_steps_once_observed():
    """The check's result is threaded into the scale: torch.compile dropped it as dead code, and a compiled step
    fake-quantized an unobserved input silently with scale 1 (eager raised), for Python and tensor flags alike."""
    qat, x = _qat(), torch.randn(3, 4)
    step = torch.compile(lambda params, state, x, phase: qat.apply(params, state, x, phase=phase), fullgraph=True)
    unobserved = qat.init(x)
    for phase in (qstats.QATPhase(observe=False), qstats.QATPhase(observe=torch.tensor(False),
                                                                 fake_quantize=torch.tensor(True))):
        with pytest.raises(ValueError, match=r"the input of layer '0' .*saw no data"):
            step(qat.params(), unobserved, x, phase)
    _, observed = qat.apply(qat.params(), unobserved, x, phase=qstats.QATPhase(fake_quantize=False))
    phase = qstats.QATPhase(observe=torch.tensor(True), fake_quantize=torch.tensor(True))
    out, state = step(qat.params(), observed, x, phase)
    expected, expected_state = qat.apply(qat.params(), observed, x, phase=phase)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(state, expected_state)
