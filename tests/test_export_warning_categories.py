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
