"""A sequence-first model's activations (``[tokens, batch, features]``) take the observation weight
transposed, ``[tokens, batch]``, as docs/calibrate.md says: its padding is then left out, as a
plain-torch selection of the non-padding tokens; a ``[batch, tokens]`` weight fits it only where
tokens equal batch, and then masks the transposed tokens."""

from __future__ import annotations

import warnings

import pytest
import torch

import qstats

RECIPE = qstats.Recipe([qstats.Rule("Linear", sites=("input",))])


def _calibrated(model, x, weight):
    return qstats.calibrate(model, [x], RECIPE, progress=False, observation_weight=lambda batch: weight)["0"]["input"]


def test_a_transposed_mask_leaves_out_the_padding_of_sequence_first_activations():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    x = torch.randn(4, 4, 8)  # [tokens, batch, features]
    x[0, 1] = 100.0  # sequence 1's first token, padding
    mask = torch.ones(4, 4)  # [batch, tokens]
    mask[1, 0] = 0
    kept = x.transpose(0, 1)[mask.bool()]  # plain torch: the non-padding tokens
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state = _calibrated(model, x, mask.T)
    assert torch.equal(state.max_val, kept.amax()) and torch.equal(state.min_val, kept.amin())
    assert torch.equal(_calibrated(model, x, mask).max_val, torch.tensor(100.0))  # tokens == batch: transposed
    with pytest.warns(UserWarning, match=r"observation weight of shape \(3, 4\) fits no observed activation"):
        _calibrated(model, x[:, :3], mask[:3])
