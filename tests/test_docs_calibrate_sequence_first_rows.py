"""docs/calibrate.md: a sequence-first model that flattens its ``[tokens, batch, features]``
activations to rows (``x.reshape(-1, features)``, tokens-major) takes a ``[batch, tokens]``
observation weight by its element count, in the wrong order and without a warning; the transposed
weight leaves its padding out, as a plain-torch selection of the non-padding rows."""

from __future__ import annotations

import warnings

import torch

import qstats


class SequenceFirstRows(torch.nn.Module):
    """A projection of the flattened tokens of a sequence-first input."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        tokens, batch, features = x.shape
        return self.proj(x.reshape(tokens * batch, features)).reshape(tokens, batch, features)


def _observed(x, weight):
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("input",))])
    model = SequenceFirstRows().eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = qstats.calibrate(model, [x], recipe, progress=False, observation_weight=lambda batch: weight)
    return state["proj"]["input"], [str(warning.message) for warning in caught]


def test_flattened_sequence_first_rows_take_the_weight_transposed():
    torch.manual_seed(0)
    x = torch.randn(3, 2, 8)  # [tokens, batch, features]: tokens differ from batch
    x[2, 0] = 100.0  # sequence 0's last token, padding
    mask = torch.ones(2, 3)  # [batch, tokens]
    mask[0, 2] = 0
    kept = x.transpose(0, 1)[mask.bool()]  # plain torch: the non-padding tokens
    state, caught = _observed(x, mask.T)
    assert torch.equal(state.max_val, kept.amax()) and torch.equal(state.min_val, kept.amin())
    assert not caught
    wrong, caught = _observed(x, mask)  # [batch, tokens]: fits the rows by count, masks another row
    assert torch.equal(wrong.max_val, torch.tensor(100.0)) and not caught
