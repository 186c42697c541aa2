"""A compressed-tensors config naming a `qstats_*` observer with bad `observer_kwargs` is refused when
the recipe is read, as the llm-compressor drop-in refuses them when made: before, `calibrate` ran
every batch and `compute_qparams_tree` raised after the whole calibration."""

import pytest
import torch

import qstats


def _config(observer, kwargs):
    return {"config_groups": {"g": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
        "input_activations": {"num_bits": 8, "type": "int", "symmetric": False, "strategy": "tensor",
                              "observer": observer, "observer_kwargs": kwargs}}}}


@pytest.mark.parametrize("observer, kwargs, named", [
    ("qstats_histogram", {"method": "percentile", "percentile": 120}, "percentile"),
    ("qstats_histogram", {"method": "entropy", "start_bin": 0}, "start_bin"),
    ("qstats_mse", {"patience": -1}, "patience"),
    ("qstats_mse", {"maxshrink": 2.0}, "maxshrink"),
    ("qstats_mse", {"averaging_constant": 0.1}, "averaging_constant"),
])
def test_bad_observer_kwargs_refused_when_read(observer, kwargs, named):
    with pytest.raises(ValueError, match=named):
        qstats.Recipe.from_compressed_tensors(_config(observer, kwargs))


def test_good_observer_kwargs_give_the_histograms_qparams():
    recipe = qstats.Recipe.from_compressed_tensors(
        _config("qstats_histogram", {"method": "percentile", "percentile": 99.0}))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    batches = [torch.randn(16, 8) for _ in range(3)]
    states = qstats.calibrate(model, batches, recipe, progress=False)
    got = qstats.compute_qparams_tree(states, recipe, model)["0"]["input"]

    spec = qstats.QuantSpec.from_compressed_tensors(
        _config("qstats_histogram", {})["config_groups"]["g"]["input_activations"])
    obs = qstats.histogram(spec)
    state = obs.init(batches[0])
    for x in batches:
        state = obs.update(state, x)
    want = qstats.compute_qparams(state, spec, method="percentile", percentile=99.0)
    assert torch.equal(got.scale, want.scale) and torch.equal(got.zero_point, want.zero_point)
