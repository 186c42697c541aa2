"""qstats.distributed.all_reduce on 3 gloo ranks (tests/_distributed_merge_cases_worker.py) against
the sequential ``obs.merge`` of the same states in rank order: every observer of observer_cases,
plain and stacked over experts, with uneven data (the last rank saw none), exact=True and False,
buckets split into many small all_reduces, states with no element, and one rank's bad input."""

from __future__ import annotations

import functools
import os
import sys

import optree
import pytest
import torch

from qstats import distributed

sys.path.insert(0, os.path.dirname(__file__))
import _distributed_merge_cases_worker as worker  # noqa: E402
from _shared import fork_ranks  # noqa: E402


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone(memory_format=torch.contiguous_format).reshape(-1).view(torch.uint8)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("merge")
    codes = fork_ranks(worker.run_rank, str(out), world=worker.WORLD, timeout=300)
    files = [out / f"merge{rank}.pt" for rank in range(worker.WORLD)]
    results = [torch.load(f, weights_only=False) if f.exists() else {"crash": "no results"} for f in files]
    assert codes == [0] * worker.WORLD and not any("crash" in r for r in results), (codes, results)
    return results


@functools.lru_cache(maxsize=1)
def _sequential() -> dict:
    """{name: (merged state, fields summed in floating point)}: ``obs.merge`` folded in rank order."""
    observers = worker.case_observers()
    per_rank = [worker.rank_states(rank) for rank in range(worker.WORLD)]
    out = {}
    for name, obs in observers.items():
        merged = functools.reduce(obs.merge, [states[name] for states in per_rank])
        ops = distributed.reduce_ops(merged)
        leaves = optree.tree_leaves(merged)
        float_sums = [ops != "fold" and op == "sum" and leaf.is_floating_point() for op, leaf in
                      zip(ops.values() if ops != "fold" else [None] * len(leaves), leaves)]
        out[name] = (leaves, float_sums)
    return out


def _assert_equal_to_sequential(got: dict, bit_exact: bool):
    for name, (want, float_sums) in _sequential().items():
        assert len(got[name]) == len(want), name
        for index, (a, b, float_sum) in enumerate(zip(got[name], want, float_sums)):
            assert a.dtype == b.dtype and a.shape == b.shape, (name, index, a, b)
            if float_sum and not bit_exact:  # summed by the backend: rounding may differ
                torch.testing.assert_close(a, b, rtol=1e-6, atol=0, msg=f"{name} field {index}")
            else:
                assert torch.equal(_bits(a), _bits(b)), (name, index, a, b)


@pytest.mark.parametrize("exact", [False, True])
def test_every_observer_plain_and_stacked_equals_the_sequential_merge(ranks, exact):
    for result in ranks:
        _assert_equal_to_sequential(result[f"cases/exact={exact}"], bit_exact=exact)
    for result in ranks[1:]:  # every rank gets the same result, float sums included
        for name, leaves in result[f"cases/exact={exact}"].items():
            for a, b in zip(leaves, ranks[0][f"cases/exact={exact}"][name]):
                assert torch.equal(_bits(a), _bits(b)), name


def test_buckets_split_into_small_all_reduces_equal_the_sequential_merge(ranks):
    for result in ranks:
        _assert_equal_to_sequential(result["cases/small_buckets"], bit_exact=False)


def test_a_field_larger_than_a_bucket_is_reduced_alone_in_the_buffer_that_becomes_its_result(ranks):
    """The merged fields own their memory; a field as large as a bucket is not copied out of a
    shared buffer (which, beside the copies, made the peak three times the states)."""
    for result in ranks:
        buffers = result["small_buckets/buffers"]
        fields = {address: size for leaves in result["small_buckets/fields"].values() for size, address in leaves}
        large = [(size, address) for size, address in buffers if size > worker.SMALL_BUCKET_BYTES]
        assert large and len(buffers) > 10
        for size, address in large:
            assert fields.get(address) == size, (size, address)
        for name in ("minmax/axis0", "stacked/histogram/axis0", "stacked/hessian"):
            for size, address in result["small_buckets/fields"][name]:
                if size > worker.SMALL_BUCKET_BYTES:
                    assert (size, address) in buffers, (name, size)


@pytest.mark.parametrize("kind", ["empty", "learnable"])
def test_states_without_elements_or_with_fields_requiring_grad_merge(ranks, kind):
    """States of zero channels; states whose fields require grad (negating a max field in place in
    the reduced buffer refused those)."""
    make = worker.empty_states if kind == "empty" else worker.learnable_states
    per_rank = [make(rank) for rank in range(worker.WORLD)]
    for name, (_, obs) in per_rank[0].items():
        want = optree.tree_leaves(functools.reduce(obs.merge, [states[name][0] for states in per_rank]))
        for result in ranks:
            got = result[kind][name]
            assert [(t.shape, t.dtype) for t in got] == [(t.shape, t.dtype) for t in want], name
            assert all(torch.equal(a, b) for a, b in zip(got, want)), name


@pytest.mark.parametrize("name", ["nan_extreme_on_rank_1", "other_shape_on_rank_2", "float_count_on_rank_0",
                                  "missing_site_on_rank_1"])
def test_one_rank_with_bad_input_makes_every_rank_raise(ranks, name):
    for rank, result in enumerate(ranks):
        error = result["bad/" + name]
        assert isinstance(error, dict) and error["error"].startswith("ValueError"), (rank, error)
    for result in ranks:
        assert not isinstance(result["bad/after"], dict), result["bad/after"]
