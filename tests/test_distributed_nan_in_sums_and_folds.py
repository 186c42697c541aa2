"""A NaN in one rank's state, in a field that no rank reduces by min/max: a Hessian or importance
sum (reduced elementwise, or folded with ``exact=True``), a ``moments`` sum, the range of a folded
``mse`` or moving-average state. Observers leave NaN out of every field (they count it in
``nonfinite``), so such a state is corrupt: with 2 and 3 gloo ranks, every rank raises a ValueError
naming the field, the tree path and the rank, where the NaN spread to every rank's result in silence
(the mse merge dropped it instead). The same trees without the NaN, next to a rank that saw no data
(``init`` states: +-inf extremes), still merge as ``functools.reduce(obs.merge, ...)`` in rank order
and, for the extremes, as ``torch.amin``/``amax`` over all the data."""

from __future__ import annotations

import functools
import os
import sys
import traceback
import warnings
from datetime import timedelta

import optree
import pytest
import torch

import qstats
from qstats import distributed

sys.path.insert(0, os.path.dirname(__file__))
from _shared import exit_rank, fork_ranks, gloo_group  # noqa: E402

SPEC = qstats.QuantSpec(dtype="int8")
# name: (observer, field given a NaN, exact)
CASES = {
    "hessian": (qstats.hessian(), "total", False),
    "hessian exact": (qstats.hessian(), "total", True),
    "imatrix exact": (qstats.imatrix(), "square_total", True),
    "moments": (qstats.moments(SPEC), "total", False),
    "mse range": (qstats.mse(SPEC), "min_val", False),
    "mse loss": (qstats.mse(SPEC), "loss", False),
    "moving average": (qstats.moving_average_minmax(SPEC), "max_val", False),
}


def batches(rank: int) -> list:
    """Rank 1 saw no data (its states are ``init`` states); the others two batches each."""
    generator = torch.Generator().manual_seed(10 + rank)
    return [] if rank == 1 else [torch.randn(6, 8, generator=generator) * (rank + 1) for _ in range(2)]


def local_state(obs, rank: int):
    state = obs.init(torch.zeros(6, 8))
    for x in batches(rank):
        state = obs.update(state, x)
    return state


def with_nan(state, field: str):
    value = getattr(state, field).clone()
    value.view(-1)[-1] = float("nan")
    return state._replace(**{field: value})


def _rank(rank: int, port: int, out: str, world: int) -> None:
    results: dict = {}
    warnings.simplefilter("ignore")
    try:
        with gloo_group(rank, port, world=world, timeout=timedelta(seconds=30)):
            for name, (obs, field, exact) in CASES.items():
                state = local_state(obs, rank)
                bad = with_nan(state, field) if rank == world - 1 else state
                try:
                    distributed.all_reduce({"layers": {"0": bad}}, obs, exact=exact)
                    results[name] = "no error"
                except ValueError as error:
                    results[name] = str(error)
                merged = distributed.all_reduce({"layers": {"0": state}}, obs, exact=exact)  # in step after it
                results[name, "merged"] = optree.tree_map(torch.clone, merged["layers"]["0"])
    except Exception:
        results["crash"] = traceback.format_exc()
    torch.save(results, os.path.join(out, f"nan{rank}.pt"))
    exit_rank(0)


@pytest.fixture(scope="module", params=[2, 3], ids=["2 ranks", "3 ranks"])
def ranks(request, tmp_path_factory):
    world = request.param
    out = tmp_path_factory.mktemp(f"nan{world}")
    assert fork_ranks(_rank, str(out), world, world=world, timeout=240) == [0] * world
    results = [torch.load(out / f"nan{rank}.pt", weights_only=False) for rank in range(world)]
    assert not any("crash" in r for r in results), [r.get("crash") for r in results]
    return results


@pytest.mark.parametrize("name", list(CASES))
def test_a_nan_outside_the_extremes_on_one_rank_raises_on_every_rank_naming_it(ranks, name):
    obs, field, _ = CASES[name]
    odd = len(ranks) - 1
    state_type = type(obs.init(torch.zeros(6, 8))).__name__
    for rank, result in enumerate(ranks):
        error = result[name]
        assert error.startswith("all_reduce"), (name, rank, error)
        assert f"field {field!r} of the {state_type} at 'layers/0' holds NaN" in error, (name, rank, error)
        named = f"(rank {odd})" if rank == odd else f"rank {odd}:"  # the odd rank names itself too
        assert named in error, (name, rank, error)


@pytest.mark.parametrize("name", list(CASES))
def test_the_same_states_without_nan_merge_as_the_sequential_merge(ranks, name):
    obs = CASES[name][0]
    folded = functools.reduce(obs.merge, [local_state(obs, rank) for rank in range(len(ranks))])
    for rank, result in enumerate(ranks):
        merged = result[name, "merged"]
        for field, got, want in zip(folded._fields, merged, folded):
            assert got.dtype == want.dtype and got.shape == want.shape, (name, rank, field)
            # bit for bit also for the elementwise float sums: two ranks add, the one without data adds zeros
            assert torch.equal(got, want), (name, rank, field)


def test_the_extremes_without_nan_equal_those_of_all_the_data(ranks):
    data = torch.cat([x for rank in range(len(ranks)) for x in batches(rank)])
    for result in ranks:
        state = result["mse range", "merged"]  # the widest first-batch range, which the ranks' minmax bound
        assert bool(data.amin() <= state.min_val) and bool(state.max_val <= data.amax())
        moving = result["moving average", "merged"]
        assert bool(data.amin() <= moving.min_val) and bool(moving.max_val <= data.amax())
        assert int(moving.count) == data.numel()
