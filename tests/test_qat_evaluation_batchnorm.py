"""Evaluating a QAT model with batch norm (docs/qat.md): torch.ao's QAT modules under ``model.eval()``
normalize with the running statistics, which ``QATPhase(observe=False, fake_quantize=True,
freeze_batchnorm=True)`` reproduces; batch norm follows the phase, never the model's train/eval mode."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.ao.quantization import FakeQuantize, MovingAverageMinMaxObserver, PerChannelMinMaxObserver

import qstats

WEIGHT_SPEC = qstats.QuantSpec.from_torch_ao(torch.qint8, torch.per_channel_symmetric, quant_min=-128, quant_max=127)
ACT_SPEC = qstats.QuantSpec.from_torch_ao(torch.quint8, torch.per_tensor_affine, quant_min=0, quant_max=255)


class _ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.fc = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(F.relu(self.bn(self.conv(x))).mean(dim=(2, 3)))


class _TorchAo(nn.Module):
    """_ConvBN with torch.ao FakeQuantize modules on the conv's and the Linear's input and weight."""

    def __init__(self, net):
        super().__init__()
        self.net = net
        self.weights = nn.ModuleList(FakeQuantize(observer=PerChannelMinMaxObserver, quant_min=-128, quant_max=127,
                                                  dtype=torch.qint8, qscheme=torch.per_channel_symmetric)
                                     for _ in range(2))
        self.inputs = nn.ModuleList(FakeQuantize(observer=MovingAverageMinMaxObserver, quant_min=0, quant_max=255,
                                                 dtype=torch.quint8, qscheme=torch.per_tensor_affine)
                                    for _ in range(2))

    def forward(self, x):
        conv, fc = self.net.conv, self.net.fc
        h = F.conv2d(self.inputs[0](x), self.weights[0](conv.weight), conv.bias)
        h = F.relu(self.net.bn(h)).mean(dim=(2, 3))
        return F.linear(self.inputs[1](h), self.weights[1](fc.weight), fc.bias)


def test_frozen_batchnorm_phase_evaluates_as_torch_ao_in_eval_mode():
    torch.manual_seed(0)
    model, reference = _ConvBN(), _TorchAo(_ConvBN())
    reference.net.load_state_dict(model.state_dict())
    qat = qstats.qat.prepare(model, qstats.minmax(WEIGHT_SPEC), qstats.moving_average_minmax(ACT_SPEC, 0.01))
    params = qat.params()
    state = qat.init(torch.zeros(1, 3, 6, 6))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _ in range(3):  # training steps' observations and batch statistics
            x = torch.randn(4, 3, 6, 6, generator=g) * 2
            reference(x)
            _, state = qat.apply(params, state, x, phase=qstats.QATPhase())
        x = torch.randn(4, 3, 6, 6, generator=g)
        reference.eval()
        for point in (*reference.weights, *reference.inputs):
            point.disable_observer()
        expected = reference(x)
        evaluate = qstats.QATPhase(observe=False, fake_quantize=True, freeze_batchnorm=True)
        out, after = qat.apply(params, state, x, phase=evaluate)
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
        assert torch.equal(after.batchnorm["bn"].running_mean, reference.net.bn.running_mean)
        # the model's eval mode does not switch batch norm: without the frozen flag it uses the batch's statistics
        qat.module.eval()
        batch_stats, _ = qat.apply(params, state, x, phase=evaluate._replace(freeze_batchnorm=False))
        assert not torch.allclose(batch_stats, expected, rtol=1e-3, atol=1e-3)
