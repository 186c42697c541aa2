"""Ranks of tests/test_io_distributed_edges.py: ``run_rank(rank, port, out)`` joins a 2-rank gloo
group on 127.0.0.1 with a short timeout (a hang becomes an error), runs every scenario of
`scenarios` through `qstats.distributed.all_reduce`, and saves ``{name: leaves | {"error": ...}}``
to ``OUT/edges{rank}.pt``. The test process rebuilds the data (`rank_data`) for its references."""

from __future__ import annotations

import traceback
from datetime import timedelta
from typing import NamedTuple

import optree
import torch

import qstats
from qstats.observers import register_state

WORLD = 2
FP8 = torch.float8_e4m3fn


@register_state
class _Fp8RangeState(NamedTuple):
    """Extremes kept in float8 and a row count in int16: dtypes gloo cannot reduce."""

    min_val: torch.Tensor
    max_val: torch.Tensor
    count: torch.Tensor


qstats.distributed.register_reduce_ops(_Fp8RangeState, {"min_val": "min", "max_val": "max", "count": "sum"})


@register_state
class _NamedOpsState(NamedTuple):
    """Declared with a callable that knows ``lo`` and ``hi`` only (it raises KeyError for ``n``)."""

    lo: torch.Tensor
    hi: torch.Tensor
    n: torch.Tensor


qstats.distributed.register_reduce_ops(
    _NamedOpsState, lambda fields: {f: {"lo": "min", "hi": "max"}[f] for f in fields}
)


def fp8_range_observer(dtype=FP8, count_dtype=torch.int16) -> qstats.Observer:
    def init_fn(x):
        c = x.shape[-1]
        return _Fp8RangeState(torch.full((c,), 448.0).to(dtype), torch.full((c,), -448.0).to(dtype),
                              torch.zeros((), dtype=count_dtype))

    def update_fn(state, x, weight=None):
        lo = torch.minimum(state.min_val.float(), x.amin(0)).to(dtype)
        hi = torch.maximum(state.max_val.float(), x.amax(0)).to(dtype)
        return _Fp8RangeState(lo, hi, state.count + x.shape[0])

    def merge_fn(a, b):
        return _Fp8RangeState(torch.minimum(a.min_val.float(), b.min_val.float()).to(a.min_val.dtype),
                              torch.maximum(a.max_val.float(), b.max_val.float()).to(a.max_val.dtype),
                              a.count + b.count)

    return qstats.Observer(init_fn, update_fn, merge_fn, exact=True, name="fp8_range")


def rank_data(rank: int) -> torch.Tensor:
    """This rank's tokens: (1 expert, rows, 3 channels), rows differing per rank."""
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(1, 4 + 3 * rank, 3, generator=g) * (rank + 1)


def _moving_average():
    return qstats.stacked_observer(qstats.moving_average_minmax(qstats.QuantSpec(granularity=qstats.PerAxis(-1))), 1)


def scenarios(rank: int) -> dict:
    """name -> (tree, observers) on this rank."""
    x = rank_data(rank)
    ma = _moving_average()
    # rank 0 calibrated no batch (init state, own memory); rank 1 keeps channel 0 of its
    # single-expert stacked state: one-element views of stride 3
    state = ma.init(x) if rank == 0 else ma.update(ma.init(x), x)
    channel0 = type(state)(*(v[:, 0].clone(memory_format=torch.contiguous_format) if rank == 0 else v[:, 0]
                             for v in state))
    fp8 = fp8_range_observer()
    rows = x[0]
    out = {
        "strided_fold": ({"expert": channel0}, ma),
        "fp8_state": ({"a": fp8.update(fp8.init(rows), rows)}, fp8),
    }
    # rank 1 holds its extremes in float8, rank 0 in float32 (and a minmax state beside it)
    wide = fp8_range_observer(torch.float32, torch.int64)
    mixed = (fp8 if rank == 1 else wide)
    minmax = qstats.minmax(qstats.QuantSpec())
    out["dtype_differs"] = (
        {"a": mixed.update(mixed.init(rows), rows), "b": minmax.update(minmax.init(rows), rows)},
        {"a": mixed, "b": minmax},
    )
    # rank 1 adds a state whose declared ops callable raises KeyError (before the structure check)
    extra = {"c": _NamedOpsState(rows.amin(0), rows.amax(0), torch.tensor(rows.shape[0]))} if rank == 1 else {}
    out["ops_callable_fails"] = ({"b": minmax.update(minmax.init(rows), rows), **extra}, minmax)
    out["after"] = ({"b": minmax.update(minmax.init(rows), rows)}, {"b": minmax})
    return out


def run_rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    results = {}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                                timeout=timedelta(seconds=20))
        for name, (tree, observers) in scenarios(rank).items():
            try:
                merged = qstats.distributed.all_reduce(tree, observers)
                results[name] = [t.clone() for t in optree.tree_leaves(merged)]
            except Exception as error:  # recorded for the test to check, on every rank
                results[name] = {"error": f"{type(error).__name__}: {error}"}
                if "imed out" in str(error) or "Connection closed" in str(error):
                    break  # the group is broken: later scenarios would only wait again
        dist.destroy_process_group()
    except Exception:
        results["crash"] = traceback.format_exc()
    torch.save(results, f"{out}/edges{rank}.pt")
