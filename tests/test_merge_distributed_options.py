"""`qstats.distributed.all_reduce` of states whose observers differ on one rank in an option the state
does not hold (a moving average's averaging constant, an mse search's norm or expand): such states were
merged in silence into statistics no single observer computes (a sequential ``obs.merge`` cannot tell
either). Now every rank raises ValueError naming the option, its value on each rank and the ranks, on 2
and 3 gloo ranks, none waits, and the group stays in step (a good merge afterwards equals a sequential
``obs.merge``)."""

from __future__ import annotations

import functools
import os
import sys
import traceback

import optree
import pytest
import torch

import qstats
from qstats import coreai_opt

sys.path.insert(0, os.path.dirname(__file__))
from _shared import fork_ranks, gloo_group  # noqa: E402

SPEC = qstats.QuantSpec(granularity=qstats.PerAxis(0))


def _data(rank: int) -> torch.Tensor:
    return torch.randn(3, 16, generator=torch.Generator().manual_seed(40 + rank)) * (rank + 1)


def _observers(odd: bool) -> dict:
    """name -> (observer on this rank, the option named where the last rank's differs)."""
    return {
        "averaging constant": (qstats.moving_average_minmax(SPEC, 0.5 if odd else 0.1), "averaging_constant=0.5"),
        "mse norm": (qstats.mse(SPEC, norm=3.0 if odd else 2.4), "norm=3.0"),
        "mse expand": (qstats.mse(SPEC, expand=1.5 if odd else 1.0), "expand=1.5"),
        "moving average mse": (qstats.mse(SPEC, mode="moving_average", averaging_constant=0.2 if odd else 0.01),
                               "averaging_constant=0.2"),
        "stacked moving average": (qstats.stacked_observer(qstats.moving_average_minmax(SPEC, 0.5 if odd else 0.1),
                                                           2), "averaging_constant=0.5"),
        "coreai_opt moving average": (coreai_opt.moving_average_minmax(SPEC, 0.5 if odd else 0.1),
                                      "averaging_constant=0.5"),
    }


def _state(observer, x):
    return observer.update(observer.init(x), x)


def run_rank(rank: int, port: int, world: int, out: str) -> None:
    results: dict = {}
    try:
        with gloo_group(rank, port, world):  # one thread: a forked child must not use its parent's OpenMP pool
            x = _data(rank)
            for name, (observer, _) in _observers(rank == world - 1).items():
                data = torch.stack([x, x * 2]) if name.startswith("stacked") else x
                try:
                    merged = qstats.distributed.all_reduce({"layer": {"input": _state(observer, data)}}, observer)
                    results[name] = optree.tree_leaves(merged)
                except Exception as error:  # noqa: BLE001 - the test reads the message
                    results[name] = {"error": f"{type(error).__name__}: {error}"}
            good = _observers(False)["averaging constant"][0]
            results["after"] = optree.tree_leaves(qstats.distributed.all_reduce({"layer": _state(good, x)}, good))
    except Exception:  # noqa: BLE001
        results["crash"] = traceback.format_exc()
    torch.save(results, f"{out}/options{rank}.pt")


@functools.lru_cache(maxsize=None)
def _results(world: int, out: str) -> list:
    codes = fork_ranks(run_rank, world, out, world=world, timeout=240)
    files = [os.path.join(out, f"options{rank}.pt") for rank in range(world)]
    results = [torch.load(f, weights_only=False) if os.path.exists(f) else {"crash": "no results"} for f in files]
    assert codes == [0] * world and not any("crash" in r for r in results), (codes, results)
    return results


@pytest.fixture(scope="module", params=[2, 3], ids=["2 ranks", "3 ranks"])
def ranks(request, tmp_path_factory):
    return _results(request.param, str(tmp_path_factory.mktemp(f"options{request.param}")))


@pytest.mark.parametrize("name", list(_observers(False)))
def test_an_option_the_state_does_not_hold_raises_on_every_rank_naming_it(ranks, name):
    odd = len(ranks) - 1
    option = _observers(False)[name][1]  # the last rank's value
    for rank, result in enumerate(ranks):
        assert isinstance(result[name], dict), (name, rank, "merged in silence")
        error = result[name]["error"]
        assert error.startswith("ValueError: all_reduce"), (rank, error)
        assert "built with" in error and option in error.split(f"rank {odd} holds")[1], (rank, error)
        assert f"rank {odd} holds" in error and "rank 0 holds" in error and "'layer/input'" in error, (rank, error)


def test_the_group_stays_in_step_and_merges_as_a_sequential_merge(ranks):
    observer = _observers(False)["averaging constant"][0]
    expected = _state(observer, _data(0))
    for rank in range(1, len(ranks)):
        expected = observer.merge(expected, _state(observer, _data(rank)))
    for result in ranks:
        assert all(torch.equal(a, b) for a, b in zip(result["after"], expected))


def test_observers_declare_the_options_their_states_do_not_hold():
    """A sequential merge cannot tell these apart (the states are alike): the observers say them."""
    x = _data(0)
    for make, name in [(lambda v: qstats.moving_average_minmax(SPEC, v), "averaging_constant"),
                       (lambda v: qstats.mse(SPEC, norm=v), "norm"),
                       (lambda v: qstats.mse(SPEC, mode="moving_average", averaging_constant=v), "averaging_constant")]:
        a, b = make(0.25), make(0.5)
        assert torch.equal(_state(a, x).min_val, _state(b, x).min_val)  # one batch: the same state
        assert dict(a.options)[name] == 0.25 and dict(b.options)[name] == 0.5
    ones = torch.ones(16)
    assert qstats.mse(SPEC, reference=(-ones, ones)).options == qstats.mse(SPEC, reference=(-2 * ones, 2 * ones)).options
