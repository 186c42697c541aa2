"""Forwards that write their own buffers in place (a norm module of one's own calling ``F.batch_norm`` on its
running statistics, ``self.calls += 1``, ``self.ema.mul_(...)``): `qstats.qat.prepare` cannot put those buffers in
the QAT state, so ``qat.init`` and ``qat.apply`` change them, against the documented purity; it must say so,
naming the modules (it said nothing). Reference for what such a forward does: ``nn.BatchNorm2d``'s own update,
which a call of the model itself makes in the same way."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qstats

_OBSERVER = qstats.minmax(qstats.QuantSpec("int8"))


class _Norm(nn.Module):
    """A batch norm of one's own: F.batch_norm updates ``running_mean``/``running_var`` in place."""

    def __init__(self, channels: int):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(channels)), nn.Parameter(torch.zeros(channels))
        self.register_buffer("running_mean", torch.zeros(channels))
        self.register_buffer("running_var", torch.ones(channels))

    def forward(self, x):
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, self.training, 0.1, 1e-5)


class _Counting(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros(()))
        self.register_buffer("ema", torch.zeros(4))

    def forward(self, x):
        self.calls += 1
        self.ema.mul_(0.9).add_(x.mean(0).detach(), alpha=0.1)
        return self.fc(x)


class _Reading(nn.Module):
    """Reads its buffers only (running statistics in eval mode, an out-of-place add): nothing to name."""

    def __init__(self):
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(4))
        self.register_buffer("running_var", torch.ones(4))

    def forward(self, x):
        return F.batch_norm(x, self.running_mean, self.running_var, training=False) + self.running_mean.add(1)


def test_own_batch_norm_updating_its_buffers_is_named():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Sequential(_Norm(4)), nn.ReLU())
    reference = nn.BatchNorm2d(4, momentum=0.1)
    with pytest.warns(UserWarning, match=r"the forwards of \['1\.0'\] write their buffers in place"):
        qat = qstats.qat.prepare(model, _OBSERVER)
    x = torch.randn(2, 3, 6, 6)
    state = qat.init(x)
    model[1][0].running_mean.zero_(), model[1][0].running_var.fill_(1)
    qat.apply(qat.params(), state, x, phase=qstats.QATPhase(observe=True, fake_quantize=False))
    reference(model[0](x))  # what the warning says happens: nn.BatchNorm's update of the buffers
    torch.testing.assert_close(model[1][0].running_mean, reference.running_mean)
    torch.testing.assert_close(model[1][0].running_var, reference.running_var)


def test_in_place_buffer_updates_are_named_and_reading_buffers_is_not():
    with pytest.warns(UserWarning, match=r"the forwards of \['0'\] write their buffers in place"):
        qstats.qat.prepare(nn.Sequential(_Counting(), nn.Linear(4, 4)), _OBSERVER)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qstats.qat.prepare(nn.Sequential(nn.Linear(4, 4), _Reading()), _OBSERVER)
        qstats.qat.prepare(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)), _OBSERVER)  # made pure by prepare
