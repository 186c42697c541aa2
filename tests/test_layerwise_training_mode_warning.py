"""A meta model left in training mode (attention dropout): `calibrate_layerwise` and `gptq_layerwise`
warn as `qstats.calibrate` warns on the loaded model (the reference), once, naming the module by its
path in the model. They warned once per layer, as 'calibrate', naming 'layer.self_attn' (the path
inside the runner of one layer), a module the model does not have."""

from __future__ import annotations

import warnings

import pytest
import torch

import qstats

transformers = pytest.importorskip("transformers")
from _shared import save_sharded, tiny_llama_config  # noqa: E402

SPEC = qstats.QuantSpec(dtype="int4", granularity=qstats.PerAxis(0))
RECIPE = qstats.Recipe([qstats.Rule("Linear", sites=("input", "weight"), spec=SPEC)], ignore=["lm_head"])


def _training_mode_warnings(call) -> list:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    return [str(warning.message) for warning in caught if "is in training mode" in str(warning.message)]


@pytest.mark.parametrize("where", ["calibrate_layerwise", "gptq_layerwise"])
def test_a_model_in_training_mode_is_named_once_by_its_path_in_the_model(tmp_path, where):
    config = tiny_llama_config(attention_dropout=0.5)
    torch.manual_seed(0)
    directory = save_sharded(tmp_path, transformers.AutoModelForCausalLM.from_config(config))
    batches = [{"input_ids": torch.randint(0, 96, (2, 6))} for _ in range(2)]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(directory).train()
    reference = _training_mode_warnings(lambda: qstats.calibrate(loaded, batches, RECIPE, progress=False))
    assert len(reference) == 1 and "'model.layers.0.self_attn'" in reference[0]
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config)  # training mode, as built
    got = _training_mode_warnings(lambda: getattr(qstats, where)(meta, directory, batches, RECIPE, progress=False))
    assert got == [reference[0].replace("calibrate:", f"{where}:", 1)]


def test_a_warning_of_every_layer_is_shown_once_as_calibrate_shows_it(tmp_path, monkeypatch):
    """Under the default filter, a warning each layer's calibration repeats (an observation weight
    fitting no activation) is shown once, as `qstats.calibrate` shows it once over its batches; the
    filter hiding the layers' training-mode warnings is set once for the run (set around each layer,
    it showed it once per layer and once after them)."""
    config = tiny_llama_config()
    torch.manual_seed(0)
    directory = save_sharded(tmp_path, transformers.AutoModelForCausalLM.from_config(config))
    batches = [{"input_ids": torch.randint(0, 96, (2, 6))} for _ in range(3)]
    unfitting = lambda batch: torch.ones(3)  # noqa: E731

    def shown(call) -> list:
        messages: list = []
        with warnings.catch_warnings():
            warnings.resetwarnings()
            warnings.simplefilter("default")
            monkeypatch.setattr(warnings, "showwarning", lambda message, *rest, **options: messages.append(str(message)))
            call()
        monkeypatch.undo()
        return [message for message in messages if "fits no observed activation" in message]

    loaded = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    reference = shown(lambda: qstats.calibrate(loaded, batches, RECIPE, progress=False, observation_weight=unfitting))
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config).eval()
    got = shown(lambda: qstats.calibrate_layerwise(meta, directory, batches, RECIPE, progress=False,
                                                   observation_weight=unfitting))
    # named after the caller, as its training-mode warning is
    assert len(reference) == 1 and got == [reference[0].replace("calibrate:", "calibrate_layerwise:", 1)]
