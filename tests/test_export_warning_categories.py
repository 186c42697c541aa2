"""The export's warnings have a category of their own, `qstats.export.ExportWarning` (a UserWarning), and
the one for experts transformers loads back as random weights (Mixtral) its subclass
`qstats.export.UnloadedExpertsWarning`: ``warnings.simplefilter("ignore", UnloadedExpertsWarning)``
silences exactly that warning (one exporting for vLLM, which reads the experts, filters it), the
others still shown. The reference for which warning it is: transformers' own loading of the checkpoint
(its MISSING experts, tests/test_export_moe_unloaded_warning.py)."""

from __future__ import annotations

import warnings

import pytest
import torch

import qstats

transformers = pytest.importorskip("transformers")
from test_export_moe_transformers_loading import w4_experts  # noqa: E402

UNLOADED = "leaves those experts randomly initialised"


def _exported(tmp_path, name, *filters) -> list:
    """The warnings of the export of a tiny Mixtral's int4 experts, calibrated in float32 and written
    in bfloat16 (scales rounded: another export warning), under ``filters`` (``(action, category)``
    each, after ``"always"``)."""
    model, qparams, recipe = w4_experts("mixtral")
    model = model.to(torch.bfloat16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.warn("export: a warning of the model's rounding", qstats.export.ExportWarning)  # shown by every filter below
        for action, category in filters:
            warnings.simplefilter(action, category)
        qstats.export.compressed_tensors(model, qparams, str(tmp_path / name), recipe)
    return caught


def test_ignoring_unloaded_experts_warning_silences_exactly_it(tmp_path):
    shown = _exported(tmp_path, "shown")
    unloaded = [c for c in shown if UNLOADED in str(c.message)]
    assert len(unloaded) == 1 and unloaded[0].category is qstats.export.UnloadedExpertsWarning
    assert issubclass(qstats.export.UnloadedExpertsWarning, qstats.export.ExportWarning)
    assert issubclass(qstats.export.ExportWarning, UserWarning)  # filters on UserWarning still apply
    others = [str(c.message) for c in shown if UNLOADED not in str(c.message)]
    assert len(others) > 1 and any("rounded" in message for message in others)  # the test's own, and the export's

    filtered = _exported(tmp_path, "filtered", ("ignore", qstats.export.UnloadedExpertsWarning))
    assert [str(c.message) for c in filtered] == others


def test_every_export_warning_is_an_export_warning(tmp_path):
    shown = _exported(tmp_path, "shown")
    assert shown and all(issubclass(c.category, qstats.export.ExportWarning) for c in shown), \
        [(c.category, str(c.message)[:80]) for c in shown]
    ignored = _exported(tmp_path, "ignored", ("ignore", qstats.export.ExportWarning))
    assert [str(c.message) for c in ignored] == ["export: a warning of the model's rounding"]  # the test's own, before the filter


def test_the_layerwise_exports_unread_checkpoint_tensors_warning_is_an_export_warning(tmp_path):
    """``compressed_tensors_layerwise`` of a model built from a config of fewer layers than its checkpoint
    warns naming the tensors it does not read (those ``from_pretrained`` reports unexpected, the reference);
    that warning was a plain UserWarning, which ``simplefilter("ignore", ExportWarning)`` left shown."""
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    torch.manual_seed(0)
    checkpoint = str(tmp_path / "checkpoint")
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(checkpoint)
    smaller = transformers.LlamaConfig(**{**config.to_dict(), "num_hidden_layers": 2})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, info = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, config=smaller, output_loading_info=True)
    assert info["unexpected_keys"]
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(smaller).eval()
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("weight",),
                                        spec=qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0)))])
    states = qstats.calibrate_layerwise(model, checkpoint, [{"input_ids": torch.zeros(1, 4, dtype=torch.long)}],
                                        recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe.resolve(model))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qstats.export.compressed_tensors_layerwise(model, checkpoint, qparams, str(tmp_path / "ours"), recipe,
                                                   progress=False)
    unread = [c for c in caught if "has no tensor for" in str(c.message)]
    assert len(unread) == 1 and issubclass(unread[0].category, qstats.export.ExportWarning)
    assert str(len(info["unexpected_keys"])) in str(unread[0].message)
