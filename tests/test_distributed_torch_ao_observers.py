"""qstats' torch.ao drop-in observers (`qstats.torch_ao.QstatsObserver`) on 2 gloo ranks, each fed
its shard of the batches, their states merged with ``qstats.distributed.all_reduce(module.state,
module.observer)`` and set back: against torch.ao's own observers fed every batch in one process,

- ``MinMaxObserver`` and ``PerChannelMinMaxObserver``: the same ``min_val``/``max_val`` and
  ``calculate_qparams``, bit for bit;
- ``HistogramObserver``: the same exact extremes and as many values counted (its bins differ by
  design, docs/differences.md), and the state one process's drop-in gets, bit for bit.
"""

from __future__ import annotations

import os
import sys
import traceback
import warnings
from datetime import timedelta

import pytest
import torch
from torch.ao.quantization import observer as ao

from qstats import distributed, torch_ao

sys.path.insert(0, os.path.dirname(__file__))
from _shared import exit_rank, fork_ranks, gloo_group  # noqa: E402

WORLD = 2


def batches() -> list:
    generator = torch.Generator().manual_seed(3)
    return [torch.randn(4, 8, generator=generator) * (i + 1) + 0.1 * i for i in range(5)]


def pairs() -> dict:
    """name: (qstats drop-in, torch.ao's observer)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {
            "MinMaxObserver": (torch_ao.default_observer(), ao.default_observer()),
            "PerChannelMinMaxObserver": (torch_ao.default_per_channel_weight_observer(),
                                         ao.default_per_channel_weight_observer()),
            "affine per channel": (torch_ao.QstatsObserver(qscheme=torch.per_channel_affine, ch_axis=1),
                                   ao.PerChannelMinMaxObserver(ch_axis=1)),
            "HistogramObserver": (torch_ao.default_histogram_observer(), ao.default_histogram_observer()),
        }


def _rank(rank: int, port: int, out: str) -> None:
    results: dict = {}
    try:
        with gloo_group(rank, port, world=WORLD, timeout=timedelta(seconds=30)):
            for name, (module, _) in pairs().items():
                for x in batches()[rank::WORLD]:
                    module(x)
                module.set_state(distributed.all_reduce({"state": module.state}, module.observer)["state"])
                results[name] = (module.state, module.calculate_qparams())
    except Exception:
        results["crash"] = traceback.format_exc()
    torch.save(results, os.path.join(out, f"ao{rank}.pt"))
    exit_rank(0)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("ao")
    codes = fork_ranks(_rank, str(out), world=WORLD, timeout=120)
    files = [out / f"ao{rank}.pt" for rank in range(WORLD)]
    results = [torch.load(f, weights_only=False) if f.exists() else {"crash": "no results"} for f in files]
    assert codes == [0] * WORLD and not any("crash" in r for r in results), (codes, results)
    return results


@pytest.fixture(scope="module")
def one_process():
    """name: (the drop-in fed every batch, torch.ao's observer fed every batch)."""
    observers = pairs()
    for module, reference in observers.values():
        for x in batches():
            module(x)
            reference(x)
    return observers


@pytest.mark.parametrize("name", ["MinMaxObserver", "PerChannelMinMaxObserver", "affine per channel"])
def test_minmax_drop_ins_merged_equal_torch_ao_fed_every_batch(ranks, one_process, name):
    _, reference = one_process[name]
    scale, zero_point = reference.calculate_qparams()
    for rank, result in enumerate(ranks):
        state, (got_scale, got_zero_point) = result[name]
        assert torch.equal(state.min_val, reference.min_val) and torch.equal(state.max_val, reference.max_val), rank
        assert torch.equal(got_scale, scale) and torch.equal(got_zero_point, zero_point), (rank, got_scale, scale)


def test_histogram_drop_in_merged_keeps_torch_ao_extremes_and_count(ranks, one_process):
    module, reference = one_process["HistogramObserver"]
    for rank, result in enumerate(ranks):
        state, _ = result["HistogramObserver"]
        assert torch.equal(state.min_val, reference.min_val) and torch.equal(state.max_val, reference.max_val), rank
        counted = int(state.counts.sum() + state.underflow.sum() + state.overflow.sum())
        assert counted == int(reference.histogram.sum()) == sum(x.numel() for x in batches()), rank
        for field, a, b in zip(state._fields, state, module.state):
            assert torch.equal(a, b), (rank, field)
