"""docs/migrating_llmcompressor.md's order of the samples ``oneshot`` reads from a ``datasets.Dataset`` with
``shuffle_calibration_samples=False`` (a moving average's checkpoint depends on it), against llm-compressor
0.14's own ``LengthAwareSampler``: longest first, samples of equal length in ``torch.argsort``'s order, which
is not stable (Python's ``sorted`` keeps equal lengths in dataset order: another order from 17 samples of
three lengths on)."""

from __future__ import annotations

import pathlib
import random
import re

import pytest
import torch

pytest.importorskip("llmcompressor")
datasets = pytest.importorskip("datasets")
from llmcompressor.datasets.utils import LengthAwareSampler  # noqa: E402

PAGE = pathlib.Path(__file__).resolve().parent.parent / "docs" / "migrating_llmcompressor.md"


def _documented_order(batches: list) -> list:
    """The page's expression of that order (the code span after "longest first,"), evaluated on ``batches``."""
    text = " ".join(PAGE.read_text().split())
    expression = re.search(r"longest first, `([^`]+)`", text).group(1)
    return eval(expression, {"torch": torch, "batches": batches})  # noqa: S307 (the page's own code)


@pytest.mark.parametrize("count", [8, 32, 512])
def test_documented_sample_order_is_llm_compressors(count):
    rng = random.Random(count)
    lengths = [rng.choice([8, 12, 16]) for _ in range(count)]
    dataset = datasets.Dataset.from_dict({"input_ids": [list(range(n)) for n in lengths]})
    want = list(LengthAwareSampler(dataset))
    batches = [{"input_ids": torch.arange(n).unsqueeze(0), "index": i} for i, n in enumerate(lengths)]
    got = [batch["index"] for batch in _documented_order(batches)]
    assert got == want
