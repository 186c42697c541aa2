"""Data-parallel QAT: activation ranges merged across 2 gloo ranks on 127.0.0.1 (QATModel.sync).

Each rank trains the same QAT MLP on its own shard, averaging gradients with ``all_reduce`` (what
DDP does), and calls ``qat.sync(state)`` where ``schedule.sync_at(step)`` says. The test process
compares the ranks' results with

- each other: identical frozen activation states on every rank (without the merge they differ);
- an independent reduction of the ranks' pre-merge states with plain torch (min of mins, max of
  maxes, sum of counts) for min/max observers, and the rank-order fold of ``obs.merge`` for
  moving averages.

Run as ``python tests/test_qat_distributed.py RANK WORLD PORT OUT_DIR ACTIVATION_OBSERVER`` for one
rank (the test does this).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from datetime import timedelta

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qstats
from _shared import exit_rank, free_port

WORLD = 2
STEPS = 8
SCHEDULE = qstats.QATSchedule(observe_at=0, fake_quantize_at=2, freeze_ranges_at=5)
ACT_SPEC = qstats.QuantSpec("uint8", "asymmetric")
W_SPEC = qstats.QuantSpec("int8", granularity=qstats.PerAxis(0))


def activation_observer(kind: str) -> qstats.Observer:
    if kind == "minmax":
        return qstats.minmax(ACT_SPEC)
    return qstats.moving_average_minmax(ACT_SPEC, 0.1)


def make_qat(kind: str):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))
    return qstats.qat.prepare(model, qstats.memoryless_minmax(W_SPEC), activation_observer(kind))


def shard(rank: int, step: int):
    """Rank-dependent data: rank 1's inputs are wider, so unmerged ranges would differ."""
    g = torch.Generator().manual_seed(100 * rank + step)
    x = torch.randn(8, 6, generator=g) * (1.0 + 2.0 * rank)
    return x, torch.randint(0, 4, (8,), generator=g)


def run_rank(rank: int, world: int, port: int, out_dir: str, kind: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        qat = make_qat(kind)
        params = {k: v.detach().clone() for k, v in qat.params().items()}
        state = qat.init(shard(rank, 0)[0])

        def loss_fn(params, state, x, y, phase):
            out, new_state = qat.apply(params, state, x, phase=phase)
            return F.cross_entropy(out, y), new_state

        grad_fn = torch.func.grad(loss_fn, has_aux=True)
        record = {"before_sync": {}, "after_sync": {}, "synced_at": []}
        for step in range(STEPS):
            x, y = shard(rank, step)
            grads, state = grad_fn(params, state, x, y, SCHEDULE(step))
            for name in sorted(grads):  # DDP: average the gradients
                dist.all_reduce(grads[name])
                params[name] = params[name] - 0.1 * grads[name] / world
            if SCHEDULE.sync_at(step):
                record["before_sync"][step] = state.activations
                state = qat.sync(state)
                record["after_sync"][step] = state.activations
                record["synced_at"].append(step)
        record["final"] = state.activations
        record["params"] = params
        torch.save(record, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()  # both ranks are done with every collective before either tears down
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module", params=["minmax", "moving_average"])
def ranks(request, tmp_path_factory):
    kind = request.param
    out = tmp_path_factory.mktemp(f"qat_{kind}")
    port = free_port()
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen([sys.executable, __file__, str(r), str(WORLD), str(port), str(out), kind], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in range(WORLD)
    ]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=180)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            logs.append(p.communicate()[0])
    if any(p.returncode != 0 for p in procs):
        pytest.fail("a rank failed:\n" + "\n---\n".join(logs))
    return kind, [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _equal(a, b) -> bool:
    return all(torch.equal(u, v) for u, v in zip(a, b))


def test_ranks_merge_at_the_schedule_points_and_freeze_the_same_ranges(ranks):
    kind, results = ranks
    expected_steps = [s for s in range(STEPS) if SCHEDULE.sync_at(s)]
    assert expected_steps == [SCHEDULE.freeze_ranges_at - 1]
    for r in results:
        assert r["synced_at"] == expected_steps
    step = expected_steps[0]
    for key in results[0]["final"]:
        # Before the merge the ranks saw different data, so their ranges differ...
        assert not _equal(results[0]["before_sync"][step][key], results[1]["before_sync"][step][key])
        # ...after it every rank holds the same state, and keeps it frozen to the end.
        assert _equal(results[0]["after_sync"][step][key], results[1]["after_sync"][step][key])
        for r in results:
            assert _equal(r["final"][key], r["after_sync"][step][key])
        a, b = qstats.compute_qparams(results[0]["final"][key], ACT_SPEC), qstats.compute_qparams(results[1]["final"][key], ACT_SPEC)
        assert torch.equal(a.scale, b.scale) and torch.equal(a.zero_point, b.zero_point)
    for name in results[0]["params"]:
        torch.testing.assert_close(results[0]["params"][name], results[1]["params"][name])


def test_merged_state_equals_reference_reduction(ranks):
    kind, results = ranks
    step = SCHEDULE.freeze_ranges_at - 1
    for key in results[0]["final"]:
        before = [r["before_sync"][step][key] for r in results]
        merged = results[0]["after_sync"][step][key]
        if kind == "minmax":  # independent: plain torch over the ranks' extremes and counts
            assert torch.equal(merged.min_val, torch.stack([s.min_val for s in before]).amin(0))
            assert torch.equal(merged.max_val, torch.stack([s.max_val for s in before]).amax(0))
            assert torch.equal(merged.count, torch.stack([s.count for s in before]).sum(0))
        else:  # moving averages fold obs.merge in rank order
            observer = activation_observer(kind)
            reference = functools.reduce(observer.merge, before)
            assert _equal(merged, reference)
            # the merge is the batch-weighted mean of the ranks' averages
            weights = torch.stack([s.batches for s in before]).float()
            mean_max = (torch.stack([s.max_val for s in before]) * weights).sum(0) / weights.sum(0)
            torch.testing.assert_close(merged.max_val, mean_max)


def test_sync_without_process_group_is_identity():
    qat = make_qat("minmax")
    state = qat.init(torch.randn(3, 6))
    state = qat.apply(qat.params(), state, torch.randn(3, 6), phase=qstats.QATPhase(True, False))[1]
    synced = qat.sync(state)
    for key in state.activations:
        assert _equal(synced.activations[key], state.activations[key])
    with pytest.raises(TypeError, match="QATState"):
        qat.sync(dict(state._asdict()))


if __name__ == "__main__":
    run_rank(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
    exit_rank(0)  # its results are saved: no teardown for gloo to abort
