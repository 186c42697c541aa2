"""An observer's or spec's refusal inside a `prepare`d model names the layer and its weight or input: a group size
that does not divide a layer's width, a static state sized on inputs of another shape, an observer without
statistics (its type kept: `NoStatistics`). They named the tensor's shape only (``PerGroup.group_size 32 does not
divide dimension 40 of a tensor of shape (8, 40)``), which in a model of many layers points at none.

Reference: torchao's QAT refuses the same layers (``in_features (40) % group_size (32) must be == 0`` at prepare,
naming the width), and leaves the others to train."""

import copy
import warnings

import pytest
import torch
from torch import nn

import qstats
from qstats._qparams import NoStatistics

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from torchao.quantization import quantize_
    from torchao.quantization.granularity import PerGroup
    from torchao.quantization.qat import IntxFakeQuantizeConfig, QATConfig
    from torchao.quantization.quant_primitives import MappingType


def _model():
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 40), nn.ReLU(), nn.Linear(40, 8))


def test_a_group_size_that_does_not_divide_a_weight_names_the_layer_torchao_refuses():
    torch.manual_seed(0)
    model = _model()
    refused = []
    for name, layer in model.named_children():
        if isinstance(layer, nn.Linear):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    quantize_(copy.deepcopy(nn.Sequential(layer)),
                              QATConfig(weight_config=IntxFakeQuantizeConfig(torch.int4, group_size=32), step="prepare"))
                except ValueError as error:
                    assert "in_features (40) % group_size (32)" in str(error)
                    refused.append(name)
    assert refused == ["4"]
    spec = qstats.QuantSpec.from_torchao(torch.int4, mapping_type=MappingType.SYMMETRIC, granularity=PerGroup(32))
    qat = qstats.qat.prepare(model, qstats.memoryless_minmax(spec), None)
    with pytest.raises(ValueError, match=r"^QATModel\.init: the weight of layer '4': PerGroup\.group_size 32 does not "
                                         r"divide dimension 40 of a tensor of shape \(8, 40\)"):
        qat.init(torch.zeros(1, 64))


def test_a_group_size_that_does_not_divide_an_input_names_the_layer():
    # torchao's per-group activation fake quantizer raises a bare AssertionError there
    spec = qstats.QuantSpec.from_torchao(torch.int8, mapping_type=MappingType.ASYMMETRIC, granularity=PerGroup(32))
    qat = qstats.qat.prepare(_model(), None, qstats.memoryless_minmax(spec))
    with pytest.raises(ValueError, match=r"^QATModel\.init: the input of layer '4': PerGroup\.group_size 32 does not "
                                         r"divide dimension 40"):
        qat.init(torch.zeros(1, 64))


def test_a_static_state_sized_on_other_inputs_names_the_layer():
    activations = qstats.moving_average_minmax(qstats.QuantSpec("uint8", "asymmetric", granularity=qstats.PerAxis(1)), 0.1)
    qat = qstats.qat.prepare(_model(), None, activations)
    state = qat.init(torch.zeros(2, 5, 64))
    with pytest.raises(ValueError, match=r"^QATModel\.apply: the input of layer '0': moving_average_minmax\.update: a "
                                         r"tensor of shape \(2, 7, 64\) gives quantization parameters of shape \(7,\), "
                                         r"but the state has shape \(5,\)"):
        qat.apply(qat.params(), state, torch.zeros(2, 7, 64))


@pytest.mark.parametrize("observer", [qstats.placeholder, qstats.recording])
def test_an_observer_without_statistics_names_the_layer_it_would_fake_quantize(observer):
    qat = qstats.qat.prepare(_model(), None, observer(qstats.QuantSpec("uint8", "asymmetric")))
    x = torch.randn(3, 64)
    state = qat.init(x)
    _, state = qat.apply(qat.params(), state, x, phase=qstats.QATPhase(fake_quantize=False))  # observing works
    with pytest.raises(NoStatistics, match=r"^QATModel\.apply: the input of layer '0': compute_qparams: a \w+State has "
                                        "no statistics"):
        qat.apply(qat.params(), state, x)
