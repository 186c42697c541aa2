"""The weight ranges to quantize a trained QAT model with, against torch.ao's ``convert_fx``: it
observes the trained weights once more where the observers still run (docs/qat.md)."""

import copy

import torch
from torch import nn
from torch.ao.quantization import FakeQuantize, MovingAverageMinMaxObserver, PerChannelMinMaxObserver, QConfig, QConfigMapping
from torch.ao.quantization.quantize_fx import convert_fx, prepare_qat_fx

import qstats

WEIGHT = dict(observer=PerChannelMinMaxObserver, quant_min=-128, quant_max=127, dtype=torch.qint8,
              qscheme=torch.per_channel_symmetric)
INPUT = dict(observer=MovingAverageMinMaxObserver, quant_min=0, quant_max=255, dtype=torch.quint8,
             qscheme=torch.per_tensor_affine, averaging_constant=0.1)


def test_trained_weights_observed_once_more_give_torch_aos_converted_scales(quantized_engine):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8))
    qconfig = QConfig(activation=FakeQuantize.with_args(**INPUT), weight=FakeQuantize.with_args(**WEIGHT))
    x = torch.randn(4, 16)
    reference = prepare_qat_fx(copy.deepcopy(model).train(), QConfigMapping().set_global(qconfig), (x,))
    weight_spec = qstats.QuantSpec.from_torch_ao(torch.qint8, torch.per_channel_symmetric, quant_min=-128, quant_max=127)
    input_spec = qstats.QuantSpec.from_torch_ao(torch.quint8, torch.per_tensor_affine, quant_min=0, quant_max=255)
    qat = qstats.qat.prepare(model, qstats.minmax(weight_spec), qstats.moving_average_minmax(input_spec, 0.1))
    params, state = qat.params(), qat.init(x)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(4, 16, generator=g)
        optimizer.zero_grad()
        reference(x).square().sum().backward()
        params = {name: p.detach().clone() for name, p in reference.named_parameters()}  # the step's weights
        _, state = qat.apply(params, state, x)
        optimizer.step()
    params = {name: p.detach().clone() for name, p in reference.named_parameters()}  # the trained ones
    converted = convert_fx(copy.deepcopy(reference)).get_submodule("0").weight().q_per_channel_scales().float()
    last_step = qstats.compute_qparams(state.weights["0"], weight_spec).scale
    trained = qat.weight_observer.update(state.weights["0"], params["0.weight"])
    assert not torch.equal(last_step, converted)
    assert torch.equal(qstats.compute_qparams(trained, weight_spec).scale, converted)
