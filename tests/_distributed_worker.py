"""One rank of the multi-process tests in tests/test_distributed.py (and the data they share).

Run as ``python tests/_distributed_worker.py RANK WORLD PORT OUT_DIR``: joins a gloo group on
127.0.0.1, builds this rank's local states for every scenario, merges them with
`qstats.distributed.all_reduce`, counts the collectives, and saves the results' tensors to
``OUT_DIR/rank{RANK}.pt``. The test process rebuilds the same data (the functions below) to compute
the single-process references.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from typing import NamedTuple

import optree
import torch

import qstats
from qstats.observers import register_state

EXPERTS = 4
FEATURES = 8
NUM_BATCHES = 9


# A float-sum state nobody else declares: exercises exact=True and the declaration mechanism.
@register_state
class _SumTestState(NamedTuple):
    total: torch.Tensor
    count: torch.Tensor


qstats.distributed.register_reduce_ops(_SumTestState, {"total": "sum", "count": "sum"})


def sum_observer() -> qstats.Observer:
    def init_fn(x):
        return _SumTestState(torch.zeros(x.shape[-1], dtype=torch.float32), torch.zeros(x.shape[-1], dtype=torch.int64))

    def update_fn(state, x, weight=None):
        w = torch.ones(x.shape[0]) if weight is None else weight.float()
        total = state.total + (x.float() * w[:, None]).sum(0)
        return _SumTestState(total, state.count + (w != 0).sum().to(torch.int64))

    def merge_fn(a, b):
        return _SumTestState(a.total + b.total, a.count + b.count)

    return qstats.Observer(init_fn, update_fn, merge_fn, exact=True, name="sum_test")


def global_batches():
    """The whole data set: ``NUM_BATCHES`` batches of tokens with a routing to experts. Expert 3
    gets tokens only in the last batches (so the first ranks never see it)."""
    g = torch.Generator().manual_seed(1234)
    out = []
    for i in range(NUM_BATCHES):
        n = 3 + (7 * i) % 11
        x = torch.randn(n, FEATURES, generator=g) * (1 + i)
        route = torch.randint(0, EXPERTS - 1, (n,), generator=g)
        if i >= NUM_BATCHES - 2:
            route[::2] = EXPERTS - 1
        out.append((x, route))
    return out


def rank_batches(world: int, rank: int):
    """Uneven contiguous chunks in rank order (rank 0 gets the most, the last rank the fewest)."""
    sizes = {2: [6, 3], 4: [4, 3, 1, 1]}[world]
    start = sum(sizes[:rank])
    return global_batches()[start : start + sizes[rank]]


def _histogram_factory():
    factory = getattr(qstats, "histogram", None)
    if factory is None:
        try:
            from qstats.observers.histogram import histogram as factory
        except ImportError:
            return None
    return factory


def histogram_kwargs():
    """Small histograms (16 buckets per octave over 16 octaves) whatever the factory calls it."""
    import inspect

    parameters = inspect.signature(_histogram_factory()).parameters
    if "octaves" in parameters:
        return {"buckets_per_octave": 16, "octaves": 16}
    return {"bins": 16, "exponent_range": (-8, 8)}


def _histogram_factories():
    histogram = _histogram_factory()
    if histogram is None:
        return {}
    return {
        "histogram/tensor": lambda: histogram(qstats.QuantSpec()),
        "histogram/axis": lambda: histogram(qstats.QuantSpec(granularity=qstats.PerAxis(-1)), **histogram_kwargs()),
    }


def expert_factories():
    """Scenario name -> observer factory; each scenario is a tree {expert_i: [state per spec]}."""
    factories = {
        "minmax/tensor": lambda: qstats.minmax(qstats.QuantSpec()),
        "minmax/axis": lambda: qstats.minmax(qstats.QuantSpec(granularity=qstats.PerAxis(-1))),
        "moving_average": lambda: qstats.moving_average_minmax(qstats.QuantSpec(granularity=qstats.PerAxis(-1)), 0.1),
        "sum": sum_observer,
    }
    factories.update(_histogram_factories())
    if hasattr(qstats, "moments"):  # folded (Chan's merge)
        factories["moments"] = lambda: qstats.moments(qstats.QuantSpec(granularity=qstats.PerAxis(-1)))
    if hasattr(qstats, "imatrix"):  # float64 sums
        factories["imatrix"] = qstats.imatrix
    return factories


def calibrate_experts(obs, batches):
    """{"expert{e}": state}: one state per expert, tokens not routed to it masked by weight 0."""
    template = torch.zeros(1, FEATURES)
    states = {f"expert{e}": obs.init(template) for e in range(EXPERTS)}
    for x, route in batches:
        for e in range(EXPERTS):
            states[f"expert{e}"] = obs.update(states[f"expert{e}"], x, weight=(route == e).to(torch.float32))
    return states


def memoryless_shard(world: int, rank: int | None):
    """The last batch split unevenly across ranks along tokens (rank 0 gets nothing)."""
    x, route = global_batches()[-1]
    if rank is None:
        return x, route
    cuts = {2: [0, 0, x.shape[0]], 4: [0, 0, 2, 3, x.shape[0]]}[world]
    return x[cuts[rank] : cuts[rank + 1]], route[cuts[rank] : cuts[rank + 1]]


def memoryless_experts(obs, x, route):
    template = torch.zeros(1, FEATURES)
    return {
        f"expert{e}": obs.update(obs.init(template), x, weight=(route == e).to(torch.float32)) for e in range(EXPERTS)
    }


class TinyModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(FEATURES, 12)
        self.fc2 = torch.nn.Linear(12, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def model_and_recipe():
    torch.manual_seed(3)
    model = TinyModel().eval()
    activation = qstats.QuantSpec(dtype="uint8", mapping="asymmetric")
    rules = [qstats.Rule(targets="fc1", sites=("input",), observer=qstats.minmax, spec=activation)]
    histogram = _histogram_factory()
    if histogram is not None:
        rules.append(
            qstats.Rule(
                targets="fc2", sites=("input",), observer=histogram, spec=activation,
                observer_kwargs=histogram_kwargs(),
            )
        )
    rules.append(qstats.Rule(targets="Linear", sites=("input",), observer=qstats.minmax, spec=activation))
    return model, qstats.Recipe(rules)


def calibrate_model(batches):
    """`qstats.calibrate` over the batches' tokens: {path: {"input": state}}."""
    model, recipe = model_and_recipe()
    return qstats.calibrate(model, [x for x, _ in batches], recipe, progress=False)


class StackedExperts(torch.nn.Module):
    """Experts stored as one ``[E, out, in]`` parameter, called like transformers' fused experts:
    ``forward(hidden_states, top_k_index, top_k_weights)``."""

    def __init__(self, num_experts: int, hidden: int, out: int):
        super().__init__()
        self.num_experts = num_experts
        self.proj = torch.nn.Parameter(torch.randn(num_experts, out, hidden) * 0.1)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = hidden_states.new_zeros(hidden_states.shape[0], self.proj.shape[1])
        for expert in range(self.num_experts):
            weight = (top_k_weights * (top_k_index == expert)).sum(-1, keepdim=True)
            out = out + weight * torch.nn.functional.linear(hidden_states, self.proj[expert])
        return out


class MoE(torch.nn.Module):
    """Routes each token to ``route`` (top-1), so the data decides which expert sees what."""

    def __init__(self):
        super().__init__()
        self.experts = StackedExperts(EXPERTS, FEATURES, 6)

    def forward(self, x, route):
        return self.experts(x, route[:, None], torch.ones(x.shape[0], 1))


def calibrate_moe(batches):
    """Per-expert input states of stacked experts (leading expert dimension) from qstats.calibrate;
    the routing mask is the update weight, so an expert no token reached keeps an empty state."""
    import warnings

    torch.manual_seed(5)
    model = MoE().eval()
    spec = qstats.QuantSpec(granularity=qstats.PerAxis(-1))
    histogram = _histogram_factory()
    if histogram is not None:
        rule = qstats.Rule("StackedExperts", ("input",), histogram, spec, observer_kwargs=histogram_kwargs())
    else:
        rule = qstats.Rule("StackedExperts", ("input",), qstats.minmax, spec)
    recipe = qstats.Recipe([rule])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # experts without tokens on this rank are expected
        states = qstats.calibrate(model, batches, recipe, progress=False)
    return model, recipe, states


def leaves(tree):
    return optree.tree_leaves(tree)


class _Counter:
    def __init__(self):
        self.all_reduce = 0
        self.all_gather = 0


def _install_counter(dist):
    counter = _Counter()
    all_reduce, all_gather = dist.all_reduce, dist.all_gather

    def counted_all_reduce(*args, **kwargs):
        counter.all_reduce += 1
        return all_reduce(*args, **kwargs)

    def counted_all_gather(*args, **kwargs):
        counter.all_gather += 1
        return all_gather(*args, **kwargs)

    dist.all_reduce, dist.all_gather = counted_all_reduce, counted_all_gather
    return counter


def _run(name, fn, counter, results):
    before = (counter.all_reduce, counter.all_gather)
    try:
        out = fn()
    except Exception as error:  # recorded, checked by the test
        results[name] = {"error": f"{type(error).__name__}: {error}"}
        return
    results[name] = {
        "leaves": [t.clone() for t in leaves(out)],
        "all_reduce": counter.all_reduce - before[0],
        "all_gather": counter.all_gather - before[1],
    }


def _join_gloo(rank: int, world: int, port: int, seconds: int):
    """Joins a gloo group of ``world`` ranks over loopback, one thread; returns torch.distributed."""
    import torch.distributed as dist

    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # this process only: ranks talk over loopback
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=seconds)
    )
    return dist


def main(rank: int, world: int, port: int, out_dir: str) -> None:
    dist = _join_gloo(rank, world, port, 60)
    counter = _install_counter(dist)
    reduce = qstats.distributed.all_reduce
    results = {}
    mine = rank_batches(world, rank)
    factories = expert_factories()
    for name, factory in factories.items():
        obs = factory()
        local = calibrate_experts(obs, mine)
        results[f"local/{name}"] = {"leaves": leaves(local)}
        _run(name, lambda: reduce(local, obs), counter, results)
        _run(f"{name}/exact", lambda: reduce(local, obs, exact=True), counter, results)
        _run(f"{name}/nocheck", lambda: reduce(local, obs, check=False), counter, results)

    # One call over a mixed tree: an Observer tree of the same structure.
    mixed_names = [n for n in ("minmax/axis", "moving_average", "sum", "histogram/tensor") if n in factories]
    observers = {n: factories[n]() for n in mixed_names}
    mixed = {n: [calibrate_experts(observers[n], mine)] for n in mixed_names}
    _run("mixed", lambda: reduce(mixed, {n: [observers[n]] for n in mixed_names}), counter, results)

    # A model calibrated with qstats.calibrate on each rank's batches, merged with the recipe's
    # observers (activation sites: weights are the same on every rank and need no merge).
    model, recipe = model_and_recipe()
    local = calibrate_model(mine)
    _run("calibrate", lambda: reduce(local, recipe.observers(local, model)), counter, results)

    # Stacked experts (one state with a leading expert dimension), rank 0 routes no token to the
    # last expert.
    model, recipe, local = calibrate_moe(mine)
    results["local/moe"] = {"leaves": leaves(local)}
    _run("moe", lambda: reduce(local, recipe.observers(local, model)), counter, results)

    # Memoryless: shards of one batch (rank 0 has no tokens at all).
    obs = qstats.memoryless_minmax(qstats.QuantSpec(granularity=qstats.PerAxis(-1)))
    local = memoryless_experts(obs, *memoryless_shard(world, rank))
    _run("memoryless", lambda: reduce(local, obs), counter, results)

    # A rank passing a different tree: ValueError on every rank, no hang.
    obs = qstats.minmax(qstats.QuantSpec(granularity=qstats.PerAxis(-1)))
    width = FEATURES + (1 if rank == world - 1 else 0)
    bad = {"w": obs.update(obs.init(torch.zeros(1, width)), torch.ones(2, width))}
    _run("mismatch", lambda: reduce(bad, obs), counter, results)

    # The last rank fails its local checks (its observers tree is not a prefix of its states:
    # an empty tree given the shared observers dict): ValueError on every rank, no hang.
    good = {"w": obs.update(obs.init(torch.zeros(1, FEATURES)), torch.ones(2, FEATURES))}
    invalid = ({}, {"w": obs, "other": obs}) if rank == world - 1 else (good, obs)
    _run("invalid", lambda: reduce(*invalid), counter, results)

    # The last rank calibrated no batch: its tree of activation sites is empty. It joins the
    # check (it used to return at once and leave the others waiting in it): ValueError everywhere.
    model, recipe = model_and_recipe()
    local = calibrate_model(mine if rank != world - 1 else [])
    _run("empty", lambda: reduce(local, recipe.observers(local, model)), counter, results)
    # ... and where every rank's tree is empty, each gets its own back.
    _run("all-empty", lambda: reduce({}, obs), counter, results)

    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def run_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    """Entry point of a forked or spawned rank: writes ``rank{R}.err`` with the traceback on failure."""
    try:
        main(rank, world, port, out_dir)
    except BaseException:
        import traceback

        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as file:
            file.write(traceback.format_exc())
        raise


if __name__ == "__main__":
    run_rank(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])


def three_rank_batches(rank: int):
    """World 3: rank 0 gets most batches, rank 1 one, rank 2 none at all."""
    cuts = {0: (0, NUM_BATCHES - 1), 1: (NUM_BATCHES - 1, NUM_BATCHES), 2: (0, 0)}[rank]
    return global_batches()[cuts[0] : cuts[1]]


def run_three_ranks(rank: int, port: int, out_dir: str) -> None:
    """World 3 with a rank that saw no data, and a subgroup of ranks 0 and 1 that rank 2 is not in:
    saves ``{scenario: leaves}`` to ``OUT_DIR/three{RANK}.pt``."""
    results = {}
    try:
        dist = _join_gloo(rank, 3, port, 60)
        pair = dist.new_group([0, 1])
        for name in ("minmax/axis", "moving_average", "histogram/axis"):
            factory = expert_factories().get(name)
            if factory is None:
                continue
            obs = factory()
            local = calibrate_experts(obs, three_rank_batches(rank))
            results[name] = leaves(qstats.distributed.all_reduce(local, obs))
            results[f"{name}/pair"] = leaves(qstats.distributed.all_reduce(local, obs, group=pair))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        import traceback

        results = {"error": traceback.format_exc()}
    torch.save(results, os.path.join(out_dir, f"three{rank}.pt"))


def bad_input_scenarios(rank: int):
    """``{name: (tree, observers)}`` for `run_bad_inputs`: in each, rank 1 alone passes bad input
    (rank 0 in ``nan/histogram``); ``after`` is valid on both ranks."""
    g = torch.Generator().manual_seed(50 + rank)
    x = torch.randn(6, FEATURES, generator=g)
    minmax = qstats.minmax(qstats.QuantSpec(granularity=qstats.PerAxis(-1)))
    moving = qstats.moving_average_minmax(qstats.QuantSpec(granularity=qstats.PerAxis(-1)), 0.1)
    good = minmax.update(minmax.init(x), x)
    averaged = moving.update(moving.init(x), x)
    nan = torch.full((FEATURES,), float("nan"))
    scenarios = {
        # NaN extremes: the backends' min/max drop them where obs.merge keeps them
        "nan/minmax": ({"a": good._replace(min_val=nan) if rank == 1 else good}, minmax),
        # a state on another device (meta) on one rank: fingerprints agreed, the collectives did not
        "device/meta": ({"a": type(good)(*(v.to("meta") for v in good)) if rank == 1 else good}, minmax),
        # folded states on two devices on one rank: that rank raised after the check, the other hung
        "device/fold": ({"a": averaged._replace(count=averaged.count.to("meta")) if rank == 1 else averaged}, moving),
        # a folded state with another observer on one rank: only that rank's obs.merge raised
        "observer/fold": ({"a": averaged}, minmax if rank == 1 else moving),
        # a sparse field on one rank: same shape and dtype, but no flat view
        "layout/sparse": ({"a": good._replace(count=good.count.to_sparse()) if rank == 1 else good}, minmax),
        "after": ({"a": good, "b": averaged}, {"a": minmax, "b": moving}),
    }
    histogram = _histogram_factory()
    if histogram is not None:
        obs = histogram(qstats.QuantSpec(granularity=qstats.PerAxis(-1)), **histogram_kwargs())
        state = obs.update(obs.init(x), x)
        scenarios["nan/histogram"] = ({"h": [state._replace(max_val=nan) if rank == 0 else state]}, obs)
    return scenarios


def run_bad_inputs(rank: int, port: int, out_dir: str) -> None:
    """World 2, one rank passing bad input per scenario: saves ``{scenario: error or leaves}`` to
    ``OUT_DIR/bad{RANK}.pt``. A short process-group timeout turns a hang into an error."""
    results = {}
    try:
        dist = _join_gloo(rank, 2, port, 20)
        for name, (tree, observers) in bad_input_scenarios(rank).items():
            try:
                results[name] = {"leaves": [t.clone() for t in leaves(qstats.distributed.all_reduce(tree, observers))]}
            except Exception as error:  # recorded, checked by the test
                results[name] = {"error": f"{type(error).__name__}: {error}"}
        dist.destroy_process_group()
    except BaseException:
        import traceback

        results["crash"] = traceback.format_exc()
    torch.save(results, os.path.join(out_dir, f"bad{rank}.pt"))
