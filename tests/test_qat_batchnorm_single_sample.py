"""A batch of one value per channel (one sample of a Linear+BatchNorm1d model) through a frozen batch norm.

Reference: ``nn.BatchNorm1d`` in eval mode (torch.ao's QAT ConvBn/LinearBn after ``freeze_bn_stats``), which
normalises one sample with its running statistics. A tensor ``freeze_batchnorm`` (a tensor-step `QATSchedule`)
computes both sides, and the training side of one value per channel is F.batch_norm's error: it must name the
batch norm and the way out, not claim it is training."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qstats


def test_one_sample_through_a_frozen_batch_norm():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    qat = qstats.qat.prepare(model, qstats.minmax(qstats.QuantSpec("int8")))
    x = torch.randn(8, 4)
    _, state = qat.apply(qat.params(), qat.init(x), x, phase=qstats.QATPhase(observe=True, fake_quantize=False))
    model.load_state_dict(qat.state_dict(qat.params(), state))
    one = torch.randn(1, 4)
    out, _ = qat.apply(qat.params(), state, one,
                       phase=qstats.QATPhase(observe=False, fake_quantize=False, freeze_batchnorm=True))
    torch.testing.assert_close(out, model.eval()(one))
    with pytest.raises(ValueError, match=r"batch norm '1' gets one value per channel \(input \[1, 4\]\).*"
                                         r"freeze_batchnorm=True as a Python bool"):
        qat.apply(qat.params(), state, one, phase=qstats.QATSchedule(0, 0, 0, freeze_batchnorm_at=0)(torch.tensor(3)))
