"""A model built on the meta device: calibrate points to qstats.calibrate_layerwise (a function that
exists; the hint named a module, "qstats.layerwise"), and report, which has no layer-by-layer form,
only says to load the weights."""
import pytest
import torch

import qstats


def _meta_and_trees():
    torch.manual_seed(0)
    real = torch.nn.Sequential(torch.nn.Linear(4, 4))
    recipe = qstats.Recipe.from_scheme("W8A8")
    batches = [torch.randn(2, 4)]
    states = qstats.calibrate(real, batches, recipe, progress=False)
    with torch.device("meta"):
        meta = torch.nn.Sequential(torch.nn.Linear(4, 4))
    return meta, recipe, batches, states, qstats.compute_qparams_tree(states, recipe.resolve(real))


def test_calibrate_names_the_layerwise_function():
    meta, recipe, batches, _, _ = _meta_and_trees()
    assert callable(qstats.calibrate_layerwise)
    with pytest.raises(ValueError, match=r"on the meta device .*qstats\.calibrate_layerwise\b"):
        qstats.calibrate(meta, batches, recipe, progress=False)


def test_report_only_says_to_load_the_weights():
    meta, recipe, batches, states, qparams = _meta_and_trees()
    with pytest.raises(ValueError, match=r"on the meta device and holds no data \(load the weights first\)$"):
        qstats.report(states, qparams, meta, recipe, batches)
