"""A QAT point fake-quantized from a state that saw no data raises naming the layer (its module path)
and what gives it data; the values of calibrated points are those of `compute_qparams` as before."""

import pytest
import torch
from torch import nn

import qstats

W_SPEC = qstats.QuantSpec("int8", granularity=qstats.PerAxis(0))
A_SPEC = qstats.QuantSpec("uint8", "asymmetric")
FAKE_QUANTIZE_ONLY = qstats.QATPhase(observe=False, fake_quantize=True)


def _nested_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 2)))


def test_unobserved_input_names_its_layer_and_the_phase_to_run():
    qat = qstats.qat.prepare(_nested_model(), qstats.memoryless_minmax(W_SPEC), qstats.minmax(A_SPEC))
    x = torch.randn(3, 4)
    with pytest.raises(ValueError, match=r"QATModel.apply: the input of layer '0' .*saw no data.*phase.observe=True"):
        qat.apply(qat.params(), qat.init(x), x, phase=FAKE_QUANTIZE_ONLY)


def test_unobserved_weight_names_its_nested_layer():
    """Layer '0' observed, the nested layers' weights not: the first of them is named by its module path."""
    qat = qstats.qat.prepare(_nested_model(), qstats.minmax(W_SPEC), None)
    x = torch.randn(3, 4)
    state = qat.init(x)
    observer = qat.weight_observers["0"]
    weight = qat.params()["0.weight"].detach()
    state = state._replace(weights={**state.weights, "0": observer.update(state.weights["0"], weight)})
    with pytest.raises(ValueError, match=r"the weight of layer '2\.0' .*saw no data.*QATSchedule"):
        qat.apply(qat.params(), state, x, phase=FAKE_QUANTIZE_ONLY)


def test_uncalibrated_learned_range_names_its_layer_and_what_to_do():
    qat = qstats.qat.prepare(_nested_model(), qstats.minmax(W_SPEC), qstats.minmax(A_SPEC))
    with pytest.raises(ValueError, match=r"the activation of '0': .*uncalibrated.*phase.observe=True"):
        qat.learnable_ranges(qat.init(torch.randn(3, 4)))


def test_calibrated_points_fake_quantize_with_compute_qparams():
    """The checked fallback path gives what `compute_qparams` with the raising spec gives, once observed."""
    qat = qstats.qat.prepare(nn.Sequential(nn.Linear(4, 3)), qstats.minmax(W_SPEC), qstats.minmax(A_SPEC))
    x = torch.randn(8, 4)
    _, state = qat.apply(qat.params(), qat.init(x), x, phase=qstats.QATPhase(fake_quantize=False))
    out, _ = qat.apply(qat.params(), state, x, phase=FAKE_QUANTIZE_ONLY)
    layer = qat.module.get_submodule("0")
    x_fq = qstats.fake_quantize(x, qstats.compute_qparams(state.activations["0"], A_SPEC), A_SPEC)
    w_fq = qstats.fake_quantize(layer.weight, qstats.compute_qparams(state.weights["0"], W_SPEC), W_SPEC)
    torch.testing.assert_close(out, nn.functional.linear(x_fq, w_fq, layer.bias), rtol=0, atol=0)
