"""Ranks of tests/test_distributed_mismatch_errors.py: ``run_rank(rank, world, port, out)`` joins a
gloo group on 127.0.0.1 with a short timeout (a hang becomes an error), passes each scenario of
`scenarios` to `qstats.distributed.all_reduce` (one rank's input differs from the others'), and saves
``{name: merged leaves | {"error": message}}`` to ``OUT/mismatch{rank}.pt``."""

from __future__ import annotations

import traceback
from datetime import timedelta

import optree
import torch

import qstats

SPEC = qstats.QuantSpec(granularity=qstats.PerAxis(0))
MINMAX = qstats.minmax(SPEC)
HESSIAN = qstats.hessian()


def rank_data(rank: int, rows: int = 4, channels: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(7 + rank)
    return torch.randn(channels, rows + rank, generator=g) * (rank + 1)


def _minmax(x: torch.Tensor):
    return MINMAX.update(MINMAX.init(x), x)


def scenarios(rank: int, world: int) -> dict:
    """name -> (tree, observers, exact) on this rank; the last rank's input is the odd one."""
    odd = rank == world - 1
    x, y = rank_data(rank), rank_data(rank, channels=5)
    good = {"layers": {"0": _minmax(x), "1": _minmax(y)}}
    nan = _minmax(x)
    nan = nan._replace(max_val=nan.max_val.clone().index_fill_(0, torch.tensor([1]), float("nan")))
    extra = {"layers": {**good["layers"], "2": _minmax(x)}}
    wider = {"layers": {"0": _minmax(x), "1": _minmax(rank_data(rank, channels=6))}}
    meta = {"layers": {"0": _minmax(x), "1": MINMAX.init(y.to("meta"))}}
    hessian = HESSIAN.update(HESSIAN.init(x.T), x.T)
    return {
        "nan": ({"layers": {"0": nan if odd else _minmax(x), "1": _minmax(y)}}, MINMAX, False),
        "extra_module": (extra if odd else good, MINMAX, False),
        "other_shape": (wider if odd else good, MINMAX, False),
        "other_device": (meta if odd else good, MINMAX, False),
        "empty_tree": ({} if odd else good, MINMAX, False),
        "other_exact": ({"h": hessian}, HESSIAN, odd),
        "after": (good, MINMAX, False),  # the group is still in step
    }


def subgroup(world: int) -> list:
    """The ranks of the sub-group scenario: all but rank 0 from 3 ranks on (rank 0 stays outside)."""
    return list(range(1 if world > 2 else 0, world))


def run_rank(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    results: dict = {}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=30))
        for name, (tree, observers, exact) in scenarios(rank, world).items():
            try:
                merged = qstats.distributed.all_reduce(tree, observers, exact=exact)
                results[name] = optree.tree_leaves(merged)
            except Exception as error:  # noqa: BLE001 - the test reads the message
                results[name] = {"error": f"{type(error).__name__}: {error}"}
        arguments = {"propagate": "quantized" if rank == world - 1 else "float", "layers": "model.layers"}
        try:
            qstats.distributed.check_same_arguments(arguments, "calibrate_layerwise")
            results["arguments"] = "no error"
        except Exception as error:  # noqa: BLE001
            results["arguments"] = {"error": f"{type(error).__name__}: {error}"}
        members = subgroup(world)
        group = dist.new_group(members)  # every rank creates it, members or not
        tree, observers, _ = scenarios(rank, world)["other_shape"]
        try:
            results["subgroup"] = optree.tree_leaves(qstats.distributed.all_reduce(tree, observers, group))
        except Exception as error:  # noqa: BLE001
            results["subgroup"] = {"error": f"{type(error).__name__}: {error}"}
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        results["crash"] = traceback.format_exc()
    torch.save(results, f"{out}/mismatch{rank}.pt")
