"""The ``qstats_minmax`` and ``qstats_mse`` (``mode="moving_average"``) drop-ins on NVFP4 input activations
(``tensor_group``, ``dynamic="local"``: only the global scale is calibrated) against llm-compressor 0.14's own
``minmax`` and ``mse`` observers on the same batches: both average (or search) each group of 16 features over
the batches and take the global scale from the largest group, and so do the drop-ins (they averaged or
searched the whole tensor's range: other global scales)."""

from __future__ import annotations

import pytest
import torch
from _shared import bit_equal, nvfp4_input_global_scale

pytest.importorskip("llmcompressor")
import qstats.llmcompressor  # noqa: E402,F401  (registers the qstats_* observers)


def _batches(seed: int) -> list:
    """Batches of different lengths whose groups of features have different ranges from batch to batch."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(1, 10, 64), (1, 14, 64), (2, 7, 64), (1, 5, 64)]
    return [torch.randn(shape, generator=g) * torch.rand(64, generator=g).mul(8).exp() for shape in shapes]


CASES = [  # (llm-compressor's observer, its kwargs, the drop-in, its kwargs)
    ("minmax", {}, "qstats_minmax", {}),
    ("minmax", {"averaging_constant": 0.3}, "qstats_minmax", {"averaging_constant": 0.3}),
    ("mse", {}, "qstats_mse", {"mode": "moving_average"}),
    ("mse", {"averaging_constant": 0.5, "patience": 1}, "qstats_mse",
     {"mode": "moving_average", "averaging_constant": 0.5, "patience": 1}),
]


@pytest.mark.parametrize("theirs, their_kwargs, ours, our_kwargs", CASES, ids=lambda v: str(v) if v else "-")
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_nvfp4_input_global_scale_equals_llmcompressor(theirs, their_kwargs, ours, our_kwargs, seed):
    batches = _batches(seed)
    want = nvfp4_input_global_scale(theirs, their_kwargs, batches)
    got = nvfp4_input_global_scale(ours, our_kwargs, batches)
    assert got.shape == want.shape and bit_equal(got, want), (got, want)

