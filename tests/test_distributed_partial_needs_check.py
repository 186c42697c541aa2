"""``qstats.distributed.all_reduce(..., partial=True, check=False)``: the structure check is the
collective that finds the sites only some ranks hold, so ``partial=True`` without it is refused
with a ValueError on every rank (2 gloo ranks, one lacking a site), before any collective: it used
to run the collectives of the whole-tree merge on trees of other sizes, where gloo aborted the
rank's process. The group stays in step: ``partial=True`` with the check afterwards equals the
sequential ``obs.merge`` of each site's holders."""

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

MINMAX = qstats.minmax(qstats.QuantSpec(granularity=qstats.PerAxis(0)))


def _state(seed: int):
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(seed)) * (seed + 1)
    return MINMAX.update(MINMAX.init(x), x)


def _tree(rank: int) -> dict:
    """Rank 0 holds sites ``a`` and ``b``, rank 1 only ``a``."""
    return {"a": _state(rank), "b": _state(10 + rank)} if rank == 0 else {"a": _state(rank)}


def _rank(rank: int, port: int, out: str) -> None:
    results: dict = {}
    try:
        with gloo_group(rank, port, timeout=timedelta(seconds=20)):
            try:
                distributed.all_reduce(_tree(rank), MINMAX, partial=True, check=False)
                results["unchecked"] = None
            except Exception as error:  # recorded for the test, on every rank
                results["unchecked"] = f"{type(error).__name__}: {error}"
            merged = distributed.all_reduce(_tree(rank), MINMAX, partial=True)
            results["after"] = {site: list(state) for site, state in merged.items()}
    except Exception:
        results["crash"] = traceback.format_exc()
    torch.save(results, f"{out}/partial{rank}.pt")
    exit_rank(0)


def test_partial_without_the_check_is_refused_on_every_rank_and_the_group_stays_in_step(tmp_path):
    assert fork_ranks(_rank, str(tmp_path)) == [0, 0]
    sequential = {"a": functools.reduce(MINMAX.merge, [_state(0), _state(1)]), "b": _state(10)}
    for rank in range(2):
        results = torch.load(tmp_path / f"partial{rank}.pt")
        assert "crash" not in results, results["crash"]
        error = results["unchecked"]
        assert error is not None and error.startswith("ValueError: all_reduce") and "check=True" in error, (rank, error)
        assert sorted(results["after"]) == ["a", "b"], (rank, results["after"])
        for site, want in sequential.items():
            assert all(torch.equal(a, b) for a, b in zip(results["after"][site], want)), (rank, site)


def test_partial_without_the_check_is_refused_without_a_process_group():
    with pytest.raises(ValueError, match="partial=True needs check=True"):
        distributed.all_reduce(_tree(0), MINMAX, partial=True, check=False)
