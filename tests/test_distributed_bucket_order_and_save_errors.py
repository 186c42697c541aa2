"""The order in which ranks all-reduce their elementwise buckets when their states live on
devices of other indices; elementwise states that ``obs.merge`` refuses, across 2 gloo ranks
(checked against a sequential ``obs.merge``); and the errors of `qstats.save` where the file
cannot be written (checked against what ``open(path, "wb")`` raises for the same path)."""

from __future__ import annotations

import os
import sys
import traceback
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch

import qstats
from qstats import distributed

sys.path.insert(0, os.path.dirname(__file__))
from _shared import exit_rank, fork_ranks, gloo_group  # noqa: E402


def _rank(device_names):
    """One rank's elementwise states as the bucketing sees them: one state per device, in tree
    order, each with a float32 extreme ("min") and an int64 count ("sum")."""
    states = [(SimpleNamespace(device=torch.device(name)),) for name in device_names]
    keys = [(op, dtype, torch.device(name)) for name in device_names
            for op, dtype in (("min", torch.float32), ("sum", torch.int64))]
    return states, keys


@pytest.mark.parametrize(
    "first, second",
    [
        (["cuda:1", "cuda:0"], ["cuda:2", "cuda:3"]),  # the first rank's first device has the higher index
        (["cuda:0", "cuda:1"], ["cuda:9", "cuda:10"]),  # "cuda:10" sorts before "cuda:9" as a name
        (["cpu", "cuda:3", "cuda:2"], ["cpu", "cuda:6", "cuda:7"]),
    ],
)
def test_ranks_all_reduce_the_buckets_of_the_same_tree_positions_in_the_same_order(first, second):
    # Both ranks pass the same tree; the structure check numbers devices by first use, so they
    # pass it. The n-th collective must then carry, on both ranks, the bucket of the states at the
    # same tree positions: the same op, dtype and device position in the tree.
    orders = []
    for names in (first, second):
        states, keys = _rank(names)
        position = {torch.device(name): i for i, name in enumerate(names)}  # tree order, computed here
        ordered = distributed._bucket_order(keys, distributed._device_numbers(states))
        orders.append([(op, dtype, position[device]) for op, dtype, device in ordered])
    assert orders[0] == orders[1]


def test_the_structure_check_still_numbers_devices_by_first_use():
    states, _ = _rank(["cuda:5", "cpu", "cuda:2"])
    numbers = distributed._device_numbers(states)
    assert [numbers[torch.device(name)] for name in ("cuda:5", "cpu", "cuda:2")] == [0, 1, 2]


def _state():
    obs = qstats.minmax(qstats.QuantSpec())
    x = torch.tensor([-1.0, 2.0])
    return {"layer": obs.update(obs.init(x), x)}


def test_saving_into_a_missing_folder_raises_what_open_raises(tmp_path):
    path = tmp_path / "missing" / "stats.safetensors"
    with pytest.raises(FileNotFoundError):
        open(path, "wb")  # the reference: Python's own error for this path
    with pytest.raises(FileNotFoundError, match="could not write"):
        qstats.save(path, _state())
    assert not path.parent.exists()


def test_saving_onto_a_folder_raises_an_os_error(tmp_path):
    with pytest.raises(OSError):
        open(tmp_path, "wb")  # the reference: IsADirectoryError, an OSError
    with pytest.raises(OSError, match="could not write"):
        qstats.save(tmp_path, _state())
    assert tmp_path.is_dir()


def _refused_states(rank: int) -> dict:
    """name -> (tree, observers) that ``obs.merge`` refuses on every rank."""
    x = torch.randn(5, generator=torch.Generator().manual_seed(rank)) * (rank + 1)
    minmax = qstats.minmax(qstats.QuantSpec())
    state = minmax.update(minmax.init(x), x)
    histogram = qstats.histogram(qstats.QuantSpec())
    return {
        "float_count": ({"a": state._replace(count=state.count.float())}, minmax),
        "count_of_another_shape": ({"a": state._replace(count=state.count.reshape(1))}, minmax),
        "state_of_another_observer": ({"a": histogram.update(histogram.init(x), x)}, minmax),
    }


def _refused_rank(rank: int, port: int, out: str) -> None:
    errors = {}
    try:
        with gloo_group(rank, port, timeout=timedelta(seconds=20)):
            for name, (tree, observers) in _refused_states(rank).items():
                try:
                    distributed.all_reduce(tree, observers)
                    errors[name] = None
                except Exception as error:  # recorded for the test, on every rank
                    errors[name] = f"{type(error).__name__}: {error}"
    except Exception:
        errors["crash"] = traceback.format_exc()
    torch.save(errors, f"{out}/refused{rank}.pt")
    exit_rank(0)


def test_elementwise_states_that_merge_refuses_raise_on_every_rank(tmp_path):
    # the reference: a sequential merge of the two ranks' states raises for each scenario
    for name, (tree, observers) in _refused_states(0).items():
        with pytest.raises((TypeError, ValueError)):
            observers.merge(tree["a"], _refused_states(1)[name][0]["a"])
    assert fork_ranks(_refused_rank, str(tmp_path)) == [0, 0]
    for rank in range(2):
        errors = torch.load(tmp_path / f"refused{rank}.pt")
        assert "crash" not in errors, errors
        for name, error in errors.items():
            assert error is not None and error.startswith("ValueError") and "merge" in error, (rank, name, error)
