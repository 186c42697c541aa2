"""`qstats.distributed.all_reduce` of observer states holding a nested NamedTuple (allowed by the observer
kit, docs/write_an_observer.md), across 2 and 3 gloo ranks: folded (the default) and elementwise (ops
declared on dotted field names, ``"ext.low"``) states equal a sequential ``obs.merge`` of every rank's
state bit for bit, and ``torch.amin``/``amax`` and the element count of all ranks' data; a rank whose
nested structure differs makes every rank raise (none hangs)."""

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
from qstats import distributed, testing
from qstats.observers import kit

sys.path.insert(0, os.path.dirname(__file__))
from _shared import exit_rank, fork_ranks, gloo_group  # noqa: E402


@kit.register_state
class DistNestedExtremes(NamedTuple):
    low: torch.Tensor
    high: torch.Tensor


@kit.register_state
class DistNestedOtherExtremes(NamedTuple):  # the same fields as DistNestedExtremes, another type
    low: torch.Tensor
    high: torch.Tensor


@kit.register_state
class DistNestedState(NamedTuple):  # folds (no reduce ops declared)
    ext: DistNestedExtremes
    total: torch.Tensor  # float64 sum: a fold keeps its rank order
    count: torch.Tensor


@kit.register_state
class DistNestedElementwise(DistNestedState):
    pass


distributed.register_reduce_ops(
    DistNestedElementwise, {"ext.low": "min", "ext.high": "max", "total": "sum", "count": "sum"}
)


def _observer(cls=DistNestedState, inner=DistNestedExtremes):
    def init_fn(x):
        return cls(inner(torch.full((), torch.inf), torch.full((), -torch.inf)),
                   torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.int64))

    def update_fn(state, x, weight=None):
        low, high, count, _ = kit.observe_extremes(x, weight, qstats.QuantSpec(), (), "dist_nested.update")
        return cls(inner(torch.minimum(state.ext.low, low), torch.maximum(state.ext.high, high)),
                   state.total + x.double().sum(), state.count + count)

    def merge_fn(a, b):
        kit.check_same_shapes(a, b, "dist_nested.merge")
        return cls(type(a.ext)(torch.minimum(a.ext.low, b.ext.low), torch.maximum(a.ext.high, b.ext.high)),
                   a.total + b.total, a.count + b.count)

    return kit.Observer(init_fn, update_fn, merge_fn, exact=True, spec=qstats.QuantSpec(), name="dist_nested")


def _data(rank: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 + rank)
    return torch.randn(3 + 2 * rank, 8, generator=generator, dtype=torch.float32) * (rank + 1)


def _state(obs, rank: int):
    x = _data(rank)
    return obs.update(obs.init(x), x)


def _tree(rank: int) -> tuple[dict, dict]:
    fold, elementwise = _observer(), _observer(DistNestedElementwise)
    tree = {"fold": _state(fold, rank), "elementwise": _state(elementwise, rank)}
    return tree, {"fold": fold, "elementwise": elementwise}


def _merge_rank(rank: int, port: int, world: int, out: str) -> None:
    result = {}
    try:
        with gloo_group(rank, port, world=world, timeout=timedelta(seconds=30)):
            tree, observers = _tree(rank)
            merged = distributed.all_reduce(tree, observers)
            result = {name: (distributed._structure(state), distributed._values(state))
                      for name, state in merged.items()}
    except Exception:
        result["crash"] = traceback.format_exc()
    torch.save(result, f"{out}/merged{rank}.pt")
    exit_rank(0)


@pytest.mark.parametrize("world", [2, 3])
def test_nested_states_merge_as_a_sequential_merge_across_ranks(tmp_path, world):
    trees = [_tree(rank)[0] for rank in range(world)]
    observers = _tree(0)[1]
    everything = torch.cat([_data(rank).reshape(-1) for rank in range(world)])
    assert fork_ranks(_merge_rank, world, str(tmp_path), world=world) == [0] * world
    for name, obs in observers.items():
        want = functools.reduce(obs.merge, [tree[name] for tree in trees])
        # an independent reference for the merge itself: torch over all ranks' data
        assert torch.equal(want.ext.low, everything.amin()) and torch.equal(want.ext.high, everything.amax())
        assert int(want.count) == everything.numel()
        for rank in range(world):
            result = torch.load(tmp_path / f"merged{rank}.pt")
            assert "crash" not in result, result["crash"]
            structure, values = result[name]
            assert structure == distributed._structure(want)
            for got, expected in zip(values, distributed._values(want), strict=True):
                assert got.dtype == expected.dtype and torch.equal(got, expected), (rank, name)


def test_nested_fields_are_named_by_dotted_paths():
    obs = _observer(DistNestedElementwise)
    state = _state(obs, 0)
    assert distributed.reduce_ops(state) == {"ext.low": "min", "ext.high": "max", "total": "sum", "count": "sum"}
    assert distributed.reduce_ops(_state(_observer(), 0)) == "fold"
    # without a process group the tree comes back as it is, its nested structure checked
    assert distributed.all_reduce({"s": state}, obs)["s"] is state
    # and the distributed law passes both (it refused every nested state)
    xs = [_data(rank) for rank in range(3)]
    testing.check_distributed(obs, xs)
    testing.check_distributed(_observer(), xs)


def test_ops_naming_a_nested_namedtuple_itself_are_refused():
    @kit.register_state
    class DistNestedWholeExt(DistNestedState):
        pass

    distributed.register_reduce_ops(DistNestedWholeExt, {"ext": "min", "total": "sum", "count": "sum"})
    obs = _observer(DistNestedWholeExt)
    state = _state(obs, 0)
    with pytest.raises(ValueError, match=r"name 'ext', a nested DistNestedExtremes; name its fields instead: "
                                         r"\['ext.low', 'ext.high'\]"):
        distributed.reduce_ops(state)
    with pytest.raises(ValueError, match="'ext', a nested DistNestedExtremes"):
        distributed.all_reduce({"s": state}, obs)
    with pytest.raises(AssertionError, match="dist_nested: distributed: .*'ext', a nested DistNestedExtremes"):
        testing.check_distributed(obs, [_data(rank) for rank in range(3)])
    with pytest.raises(ValueError, match="ops name fields"):  # a top-level name the class lacks
        distributed.register_reduce_ops(DistNestedWholeExt, {"extra.low": "min", "total": "sum", "count": "sum"})


def _mismatch_rank(rank: int, port: int, case: str, out: str) -> None:
    error = None
    try:
        with gloo_group(rank, port, world=3, timeout=timedelta(seconds=30)):
            inner = DistNestedOtherExtremes if rank == 1 else DistNestedExtremes
            cls = DistNestedElementwise if case == "elementwise" else DistNestedState
            obs = _observer(cls, inner)
            state = _state(obs, 0)  # the same shapes and dtypes on every rank: only the nested type differs
            try:
                distributed.all_reduce({"s": state}, obs)
            except Exception as caught:  # recorded for the test, on every rank
                error = f"{type(caught).__name__}: {caught}"
    except Exception:
        error = "crash: " + traceback.format_exc()
    torch.save(error, f"{out}/mismatch{rank}.pt")
    exit_rank(0)


@pytest.mark.parametrize("case", ["fold", "elementwise"])
def test_a_nested_structure_mismatch_on_one_rank_raises_on_every_rank(tmp_path, case):
    # the reference: a sequential merge of those states refuses them (check_same_shapes: the types differ)
    states = [_state(_observer(DistNestedState, inner), 0) for inner in (DistNestedExtremes, DistNestedOtherExtremes)]
    with pytest.raises(TypeError, match="differ in type"):
        _observer().merge(*states)
    assert fork_ranks(_mismatch_rank, case, str(tmp_path), world=3) == [0, 0, 0]  # none hangs
    for rank in range(3):
        error = torch.load(tmp_path / f"mismatch{rank}.pt")
        assert error is not None, rank
        assert error.startswith("ValueError: all_reduce: the ranks passed different state trees"), (rank, error)
        # what differs is named: each rank's nested type (the rest of the two states reads alike)
        assert "DistNestedExtremes(" in error and "DistNestedOtherExtremes(" in error, (rank, error)
