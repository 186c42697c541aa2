"""``qstats.distributed.all_reduce`` on 2 gloo ranks in the cases no other test covers, each against
one process over all the data:

- called under ``torch.inference_mode()`` / ``torch.no_grad()``, or outside them on states made
  under ``inference_mode`` (minmax reduced elementwise, a moving average folded, ``partial=True``);
- bfloat16 extremes: the bfloat16 of one process's float32 extremes (rounding is monotonic);
- int64 counts past 2**53 (where a float64 would round): one process's counts plus both ranks' offsets;
- stride-0 states: `qstats.stacked_observer`'s ``init`` (a ``vmap`` of ``init``) expands its fields
  over the experts, as a rank that routed no token passes them; reduced elementwise, folded and
  under ``partial=True``."""

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
MINMAX, AVERAGE = qstats.minmax(SPEC), qstats.moving_average_minmax(SPEC, 0.25)
HISTOGRAM = qstats.histogram(SPEC, buckets_per_octave=4, octaves=8)
EXPERTS = 3
STACKED = {"minmax": qstats.stacked_observer(MINMAX, EXPERTS), "average": qstats.stacked_observer(AVERAGE, EXPERTS)}
OFFSET = 2**60  # added to each rank's histogram counts


def _batches(rank=None, experts: bool = False) -> list:
    g = torch.Generator().manual_seed(4)
    shape = (EXPERTS, 4, 6) if experts else (4, 6)
    batches = [torch.randn(*shape, generator=g) * (i + 1) for i in range(4)]
    return batches if rank is None else batches[rank::2]


def _run(obs, batches, like):
    state = obs.init(like)
    for x in batches:
        state = obs.update(state, x)
    return state


def _grad_modes(rank: int) -> dict:
    results = {}
    for mode in ("inference_mode", "no_grad", "made under inference_mode"):
        with torch.inference_mode() if mode != "no_grad" else torch.no_grad():
            states = {"minmax": _run(MINMAX, _batches(rank), _batches()[0]),
                      "average": _run(AVERAGE, _batches(rank), _batches()[0])}
            if mode != "made under inference_mode":
                results[mode] = _merge(rank, states)
        if mode == "made under inference_mode":
            results[mode] = _merge(rank, states)
    return results


def _merge(rank: int, states: dict) -> dict:
    observers = {"minmax": MINMAX, "average": AVERAGE}
    whole = distributed.all_reduce(states, observers)
    only0 = {"only0": {"input": states["average"]}} if rank == 0 else {}
    partial = distributed.all_reduce(only0, AVERAGE, partial=True)
    return {**whole, "only0": partial["only0"]["input"]}


def _expanded(rank: int) -> dict:
    results = {}
    for name, obs in STACKED.items():
        state = obs.init(_batches(experts=True)[0])  # rank 1 routed no token: its fields are stride-0
        if rank == 0:
            state = _run(obs, _batches(experts=True), _batches(experts=True)[0])
        else:
            assert all(v.stride(0) == 0 for v in state)
        results[name] = distributed.all_reduce({"experts": state}, obs)["experts"]
        tree = {"a": {"input": state}} if rank == 1 else {}
        results[name, "partial"] = distributed.all_reduce(tree, obs, partial=True)["a"]["input"]
    return results


def _rank(rank: int, port: int, out: str) -> None:
    results: dict = {}
    try:
        with gloo_group(rank, port, timeout=timedelta(seconds=30)):
            results["modes"] = _grad_modes(rank)
            state = _run(MINMAX, _batches(rank), _batches()[0])
            halves = state._replace(min_val=state.min_val.bfloat16(), max_val=state.max_val.bfloat16())
            results["bfloat16"] = distributed.all_reduce({"a": halves}, MINMAX)["a"]
            counts = _run(HISTOGRAM, _batches(rank), _batches()[0])
            counts = counts._replace(counts=counts.counts + OFFSET + rank)
            results["counts"] = distributed.all_reduce({"a": counts}, HISTOGRAM)["a"]
            results["expanded"] = _expanded(rank)
    except Exception:
        results["crash"] = traceback.format_exc()
    torch.save(results, os.path.join(out, f"cases{rank}.pt"))
    exit_rank(0)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("cases"))
    codes = fork_ranks(_rank, out, timeout=120)
    assert codes == [0, 0], codes
    ranks = [torch.load(os.path.join(out, f"cases{rank}.pt"), weights_only=False) for rank in range(2)]
    assert not any("crash" in r for r in ranks), ranks
    return ranks


def _equal(got, want) -> bool:
    return type(got) is type(want) and all(a.dtype == b.dtype and torch.equal(a, b)
                                           for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("mode", ["inference_mode", "no_grad", "made under inference_mode"])
def test_grad_modes_merge_as_outside_them(results, mode):
    one_process = _run(MINMAX, _batches(), _batches()[0])
    folded = functools.reduce(AVERAGE.merge, [_run(AVERAGE, _batches(rank), _batches()[0]) for rank in range(2)])
    for r in results:
        assert _equal(r["modes"][mode]["minmax"], one_process)
        assert _equal(r["modes"][mode]["average"], folded)
        assert _equal(r["modes"][mode]["only0"], _run(AVERAGE, _batches(0), _batches()[0]))


def test_bfloat16_extremes_are_those_of_one_process(results):
    one_process = _run(MINMAX, _batches(), _batches()[0])
    want = one_process._replace(min_val=one_process.min_val.bfloat16(), max_val=one_process.max_val.bfloat16())
    for r in results:
        assert _equal(r["bfloat16"], want)


def test_int64_counts_past_2_to_the_53_add_exactly(results):
    one_process = _run(HISTOGRAM, _batches(), _batches()[0])
    want = one_process.counts + (2 * OFFSET + 1)  # int64 arithmetic: exact
    assert float(want.max()) == float(want.max() - 1)  # a float64 could not hold them
    for r in results:
        assert torch.equal(r["counts"].counts, want) and torch.equal(r["counts"].min_val, one_process.min_val)


@pytest.mark.parametrize("name", list(STACKED))
def test_stride_0_init_states_merge_as_one_process(results, name):
    obs = STACKED[name]
    updated = _run(obs, _batches(experts=True), _batches(experts=True)[0])
    for r in results:  # one process over all the data (rank 1 had none)
        assert _equal(r["expanded"][name], updated)
        assert _equal(r["expanded"][name, "partial"], obs.init(_batches(experts=True)[0]))
