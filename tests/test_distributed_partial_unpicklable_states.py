"""``qstats.distributed.all_reduce(..., partial=True)`` where the part only one rank holds has a
state class that cannot be pickled (a NamedTuple defined inside a function): its holder cannot send
the part's types to the other ranks. Every rank raises the same ValueError naming it (2 gloo ranks),
where the holder raised pickle's error alone and the other rank failed inside gloo ("Connection
closed") or waited for it, and the group stays usable: a merge of picklable parts afterwards equals
the sequential ``obs.merge``."""

from __future__ import annotations

import os
import sys
import traceback
from datetime import timedelta
from typing import NamedTuple

import torch

import qstats
from qstats import distributed

sys.path.insert(0, os.path.dirname(__file__))
from _shared import exit_rank, fork_ranks, gloo_group  # noqa: E402

MINMAX = qstats.minmax(qstats.QuantSpec())


def _state(seed: int):
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(seed)) * (seed + 1)
    return MINMAX.update(MINMAX.init(x), x)


def _local_observer():
    """A sum observer whose state class is local to this function (not picklable)."""

    class LocalSum(NamedTuple):
        total: torch.Tensor

    return qstats.Observer(init=lambda x: LocalSum(torch.zeros(())),
                           update=lambda s, x, weight=None: LocalSum(s.total + x.sum()),
                           merge=lambda a, b: LocalSum(a.total + b.total), exact=False), LocalSum


def _rank(rank: int, port: int, out: str) -> None:
    results: dict = {}
    try:
        with gloo_group(rank, port, timeout=timedelta(seconds=20)):
            local, LocalSum = _local_observer()
            tree = {"a": _state(rank)}
            observers = {"a": MINMAX}
            if rank == 0:
                tree["b"], observers["b"] = LocalSum(torch.tensor(3.0)), local
            try:
                distributed.all_reduce(tree, observers, partial=True)
                results["unpicklable"] = None
            except Exception as error:  # recorded for the test, on every rank
                results["unpicklable"] = f"{type(error).__name__}: {error}"
            merged = distributed.all_reduce({"a": _state(rank)}, MINMAX, partial=True)
            results["after"] = list(merged["a"])
    except Exception:
        results["crash"] = traceback.format_exc()
    torch.save(results, f"{out}/unpicklable{rank}.pt")
    exit_rank(0)


def test_an_unpicklable_part_is_refused_on_every_rank_and_the_group_stays_in_step(tmp_path):
    assert fork_ranks(_rank, str(tmp_path), timeout=90) == [0, 0]
    sequential = MINMAX.merge(_state(0), _state(1))
    for rank in range(2):
        results = torch.load(tmp_path / f"unpicklable{rank}.pt")
        assert "crash" not in results, results["crash"]
        error = results["unpicklable"]
        assert error is not None and error.startswith("ValueError: all_reduce"), (rank, error)
        assert "cannot be sent" in error and "LocalSum" in error, (rank, error)
        assert all(torch.equal(a, b) for a, b in zip(results["after"], sequential)), rank
