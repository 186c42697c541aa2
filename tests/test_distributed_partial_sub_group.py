"""``qstats.distributed.all_reduce(..., group, partial=True)`` in a sub-group that leaves rank 0 out
(ranks 1 and 2 of 3 gloo ranks): the sites only some members hold are sent by broadcasts whose
source is a rank of the group, which torch names by its rank in the world. Each site equals the
extremes and counts of its holders' data computed with plain torch (min/max, histogram), or the
sequential ``obs.merge`` of its holders in rank order (a moving average); rank 0, outside the
group, gets its tree back. Merging the merged states again adds every member's copy: counts
double, extremes stay (docs/distributed.md, Resume)."""

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

SPEC = qstats.QuantSpec(granularity=qstats.PerAxis(0))
OBSERVERS = {"a": {"input": qstats.minmax(SPEC)}, "b": {"input": qstats.histogram(SPEC, octaves=8)},
             "c": {"input": qstats.moving_average_minmax(SPEC, 0.25)}}
HOLDERS = {"a": (0, 1, 2), "b": (2,), "c": (1, 2)}  # rank 0 is outside the group
MEMBERS = (1, 2)


def _data(site: str, rank: int) -> list:
    g = torch.Generator().manual_seed(10 * rank + ord(site))
    return [torch.randn(3, 5, generator=g) * (i + rank + 1) for i in range(rank + 1)]


def _state(site: str, rank: int):
    obs = OBSERVERS[site]["input"]
    batches = _data(site, rank)
    state = obs.init(batches[0])
    for x in batches:
        state = obs.update(state, x)
    return state


def _tree(rank: int) -> dict:
    return {site: {"input": _state(site, rank)} for site, holders in HOLDERS.items() if rank in holders}


def _rank(rank: int, port: int, out: str) -> None:
    results: dict = {}
    try:
        with gloo_group(rank, port, world=3, timeout=timedelta(seconds=30)):
            group = torch.distributed.new_group(list(MEMBERS))  # every rank creates it, members or not
            once = distributed.all_reduce(_tree(rank), OBSERVERS, group, partial=True)
            twice = distributed.all_reduce(once, OBSERVERS, group, partial=True)
            results = {"once": once, "twice": twice}
    except Exception:
        results["crash"] = traceback.format_exc()
    torch.save(results, f"{out}/sub_group{rank}.pt")
    exit_rank(0)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("sub_group")
    codes = fork_ranks(_rank, str(out), world=3, timeout=120)
    results = [torch.load(out / f"sub_group{rank}.pt", weights_only=False) for rank in range(3)]
    assert codes == [0, 0, 0] and not any("crash" in r for r in results), (codes, results)
    return results


def _members_data(site: str) -> torch.Tensor:
    """Every batch the members holding ``site`` saw, as rows ``(channel, values)``."""
    return torch.cat([x for rank in MEMBERS if rank in HOLDERS[site] for x in _data(site, rank)], dim=1)


@pytest.mark.parametrize("site", ["a", "b"])
def test_members_get_the_extremes_and_counts_of_their_holders_data(ranks, site):
    data = _members_data(site)
    for rank in MEMBERS:
        state = ranks[rank]["once"][site]["input"]
        assert torch.equal(state.min_val, data.amin(1)) and torch.equal(state.max_val, data.amax(1))
        if site == "a":
            count = state.count
        else:  # every value in a bucket, or below or above the resolved octaves
            count = state.counts.sum((-3, -2, -1)) + state.underflow.sum(-1) + state.overflow.sum(-1)
        assert torch.equal(count, torch.full((3,), data.shape[1]))


def test_a_moving_average_is_the_rank_order_merge_of_its_holders(ranks):
    obs = OBSERVERS["c"]["input"]
    want = functools.reduce(obs.merge, [_state("c", rank) for rank in MEMBERS])
    for rank in MEMBERS:
        assert all(torch.equal(a, b) for a, b in zip(ranks[rank]["once"]["c"]["input"], want))


def test_the_rank_outside_the_group_gets_its_tree_back(ranks):
    for key in ("once", "twice"):
        assert all(torch.equal(a, b) for a, b in zip(ranks[0][key]["a"]["input"], _state("a", 0)))
        assert sorted(ranks[0][key]) == ["a"]


def test_merging_merged_states_again_doubles_the_counts_and_keeps_the_extremes(ranks):
    data = _members_data("a")
    for rank in MEMBERS:
        state = ranks[rank]["twice"]["a"]["input"]
        assert torch.equal(state.count, torch.full((3,), 2 * data.shape[1]))
        assert torch.equal(state.min_val, data.amin(1)) and torch.equal(state.max_val, data.amax(1))
