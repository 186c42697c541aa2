"""QAT models with normalisation layers other than a plain tracking ``nn.BatchNorm``.

References: torch.ao ``FakeQuantize`` modules wired around the same layers (a batch norm without
running statistics, ``track_running_stats=False``, normalises every batch with its own statistics in
train and eval mode and updates nothing, so ``prepare`` keeps it as it is), and the buffers of the
model's own ``InstanceNorm`` / ``SyncBatchNorm`` layers.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qstats
from _qat_torch_ao_reference import ACT_SPEC, W_SPEC, activation_fake_quant, train_beside_reference, weight_fake_quant


def _model():
    return nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4, track_running_stats=False), nn.ReLU(),
                         nn.Flatten(), nn.Linear(16, 3))


class _Reference(nn.Module):
    """``_model()`` with torch.ao FakeQuantize modules on each layer's input and weight."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.a_conv, self.a_linear, self.w_conv, self.w_linear = activation_fake_quant(), activation_fake_quant(), weight_fake_quant(), weight_fake_quant()

    def forward(self, x):
        conv, bn, linear = self.model[0], self.model[1], self.model[4]
        h = F.conv2d(self.a_conv(x), self.w_conv(conv.weight), conv.bias)
        h = F.relu(bn(h)).flatten(1)
        return F.linear(self.a_linear(h), self.w_linear(linear.weight), linear.bias)


@pytest.mark.parametrize("training", [True, False])
def test_batchnorm_without_running_statistics_trains_as_torch_ao_fake_quant_modules(training):
    torch.manual_seed(0)
    model, reference = _model(), _Reference(_model())
    with torch.no_grad():
        model[1].weight.uniform_(0.5, 1.5)
        model[1].bias.uniform_(-0.5, 0.5)
    reference.model.load_state_dict(model.state_dict())
    model.train(training), reference.train(training)
    qat = qstats.qat.prepare(model, qstats.moving_average_minmax(W_SPEC, 0.01),
                             qstats.moving_average_minmax(ACT_SPEC, 0.01))
    assert qat.batchnorm_layers == ()
    g = torch.Generator().manual_seed(1)
    state = qat.init(torch.zeros(2, 2, 4, 4))
    params = {name: p.detach().clone() for name, p in qat.params().items()}
    batches = [(torch.randn(5, 2, 4, 4, generator=g) * (step + 1), torch.randint(0, 3, (5,), generator=g))
               for step in range(3)]
    params, state, _ = train_beside_reference(qat, params, state, reference, reference.model, batches,
                                              F.cross_entropy, phase=qstats.QATPhase())
    assert state.batchnorm == {}
    for key, fq in (("0", reference.a_conv), ("4", reference.a_linear)):
        qp = qstats.compute_qparams(state.activations[key], ACT_SPEC)
        torch.testing.assert_close(qp.scale.reshape(-1), fq.scale.reshape(-1), rtol=1e-6, atol=0)


def test_sync_batchnorm_is_named_in_a_warning_and_normalises_each_ranks_batch():
    # SyncBatchNorm normalises with the statistics of every rank's batch (and refuses CPU tensors when
    # several ranks run); the rewritten model computes each rank's own batch norm, which prepare says.
    torch.manual_seed(0)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4)))
    reference = nn.BatchNorm2d(4)
    reference.load_state_dict(model[1].state_dict())
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        qat = qstats.qat.prepare(model, qstats.minmax(W_SPEC))
    assert any("SyncBatchNorm layers ['1']" in str(w.message) for w in record)
    x = torch.randn(3, 2, 5, 5)
    out, state = qat.apply(qat.params(), qat.init(x), x, phase=qstats.QATPhase(False, False, False))
    torch.testing.assert_close(out, reference(model[0](x)))
    torch.testing.assert_close(state.batchnorm["1"].running_var, reference.running_var)


@pytest.mark.parametrize("track_running_stats", [True, False])
def test_instance_norm_that_tracks_running_statistics_is_named_in_a_warning(track_running_stats):
    # its running statistics are buffers that every training-mode call updates in place, as the warning says
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 3), nn.InstanceNorm2d(4, track_running_stats=track_running_stats))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        qat = qstats.qat.prepare(model, qstats.minmax(W_SPEC))
    warned = [str(w.message) for w in record if "instance norms ['1']" in str(w.message)]
    assert len(warned) == int(track_running_stats)
    if track_running_stats:
        x = torch.randn(3, 2, 5, 5)
        before = model[1].running_mean.clone()
        qat.apply(qat.params(), qat.init(x), x)
        assert not torch.equal(model[1].running_mean, before)
