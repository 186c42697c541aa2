"""``nn.RReLU`` draws random negative slopes in training mode, and an instance norm tracking running
statistics updates them there (and normalises by each instance's statistics, not the running ones):
calibrating either in training mode warns naming it, as for dropout and batch norm; in eval mode, or
an instance norm without running statistics (the same in both modes), it does not."""

from __future__ import annotations

import warnings

import pytest
import torch

import qstats

RECIPE = qstats.Recipe([qstats.Rule("Linear", sites=("input",))])


def _model(middle: torch.nn.Module) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), middle, torch.nn.Linear(4, 4))


def _batches():
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(2, 4, 4, generator=generator) for _ in range(2)]


def _calibrates_without_warning(model) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qstats.calibrate(model, _batches(), RECIPE, progress=False)


def test_rrelu_in_training_mode_warns_and_in_eval_mode_does_not():
    rrelu = torch.nn.RReLU(0.1, 0.3).train()
    x = -torch.ones(64)
    torch.manual_seed(2)
    assert torch.unique(rrelu(x)).numel() > 1  # torch: a random slope per element while training
    model = _model(rrelu).train()
    with pytest.warns(UserWarning, match=r"calibrate: module '1' \(RReLU\) is in training mode"):
        qstats.calibrate(model, _batches(), RECIPE, progress=False)
    model.eval()
    assert torch.equal(rrelu(x), torch.full_like(x, -0.2))  # eval: the mean slope (0.1 + 0.3) / 2
    _calibrates_without_warning(model)


def test_instance_norm_with_running_statistics_in_training_mode_warns():
    norm = torch.nn.InstanceNorm1d(4, track_running_stats=True)
    model = _model(norm).train()
    with pytest.warns(UserWarning, match=r"calibrate: module '1' \(InstanceNorm1d\) is in training mode"):
        qstats.calibrate(model, _batches(), RECIPE, progress=False)
    assert not torch.equal(norm.running_mean, torch.zeros(4))  # torch updated them while training
    model.eval()
    _calibrates_without_warning(model)


def test_instance_norm_without_running_statistics_does_not_warn():
    norm = torch.nn.InstanceNorm1d(4)
    x = torch.randn(2, 4, 4, generator=torch.Generator().manual_seed(3))
    assert torch.equal(norm.train()(x), norm.eval()(x))  # the same in both modes
    _calibrates_without_warning(_model(norm).train())
