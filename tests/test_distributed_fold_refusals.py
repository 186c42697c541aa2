"""States that ``qstats.distributed.all_reduce`` gathers and folds with ``obs.merge`` (not
elementwise), where each rank's state passes its own checks but the merge refuses the pair: two
``fixed_qparams`` states of different constants, on 2 and 3 gloo ranks and in a sub-group. Every
rank raises a ValueError naming the tree path and the ranks (in the world) whose states the merge
refused, as the sequential merge refuses them, none waits; a good fold afterwards equals the
sequential ``obs.merge`` bit for bit."""

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

SPEC = qstats.QuantSpec(dtype="uint8", mapping="asymmetric")
MOMENTS = qstats.moments(qstats.QuantSpec(granularity=qstats.PerAxis(0)))


def _fixed(rank: int, odd: int):
    observer = qstats.fixed_qparams(SPEC, 0.5 if rank == odd else 0.25, 0)
    x = torch.rand(4, 6, generator=torch.Generator().manual_seed(rank))
    return observer, observer.update(observer.init(x), x)


def _moments(rank: int):
    x = torch.randn(3, 5 + rank, generator=torch.Generator().manual_seed(rank)) * (rank + 1)
    return MOMENTS.update(MOMENTS.init(x[:, :5]), x[:, :5])


def _rank(rank: int, port: int, world: int, odd: int, members, out: str) -> None:
    results: dict = {}
    try:
        with gloo_group(rank, port, world=world, timeout=timedelta(seconds=20)):
            group = None if members is None else torch.distributed.new_group(members)  # every rank creates it
            if members is None or rank in members:
                observer, state = _fixed(rank, odd)
                try:
                    distributed.all_reduce({"layers": {"3": state}}, observer, group)
                    results["fixed"] = None
                except Exception as error:  # recorded for the test, on every rank
                    results["fixed"] = f"{type(error).__name__}: {error}"
                results["after"] = list(distributed.all_reduce({"m": _moments(rank)}, MOMENTS, group)["m"])
    except Exception:
        results["crash"] = traceback.format_exc()
    torch.save(results, f"{out}/fold{rank}.pt")
    exit_rank(0)


@pytest.mark.parametrize("world,odd,members", [(2, 1, None), (3, 0, None), (3, 2, [1, 2])],
                         ids=["2 ranks", "3 ranks, rank 0 differs", "sub-group of ranks 1 and 2"])
def test_a_fold_that_merge_refuses_names_the_ranks_and_path_on_every_rank(tmp_path, world, odd, members):
    ranks = list(range(world)) if members is None else members
    with pytest.raises(ValueError, match="different constants"):  # the sequential merge refuses them too
        functools.reduce(_fixed(0, odd)[0].merge, [_fixed(rank, odd)[1] for rank in ranks])
    refused = ranks[max(1, ranks.index(odd))]  # the rank whose state is merged into the others' when it fails
    assert fork_ranks(_rank, world, odd, members, str(tmp_path), world=world) == [0] * world
    for rank in ranks:
        results = torch.load(tmp_path / f"fold{rank}.pt")
        assert "crash" not in results, results["crash"]
        error = results["fixed"]
        assert error is not None and error.startswith("ValueError: all_reduce"), (rank, error)
        assert "'layers/3'" in error and f"rank {refused}" in error and "different constants" in error, (rank, error)
        assert f"rank(s) {ranks[:ranks.index(refused)]}" in error, (rank, error)
        sequential = functools.reduce(MOMENTS.merge, [_moments(r) for r in ranks])
        assert all(torch.equal(a, b) for a, b in zip(results["after"], sequential)), rank
