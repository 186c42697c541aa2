"""The input range of a convolution padded otherwise than with zeros (``padding_mode="reflect"``, ...).

Reference: torch.ao's ``prepare_qat_fx``, whose activation observer before such a convolution receives
the module's input, before the padding (the padding copies values, so observers that count values,
histograms and moments, would see the copied ones twice), and the convolution of the fake-quantized
input.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.ao.quantization import (
    FakeQuantize,
    MovingAverageMinMaxObserver,
    QConfig,
    QConfigMapping,
    default_weight_fake_quant,
)
from torch.ao.quantization.quantize_fx import prepare_qat_fx

import qstats

SPEC = qstats.QuantSpec("uint8", "asymmetric")
OBSERVERS = {"histogram": qstats.histogram(SPEC), "moments": qstats.moments(SPEC)}


def _observed_by_torch_ao(model, x):
    """The tensor torch.ao's activation observer before the convolution receives."""
    qconfig = QConfig(activation=FakeQuantize.with_args(observer=MovingAverageMinMaxObserver, quant_min=0,
                                                        quant_max=255, dtype=torch.quint8),
                      weight=default_weight_fake_quant)
    reference = prepare_qat_fx(copy.deepcopy(model).train(), QConfigMapping().set_global(qconfig), (x,))
    seen = []
    reference.activation_post_process_0.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    reference(x)
    return seen[0]


@pytest.mark.parametrize("padding_mode", ["reflect", "replicate", "circular"])
@pytest.mark.parametrize("name", sorted(OBSERVERS))
@pytest.mark.parametrize("conv", [nn.Conv1d, nn.Conv2d])
def test_padded_convolution_observes_its_input_before_the_padding(padding_mode, name, conv):
    torch.manual_seed(0)
    observer = OBSERVERS[name]
    layer = conv(2, 3, 3, padding=2, padding_mode=padding_mode)
    model = nn.Sequential(layer)
    x = torch.randn(2, 2, *(6,) * (layer.weight.ndim - 2)) * 3
    seen = _observed_by_torch_ao(model, x)
    assert torch.equal(seen, x)
    qat = qstats.qat.prepare(model, None, observer)
    out, state = qat.apply(qat.params(), qat.init(x), x)
    expected = observer.update(observer.init(seen), seen)
    for got, want in zip(torch.utils._pytree.tree_leaves(state.activations["0"]),
                         torch.utils._pytree.tree_leaves(expected)):
        assert torch.equal(got, want)
    fake_quantized = qstats.fake_quantize(seen, qstats.compute_qparams(expected, SPEC), SPEC)
    torch.testing.assert_close(out, layer(fake_quantized))


def test_padded_convolution_input_gradient_is_the_straight_through_one():
    # the gradient reaches every input value through its padded copies: those of the padded convolution
    # of a straight-through fake quantization of the input
    torch.manual_seed(0)
    observer = qstats.minmax(SPEC)
    layer = nn.Conv2d(2, 3, 3, padding=1, padding_mode="reflect")
    qat = qstats.qat.prepare(nn.Sequential(layer), None, observer)
    x = torch.randn(2, 2, 5, 5)
    state = qat.init(x)
    _, state = qat.apply(qat.params(), state, x)
    probe = (x * 1.5).requires_grad_(True)  # values past the observed range clip
    out, _ = qat.apply(qat.params(), state, probe, phase=qstats.QATPhase(observe=False))
    (grad,) = torch.autograd.grad(out.square().sum(), probe)
    reference = probe.detach().clone().requires_grad_(True)
    qp = qstats.compute_qparams(state.activations["0"], SPEC)
    (expected,) = torch.autograd.grad(layer(qstats.fake_quantize(reference, qp, SPEC)).square().sum(), reference)
    torch.testing.assert_close(grad, expected)


class _OwnForwardConv2d(nn.Conv2d):
    """A convolution with its own forward, which torch.fx traces through to F.pad and F.conv2d."""

    def forward(self, x):
        return super().forward(x) * 2


@pytest.mark.parametrize("name", sorted(OBSERVERS))
def test_traced_through_padded_convolution_observes_its_input_before_the_padding(name):
    # torch.ao's prepare_qat_fx observes the padded tensor F.conv2d receives there; qstats the input, as for
    # a plain padded convolution (each value counted once)
    torch.manual_seed(0)
    observer = OBSERVERS[name]
    layer = _OwnForwardConv2d(2, 3, 3, padding=2, padding_mode="reflect")
    x = torch.randn(2, 2, 6, 6) * 3
    qat = qstats.qat.prepare(nn.Sequential(layer), None, observer)
    out, state = qat.apply(qat.params(), qat.init(x), x)
    expected = observer.update(observer.init(x), x)
    for got, want in zip(torch.utils._pytree.tree_leaves(state.activations["0"]),
                         torch.utils._pytree.tree_leaves(expected)):
        assert torch.equal(got, want)
    torch.testing.assert_close(out, layer(qstats.fake_quantize(x, qstats.compute_qparams(expected, SPEC), SPEC)))
