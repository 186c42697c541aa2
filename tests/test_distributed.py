"""qstats.distributed.all_reduce with real gloo process groups (2 and 4 ranks on 127.0.0.1).

One spawn per world size runs every scenario (tests/_distributed_worker.py); this process rebuilds
the same data and compares each rank's merged states with

- single-process calibration over all the data (exact observers: bit for bit), and with plain
  ``torch.amin``/``amax`` over the tokens routed to each expert (an independent reference);
- ``functools.reduce(obs.merge, [state_rank0, state_rank1, ...])`` for folded states (bit for bit).

Data is uneven across ranks, and some ranks route no token to some expert (masked by weight 0).
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import subprocess
import sys

import optree
import pytest
import torch

import qstats
from qstats import distributed

sys.path.insert(0, os.path.dirname(__file__))
import _distributed_worker as worker  # noqa: E402
from _shared import free_port  # noqa: E402

WORLDS = (2, 4)
WORKER = os.path.join(os.path.dirname(__file__), "_distributed_worker.py")


def _warm_up():
    """Computes every single-process reference once, so that forked ranks start warm (torch's
    lazy imports done) instead of each paying them again."""
    for name in worker.expert_factories():
        _single(name)


def _fork_ranks(world, port, out):
    context = multiprocessing.get_context("fork")
    procs = [context.Process(target=worker.run_rank, args=(rank, world, port, str(out))) for rank in range(world)]
    for p in procs:
        p.start()
    return procs


def _spawn_ranks(world, port, out):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return [
        subprocess.Popen([sys.executable, WORKER, str(rank), str(world), str(port), str(out)], env=env)
        for rank in range(world)
    ]


def _wait(proc, timeout):
    if isinstance(proc, subprocess.Popen):
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join()
    return proc.exitcode


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{world: [results of rank 0, rank 1, ...]}; both world sizes run at the same time, as forked
    processes where the platform forks (warm: no second import of torch), else as new interpreters."""
    fork = "fork" in multiprocessing.get_all_start_methods() and not os.environ.get("QSTATS_TEST_SPAWN")
    if fork:
        _warm_up()
    launched = {}
    for world in WORLDS:
        out = tmp_path_factory.mktemp(f"world{world}")
        launched[world] = (out, (_fork_ranks if fork else _spawn_ranks)(world, free_port(), out))
    results = {}
    for world, (out, procs) in launched.items():
        codes = [_wait(p, 180) for p in procs]
        if any(code != 0 for code in codes):
            errors = [(out / f"rank{r}.err").read_text() for r in range(world) if (out / f"rank{r}.err").exists()]
            pytest.fail(f"world {world}: exit codes {codes}\n" + "\n---\n".join(errors))
        results[world] = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]
    return results


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))
    return torch.equal(a, b)


def assert_bit_equal(got, want, what):
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        assert bit_equal(g, w), f"{what}: leaf {i} differs:\n{g}\n{w}"


@functools.lru_cache(maxsize=None)
def _single(name):
    """Leaves of single-process calibration over all the data with scenario ``name``."""
    return worker.leaves(worker.calibrate_experts(worker.expert_factories()[name](), worker.global_batches()))


@functools.lru_cache(maxsize=None)
def _merged(name, world):
    """Leaves of ``reduce(obs.merge, [state_rank0, ...])`` in rank order for scenario ``name``."""
    return worker.leaves(_rank_order_merge(worker.expert_factories()[name](), world))


def _rank_order_merge(obs, world):
    locals_ = [worker.calibrate_experts(obs, worker.rank_batches(world, r)) for r in range(world)]
    return optree.tree_map(
        lambda *states: functools.reduce(obs.merge, states),
        *locals_,
        is_leaf=distributed._is_state,
    )


EXACT = [n for n in worker.expert_factories() if n.startswith(("minmax", "histogram"))]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", EXACT)
def test_exact_observers_equal_single_process(runs, world, name):
    single = _single(name)
    for rank, result in enumerate(runs[world]):
        for variant in ("", "/exact", "/nocheck"):
            got = result[name + variant]
            assert "error" not in got, got
            assert_bit_equal(got["leaves"], single, f"{name}{variant} rank {rank}")


@pytest.mark.parametrize("world", WORLDS)
def test_minmax_equals_plain_torch_extremes(runs, world):
    x = torch.cat([b[0] for b in worker.global_batches()])
    route = torch.cat([b[1] for b in worker.global_batches()])
    got = runs[world][world - 1]["minmax/axis"]["leaves"]  # expert0..3 x (min, max, count, nonfinite)
    for e in range(worker.EXPERTS):
        rows = x[route == e]
        assert torch.equal(got[4 * e], rows.amin(0)) and torch.equal(got[4 * e + 1], rows.amax(0))
        assert torch.equal(got[4 * e + 2], torch.full((worker.FEATURES,), rows.shape[0]))


def test_some_rank_saw_no_data_for_an_expert(runs):
    # The scenario the brief asks for: the premise of the tests above, checked on the data.
    for world in WORLDS:
        counts = [int((b[1] == worker.EXPERTS - 1).sum()) for b in worker.rank_batches(world, 0)]
        assert sum(counts) == 0
        local = runs[world][0]["local/minmax/tensor"]["leaves"]
        assert torch.isinf(local[4 * (worker.EXPERTS - 1)])  # rank 0's expert-3 state is the identity


@pytest.mark.parametrize("world", WORLDS)
def test_collective_counts(runs, world):
    result = runs[world][0]
    for name in EXACT:
        if name.startswith("minmax"):
            # check + one float32 MIN (max negated into it) + one int64 SUM
            assert (result[name]["all_reduce"], result[name]["all_gather"]) == (3, 0)
            assert (result[name + "/nocheck"]["all_reduce"], result[name + "/nocheck"]["all_gather"]) == (2, 0)
    # folded: check + one all_gather of every state's bytes
    assert (result["moving_average"]["all_reduce"], result["moving_average"]["all_gather"]) == (1, 1)
    assert (result["moving_average/nocheck"]["all_reduce"], result["moving_average/nocheck"]["all_gather"]) == (0, 1)
    # float sums: SUM float32 + SUM int64, or everything folded with exact=True
    assert (result["sum"]["all_reduce"], result["sum"]["all_gather"]) == (3, 0)
    assert (result["sum/exact"]["all_reduce"], result["sum/exact"]["all_gather"]) == (1, 1)
    # a whole calibrated model (minmax and histogram sites): check + float32 MIN + int64 SUM
    assert (result["calibrate"]["all_reduce"], result["calibrate"]["all_gather"]) == (3, 0)


FOLDED = [n for n in ("moving_average", "moments") if n in worker.expert_factories()]
FLOAT_SUMS = [n for n in ("sum", "imatrix") if n in worker.expert_factories()]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", FOLDED)
def test_folded_states_equal_rank_order_merge(runs, world, name):
    want = _merged(name, world)
    for rank, result in enumerate(runs[world]):
        for variant in ("", "/exact", "/nocheck"):
            assert_bit_equal(result[name + variant]["leaves"], want, f"{name}{variant} rank {rank}")
        assert (result[name]["all_reduce"], result[name]["all_gather"]) == (1, 1)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", FLOAT_SUMS)
def test_float_sums_exact_and_not(runs, world, name):
    want = _merged(name, world)
    single = _single(name)
    for rank, result in enumerate(runs[world]):
        # exact=True: gathered and folded in rank order, bit for bit
        assert_bit_equal(result[name + "/exact"]["leaves"], want, f"{name}/exact rank {rank}")
        assert (result[name + "/exact"]["all_reduce"], result[name + "/exact"]["all_gather"]) == (1, 1)
        # default: one SUM per dtype, equal up to rounding
        for got, w, s in zip(result[name]["leaves"], want, single):
            torch.testing.assert_close(got, w, rtol=1e-6, atol=1e-5)
            torch.testing.assert_close(got, s, rtol=1e-6, atol=1e-5)
        assert (result[name]["all_reduce"], result[name]["all_gather"]) == (3, 0)
    # every rank receives the very same numbers
    for result in runs[world][1:]:
        assert_bit_equal(result[name]["leaves"], runs[world][0][name]["leaves"], f"{name} across ranks")


@pytest.mark.parametrize("world", WORLDS)
def test_calibrated_model_equals_single_process(runs, world):
    """Each rank runs qstats.calibrate on its batches; all_reduce with recipe.observers(...) gives
    the activation states of one process calibrating every batch, bit for bit."""
    want = worker.leaves(worker.calibrate_model(worker.global_batches()))
    for rank, result in enumerate(runs[world]):
        assert "error" not in result["calibrate"], result["calibrate"]
        assert_bit_equal(result["calibrate"]["leaves"], want, f"calibrate rank {rank}")


@pytest.mark.parametrize("world", WORLDS)
def test_mixed_tree_in_one_call(runs, world):
    factories = worker.expert_factories()
    names = sorted(n for n in ("minmax/axis", "moving_average", "sum", "histogram/tensor") if n in factories)
    want = []
    buckets = set()
    for n in names:
        obs = factories[n]()
        want.extend(_merged(n, world) if n in ("sum", "moving_average") else _single(n))
        state = obs.init(torch.zeros(1, worker.FEATURES))
        ops = distributed.reduce_ops(state)
        if ops != "fold":
            for field, value in zip(state._fields, state):
                op = "min" if ops[field] == "max" and value.is_floating_point() else ops[field]
                buckets.add((op, value.dtype))
    result = runs[world][world - 1]["mixed"]
    assert "error" not in result, result
    for i, (got, w) in enumerate(zip(result["leaves"], want)):
        if bit_equal(got, w):
            continue
        torch.testing.assert_close(got, w, rtol=1e-6, atol=1e-5)  # float sums reduced by all_reduce
        assert got.is_floating_point(), f"leaf {i}"
    assert result["all_reduce"] == 1 + len(buckets) and result["all_gather"] == 1


@pytest.mark.parametrize("world", WORLDS)
def test_stacked_experts_equal_single_process(runs, world):
    """qstats.calibrate on a model with stacked experts ([E, out, in] parameter, routing mask as the
    update weight); rank 0 routes no token to the last expert."""
    _, _, single = worker.calibrate_moe(worker.global_batches())
    want = worker.leaves(single)
    local = dict(zip(single["experts"]["input"]._fields, runs[world][0]["local/moe"]["leaves"]))
    assert torch.isinf(local["min_val"][worker.EXPERTS - 1]).all()  # the premise: no data there
    assert not torch.isinf(want[list(single["experts"]["input"]._fields).index("min_val")][-1]).any()
    for rank, result in enumerate(runs[world]):
        assert "error" not in result["moe"], result["moe"]
        assert_bit_equal(result["moe"]["leaves"], want, f"moe rank {rank}")
        assert (result["moe"]["all_reduce"], result["moe"]["all_gather"]) == (3, 0)


@pytest.mark.parametrize("world", WORLDS)
def test_memoryless_shards_of_one_batch(runs, world):
    obs = qstats.memoryless_minmax(qstats.QuantSpec(granularity=qstats.PerAxis(-1)))
    want = worker.leaves(worker.memoryless_experts(obs, *worker.memoryless_shard(world, None)))
    assert worker.memoryless_shard(world, 0)[0].shape[0] == 0  # rank 0 holds no tokens
    for rank, result in enumerate(runs[world]):
        assert_bit_equal(result["memoryless"]["leaves"], want, f"memoryless rank {rank}")


@pytest.mark.parametrize("world", WORLDS)
def test_mismatched_trees_raise_on_every_rank(runs, world):
    for result in runs[world]:
        assert "error" in result["mismatch"]
        error = result["mismatch"]["error"]
        assert error.startswith("ValueError") and "different state trees" in error


@pytest.mark.parametrize("world", WORLDS)
def test_a_rank_failing_its_local_checks_raises_on_every_rank(runs, world):
    """The failing rank used to raise before the collective check and leave the others waiting
    until the process group's timeout."""
    for rank, result in enumerate(runs[world]):
        error = result["invalid"].get("error", "")
        assert error.startswith("ValueError"), (rank, result["invalid"])
        expected = "this rank's tree is not valid" if rank == world - 1 else "another rank's tree failed"
        assert expected in error, (rank, error)


@pytest.mark.parametrize("world", WORLDS)
def test_a_rank_without_batches_raises_on_every_rank(runs, world):
    """A rank that calibrated no batch has an empty tree (no activation states): every rank
    raises the structure error, the empty one with a hint, instead of the others hanging."""
    for rank, result in enumerate(runs[world]):
        error = result["empty"].get("error", "")
        assert error.startswith("ValueError") and "different state trees" in error, (rank, result["empty"])
        assert ("no states here" in error) == (rank == world - 1)
        assert "error" not in result["all-empty"]


# ---- single process: no collectives --------------------------------------------------------
def test_without_process_group_returns_the_tree():
    obs = qstats.minmax(qstats.QuantSpec())
    tree = {"a": [obs.update(obs.init(torch.zeros(3)), torch.tensor([1.0, -2.0, 3.0]))]}
    assert distributed.all_reduce(tree, obs) is tree
    assert distributed.all_reduce(tree, {"a": [obs]}) is tree


def test_bad_trees_raise():
    obs = qstats.minmax(qstats.QuantSpec())
    state = obs.init(torch.zeros(3))
    with pytest.raises(TypeError, match="not an observer state"):
        distributed.all_reduce({"a": torch.zeros(2)}, obs)
    with pytest.raises(ValueError, match="not a prefix"):
        distributed.all_reduce({"a": [state, state]}, {"a": [obs]})
    with pytest.raises(TypeError, match="not a qstats.Observer"):
        distributed.all_reduce({"a": state}, {"a": "minmax"})


def test_register_reduce_ops_validates():
    with pytest.raises(ValueError, match="unknown ops"):
        distributed.register_reduce_ops(
            qstats.MinMaxState, {"min_val": "avg", "max_val": "max", "count": "sum", "nonfinite": "sum"}
        )
    with pytest.raises(ValueError, match="fields"):
        distributed.register_reduce_ops(qstats.MinMaxState, {"min_val": "min"})
    with pytest.raises(TypeError):
        distributed.register_reduce_ops(3, "fold")
    assert distributed.reduce_ops(qstats.minmax(qstats.QuantSpec()).init(torch.zeros(2)))["max_val"] == "max"


def test_declared_ops_agree_with_merge():
    """Every declared elementwise state: applying its ops field by field equals obs.merge."""
    g = torch.Generator().manual_seed(0)
    combine = {"min": torch.minimum, "max": torch.maximum, "sum": torch.add}
    for name, factory in worker.expert_factories().items():
        obs = factory()
        a = worker.calibrate_experts(obs, worker.global_batches()[:3])["expert0"]
        b = obs.update(obs.init(torch.zeros(1, worker.FEATURES)), torch.randn(5, worker.FEATURES, generator=g))
        ops = distributed.reduce_ops(a)
        if ops == "fold":
            continue
        want = obs.merge(a, b)
        got = type(a)(*(combine[ops[f]](u, v) for f, u, v in zip(a._fields, a, b)))
        assert_bit_equal(list(got), list(want), name)


def _run_ranks(target, world: int, out, prefix: str, timeout: float):
    """Forks (or spawns) ``world`` ranks of ``target(rank, port, out)``; returns their exit codes
    and the results each saved to ``out/{prefix}{rank}.pt`` (``{"crash": ...}`` where none)."""
    context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    port = free_port()
    procs = [context.Process(target=target, args=(rank, port, str(out))) for rank in range(world)]
    for p in procs:
        p.start()
    codes = [_wait(p, timeout) for p in procs]
    files = [out / f"{prefix}{rank}.pt" for rank in range(world)]
    return codes, [torch.load(f, weights_only=False) if f.exists() else {"crash": "no results"} for f in files]


def test_three_ranks_one_without_data_and_a_subgroup(tmp_path):
    # World 3, rank 2 calibrates nothing at all: exact observers equal one process over all the
    # data, the moving average the rank-order merge. All three ranks also call all_reduce with
    # the subgroup {0, 1}: its members get the merge of their two states; rank 2, not a member,
    # used to raise "Invalid process group specified" (check=True) or IndexError (check=False),
    # where torch's own collectives do nothing; it now gets its tree back.
    codes, results = _run_ranks(worker.run_three_ranks, 3, tmp_path, "three", 180)
    errors = [r.get("error", r.get("crash")) for r in results if "error" in r or "crash" in r]
    assert not errors and codes == [0, 0, 0], (codes, errors)
    factories = worker.expert_factories()
    for name in ("minmax/axis", "moving_average", "histogram/axis"):
        if name not in factories:
            continue
        obs = factories[name]()
        local = [worker.calibrate_experts(obs, worker.three_rank_batches(r)) for r in range(3)]
        merged = optree.tree_map(obs.merge, local[0], local[1], is_leaf=distributed._is_state)
        if obs.exact:
            want = worker.leaves(worker.calibrate_experts(obs, worker.global_batches()))
        else:
            want = worker.leaves(optree.tree_map(obs.merge, merged, local[2], is_leaf=distributed._is_state))
        for rank in range(3):
            assert_bit_equal(results[rank][name], want, f"{name} rank {rank}")
        for rank in (0, 1):
            assert_bit_equal(results[rank][f"{name}/pair"], worker.leaves(merged), f"{name}/pair rank {rank}")
        assert_bit_equal(results[2][f"{name}/pair"], worker.leaves(local[2]), f"{name}/pair rank 2")


def test_bad_input_on_one_rank_raises_on_every_rank(tmp_path):
    """One rank passes bad input; every rank raises a ValueError naming it (none hangs, none returns
    a silently wrong merge), and the group stays usable. Each used to fail: a NaN extreme was dropped
    by gloo's MIN/MAX (on rank 1 for min, rank 0 for max), so the result was not reduce(obs.merge)
    and depended on the rank order; a state on another device passed the check and desynchronised
    the collectives; folded states on two devices raised on their rank after the check, leaving the
    other in all_gather until the timeout; a folded state with another rank's observer raised on
    that rank only; a sparse field raised on its rank after the check."""
    codes, results = _run_ranks(worker.run_bad_inputs, 2, tmp_path, "bad", 150)
    assert codes == [0, 0] and not any("crash" in r for r in results), (codes, results)

    def error(rank, name):
        got = results[rank][name]
        assert "error" in got, (rank, name, got)
        assert got["error"].startswith("ValueError"), (rank, name, got["error"])
        return got["error"]

    for name, bad_rank, what in (
        ("nan/minmax", 1, "field 'min_val' of the MinMaxState at 'a' holds NaN"),
        ("nan/histogram", 0, "field 'max_val' of the HistogramState at 'h/0' holds NaN"),
        ("device/fold", 1, "states to fold live on several devices ['cpu', 'meta']"),
        ("layout/sparse", 1, "field 'count' of the MinMaxState at 'a' is a torch.sparse_coo tensor"),
    ):
        if name not in results[0]:
            continue
        assert what in error(bad_rank, name), name
        assert "another rank's tree failed its local checks" in error(1 - bad_rank, name), name
    for name in ("device/meta", "observer/fold"):
        for rank in range(2):
            assert "different state trees" in error(rank, name), (name, rank)
    # the group is still in step: a valid call gives both ranks reduce(obs.merge) in rank order
    scenarios = [worker.bad_input_scenarios(r)["after"] for r in range(2)]
    observers = scenarios[0][1]
    want = worker.leaves({k: observers[k].merge(scenarios[0][0][k], scenarios[1][0][k]) for k in observers})
    for rank in range(2):
        assert "error" not in results[rank]["after"], results[rank]["after"]
        assert_bit_equal(results[rank]["after"]["leaves"], want, f"after rank {rank}")


def test_nan_extremes_come_back_unchanged_without_process_group():
    """The NaN check guards the collectives (gloo's MIN drops a NaN that obs.merge keeps): one
    process returns the tree itself, as documented, with no host sync for the check."""
    obs = qstats.minmax(qstats.QuantSpec())
    tree = {"x": [obs.init(torch.zeros(3)), obs.init(torch.zeros(3))._replace(max_val=torch.tensor(float("nan")))]}
    assert distributed.all_reduce(tree, obs) is tree
