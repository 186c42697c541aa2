"""``qstats.distributed.merge_partial_sites(..., device=...)`` where one rank passes a device that is
none (``"nonsense"``) or that it lacks (``"cuda:99"``), on 2 gloo ranks that each hold a site the
other lacks: every rank raises a ValueError naming that rank and the device, where that rank alone
raised torch's RuntimeError on receiving the first merged site and the other waited for it in the
next broadcast. The group stays in step: a merge afterwards equals the sequential ``obs.merge``."""

from __future__ import annotations

import datetime
import os
import sys

import pytest
import torch

import qstats
from qstats import distributed

sys.path.insert(0, os.path.dirname(__file__))
from _shared import exit_rank, fork_ranks, gloo_group  # noqa: E402

MINMAX = qstats.minmax(qstats.QuantSpec(granularity=qstats.PerAxis(0)))
DEVICES = ["nonsense", "cuda:99"]


def _state(seed: int):
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(seed)) * (seed + 1)
    return MINMAX.update(MINMAX.init(x), x)


def _tree(rank: int) -> dict:
    """Both ranks hold ``a``; rank 0 alone ``b``, rank 1 alone ``c``."""
    return {"a": _state(rank), "b": _state(10)} if rank == 0 else {"a": _state(rank), "c": _state(11)}


def _rank(rank: int, port: int, out: str) -> None:
    results: dict = {}
    try:
        with gloo_group(rank, port, timeout=datetime.timedelta(seconds=15)):
            for device in DEVICES:
                try:
                    distributed.merge_partial_sites(_tree(rank), MINMAX, device=device if rank == 1 else None)
                    results[device] = "no error"
                except Exception as error:  # noqa: BLE001  (what each rank raised is the result)
                    results[device] = f"{type(error).__name__}: {error}"
            common, _, merged = distributed.merge_partial_sites(_tree(rank), MINMAX)
            results["after"] = {"common": sorted(common), **{site: list(state) for site, state in merged.items()}}
    except Exception as error:  # noqa: BLE001
        results["crash"] = f"{type(error).__name__}: {error}"
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    exit_rank(0)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("device")
    codes = fork_ranks(_rank, str(out), timeout=90)
    results = [torch.load(out / f"rank{rank}.pt") if (out / f"rank{rank}.pt").exists() else {"crash": "none"}
               for rank in range(2)]
    assert codes == [0, 0] and not any("crash" in r for r in results), (codes, results)
    return results


@pytest.mark.parametrize("device", DEVICES)
def test_a_device_one_rank_cannot_use_raises_on_every_rank_naming_it(ranks, device):
    for rank, result in enumerate(ranks):
        error = result[device]
        assert error.startswith("ValueError: all_reduce"), (rank, error)
        assert f"merge_partial_sites: device {device!r}" in error and "rank 1" in error, (rank, error)


def test_the_group_stays_in_step(ranks):
    for result in ranks:
        assert result["after"]["common"] == ["a"]
        for site, state in {"b": _state(10), "c": _state(11)}.items():
            assert all(torch.equal(a, b) for a, b in zip(result["after"][site], state, strict=True)), site
