"""Ranks of tests/test_distributed_bool_fields.py: ``run_rank(rank, world, port, out)`` joins a gloo
group on 127.0.0.1 with a short timeout, all-reduces `flag_state` of this rank's data and saves the
merged leaves to ``OUT/flags{rank}.pt``."""

from __future__ import annotations

import traceback
from datetime import timedelta
from typing import NamedTuple

import torch

import qstats
from qstats.observers import register_state


@register_state
class _SeenState(NamedTuple):
    """Which channels saw a positive value (a bool merged by ``+``, torch's logical or), and rows."""

    seen: torch.Tensor
    count: torch.Tensor


qstats.distributed.register_reduce_ops(_SeenState, {"seen": "sum", "count": "sum"})


def seen_observer() -> qstats.Observer:
    def init_fn(x):
        return _SeenState(torch.zeros(x.shape[-1], dtype=torch.bool), torch.zeros((), dtype=torch.int64))

    def update_fn(state, x, weight=None):
        return _SeenState(state.seen + (x > 0).any(0), state.count + x.shape[0])

    def merge_fn(a, b):
        return _SeenState(a.seen + b.seen, a.count + b.count)

    return qstats.Observer(init_fn, update_fn, merge_fn, exact=True, name="seen")


def rank_data(rank: int) -> torch.Tensor:
    """Channel 0 positive on every rank, channel 1 on none, channel 2 on rank 0 only."""
    x = -torch.ones(3 + rank, 3)
    x[:, 0] = 1.0
    if rank == 0:
        x[0, 2] = 1.0
    return x


def rank_state(rank: int):
    obs = seen_observer()
    x = rank_data(rank)
    return obs.update(obs.init(x), x)


def run_rank(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=30))
        merged = qstats.distributed.all_reduce({"a": rank_state(rank), "b": rank_state(rank)}, seen_observer())
        result = {"leaves": list(merged["a"]),
                  "storage_bytes": [leaf.untyped_storage().nbytes() for state in merged.values() for leaf in state]}
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        result = {"crash": traceback.format_exc()}
    torch.save(result, f"{out}/flags{rank}.pt")
