"""Claims of the docs checked against an independent computation or the reference library itself."""

from __future__ import annotations

import pytest
import torch

import qstats


def test_mean_std_takes_the_population_std_of_x():
    """docs/observers.md: ``"mean_std"`` is ``mean ± k * std`` of x with the population std (not
    Brevitas' ``E|x| + k * std(|x|)`` with the unbiased variance)."""
    x = torch.tensor([0.5, -1.0, 3.0, 2.0], dtype=torch.float64)
    obs = qstats.moments(qstats.QuantSpec(dtype="int8"))
    state = obs.update(obs.init(x.float()), x.float())
    mean, std = x.mean(), x.std(correction=0)
    expected = max(abs(mean - 3 * std), abs(mean + 3 * std)) / 127.5
    scale = qstats.compute_qparams(state, obs.spec, method="mean_std").scale
    assert float(scale) == pytest.approx(float(expected), rel=1e-6)
    unbiased = max(abs(mean - 3 * x.std()), abs(mean + 3 * x.std())) / 127.5
    assert float(scale) != pytest.approx(float(unbiased), rel=1e-3)


@pytest.mark.parametrize("observer", ["imatrix_mse", "nvfp4_expanded_imatrix"])
def test_llm_compressor_imatrix_observers_are_refused_by_name(observer):
    """docs/recipes.md: a scheme or checkpoint config naming llm-compressor's imatrix observers is
    refused with a ValueError naming the observer (no silent fallback to another search)."""
    llmcompressor_observers = pytest.importorskip("llmcompressor.observers")
    assert observer.replace("_", "-") in llmcompressor_observers.Observer.registered_names()  # the reference has it
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128,
               "observer": observer}
    with pytest.raises(ValueError, match=observer):
        qstats.Recipe.from_scheme({"targets": ["Linear"], "weights": weights})
    config = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": [],
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}}
    with pytest.raises(ValueError, match=observer):
        qstats.Recipe.from_compressed_tensors(config)
