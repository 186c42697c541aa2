"""qstats.hessian: the sum of x^T x over a linear layer's input rows (GPTQ's Hessian).

References: float64 matrix products of the kept rows (independent), llm-compressor 0.14's
``accumulate_hessian`` (its normalised H is ``2 / samples * total``), the laws of qstats.testing,
a real 2-rank gloo all_reduce against the sequential merge.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

import qstats
from qstats.observers.hessian import HessianState, gptq_hessian, hessian
from _shared import fork_ranks


def _gram(rows: torch.Tensor) -> torch.Tensor:
    rows = rows.double()
    return rows.T @ rows


def test_sum_of_outer_products_of_the_rows():
    gen = torch.Generator().manual_seed(0)
    obs = hessian()
    batches = [torch.randn(3, 7, 24, generator=gen) for _ in range(4)]
    state = obs.init(batches[0])
    for x in batches:
        state = obs.update(state, x)
    rows = torch.cat([x.reshape(-1, 24) for x in batches])
    assert state.total.dtype == torch.float32 and state.count.dtype == torch.int64
    torch.testing.assert_close(state.total.double(), _gram(rows), rtol=1e-5, atol=1e-4)
    assert int(state.count) == rows.shape[0] and int(state.nonfinite) == 0
    wide = hessian(dtype=torch.float64)
    state64 = wide.update(wide.init(rows), rows)
    torch.testing.assert_close(state64.total, _gram(rows), rtol=1e-12, atol=1e-10)


def test_matches_llm_compressor_accumulate_hessian():
    helpers = pytest.importorskip("llmcompressor.modifiers.gptq.helpers")
    gen = torch.Generator().manual_seed(1)
    layer = torch.nn.Linear(32, 16, bias=False)
    batches = [torch.randn(2, 9, 32, generator=gen) * torch.linspace(0.1, 3, 32) for _ in range(5)]
    reference, samples = helpers.make_empty_hessian(layer), torch.zeros(())
    obs = hessian()
    state = obs.init(batches[0])
    for x in batches:
        reference, samples = helpers.accumulate_hessian(x, layer, reference, samples)
        state = obs.update(state, x)
    # llm-compressor normalises by its sample count (2 per batch here), qstats counts rows (18)
    assert int(samples) == 10 and int(state.count) == 90
    torch.testing.assert_close(2.0 * state.total / samples, reference / samples, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gptq_hessian(state), reference / int(state.count), rtol=1e-5, atol=1e-5)


def test_masks_and_nonfinite_rows_are_left_out():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(4, 6, 16, generator=gen)
    padding = torch.rand(4, 6, generator=gen) > 0.3
    x[0, 1, 3] = float("nan")
    x[2, 2, 0] = float("inf")
    obs = hessian()
    state = obs.update(obs.init(x), x, padding.float())
    rows, keep = x.reshape(-1, 16), padding.reshape(-1)
    finite = torch.isfinite(rows).all(dim=1)
    torch.testing.assert_close(state.total.double(), _gram(rows[keep & finite]), rtol=1e-5, atol=1e-4)
    assert int(state.count) == int((keep & finite).sum())
    assert int(state.nonfinite) == int((keep & ~finite).sum())
    # a finite row whose products overflow float32 is left out too (it made the total Inf); float64 keeps it
    big = torch.randn(3, 16, generator=gen)
    big[1, 5] = 1e20
    state = obs.update(obs.init(big), big)
    assert int(state.count) == 2 and int(state.nonfinite) == 1 and torch.isfinite(state.total).all()
    torch.testing.assert_close(state.total.double(), _gram(big[[0, 2]]), rtol=1e-5, atol=1e-4)
    wide = hessian(dtype=torch.float64)
    assert int(wide.update(wide.init(big), big).count) == 3
    # a per-batch mask (prefix of the row dimensions) leaves out whole sequences
    sequences = torch.tensor([1.0, 0.0, 1.0, 1.0])
    clean = torch.randn(4, 6, 16, generator=gen)
    state = obs.update(obs.init(clean), clean, sequences)
    torch.testing.assert_close(state.total.double(), _gram(clean[sequences.bool()].reshape(-1, 16)),
                               rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="does not match the leading"):
        obs.update(obs.init(clean), clean, torch.ones(5))
    with pytest.raises(ValueError, match="features"):
        obs.update(obs.init(clean), torch.randn(3, 8))


def test_stacked_experts_equal_a_loop_over_routed_rows():
    gen = torch.Generator().manual_seed(3)
    experts, tokens, features = 6, 40, 16
    x = torch.randn(tokens, features, generator=gen)
    route = torch.rand(experts, tokens, generator=gen) > 0.6
    route[4] = False  # an expert that receives no token
    obs = qstats.stacked_observer(hessian(), experts)
    shared = x.expand(experts, tokens, features)
    state = obs.update(obs.init(shared), shared, route.float())
    assert state.total.shape == (experts, features, features)
    for e in range(experts):
        torch.testing.assert_close(state.total[e].double(), _gram(x[route[e]]), rtol=1e-5, atol=1e-4)
        assert int(state.count[e]) == int(route[e].sum())
    # per-expert inputs (not shared) under vmap too
    own = torch.randn(experts, tokens, features, generator=gen)
    state = obs.update(obs.init(own), own, route.float())
    for e in range(experts):
        torch.testing.assert_close(state.total[e].double(), _gram(own[e][route[e]]), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("experts", [3, 16])
def test_gptq_hessian_of_a_stacked_state_divides_each_expert_by_its_own_rows(experts):
    """A stacked state's count is ``[E]``: it divided the last axis of ``[E, in, in]`` (an error for
    E != in, silently wrong values for E == in)."""
    gen = torch.Generator().manual_seed(13)
    features, tokens = 16, 40
    x = torch.randn(tokens, features, generator=gen)
    route = torch.rand(experts, tokens, generator=gen) > 0.5
    route[1] = False  # no row: zeros
    obs = qstats.stacked_observer(hessian(), experts)
    shared = x.expand(experts, tokens, features)
    state = obs.update(obs.init(shared), shared, route.float())
    normalized = gptq_hessian(state)
    assert normalized.shape == (experts, features, features)
    for e in range(experts):
        assert torch.equal(normalized[e], gptq_hessian(HessianState(*(field[e] for field in state))))
    assert torch.equal(normalized[1], torch.zeros(features, features))


def test_gptq_hessian_of_a_finite_sum_past_half_float32_range_is_finite():
    """2 * total overflowed float32 before the division by the row count (a finite sum of 2.8e38
    became Inf, and gptq fell back to round-to-nearest calling the Hessian not positive definite)."""
    x = torch.randn(200, 8, generator=torch.Generator().manual_seed(14)) * 1e18
    state = hessian().update(hessian().init(x), x)
    assert torch.isfinite(state.total).all() and state.total.abs().max() > torch.finfo(torch.float32).max / 2
    wide = hessian(dtype=torch.float64).update(hessian(dtype=torch.float64).init(x), x)
    normalized = gptq_hessian(state)
    assert torch.isfinite(normalized).all()
    torch.testing.assert_close(normalized, gptq_hessian(wide), rtol=1e-5, atol=1e-5 * float(normalized.abs().max()))


@pytest.mark.parametrize("shared", ["every token", "one padding mask", "a copy per expert", "a shuffled copy each"])
def test_stacked_experts_keeping_the_same_rows_equal_each_expert_alone(shared):
    """Every expert calibrated on every token (llm-compressor's default for MoE, qstats'
    ``all_experts``): the experts keep the same rows, and each state equals that expert's own
    observer bit for bit, and the float64 product of the kept rows to float32 rounding."""
    gen = torch.Generator().manual_seed(4)
    experts, tokens, features = 5, 30, 12
    x = torch.randn(tokens, features, generator=gen)
    keep = torch.ones(tokens) if shared == "every token" else (torch.rand(tokens, generator=gen) > 0.3).float()
    obs, one = qstats.stacked_observer(hessian(), experts), hessian()
    shared_x = x.expand(experts, tokens, features)
    start = obs.update(obs.init(shared_x), shared_x, torch.rand(experts, tokens, generator=gen) > 0.5)
    if "copy" in shared:  # as the experts' captured matmul inputs: rows [E * T], a block each (in any order)
        orders = [torch.randperm(tokens, generator=gen) if "shuffled" in shared else torch.arange(tokens)
                  for _ in range(experts)]
        rows = torch.cat([x[order] for order in orders])
        blocks = torch.block_diag(*[keep[order][None] for order in orders])
        state = obs.update(start, rows.expand(experts, *rows.shape), blocks)
    else:
        state = obs.update(start, shared_x, keep.expand(experts, tokens))
    for e in range(experts):
        order = orders[e] if "copy" in shared else torch.arange(tokens)  # each expert's rows in its order
        alone = one.update(HessianState(*(field[e] for field in start)), x[order], keep[order])
        assert all(torch.equal(a, b) for a, b in zip(alone, (field[e] for field in state))), e
        torch.testing.assert_close(state.total[e].double(), start.total[e].double() + _gram(x[keep.bool()]),
                                   rtol=1e-5, atol=1e-4)


def test_laws():
    qstats.testing.check_all(hessian(), lambda g: torch.randn(12, 16, generator=g), max_examples=5)


def test_save_load_round_trip(tmp_path):
    obs = qstats.stacked_observer(hessian(), 3)
    x = torch.randn(3, 10, 8)
    state = obs.update(obs.init(x), x)
    qstats.save(tmp_path / "h.safetensors", {"layer": {"input": state}})
    loaded = qstats.load(tmp_path / "h.safetensors")["layer"]["input"]
    assert isinstance(loaded, HessianState)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(loaded, state))


def test_compute_qparams_is_refused():
    obs = hessian()
    state = obs.update(obs.init(torch.ones(2, 4)), torch.ones(2, 4))
    with pytest.raises(TypeError, match="no range"):
        qstats.compute_qparams(state, qstats.QuantSpec())


def test_calibrate_collects_hessians_through_a_recipe():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    batches = [torch.randn(4, 16) for _ in range(3)]
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("input",), observer=hessian)])
    states = qstats.calibrate(model, batches, recipe, progress=False)
    inputs = torch.cat(batches)
    torch.testing.assert_close(states["0"]["input"].total.double(), _gram(inputs), rtol=1e-5, atol=1e-4)
    hidden = torch.relu(model[0](inputs)).detach()
    torch.testing.assert_close(states["2"]["input"].total.double(), _gram(hidden), rtol=1e-5, atol=1e-4)
    assert int(states["2"]["input"].count) == 12
    with pytest.raises(TypeError, match=r"\['0'\]\['input'\].*no range"):  # names the site
        qstats.compute_qparams_tree(states, recipe, model)


def _rank_state(rank: int) -> HessianState:
    gen = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(5 + 3 * rank, 12, generator=gen) * 1000.0 ** rank
    obs = hessian()
    return obs.update(obs.init(x), x)


def _run_rank(rank: int, port: int, world: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        state = _rank_state(rank)
        exact = qstats.distributed.all_reduce({"l": state}, hessian(), exact=True)["l"]
        summed = qstats.distributed.all_reduce({"l": state}, hessian())["l"]
        torch.save({"exact": tuple(exact), "summed": tuple(summed)}, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_distributed_all_reduce_sums_and_exact_folds(tmp_path):
    world = 2
    assert fork_ranks(_run_rank, world, str(tmp_path), world=world, timeout=60) == [0] * world
    sequential = functools.reduce(hessian().merge, [_rank_state(r) for r in range(world)])
    for rank in range(world):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        assert all(torch.equal(a, b) for a, b in zip(result["exact"], sequential))  # rank order, bit for bit
        torch.testing.assert_close(result["summed"][0], sequential.total, rtol=1e-6, atol=0)
        assert torch.equal(result["summed"][1], sequential.count)


@pytest.mark.parametrize("routing", ["top-k", "every token", "one padding mask"])
@pytest.mark.parametrize("rows", ["shared by the experts", "each expert its own"])
def test_vmap_over_layers_of_stacked_experts_equals_a_loop_over_routed_rows(routing, rows):
    """``torch.vmap`` over layers of a stacked Hessian (layers x experts): add_masked_gram's vmap rule
    indexed with a boolean mask, which the outer vmap could not batch (RuntimeError)."""
    gen = torch.Generator().manual_seed(21)
    layers, experts, tokens, features = 3, 4, 20, 8
    if rows == "shared by the experts":
        x = torch.randn(layers, tokens, features, generator=gen)[:, None].expand(layers, experts, tokens, features)
    else:
        x = torch.randn(layers, experts, tokens, features, generator=gen)
    if routing == "top-k":
        route = torch.rand(layers, experts, tokens, generator=gen) > 0.6
        route[1, 2] = False  # an expert of layer 1 that receives no token
    else:
        keep = torch.ones(tokens) if routing == "every token" else torch.rand(tokens, generator=gen) > 0.3
        route = keep.bool().expand(layers, experts, tokens)
    obs = qstats.stacked_observer(hessian(), experts)
    start = torch.vmap(obs.init)(x)
    state = torch.vmap(obs.update)(start, x, route.float())
    assert state.total.shape == (layers, experts, features, features) and state.count.shape == (layers, experts)
    for layer in range(layers):
        for e in range(experts):
            kept = x[layer, e][route[layer, e]]
            torch.testing.assert_close(state.total[layer, e].double(), _gram(kept), rtol=1e-5, atol=1e-4)
            assert int(state.count[layer, e]) == kept.shape[0] and int(state.nonfinite[layer, e]) == 0
    merged = torch.vmap(obs.merge)(state, state)
    torch.testing.assert_close(merged.total.double(), 2 * state.total.double(), rtol=0, atol=0)


def test_a_hand_built_state_with_a_negative_or_float_count_is_refused():
    """A negative, fractional or float ``count`` (or ``nonfinite``) was accepted: gptq_hessian divided
    by it (a negative Hessian, or one scaled by a count that is no number of rows)."""
    obs, x = hessian(), torch.randn(6, 4)
    good = obs.update(obs.init(x), x)
    bad = {
        "negative": good._replace(count=torch.tensor(-6)),
        "negative nonfinite": good._replace(nonfinite=torch.tensor(-1)),
        "fractional": good._replace(count=torch.tensor(2.5)),
        "float": good._replace(count=torch.tensor(6.0)),
        "python float": good._replace(count=6.0),
        "int32": good._replace(count=torch.tensor(6, dtype=torch.int32)),
    }
    # update and merge check the dtypes only (the values would be a host read per update)
    checks_values = ((gptq_hessian, "gptq_hessian"),
                     (lambda s: qstats.gptq(torch.randn(3, 4), s, qstats.QuantSpec(dtype="int4")), "gptq"))
    checks_dtypes = ((lambda s: obs.update(s, x), "hessian.update"), (lambda s: obs.merge(good, s), "hessian.merge"),
                     (lambda s: obs.merge(s, good), "hessian.merge"))
    for name, state in bad.items():
        for call, where in checks_values + (checks_dtypes if not name.startswith("negative") else ()):
            with pytest.raises(ValueError, match=rf"{where}: HessianState\.(count|nonfinite|count and \.nonfinite)"):
                call(state)
    # a stack with one negative expert: under vmap too
    stacked = qstats.stacked_observer(hessian(), 3)
    xs = torch.randn(3, 6, 4)
    state = stacked.update(stacked.init(xs), xs)
    negative = state._replace(count=torch.tensor([6, -1, 6]))
    with pytest.raises(ValueError, match="negative"):
        gptq_hessian(negative)
    assert torch.equal(gptq_hessian(state), torch.vmap(gptq_hessian)(state))
