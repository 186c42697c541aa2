"""Observation weights are masks (0 leaves a row out, any other value keeps it once): a weight function
returning NaN, a negative or an infinite value is refused by name by `calibrate`, `observing` and
`report`, where every observer would otherwise keep such rows as weighted ones."""

from __future__ import annotations

import pytest
import torch

import qstats


def _model_and_recipe():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2)).eval()
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("weight", "input"), observer=qstats.hessian)])
    return model, recipe


BAD = {
    "nan": torch.tensor([[1.0, float("nan"), 1.0]]),
    "negative": torch.tensor([[1.0, -1.0, 1.0]]),
    "negative int": torch.tensor([[1, -1, 1]]),
    "inf": torch.tensor([[1.0, float("inf"), 1.0]]),
}


@pytest.mark.parametrize("kind", sorted(BAD))
def test_calibrate_and_report_refuse_a_weight_that_is_not_a_mask(kind):
    # a NaN or -1 weight used to keep its row, as a weight of 1
    model, recipe = _model_and_recipe()
    x = torch.randn(1, 3, 4)
    weight = BAD[kind]
    with pytest.raises(ValueError, match=r"calibrate: observation_weight\(batch\): .* negative, NaN or infinite"):
        qstats.calibrate(model, [x], recipe, progress=False, observation_weight=lambda batch: weight)
    minmax = qstats.Recipe([qstats.Rule("Linear", sites=("weight", "input"))])  # hessians give no qparams to report
    states = qstats.calibrate(model, [x], minmax, progress=False)
    qparams = qstats.compute_qparams_tree(states, minmax, model)
    with pytest.raises(ValueError, match=r"report: observation_weight\(batch\): .* negative, NaN or infinite"):
        qstats.report(states, qparams, model=model, recipe=minmax, batches=[x], observation_weight=lambda batch: weight)
    with qstats.observing(model, recipe) as session:
        with pytest.raises(ValueError, match=r"observing: .* negative, NaN or infinite"):
            with session.weighted(weight):
                model(x)


def test_a_mask_of_any_positive_values_keeps_the_rows_a_zero_one_mask_keeps():
    model, recipe = _model_and_recipe()
    x = torch.randn(2, 3, 4)
    keep = torch.tensor([[1, 0, 1], [1, 1, 0]])
    for weight in (keep, keep.bool(), keep * 0.25):
        states = qstats.calibrate(model, [x], recipe, progress=False, observation_weight=lambda batch: weight)
        rows = x[keep.bool()]
        assert int(states["0"]["input"].count) == rows.shape[0]
        torch.testing.assert_close(states["0"]["input"].total.double(), rows.double().T @ rows.double())
