"""The drop-ins on NVFP4 input activations (``tensor_group``, ``dynamic="local"``: only the global scale is
calibrated) observing 2-D ``(tokens, features)`` inputs, as llm-compressor's linearized MoE experts pass their
routed rows, against llm-compressor 0.14's own observers on the same batches. llm-compressor's view of a 2-D
input (``flatten_for_calibration``) has no group dimension, so its ``minmax`` and ``mse`` average (or search)
the tensor's range, not each group's as they do for 3-D inputs; the drop-ins averaged each group of 16
features there too (global scales 1-48% off llm-compressor's on these batches)."""

from __future__ import annotations

import pytest
import torch
from _shared import bit_equal, nvfp4_input_global_scale

pytest.importorskip("qstats.llmcompressor")  # registers the qstats_* observers


def _batches(seed: int, rows: bool) -> list:
    """Batches of different lengths whose groups of 16 features have different ranges from batch to batch:
    ``(tokens, 64)`` rows, or the same values as ``(1, tokens, 64)`` sequences."""
    g = torch.Generator().manual_seed(seed)
    batches = [torch.randn(5 + i, 64, generator=g) * torch.rand(4, generator=g).repeat_interleave(16) * 4
               for i in range(6)]
    return batches if rows else [x.unsqueeze(0) for x in batches]


CASES = [  # (llm-compressor's observer, its kwargs, the drop-in, its kwargs)
    ("minmax", {}, "qstats_minmax", {}),
    ("minmax", {"averaging_constant": 0.3}, "qstats_minmax", {"averaging_constant": 0.3}),
    ("mse", {"averaging_constant": 0.3}, "qstats_mse", {"mode": "moving_average", "averaging_constant": 0.3}),
    ("memoryless_mse", {}, "qstats_mse", {"mode": "moving_average", "averaging_constant": 1.0}),
    ("static_minmax", {}, "qstats_static_minmax", {}),
    ("memoryless_minmax", {}, "qstats_memoryless_minmax", {}),
]


@pytest.mark.parametrize("rows", [True, False], ids=["2d", "3d"])
@pytest.mark.parametrize("theirs, their_kwargs, ours, our_kwargs", CASES, ids=lambda v: str(v) if v else "-")
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_nvfp4_input_global_scale_of_rows_equals_llmcompressor(theirs, their_kwargs, ours, our_kwargs, seed, rows):
    batches = _batches(seed, rows)
    want = nvfp4_input_global_scale(theirs, their_kwargs, batches)
    got = nvfp4_input_global_scale(ours, our_kwargs, batches)
    assert got.shape == want.shape and bit_equal(got, want), (got, want)
