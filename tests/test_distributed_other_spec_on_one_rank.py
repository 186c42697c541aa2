"""One rank whose observer has another QuantSpec than the others' while its states have the same
shapes (per column instead of per row of a square weight, int4 instead of int8), on 2 and 3 gloo
ranks: ``qstats.distributed.all_reduce`` raises on every rank, naming the odd rank, the tree path
and the specs (a sequential ``obs.merge`` cannot tell, as states do not hold their spec: the merge
would mix rows with columns, or leave that rank with other qparams), none waits; the same spec on
every rank still merges as the sequential ``obs.merge``, bit for bit."""

from __future__ import annotations

import functools
import os
import sys
import traceback
from datetime import timedelta

import pytest
import torch

import qstats
from qstats import distributed

sys.path.insert(0, os.path.dirname(__file__))
from _shared import exit_rank, fork_ranks, gloo_group  # noqa: E402

ROWS = qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0))
SCENARIOS = {
    "columns": qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(1)),
    "int4": qstats.QuantSpec(dtype="int4", granularity=qstats.PerAxis(0)),
    "same": ROWS,
}


def _data(rank: int) -> torch.Tensor:
    return torch.randn(4, 4, generator=torch.Generator().manual_seed(rank)) * (rank + 1)


def _tree(spec):
    def state(rank):
        obs = qstats.minmax(spec)
        return {"layers": {"1": {"input": obs.update(obs.init(_data(rank)), _data(rank))}}}
    return state


def _rank(rank: int, port: int, world: int, out: str) -> None:
    results: dict = {}
    try:
        with gloo_group(rank, port, world=world, timeout=timedelta(seconds=20)):
            for name, other in SCENARIOS.items():
                spec = other if rank == world - 1 else ROWS
                try:
                    merged = distributed.all_reduce(_tree(spec)(rank), qstats.minmax(spec))
                    results[name] = list(merged["layers"]["1"]["input"])
                except Exception as error:  # recorded for the test, on every rank
                    results[name] = f"{type(error).__name__}: {error}"
    except Exception:
        results["crash"] = traceback.format_exc()
    torch.save(results, f"{out}/spec{rank}.pt")
    exit_rank(0)


@pytest.fixture(scope="module", params=[2, 3], ids=["2 ranks", "3 ranks"])
def ranks(request, tmp_path_factory):
    world, out = request.param, tmp_path_factory.mktemp(f"spec{request.param}")
    assert fork_ranks(_rank, world, str(out), world=world) == [0] * world
    results = [torch.load(out / f"spec{rank}.pt") for rank in range(world)]
    assert not any("crash" in r for r in results), [r.get("crash") for r in results]
    return results


def test_the_sequential_merge_cannot_tell_the_specs_apart():
    state = _tree(ROWS)(0)["layers"]["1"]["input"]
    other = _tree(SCENARIOS["columns"])(1)["layers"]["1"]["input"]
    merged = qstats.minmax(ROWS).merge(state, other)  # accepted: the states have the same shapes
    assert merged.min_val.shape == (4,)


@pytest.mark.parametrize("name,words", [("columns", "granularity=PerAxis(axis=1)"), ("int4", "dtype='int4'")])
def test_another_spec_on_one_rank_is_named_on_every_rank(ranks, name, words):
    odd = len(ranks) - 1
    for rank, results in enumerate(ranks):
        error = results[name]
        assert isinstance(error, str) and error.startswith("ValueError: all_reduce"), (rank, error)
        assert "'layers/1/input'" in error and f"rank {odd}" in error and words in error, (rank, error)
        assert "granularity=PerAxis(axis=0)" in error, (rank, error)


def test_the_same_spec_on_every_rank_merges_as_the_sequential_merge(ranks):
    world = len(ranks)
    states = [_tree(ROWS)(rank)["layers"]["1"]["input"] for rank in range(world)]
    sequential = functools.reduce(qstats.minmax(ROWS).merge, states)
    for results in ranks:
        assert all(torch.equal(a, b) for a, b in zip(results["same"], sequential))
