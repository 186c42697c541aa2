"""One rank passes ``exact``, ``partial`` or ``check`` that is not True or False (a string read from
its own config, ``"True"``; a ``check`` of None or 0, falsy), the others a bool (``check=True``), to
``qstats.distributed.all_reduce`` on 2 and 3 gloo ranks: every rank raises a ValueError naming that
rank and the argument, where that rank alone raised its TypeError before the check and the others
waited in the check for it. The group stays in step: a merge afterwards equals
``torch.amin``/``amax`` over every rank's data."""

from __future__ import annotations

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
# name: (the odd rank's arguments, the other ranks')
CASES = {"exact": ({"exact": "True"}, {"exact": False}), "partial": ({"partial": "no"}, {"partial": False}),
         "check": ({"check": "True"}, {"check": True}), "check=None": ({"check": None}, {"check": True}),
         "check=0 partial": ({"check": 0, "partial": True}, {"partial": True})}


def data(rank: int) -> torch.Tensor:
    return torch.randn(3, 5, generator=torch.Generator().manual_seed(rank)) * (rank + 1)


def _rank(rank: int, port: int, out: str, world: int) -> None:
    results: dict = {}
    try:
        with gloo_group(rank, port, world=world, timeout=timedelta(seconds=20)):
            tree = {"layer": {"input": MINMAX.update(MINMAX.init(data(rank)), data(rank))}}
            for name, (bad, good) in CASES.items():
                arguments = bad if rank == world - 1 else good
                try:
                    distributed.all_reduce(tree, MINMAX, **arguments)
                    results[name] = "no error"
                except Exception as error:
                    results[name] = f"{type(error).__name__}: {error}"
            results["merged"] = distributed.all_reduce(tree, MINMAX)["layer"]["input"]
    except Exception:
        results["crash"] = traceback.format_exc()
    torch.save(results, os.path.join(out, f"flag{rank}.pt"))
    exit_rank(0)


@pytest.fixture(scope="module", params=[2, 3], ids=["2 ranks", "3 ranks"])
def ranks(request, tmp_path_factory):
    world = request.param
    out = tmp_path_factory.mktemp(f"flag{world}")
    codes = fork_ranks(_rank, str(out), world, world=world, timeout=120)
    files = [out / f"flag{rank}.pt" for rank in range(world)]
    results = [torch.load(f, weights_only=False) if f.exists() else {"crash": "no results"} for f in files]
    assert codes == [0] * world and not any("crash" in r for r in results), (codes, results)
    return results


@pytest.mark.parametrize("name", list(CASES))
def test_a_flag_that_is_no_bool_on_one_rank_raises_on_every_rank_naming_it(ranks, name):
    odd = len(ranks) - 1
    flag = name.split("=")[0]
    value = CASES[name][0][flag]
    for rank, result in enumerate(ranks):
        error = result[name]
        assert error.startswith("ValueError: all_reduce"), (name, rank, error)
        assert f"{flag} must be True or False, got {value!r}" in error, (name, rank, error)
        assert (f"(rank {odd})" if rank == odd else f"rank {odd}:") in error, (name, rank, error)


def test_the_group_stays_in_step(ranks):
    data_all = torch.cat([data(rank) for rank in range(len(ranks))], dim=1)
    for result in ranks:
        assert torch.equal(result["merged"].min_val, data_all.amin(dim=1))
        assert torch.equal(result["merged"].max_val, data_all.amax(dim=1))
