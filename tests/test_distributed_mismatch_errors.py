"""One rank's bad input to qstats.distributed.all_reduce (a NaN extreme, an extra module, a field of
another shape, a state on another device, an empty tree, another ``exact``) on 2 and 3 gloo ranks
(tests/_distributed_mismatch_worker.py): every rank raises, none waits, and every rank's message names
the odd rank, the tree path and what differs there, so the log of any one rank tells the user what to
fix. The group stays in step: a good merge afterwards equals a sequential ``obs.merge``."""

from __future__ import annotations

import functools
import multiprocessing
import os
import sys

import optree
import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import _distributed_mismatch_worker as worker  # noqa: E402
from _shared import free_port  # noqa: E402


def _wait(proc, timeout):
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join()
    return proc.exitcode


@functools.lru_cache(maxsize=None)
def _results(world: int, out: str) -> list:
    context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    port = free_port()
    procs = [context.Process(target=worker.run_rank, args=(rank, world, port, out)) for rank in range(world)]
    for p in procs:
        p.start()
    codes = [_wait(p, 240) for p in procs]
    files = [os.path.join(out, f"mismatch{rank}.pt") for rank in range(world)]
    results = [torch.load(f, weights_only=False) if os.path.exists(f) else {"crash": "no results"} for f in files]
    assert codes == [0] * world and not any("crash" in r for r in results), (codes, results)
    return results


@pytest.fixture(scope="module", params=[2, 3], ids=["2 ranks", "3 ranks"])
def ranks(request, tmp_path_factory):
    return _results(request.param, str(tmp_path_factory.mktemp(f"mismatch{request.param}")))


def _errors(results, name):
    errors = [r[name] for r in results]
    for rank, error in enumerate(errors):
        assert isinstance(error, dict) and error["error"].startswith("ValueError: all_reduce"), (name, rank, error)
    return [error["error"] for error in errors]


def test_a_nan_extreme_on_one_rank_is_named_on_every_rank(ranks):
    odd = len(ranks) - 1
    for rank, error in enumerate(_errors(ranks, "nan")):
        assert "holds NaN" in error and "'max_val'" in error and "layers/0" in error, (rank, error)
        if rank != odd:
            assert f"rank {odd}" in error, (rank, error)


def test_an_extra_module_on_one_rank_is_named_on_every_rank(ranks):
    odd = len(ranks) - 1
    for rank, error in enumerate(_errors(ranks, "extra_module")):
        assert "different state trees" in error and f"rank {odd}" in error and "'layers/2'" in error, (rank, error)


def test_a_field_of_another_shape_is_named_with_both_shapes(ranks):
    odd = len(ranks) - 1
    for rank, error in enumerate(_errors(ranks, "other_shape")):
        assert "'layers/1'" in error and f"rank {odd}" in error and "rank 0" in error, (rank, error)
        assert "min_val (5,)" in error and "min_val (6,)" in error, (rank, error)


def test_a_state_on_another_device_is_named_with_both_devices(ranks):
    for rank, error in enumerate(_errors(ranks, "other_device")):
        assert "'layers/1'" in error and "on cpu" in error and "on meta" in error, (rank, error)


def test_an_empty_tree_on_one_rank_is_named_on_every_rank(ranks):
    odd = len(ranks) - 1
    for rank, error in enumerate(_errors(ranks, "empty_tree")):
        assert f"rank {odd} holds nothing at 'layers/0'" in error, (rank, error)


def test_another_exact_on_one_rank_is_named_as_the_argument(ranks):
    odd = len(ranks) - 1
    for rank, error in enumerate(_errors(ranks, "other_exact")):
        assert "different arguments" in error and f"exact=True on rank {odd}" in error, (rank, error)
        assert "exact=False on rank 0" in error, (rank, error)


def test_a_sub_group_names_its_members_by_their_ranks_in_the_world(ranks):
    world = len(ranks)
    members = worker.subgroup(world)
    for rank, result in enumerate(ranks):
        if rank not in members:  # outside the group: its tree comes back as it is
            tree = worker.scenarios(rank, world)["other_shape"][0]
            assert all(torch.equal(a, b) for a, b in zip(result["subgroup"], optree.tree_leaves(tree)))
            continue
        error = result["subgroup"]["error"]
        assert f"at 'layers/1' rank {members[0]} holds" in error and f"rank {world - 1} holds" in error, (rank, error)


def test_other_arguments_on_one_rank_are_named_with_every_rank_s_value(ranks):
    """The layer-by-layer argument check said only "this rank: propagate='float', layers=...", so
    the log of a rank that agreed with the majority did not say which argument to change."""
    odd = len(ranks) - 1
    for rank, result in enumerate(ranks):
        error = result["arguments"]["error"]
        assert error.startswith("ValueError: calibrate_layerwise: the ranks passed different arguments"), error
        assert f"propagate='quantized' on rank {odd}" in error and "propagate='float' on rank 0" in error, error
        assert "layers=" not in error, error  # the same on every rank


def test_the_group_stays_in_step_and_merges_as_a_sequential_merge(ranks):
    world = len(ranks)
    states = [worker.scenarios(rank, world)["after"][0]["layers"] for rank in range(world)]
    expected = states[0]
    for other in states[1:]:  # obs.merge in rank order
        expected = {key: worker.MINMAX.merge(expected[key], other[key]) for key in expected}
    for rank, result in enumerate(ranks):
        got = result["after"]
        assert not isinstance(got, dict), (rank, got)
        for a, b in zip(got, optree.tree_leaves({"layers": expected})):
            assert a.dtype == b.dtype and torch.equal(a, b)
