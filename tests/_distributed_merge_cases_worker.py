"""Ranks of tests/test_distributed_merge_equals_sequential.py: ``run_rank(rank, port, out)`` joins a
3-rank gloo group on 127.0.0.1 with a short timeout (a hang becomes an error), merges every state of
`rank_trees` with `qstats.distributed.all_reduce` (exact=False and exact=True, then again with
buckets of a few hundred bytes), runs the scenarios of `bad_trees`, and saves the results to
``OUT/merge{rank}.pt``. The test process rebuilds each rank's states for the sequential merge."""

from __future__ import annotations

import sys
import traceback
from datetime import timedelta

import optree
import torch

import qstats

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from observer_cases import CASES  # noqa: E402

WORLD = 3
EXPERTS = 3
BATCHES = (3, 1, 0)  # per rank: uneven, and the last rank saw no data (it passes init states)
SMALL_BUCKET_BYTES = 200


def _case_data(index: int, rank: int, make_x):
    g = torch.Generator().manual_seed(1000 * index + rank)
    return [make_x(g) for _ in range(BATCHES[rank])], make_x(torch.Generator().manual_seed(index))


def case_observers() -> dict:
    """``{name: observer}``: every observer of observer_cases, and a stacked (3 experts) one of each."""
    out = {}
    for case in CASES:
        name, factory = case[0], case[1]
        out[name] = factory()
        out["stacked/" + name] = qstats.stacked_observer(factory(), EXPERTS)
    return out


def rank_states(rank: int) -> dict:
    """``{name: state}`` of this rank: its batches (stacked experts routed by a mask, one expert
    without tokens on every rank), or the observer's init state."""
    observers = case_observers()
    out = {}
    for index, case in enumerate(CASES):
        name, make_x = case[0], case[2]
        batches, like = _case_data(index, rank, make_x)
        obs = observers[name]
        state = obs.init(like)
        for x in batches:
            state = obs.update(state, x)
        out[name] = state
        stacked = observers["stacked/" + name]
        like_stack = like.expand(EXPERTS, *like.shape)
        state = stacked.init(like_stack)
        for j, x in enumerate(batches):
            mask = torch.zeros(EXPERTS, x.shape[0])
            mask[j % 2, :: 1 + j % 2] = 1  # expert 2 sees no token
            state = stacked.update(state, x.expand(EXPERTS, *x.shape), mask)
        out["stacked/" + name] = state
    return out


def empty_states(rank: int) -> dict:
    """States of zero channels (a layer with no columns): every field holds no element."""
    x = torch.randn(4 + rank, 0)
    spec = qstats.QuantSpec(granularity=qstats.PerAxis(-1))
    minmax, moving = qstats.minmax(spec), qstats.moving_average_minmax(spec)
    return {"minmax": (minmax.update(minmax.init(x), x), minmax), "moving": (moving.update(moving.init(x), x), moving)}


def learnable_states(rank: int) -> dict:
    """States whose float fields require grad (an observer that does not detach its input)."""
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(rank))
    minmax, histogram = qstats.minmax(qstats.QuantSpec()), qstats.histogram(qstats.QuantSpec(), octaves=8)
    out = {}
    for name, obs in (("minmax", minmax), ("histogram", histogram)):
        state = obs.update(obs.init(x), x)
        out[name] = (type(state)(*(v.clone().requires_grad_(True) if v.is_floating_point() else v for v in state)), obs)
    return out


def bad_trees(rank: int) -> dict:
    """name -> (tree, observers): one rank's input is bad; every rank must raise, none wait."""
    obs = qstats.minmax(qstats.QuantSpec(granularity=qstats.PerAxis(0)))
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(rank))
    good = obs.update(obs.init(x), x)
    out = {}
    nan = good._replace(max_val=torch.tensor([0.0, float("nan"), 1.0, 2.0]))
    out["nan_extreme_on_rank_1"] = ({"a": nan if rank == 1 else good}, obs)
    short = obs.update(obs.init(x[:3]), x[:3])
    out["other_shape_on_rank_2"] = ({"a": short if rank == 2 else good}, obs)
    out["float_count_on_rank_0"] = ({"a": good._replace(count=good.count.float()) if rank == 0 else good}, obs)
    out["missing_site_on_rank_1"] = ({"a": good} if rank == 1 else {"a": good, "b": good}, obs)
    out["after"] = ({"a": good}, obs)  # the group is still in step
    return out


def _leaves(tree):
    return [t.clone() for t in optree.tree_leaves(tree)]


def _merge_all(rank: int, results: dict) -> None:
    observers = case_observers()
    states = rank_states(rank)
    for exact in (False, True):
        merged = qstats.distributed.all_reduce(states, observers, exact=exact)
        results[f"cases/exact={exact}"] = {name: _leaves(state) for name, state in merged.items()}
    grad = learnable_states(rank)
    merged = qstats.distributed.all_reduce({k: s for k, (s, _) in grad.items()}, {k: o for k, (_, o) in grad.items()})
    results["learnable"] = {name: _leaves(state) for name, state in merged.items()}
    empty = empty_states(rank)
    merged = qstats.distributed.all_reduce({k: s for k, (s, _) in empty.items()}, {k: o for k, (_, o) in empty.items()})
    results["empty"] = {name: _leaves(state) for name, state in merged.items()}


def _reduce_recording(buffers: list):
    """dist.all_reduce, recording each buffer's size and address."""
    import torch.distributed as dist

    reduce = dist.all_reduce

    def recording(tensor, *args, **kwargs):
        buffers.append((tensor.numel() * tensor.element_size(), tensor.data_ptr()))
        return reduce(tensor, *args, **kwargs)

    return recording


def _small_buckets(rank: int, results: dict) -> None:
    """Every case again with buckets of `SMALL_BUCKET_BYTES`, recording the buffers reduced."""
    import torch.distributed as dist

    from qstats import distributed

    observers = case_observers()
    states = rank_states(rank)
    buffers: list = []
    reduce, bucket_bytes = dist.all_reduce, getattr(distributed, "BUCKET_BYTES", None)
    dist.all_reduce, distributed.BUCKET_BYTES = _reduce_recording(buffers), SMALL_BUCKET_BYTES
    try:
        merged = qstats.distributed.all_reduce(states, observers)
    finally:
        dist.all_reduce, distributed.BUCKET_BYTES = reduce, bucket_bytes
    results["cases/small_buckets"] = {name: _leaves(state) for name, state in merged.items()}
    results["small_buckets/buffers"] = buffers
    results["small_buckets/fields"] = {
        name: [(leaf.numel() * leaf.element_size(), leaf.data_ptr()) for leaf in optree.tree_leaves(state)]
        for name, state in merged.items()}


def run_rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    results: dict = {}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                                timeout=timedelta(seconds=30))
        _merge_all(rank, results)
        _small_buckets(rank, results)
        for name, (tree, observers) in bad_trees(rank).items():
            try:
                results["bad/" + name] = _leaves(qstats.distributed.all_reduce(tree, observers))
            except Exception as error:  # recorded for the test to check, on every rank
                results["bad/" + name] = {"error": f"{type(error).__name__}: {error}"}
                if "imed out" in str(error) or "Connection closed" in str(error):
                    break  # the group is broken: later scenarios would only wait again
        dist.destroy_process_group()
    except Exception:
        results["crash"] = traceback.format_exc()
    torch.save(results, f"{out}/merge{rank}.pt")
