"""`calibrate_layerwise` checks each batch's observation weight when it captures the batch, and its
errors name `calibrate_layerwise` (not the `calibrate` it runs per layer)."""

import pytest
import torch

import qstats
from _shared import saved_loaded_and_meta, tiny_llama_config


@pytest.mark.parametrize("weight, error, named", [
    (lambda batch: [1.0], TypeError, r"observation_weight\(batch\) must return a tensor or None, got list"),
    (lambda batch: -torch.ones(1, 6), ValueError, r"observation_weight\(batch\): .*negative, NaN or infinite"),
])
def test_a_bad_observation_weight_is_refused_under_calibrate_layerwise(tmp_path, weight, error, named):
    _, model = saved_loaded_and_meta(tmp_path, tiny_llama_config())
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("input",))])
    batches = [{"input_ids": torch.randint(0, 96, (1, 6))}]
    with pytest.raises(error, match=r"^calibrate_layerwise: " + named):
        qstats.calibrate_layerwise(model, str(tmp_path), batches, recipe, observation_weight=weight, progress=False)
