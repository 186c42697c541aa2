"""``qstats.distributed.all_reduce(..., partial=True)`` on 2 gloo ranks holding the same states at one
key in other containers (a list on rank 0, a tuple on rank 1; a dict on rank 0): every rank raises,
and its message names what each rank holds there with the containers as optree writes them
(``PyTreeSpec([*, *])`` against ``PyTreeSpec((*, *))``), as the message without ``partial`` does.
Before, both ranks' holdings read alike (each state described, the containers left out), so the
message did not say what differs. A good merge afterwards equals ``functools.reduce(obs.merge, ...)``."""

from __future__ import annotations

import functools
import os
import sys
import traceback
from datetime import timedelta

import optree
import pytest
import torch

import qstats
from qstats import distributed

sys.path.insert(0, os.path.dirname(__file__))
from _shared import exit_rank, fork_ranks, gloo_group  # noqa: E402

OBS = qstats.minmax(qstats.QuantSpec(granularity=qstats.PerAxis(0)))
HOLDS = {  # case: (rank 0's containers, rank 1's) of the states at "a/input"
    "list and tuple": (list, tuple),
    "dict and list": (lambda states: dict(zip("xy", states)), list),
}


def _state(rank: int):
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank)) * (rank + 1)
    return OBS.update(OBS.init(x), x)


def _tree(rank: int, case: str) -> dict:
    state = _state(rank)
    tree = {"a": {"input": HOLDS[case][rank]([state, state])}}
    if rank == 0:
        tree["b"] = {"input": state}  # a site only rank 0 holds: the ranks' trees differ, partial merges them
    return tree


def _rank(rank: int, port: int, out: str) -> None:
    results: dict = {}
    try:
        with gloo_group(rank, port, timeout=timedelta(seconds=30)):
            for case in HOLDS:
                try:
                    distributed.all_reduce(_tree(rank, case), OBS, partial=True)
                    results[case] = "no error"
                except ValueError as error:
                    results[case] = str(error)
            results["merged"] = distributed.all_reduce({"a": {"input": _state(rank)}}, OBS, partial=True)
    except Exception:
        results["crash"] = traceback.format_exc()
    torch.save(results, os.path.join(out, f"containers{rank}.pt"))
    exit_rank(0)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("containers"))
    codes = fork_ranks(_rank, out, timeout=120)
    assert codes == [0, 0], codes
    ranks = [torch.load(os.path.join(out, f"containers{rank}.pt"), weights_only=False) for rank in range(2)]
    assert not any("crash" in r for r in ranks), ranks
    return ranks


@pytest.mark.parametrize("case", list(HOLDS))
def test_other_containers_at_one_key_are_named_on_every_rank(results, case):
    subtrees = [_tree(rank, case)["a"]["input"] for rank in range(2)]
    # a rank holding a dict there holds its entries as parts of their own: the message says "a dict"
    held = ["a dict" if isinstance(subtree, dict)
            else str(optree.tree_structure(subtree, is_leaf=distributed.is_named_tuple)) for subtree in subtrees]
    for rank, error in enumerate(r[case] for r in results):
        assert "different state trees" in error and "'a/input'" in error, (rank, error)
        assert all(spec in error for spec in held), (rank, held, error)


def test_the_group_stays_in_step(results):
    want = functools.reduce(OBS.merge, [_state(rank) for rank in range(2)])
    for r in results:
        assert all(torch.equal(a, b) for a, b in zip(r["merged"]["a"]["input"], want, strict=True))
