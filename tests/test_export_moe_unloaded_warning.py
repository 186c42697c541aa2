"""The export warns where transformers' ``from_pretrained`` leaves the unpacked experts randomly
initialised (MISSING: its weight conversion for the model type merges no per-expert
``gate_proj``/``up_proj``/``down_proj`` name into the 3-D experts), and only there: the reference is
transformers loading the checkpoint itself (its missing keys), for families it merges and ones it does
not (tests/test_export_moe_transformers_loading.py holds the full list)."""

from __future__ import annotations

import warnings

import pytest

from _shared import exported_and_loaded

transformers = pytest.importorskip("transformers")
from test_export_moe_transformers_loading import w4_experts  # noqa: E402

WARNING = "leaves those experts randomly initialised"


@pytest.mark.parametrize("family", ["qwen3_moe", "cohere2_moe", "mixtral", "granitemoe", "phimoe", "minimax_m2",
                                    "gpt_oss"])
def test_warns_exactly_where_transformers_leaves_the_experts_missing(family, tmp_path, single_thread_quiet):
    model, qparams, recipe = w4_experts(family)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, info, _ = exported_and_loaded(model, qparams, recipe, tmp_path)
    messages = [str(c.message) for c in caught if WARNING in str(c.message)]
    missing = [key for key in info["missing_keys"] if ".experts." in key]
    assert bool(messages) == bool(missing), (messages, missing)
    if messages:
        assert len(messages) == 1 and repr(model.config.model_type) in messages[0]
        assert type(model).__name__ in messages[0] and "MISSING" in messages[0]
