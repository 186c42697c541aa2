"""``qstats.distributed.all_reduce(..., partial=True)`` over 2 and 3 gloo ranks whose state trees
differ by missing sites only: a Mixtral-style MoE (a ``ModuleList`` of experts, each called with
its routed tokens only) where rank 1 routes no token to expert 3, another expert only rank 1
reaches and one no rank reaches; a rank without any batch. Every rank gets the states one process
calibrating all the batches gets, bit for bit, the sites no rank holds stay absent, and a site held
differently by two ranks (another shape, a state where another rank holds a dict, a merge that
refuses) raises on every rank, none waits."""

from __future__ import annotations

import functools
import os
import sys
import traceback
import warnings
from datetime import timedelta
from typing import NamedTuple

import optree
import pytest
import torch

import qstats
from qstats import distributed

sys.path.insert(0, os.path.dirname(__file__))
from _shared import exit_rank, fork_ranks, gloo_group  # noqa: E402

EXPERTS, FEATURES = 5, 6
# experts each batch routes tokens to: batches 1 and 4 (rank 1 of 2 and of 3 ranks) and the odd
# ones (rank 1 of 2) never reach expert 3; expert 2 only in batch 1; expert 4 in none
ROUTES = [(0, 1, 3), (0, 1, 2), (0, 3), (1,), (0, 1), (1, 0)]


class MoE(torch.nn.Module):
    """A projection, then top-1 routing on the token's first feature to per-expert Linears, each
    called with its own tokens only (transformers' Mixtral / Qwen2-MoE sparse blocks)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(FEATURES, FEATURES)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(FEATURES, 4) for _ in range(EXPERTS))

    def forward(self, x):
        route = x[:, 0].round().long()
        hidden = self.proj(x)
        out = hidden.new_zeros(x.shape[0], 4)
        for index, expert in enumerate(self.experts):
            tokens = torch.where(route == index)[0]
            if tokens.numel():
                out = out.index_add(0, tokens, expert(hidden[tokens]))
        return out


RECIPE = qstats.Recipe([
    qstats.Rule("Linear", sites=("input",), observer=qstats.minmax, spec=qstats.QuantSpec(granularity=qstats.PerAxis(-1))),
    qstats.Rule("Linear", sites=("output",), observer=qstats.histogram, spec=qstats.QuantSpec(dtype="uint8")),
])


def model_and_batches():
    torch.manual_seed(0)
    model = MoE().eval()
    batches = []
    for index, experts in enumerate(ROUTES):
        x = torch.randn(4 * len(experts), FEATURES, generator=torch.Generator().manual_seed(index)) * (index + 1)
        x[:, 0] = torch.tensor(experts).repeat(4).float()
        batches.append(x)
    return model, batches


def calibrated(model, batches) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # experts without tokens are expected here
        return qstats.calibrate(model, batches, RECIPE, progress=False)


def _record(results: dict, name: str, step) -> None:
    try:
        results[name] = optree.tree_map(torch.clone, step())
    except Exception as error:  # recorded for the test, on every rank
        results[name] = f"{type(error).__name__}: {error}"


def _rank(rank: int, port: int, world: int, out: str) -> None:
    results: dict = {}
    try:
        with gloo_group(rank, port, world=world, timeout=timedelta(seconds=30)):
            model, batches = model_and_batches()
            observers = RECIPE.observers(calibrated(model, batches), model)  # every site of the model
            local = calibrated(model, batches[rank::world])
            _record(results, "moe", lambda: distributed.all_reduce(local, RECIPE.observers(local, model), partial=True))
            _record(results, "moe/all-observers", lambda: distributed.all_reduce(local, observers, partial=True))
            # the last rank has no batch: its tree is empty
            shard = calibrated(model, batches[rank::world]) if rank < world - 1 else {}
            _record(results, "no-batch", lambda: distributed.all_reduce(shard, observers, partial=True))
            _record(results, "all-empty", lambda: distributed.all_reduce({}, observers, partial=True))
            for name, tree in _mismatches(rank, world).items():
                _record(results, name, lambda: distributed.all_reduce(tree, qstats.minmax(ROWS), partial=True))
            averages, average = _moving_averages(rank)
            _record(results, "folded", lambda: distributed.all_reduce(averages, average, partial=True))
            distributed.BUCKET_BYTES = 64  # this rank's process only: several broadcasts per rank
            _record(results, "moe/small-buckets", lambda: distributed.all_reduce(local, observers, partial=True))
            _record(results, "folded/small-buckets", lambda: distributed.all_reduce(averages, average, partial=True))
            lone = {"a": _minmax_state(torch.ones(2, 1))} if rank == 0 else {}
            _record(results, "partial-on-some-ranks",
                    lambda: distributed.all_reduce(lone, qstats.minmax(ROWS), partial=rank > 0))
            fixed = _fixed_qparams(rank)
            _record(results, "refused", lambda: distributed.all_reduce(fixed[0], fixed[1], partial=True))
            _record(results, "after", lambda: distributed.all_reduce(local, observers, partial=True))
    except Exception:
        results["crash"] = traceback.format_exc()
    torch.save(results, f"{out}/missing{rank}.pt")
    exit_rank(0)


ROWS = qstats.QuantSpec(granularity=qstats.PerAxis(0))


def _minmax_state(values: torch.Tensor):
    obs = qstats.minmax(ROWS)
    return obs.update(obs.init(values), values)


def _mismatches(rank: int, world: int) -> dict:
    """Trees whose last rank holds a site differently: of another shape, or a state where the
    others hold a dict of sites; the first rank alone holds a further site."""
    odd = rank == world - 1
    extra = {"only0": _minmax_state(torch.ones(2, 1))} if rank == 0 else {}
    shape = {"a": _minmax_state(torch.ones(5 if odd else 6, 1)), **extra}
    nested = {"a": _minmax_state(torch.ones(3, 1))} if odd else {"a": {"input": _minmax_state(torch.ones(3, 1))}}
    return {"other-shape": shape, "state-or-dict": {**nested, **extra}}


class _DecayState(NamedTuple):
    value: torch.Tensor
    count: torch.Tensor


def _decay_observer() -> qstats.Observer:
    """A state whose merge depends on the order of its operands (``0.25 * a + b``), not declared
    elementwise: all_reduce folds it with ``merge``, so the result shows the order of the fold."""
    def init_fn(x):
        return _DecayState(torch.zeros(x.shape[-1]), torch.zeros((), dtype=torch.int64))

    def update_fn(state, x, weight=None):
        return _DecayState(0.25 * state.value + x.float().sum(0), state.count + x.shape[0])

    def merge_fn(a, b):
        return _DecayState(0.25 * a.value + b.value, a.count + b.count)

    return qstats.Observer(init_fn, update_fn, merge_fn, exact=False, name="decay_test")


AVERAGE = _decay_observer()


def _moving_averages(rank: int) -> tuple:
    """Order-dependent states of every rank but the first, at a site ("m", a list of two states)
    the first rank lacks, and of every rank at "all"."""
    def state(seed: int):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(seed)) * (seed + 1)
        return AVERAGE.update(AVERAGE.init(x), x)
    tree = {"all": state(10 + rank)}
    if rank > 0:
        tree["m"] = [state(20 + rank), state(30 + rank)]
    return tree, AVERAGE


def _fixed_qparams(rank: int) -> tuple:
    """A site held by ranks 0 and 1 only, with fixed_qparams of different constants: the merge refuses."""
    obs = qstats.fixed_qparams(qstats.QuantSpec(), scale=0.5 * (rank + 1), zero_point=0)
    tree = {"a": obs.init(torch.ones(3))} if rank < 2 else {}
    return tree, obs


@pytest.fixture(scope="module", params=[2, 3], ids=["2 ranks", "3 ranks"])
def ranks(request, tmp_path_factory):
    world, out = request.param, tmp_path_factory.mktemp(f"missing{request.param}")
    assert fork_ranks(_rank, world, str(out), world=world) == [0] * world
    results = [torch.load(out / f"missing{rank}.pt", weights_only=False) for rank in range(world)]
    assert not any("crash" in r for r in results), [r.get("crash") for r in results]
    return results


def _assert_bit_equal(got, want, what: str) -> None:
    assert not isinstance(got, str), (what, got)
    assert {p: set(s) for p, s in got.items()} == {p: set(s) for p, s in want.items()}, what
    for path, sites in want.items():
        for site, state in sites.items():
            assert type(got[path][site]) is type(state), (what, path, site)
            for field, value in zip(state._fields, state):
                assert torch.equal(getattr(got[path][site], field), value), (what, path, site, field)


def test_the_ranks_hold_different_experts():
    model, batches = model_and_batches()
    for world in (2, 3):
        shards = [calibrated(model, batches[rank::world]) for rank in range(world)]
        assert "experts.3" in shards[0] and "experts.3" not in shards[1]
        assert "experts.2" in shards[1] and "experts.2" not in shards[0]
        assert all("experts.4" not in shard for shard in shards)


@pytest.mark.parametrize("name", ["moe", "moe/all-observers", "moe/small-buckets", "no-batch", "after"])
def test_every_rank_gets_one_process_calibration_of_all_batches(ranks, name):
    model, batches = model_and_batches()
    world = len(ranks)
    given = batches if name != "no-batch" else [b for rank in range(world - 1) for b in batches[rank::world]]
    want = calibrated(model, given)
    assert "experts.4" not in want
    for rank, results in enumerate(ranks):
        _assert_bit_equal(results[name], want, f"{name} rank {rank}")


@pytest.mark.parametrize("name", ["folded", "folded/small-buckets"])
def test_a_site_only_some_ranks_hold_is_their_merge_in_rank_order(ranks, name):
    world = len(ranks)
    trees = [_moving_averages(rank)[0] for rank in range(world)]
    want = {
        "all": functools.reduce(AVERAGE.merge, [tree["all"] for tree in trees]),
        "m": [functools.reduce(AVERAGE.merge, [tree["m"][i] for tree in trees[1:]]) for i in range(2)],
    }
    for rank, results in enumerate(ranks):
        got = results[name]
        assert not isinstance(got, str) and set(got) == {"all", "m"}, (name, rank, got)
        assert isinstance(got["m"], list) and len(got["m"]) == 2, (name, rank, got)
        for got_state, want_state in zip([got["all"], *got["m"]], [want["all"], *want["m"]]):
            assert all(torch.equal(a, b) for a, b in zip(got_state, want_state)), (name, rank)


def test_ranks_without_any_site_get_an_empty_tree(ranks):
    assert all(results["all-empty"] == {} for results in ranks)


def test_a_site_only_some_ranks_hold_folds_in_rank_order():
    """Where no rank holds a site twice over, the partial merge is obs.merge of its holders in rank
    order: fixed_qparams of different constants are refused by that merge too."""
    (first, obs), (second, _) = _fixed_qparams(0), _fixed_qparams(1)
    with pytest.raises(ValueError, match="different constants"):
        obs.merge(first["a"], second["a"])


@pytest.mark.parametrize("name,words", [
    ("other-shape", ["'a'", "min_val (5,)", "min_val (6,)"]),
    ("state-or-dict", ["'a'", "a dict of states", "a MinMaxState"]),
    ("refused", ["'a'", "different constants"]),
])
def test_a_site_held_differently_raises_on_every_rank(ranks, name, words):
    for rank, results in enumerate(ranks):
        error = results[name]
        assert isinstance(error, str) and error.startswith("ValueError: all_reduce"), (name, rank, error)
        if name != "refused" or rank < 2:
            assert all(word in error for word in words), (name, rank, error)


def test_ranks_passing_another_partial_raise_on_every_rank(ranks):
    for rank, results in enumerate(ranks):
        error = results["partial-on-some-ranks"]
        assert isinstance(error, str) and "different arguments" in error, (rank, error)
        assert "partial=False on rank 0" in error and "partial=True on rank 1" in error, (rank, error)
