"""torch's ``nn.MultiheadAttention`` drops attention weights out in training mode through its
``dropout`` float (no ``nn.Dropout`` child): calibrating it in training mode warns, naming it, as
for dropout modules, and in eval mode or with ``dropout=0`` it does not. (The recipes observe
``head`` only: the attention's functional forward reads ``out_proj``'s weights without calling it.)"""

from __future__ import annotations

import warnings

import pytest
import torch

import qstats


class SelfAttention(torch.nn.Module):
    def __init__(self, dropout: float):
        super().__init__()
        self.attention = torch.nn.MultiheadAttention(16, 2, dropout=dropout, batch_first=True)
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.attention(x, x, x, need_weights=False)[0])


def test_multihead_attention_dropout_in_training_mode_warns():
    torch.manual_seed(0)
    model = SelfAttention(dropout=0.5)
    assert not any(isinstance(m, torch.nn.Dropout) for m in model.modules())
    x = torch.randn(2, 5, 16)
    with torch.no_grad():  # training mode is random in torch itself: the warning is due
        assert not torch.equal(model(x), model(x))
    recipe = qstats.Recipe([qstats.Rule("head", sites=("input",))])
    with pytest.warns(UserWarning, match=r"module 'attention' \(MultiheadAttention\) is in training mode"):
        qstats.calibrate(model, [x], recipe, progress=False)
    model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qstats.calibrate(model, [x], recipe, progress=False)


def test_multihead_attention_without_dropout_does_not_warn():
    torch.manual_seed(0)
    model = SelfAttention(dropout=0.0)  # training mode: the same outputs as in eval mode
    x = torch.randn(2, 5, 16)
    with torch.no_grad():  # (eval mode runs torch's fused fast path: equal to the last bits)
        torch.testing.assert_close(model(x), model.eval()(x))
    model.train()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qstats.calibrate(model, [x], qstats.Recipe([qstats.Rule("head", sites=("input",))]), progress=False)
