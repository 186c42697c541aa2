"""A user's own state class that bears the name of a qstats state (``MinMaxState``, ``HistogramState``)
but has other fields or another merge is merged by its own ``obs.merge`` across 2 gloo ranks, as a
class nobody declared: the reductions qstats declares by name for its own states (extremes min/max,
every other field summed) are not applied to it. Compared with torch.distributed's own all_reduce of
the raw tensors (MIN/MAX) and with a sequential ``obs.merge``."""

from __future__ import annotations

import functools
import os
import sys
import traceback
from datetime import timedelta
from typing import NamedTuple

import optree
import torch
import torch.distributed as dist

import qstats
from qstats import distributed

sys.path.insert(0, os.path.dirname(__file__))
from _shared import exit_rank, fork_ranks, gloo_group  # noqa: E402

WORLD = 2


class MinMaxState(NamedTuple):  # a user's observer, named as qstats' own: its extremes are low / high
    low: torch.Tensor
    high: torch.Tensor
    count: torch.Tensor


class HistogramState(NamedTuple):  # torch.ao-style: a histogram over [min_val, max_val], rebinned on merge
    histogram: torch.Tensor
    min_val: torch.Tensor
    max_val: torch.Tensor


BINS = 8


def user_minmax() -> qstats.Observer:
    def init_fn(x):
        return MinMaxState(x.new_full(x.shape[-1:], float("inf")), x.new_full(x.shape[-1:], float("-inf")),
                           torch.zeros((), dtype=torch.int64))

    def update_fn(state, x, weight=None):
        return MinMaxState(torch.minimum(state.low, x.amin(0)), torch.maximum(state.high, x.amax(0)),
                           state.count + x.shape[0])

    def merge_fn(a, b):
        return MinMaxState(torch.minimum(a.low, b.low), torch.maximum(a.high, b.high), a.count + b.count)

    return qstats.Observer(init_fn, update_fn, merge_fn, exact=True, name="user_minmax")


def _rebinned(state: HistogramState, low, high) -> torch.Tensor:
    """``state``'s counts moved to the bins of [low, high] that their bin centres fall in."""
    width = (state.max_val - state.min_val) / BINS
    centres = state.min_val + width * (torch.arange(BINS) + 0.5)
    index = ((centres - low) / (high - low) * BINS).floor().clamp(0, BINS - 1).long()
    return torch.zeros(BINS).index_add(0, index, state.histogram)


def user_histogram() -> qstats.Observer:
    def init_fn(x):
        return HistogramState(torch.zeros(BINS), torch.tensor(0.0), torch.tensor(1.0))

    def update_fn(state, x, weight=None):
        low, high = x.min().float(), x.max().float()
        return HistogramState(torch.histc(x.float(), BINS, low.item(), high.item()), low, high)

    def merge_fn(a, b):
        low, high = torch.minimum(a.min_val, b.min_val), torch.maximum(a.max_val, b.max_val)
        return HistogramState(_rebinned(a, low, high) + _rebinned(b, low, high), low, high)

    return qstats.Observer(init_fn, update_fn, merge_fn, exact=False, name="user_histogram")


def rank_data(rank: int) -> torch.Tensor:
    return torch.randn(16, 4, generator=torch.Generator().manual_seed(rank)) * (rank + 1) + 3 * rank


def rank_states(rank: int) -> dict:
    x = rank_data(rank)
    states = {}
    for name, obs in (("minmax", user_minmax()), ("histogram", user_histogram())):
        states[name] = obs.update(obs.init(x), x)
    return states


OBSERVERS = {"minmax": user_minmax(), "histogram": user_histogram()}


def _rank(rank: int, port: int, out: str) -> None:
    results: dict = {}
    try:
        with gloo_group(rank, port, world=WORLD, timeout=timedelta(seconds=30)):
            states = rank_states(rank)
            results["merged"] = optree.tree_map(torch.clone, distributed.all_reduce(states, OBSERVERS))
            low, high = states["minmax"].low.clone(), states["minmax"].high.clone()
            dist.all_reduce(low, op=dist.ReduceOp.MIN)
            dist.all_reduce(high, op=dist.ReduceOp.MAX)
            results["torch"] = (low, high)
    except Exception:
        results["crash"] = traceback.format_exc()
    torch.save(results, os.path.join(out, f"names{rank}.pt"))
    exit_rank(0)


def test_a_user_state_named_as_a_qstats_state_merges_by_its_own_merge(tmp_path):
    assert distributed.reduce_ops(rank_states(0)["minmax"]) == "fold"
    assert distributed.reduce_ops(rank_states(0)["histogram"]) == "fold"
    assert fork_ranks(_rank, str(tmp_path), world=WORLD) == [0] * WORLD
    results = [torch.load(tmp_path / f"names{rank}.pt", weights_only=False) for rank in range(WORLD)]
    assert not any("crash" in r for r in results), [r.get("crash") for r in results]
    sequential = {name: functools.reduce(obs.merge, [rank_states(rank)[name] for rank in range(WORLD)])
                  for name, obs in OBSERVERS.items()}
    for rank, result in enumerate(results):
        merged = result["merged"]
        low, high = result["torch"]
        assert torch.equal(merged["minmax"].low, low) and torch.equal(merged["minmax"].high, high), rank
        for name, state in sequential.items():
            for got, want in zip(merged[name], state, strict=True):
                assert got.dtype == want.dtype and torch.equal(got, want), (rank, name, got, want)
    assert int(sequential["histogram"].histogram.sum()) == 16 * 4 * WORLD


def test_qstats_own_states_and_their_subclasses_keep_their_reductions():
    obs = qstats.minmax(qstats.QuantSpec())
    state = obs.update(obs.init(torch.zeros(3)), torch.tensor([1.0, -2.0, 3.0]))
    ops = {"min_val": "min", "max_val": "max", "count": "sum", "nonfinite": "sum"}
    assert distributed.reduce_ops(state) == ops

    class Derived(qstats.MinMaxState):
        pass

    assert distributed.reduce_ops(Derived(*state)) == ops
