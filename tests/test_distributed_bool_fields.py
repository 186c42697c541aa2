"""A bool field declared ``"sum"`` (torch adds bools as a logical or) all-reduced on 3 gloo ranks
(tests/_distributed_bool_worker.py) equals a sequential ``obs.merge`` bit for bit. gloo's SUM of
bools adds their bytes: it left 3 in the byte of a flag set on 3 ranks (torch writes 1), and would
wrap a flag set on 256 ranks to False. Each merged field owns its memory (not a view of the bucket)."""

from __future__ import annotations

import functools
import multiprocessing
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import _distributed_bool_worker as worker  # noqa: E402
from _shared import free_port  # noqa: E402

WORLD = 3


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def test_a_bool_sum_field_merges_as_torch_adds_bools(tmp_path):
    context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    port = free_port()
    procs = [context.Process(target=worker.run_rank, args=(rank, WORLD, port, str(tmp_path))) for rank in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        if p.is_alive():
            p.kill()
            p.join()
    results = [torch.load(tmp_path / f"flags{rank}.pt", weights_only=False) for rank in range(WORLD)]
    assert not any("crash" in r for r in results), results
    obs = worker.seen_observer()
    expected = functools.reduce(obs.merge, [worker.rank_state(rank) for rank in range(WORLD)])
    assert expected.seen.tolist() == [True, False, True]
    for rank, result in enumerate(results):
        for got, want in zip(result["leaves"], expected):
            assert got.dtype == want.dtype and torch.equal(_bits(got), _bits(want)), (rank, got, want)
        # each merged field owns its memory: the counts of "a" and "b" shared one all-reduced bucket,
        # whose whole storage torch.save wrote with either and a live field kept alive
        assert result["storage_bytes"] == [t.numel() * t.element_size() for t in (*expected, *expected)], rank
