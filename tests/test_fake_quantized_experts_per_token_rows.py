"""`fake_quantized` of a stacked-experts module whose input sites take per-token scales at run time
(W8A8's and FP8_DYNAMIC's experts): the rows of every expert in one call, expert-parallel sentinel
ids among them, against torch.ao's MinMaxObserver of each row alone."""

from __future__ import annotations

import pytest
import torch

import qstats

pytest.importorskip("transformers")

from test_fake_quantized_experts import _by_hand, _qwen3_experts  # noqa: E402


def _per_token_int8(rows, *where):
    """Each row of ``rows`` fake-quantized (int8, symmetric) under the scale torch.ao's
    MinMaxObserver takes of that row alone: a dynamic per-token input's run-time scale."""
    from torch.ao.quantization.observer import MinMaxObserver

    out = []
    for row in rows:
        observer = MinMaxObserver(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric)
        observer(row)
        scale, zero_point = observer.calculate_qparams()
        out.append(torch.fake_quantize_per_tensor_affine(row, float(scale), int(zero_point), -128, 127))
    return torch.stack(out) if out else rows


@pytest.mark.parametrize("implementation", ["batched_mm", "grouped_mm"])
def test_per_token_runtime_rows_with_sentinel_ids(implementation, single_thread_quiet):
    """Per-token scales come from each row alone, whichever expert takes it; the slots of sentinel
    ids (8 of 8 experts, routing weight 0) contribute nothing (grouped_mm: their rows stay float)."""
    layer = _qwen3_experts(implementation)
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(6, 16, generator=generator)
    spec = qstats.QuantSpec(dtype="int8", mapping="symmetric", granularity=qstats.PerToken())
    recipe = qstats.Recipe([qstats.Rule("Qwen3MoeExperts", sites=("input", "down_proj.input"), spec=spec,
                                        dynamic=True)])
    index = torch.tensor([[0, 8], [1, 2], [8, 3], [3, 4], [5, 6], [1, 8]])
    weights = torch.rand(6, 2, generator=generator) * (index < 8)
    qparams = qstats.compute_qparams_tree(
        qstats.calibrate(layer, [(hidden, index, weights)], recipe, progress=False), recipe, layer)

    with torch.no_grad():
        with qstats.fake_quantized(layer, qparams, recipe):
            ours = layer(hidden, index, weights)
        expected = _by_hand(layer.experts, _per_token_int8, hidden, index, weights)
        float_out = _by_hand(layer.experts, lambda rows, *where: rows, hidden, index, weights)
    assert (expected - float_out).abs().max() > 1e-3  # the quantization matters
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-5)
