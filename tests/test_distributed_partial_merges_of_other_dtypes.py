"""``qstats.distributed.all_reduce(..., partial=True)`` on 3 gloo ranks, a site held by ranks 0 and 1
only, whose ``obs.merge`` returns other dtypes than it is given (an observer of the user's sums float32
totals in float64), or refuses the states (`qstats.moving_average_minmax` refuses bfloat16 ones, as its
update does).
Every rank gets ``obs.merge(state of rank 0, state of rank 1)``, bit for bit, as the docs promise
(docs/distributed.md: "merged from them with obs.merge in rank order"). Before, rank 0 broadcast
the merged bytes in the shapes of the states it had been given: the other ranks' buffers did not
match, gloo aborted them (SIGABRT) and rank 0 raised a RuntimeError of ``split_with_sizes``."""

from __future__ import annotations

import functools
import os
import sys
import traceback
from datetime import timedelta
from typing import NamedTuple

import pytest
import torch

import qstats
from qstats import distributed

sys.path.insert(0, os.path.dirname(__file__))
from _shared import exit_rank, fork_ranks, gloo_group  # noqa: E402

SPEC = qstats.QuantSpec(granularity=qstats.PerAxis(0))


class Total(NamedTuple):
    total: torch.Tensor


def _total_update(state, x, weight=None):
    return Total(state.total + x.sum(0))


def _total_merge(a, b):
    return Total(a.total.double() + b.total.double())  # sums in float64, whatever it is given


def _total_merge_unwrapped(a, b):
    return a.total + b.total  # a user's slip: the sum, not a Total of it


class Merged(NamedTuple):
    total: torch.Tensor


def _total_merge_relabelled(a, b):
    return Merged(a.total + b.total)  # a state of another class than it is given


TOTAL = qstats.Observer(lambda x: Total(torch.zeros(x.shape[-1])), _total_update, _total_merge, exact=False,
                        name="total")
AVERAGE = qstats.moving_average_minmax(SPEC, 0.25)
UNWRAPPED = TOTAL._replace(merge=_total_merge_unwrapped)
RELABELLED = TOTAL._replace(merge=_total_merge_relabelled)


def _state(name: str, rank: int):
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randn(4, 6, generator=g) * (i + rank + 1) for i in range(2)]
    if name == "total":
        return TOTAL.update(TOTAL.init(batches[0]), batches[0])
    state = AVERAGE.init(batches[0])
    for x in batches:
        state = AVERAGE.update(state, x)
    return type(state)(*(v.bfloat16() if v.is_floating_point() else v for v in state))  # kept in bfloat16


def _rank(rank: int, port: int, out: str) -> None:
    results: dict = {}
    try:
        with gloo_group(rank, port, world=3, timeout=timedelta(seconds=30)):
            for name, obs in (("total", TOTAL), ("moving average", AVERAGE)):
                tree = {"shared": {"input": _state("total", rank)}}  # every rank holds it
                if rank < 2:
                    tree["half"] = {"input": _state(name, rank)}  # ranks 0 and 1 only
                try:
                    merged = distributed.all_reduce(tree, {"shared": {"input": TOTAL}, "half": {"input": obs}},
                                                    partial=True)
                    results[name] = merged["half"]["input"]
                except Exception:
                    results[name] = traceback.format_exc()
            for partial in (False, True):  # a merge returning no state: refused on every rank
                tree = {"half": {"input": _state("total", rank)}} if rank < 2 or not partial else {}
                try:
                    results["unwrapped", partial] = distributed.all_reduce(tree, UNWRAPPED, partial=partial)
                except ValueError as error:
                    results["unwrapped", partial] = str(error)
            for partial in (False, True):  # a merge returning a state of another class
                tree = {"half": {"input": _state("total", rank)}} if rank < 2 or not partial else {}
                results["relabelled", partial] = distributed.all_reduce(tree, RELABELLED, partial=partial)
    except Exception:
        results["crash"] = traceback.format_exc()
    torch.save(results, os.path.join(out, f"dtypes{rank}.pt"))
    exit_rank(0)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("dtypes"))
    codes = fork_ranks(_rank, out, world=3, timeout=120)
    ranks = [torch.load(os.path.join(out, f"dtypes{rank}.pt"), weights_only=False)
             if os.path.exists(os.path.join(out, f"dtypes{rank}.pt")) else None for rank in range(3)]
    assert codes == [0, 0, 0], (codes, ranks)
    assert not any("crash" in r for r in ranks), ranks
    return ranks


def test_every_rank_gets_the_merge_of_the_holders_in_its_dtypes(results):
    want = TOTAL.merge(_state("total", 0), _state("total", 1))
    assert [v.dtype for v in want] != [v.dtype for v in _state("total", 0)]  # the merge changes dtypes
    for rank, got in enumerate(r["total"] for r in results):
        assert not isinstance(got, str), (rank, got)
        assert type(got) is type(want)
        for a, b in zip(got, want, strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b), (rank, a, b)


@pytest.mark.parametrize("partial", [False, True])
def test_a_merge_returning_no_state_is_refused_on_every_rank(results, partial):
    assert isinstance(UNWRAPPED.merge(_state("total", 0), _state("total", 1)), torch.Tensor)  # the reference
    for rank, error in enumerate(r["unwrapped", partial] for r in results):
        assert isinstance(error, str) and "total.merge returned a Tensor, not a state" in error, (rank, error)


@pytest.mark.parametrize("partial", [False, True])
def test_a_merge_returning_another_class_gives_that_class(results, partial):
    holders = range(2 if partial else 3)
    want = functools.reduce(RELABELLED.merge, [_state("total", rank) for rank in holders])
    assert type(want) is Merged
    for r in results:
        got = r["relabelled", partial]["half"]["input"]
        assert type(got) is Merged and torch.equal(got.total, want.total), (partial, got, want)


def test_a_merge_refusing_the_holders_states_raises_on_every_rank(results):
    with pytest.raises(ValueError, match="merge of MovingAverageMinMaxStates: the state's min_val is a torch.bfloat16"):
        AVERAGE.merge(_state("moving average", 0), _state("moving average", 1))  # the reference
    for rank, got in enumerate(r["moving average"] for r in results):
        assert isinstance(got, str) and "merge of MovingAverageMinMaxStates" in got, (rank, got)
