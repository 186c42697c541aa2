"""qstats.moments against direct numpy computations on the concatenated data."""

import numpy as np
import math

import pytest
import torch

import qstats


def _batches(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(7 + 3 * i, 5, generator=g) * (1 + i) + i for i in range(4)]


@pytest.mark.parametrize("granularity", [qstats.PerTensor(), qstats.PerAxis(-1)])
def test_statistics_match_numpy_over_all_batches(granularity):
    spec = qstats.QuantSpec(granularity=granularity)
    obs = qstats.moments(spec, p=3.0)
    xs = _batches()
    state = obs.init(xs[0])
    for x in xs:
        state = obs.update(state, x)
    data = torch.cat(xs).double().numpy()
    axis = None if isinstance(granularity, qstats.PerTensor) else 0
    np.testing.assert_allclose(state.mean.numpy(), data.mean(axis=axis), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(state.variance.numpy(), data.var(axis=axis), rtol=1e-10)
    np.testing.assert_allclose(state.abs_mean.numpy(), np.abs(data).mean(axis=axis), rtol=1e-12)
    np.testing.assert_allclose(state.rms.numpy(), np.sqrt((data**2).mean(axis=axis)), rtol=1e-12)
    np.testing.assert_allclose(state.lp_norm.numpy(), ((np.abs(data) ** 3).mean(axis=axis)) ** (1 / 3), rtol=1e-10)
    assert np.all(state.count.numpy() == (data.size if axis is None else data.shape[0]))


def test_chan_merge_equals_one_pass_and_is_stable_for_large_offsets():
    spec = qstats.QuantSpec()
    obs = qstats.moments(spec)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(1000, generator=g, dtype=torch.float64) + 1e6 for _ in range(3)]
    states = [obs.update(obs.init(x), x) for x in xs]
    merged = obs.merge(obs.merge(states[0], states[1]), states[2])
    data = torch.cat(xs).numpy()
    # a naive sum-of-squares formula loses every digit here; Chan's merge keeps them
    np.testing.assert_allclose(float(merged.variance), data.var(), rtol=1e-9)
    np.testing.assert_allclose(float(merged.mean), data.mean(), rtol=1e-15)


def test_weight_mask_and_nonfinite():
    spec = qstats.QuantSpec()
    obs = qstats.moments(spec)
    x = torch.tensor([[1.0, 2.0], [float("nan"), 4.0], [5.0, float("inf")]])
    state = obs.update(obs.init(x), x, torch.tensor([1.0, 1.0, 0.0]))
    assert int(state.count) == 3 and int(state.nonfinite) == 1
    assert float(state.mean) == pytest.approx((1 + 2 + 4) / 3)
    with pytest.raises(ValueError, match="non-finite"):
        strict = qstats.moments(qstats.QuantSpec(nonfinite="raise"))
        strict.update(strict.init(x), x)


def test_range_rules_match_their_formulas():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(10000, generator=g, dtype=torch.float64) * 2 + 0.5
    data = x.numpy()
    spec = qstats.QuantSpec(dtype="uint8", mapping="asymmetric")
    obs = qstats.moments(spec, p=4.0)
    state = obs.update(obs.init(x), x)
    mean, std = data.mean(), data.std()
    cases = {
        ("mean_std", 3.0): (mean - 3 * std, mean + 3 * std),
        ("mean_std", 2.0): (mean - 2 * std, mean + 2 * std),
        ("rms", 4.0): (-4 * np.sqrt((data**2).mean()), 4 * np.sqrt((data**2).mean())),
        ("abs_mean", 5.0): (-5 * np.abs(data).mean(), 5 * np.abs(data).mean()),
        ("lp", 2.5): (-2.5 * (np.abs(data) ** 4).mean() ** 0.25, 2.5 * (np.abs(data) ** 4).mean() ** 0.25),
    }
    for (method, k), (lo, hi) in cases.items():
        options = {"p": 4.0} if method == "lp" else {}
        got = qstats.compute_qparams(state, spec, method=method, k=k, **options)
        expected = qstats.qparams_from_minmax(torch.tensor(min(lo, 0.0)), torch.tensor(max(hi, 0.0)), spec)
        assert float(got.scale) == pytest.approx(float(expected.scale), rel=1e-6), method
        assert int(got.zero_point) == int(expected.zero_point), method


def test_bad_input():
    with pytest.raises(ValueError, match="p"):
        qstats.moments(qstats.QuantSpec(), p=0)
    spec = qstats.QuantSpec()
    obs = qstats.moments(spec)
    state = obs.update(obs.init(torch.ones(3)), torch.ones(3))
    with pytest.raises(ValueError, match="method"):
        qstats.compute_qparams(state, spec, method="sigma")
    # k=inf gave NaN ranges ("uncalibrated") or 1e36 scales; k=True / p=True were read as 1
    for k in (0, -1.0, math.inf, math.nan, True):
        with pytest.raises(ValueError, match="k must be a positive finite number"):
            qstats.compute_qparams(state, spec, method="mean_std", k=k)
    with pytest.raises(ValueError, match="another order"):
        qstats.compute_qparams(state, spec, method="lp", p=3.0)  # the state holds p=4's sum
    with pytest.raises(ValueError, match="p must be a positive finite number"):
        qstats.compute_qparams(state, spec, method="lp", p=True)
    per_axis = qstats.moments(qstats.QuantSpec(granularity=qstats.PerAxis(0)))
    with pytest.raises(ValueError, match=r"\(4,\)"):
        per_axis.update(per_axis.init(torch.ones(3, 2)), torch.ones(4, 2))


def test_nonfinite_raise_under_vmap_stacked_and_compile():
    """``nonfinite="raise"`` through the min/max reduction's check: finite data under ``vmap``
    and as a stack equals the per-slice loop, and a NaN in one slice raises there and inside a
    compiled update (not only in eager mode)."""
    spec = qstats.QuantSpec(dtype="int8", nonfinite="raise")
    obs = qstats.moments(spec)
    x = torch.randn(3, 8, 16, generator=torch.Generator().manual_seed(0))
    loop = [obs.update(obs.init(x[e]), x[e]) for e in range(3)]
    batched = torch.func.vmap(lambda t: obs.update(obs.init(t), t))(x)
    stacked = qstats.stacked_observer(obs, 3)
    stacked_state = stacked.update(stacked.init(x), x)
    for e in range(3):
        for field, a, b, c in zip(loop[e]._fields, loop[e], batched, stacked_state):
            assert torch.equal(a, b[e]) and torch.equal(a, c[e]), field
    dirty = x.clone()
    dirty[1, 2, 3] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        torch.func.vmap(lambda t: obs.update(obs.init(t), t))(dirty)
    with pytest.raises(ValueError, match="non-finite"):
        stacked.update(stacked.init(dirty), dirty)
    compiled = torch.compile(obs.update, fullgraph=True)
    assert torch.equal(compiled(obs.init(x[0]), x[0]).total, loop[0].total)
    with pytest.raises(ValueError, match="non-finite"):
        compiled(obs.init(dirty[1]), dirty[1])


def test_a_first_batch_past_1e154_keeps_a_finite_variance():
    """Merging a batch into an empty state squared the batch's mean times a zero count: a float64
    mean past 1e154 gave inf * 0, a NaN variance, and compute_qparams called the state uncalibrated."""
    spec = qstats.QuantSpec(dtype="int8")
    obs = qstats.moments(spec)
    x = torch.tensor([1e200, 1e200], dtype=torch.float64)
    state = obs.update(obs.init(x), x)
    assert float(state.variance) == float(x.numpy().var()) == 0.0
    assert float(obs.merge(obs.init(x), state).m2) == 0.0
    for method in ("mean_std", "abs_mean"):
        qp = qstats.compute_qparams(state, spec, method=method)
        assert bool(qp.calibrated) and math.isfinite(float(qp.scale)) and float(qp.scale) > 0


def test_float64_values_past_float32_are_finite_under_the_raise_policy():
    """moments counts in float64: values past float32's range are finite data, and
    nonfinite="raise" must not call them NaN or Inf (the min/max reduction keeps float32 extremes)."""
    x = torch.tensor([1e200, -3e199, 2.0], dtype=torch.float64)
    obs = qstats.moments(qstats.QuantSpec(nonfinite="raise"))
    state = obs.update(obs.init(x), x)
    assert int(state.count) == 3 and int(state.nonfinite) == 0
    assert float(state.total) == float(x.sum())
    with pytest.raises(ValueError, match="non-finite"):
        bad = torch.tensor([1e200, float("inf")], dtype=torch.float64)
        obs.update(obs.init(bad), bad)



def _numpy_moments(views, masks, axis, p):
    """count, mean, variance, E|x|, rms and E|x|**p over dims (0, -1) of the float64 canonical
    views concatenated along ``axis``, masked and non-finite values left out (numpy, two passes)."""
    view, keep = np.concatenate(views, axis=axis), np.concatenate(masks, axis=axis)
    keep = keep & np.isfinite(view)
    axes = (0, view.ndim - 1)
    n = keep.sum(axis=axes)
    v = np.where(keep, view, 0.0)
    mean = v.sum(axis=axes) / np.maximum(n, 1)
    centred = np.where(keep, view - mean[None, ..., None], 0.0)

    def per(a):
        return a.sum(axis=axes) / np.maximum(n, 1)

    return n, mean, per(centred**2), per(np.abs(v)), np.sqrt(per(v**2)), per(np.abs(v) ** p)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "granularity",
    [qstats.PerTensor(), qstats.PerAxis(1), qstats.PerToken(), qstats.PerGroup(4), qstats.PerBlock((2, 4))],
    ids=["tensor", "axis1", "token", "group4", "block"],
)
def test_masked_batches_merged_in_any_order_match_numpy(granularity, dtype):
    """Row masks, an empty batch, NaN/Inf and 2**60 magnitudes (float32), merged as shards in a
    shuffled tree: the moments numpy computes over all the data, per quantization parameter."""
    g = torch.Generator().manual_seed(6)
    rows_vary = isinstance(granularity, (qstats.PerTensor, qstats.PerAxis))  # else rows are parameters
    shapes = [(2, 4, 8), (1 if rows_vary else 2, 4, 8), (0, 4, 8), (3 if rows_vary else 2, 4, 8)]
    scale = 2.0**60 if dtype == torch.float32 else 2.0**6  # bf16/fp16: within fp16's range
    xs = [(torch.randn(s, generator=g) * scale + scale / 3).to(dtype) for s in shapes]
    xs[0][1, 2, 3], xs[3][0, 0, 0] = float("nan"), float("-inf")
    ws = [(torch.rand(s[:1], generator=g) < 0.7).to(torch.int64) for s in shapes]
    obs = qstats.moments(qstats.QuantSpec(granularity=granularity), p=3.0)
    states = [obs.update(obs.init(xs[0]), x, w) for x, w in zip(xs, ws)]
    order = torch.randperm(len(states), generator=g).tolist()
    merged = obs.merge(obs.merge(states[order[0]], states[order[1]]), obs.merge(states[order[2]], states[order[3]]))

    def view(t):
        return qstats._granularity.canonical_view(t, granularity).numpy()

    seen = [(x, w) for x, w in zip(xs, ws) if x.numel()]
    views = [view(x.double()) for x, _ in seen]
    masks = [view((w != 0).reshape(-1, 1, 1).expand(x.shape)) for x, w in seen]
    axis = -1 if isinstance(granularity, qstats.PerTensor) else 0
    n, mean, var, abs_mean, rms, power = _numpy_moments(views, masks, axis, 3.0)
    assert np.array_equal(merged.count.numpy(), n)
    for got, want in [(merged.mean, mean), (merged.variance, var), (merged.abs_mean, abs_mean), (merged.rms, rms),
                      (merged.lp_norm, power ** (1 / 3))]:
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-10, atol=0.0)
    assert int(merged.nonfinite.sum()) == sum(int((~torch.isfinite(x[w != 0])).sum()) for x, w in seen)


def test_stacked_experts_with_routing_masks_match_numpy_per_expert():
    """qstats.stacked_observer over shared activations with per-expert routing masks (an idle
    expert included), two batches merged: each expert's per-channel moments are numpy's over the
    tokens routed to it."""
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(12, 6, generator=g) * 5 + 2 for _ in range(2)]
    routes = [torch.stack([torch.rand(12, generator=g) < 0.5, torch.rand(12, generator=g) < 0.2, torch.zeros(12, dtype=torch.bool)])
              for _ in range(2)]
    obs = qstats.stacked_observer(qstats.moments(qstats.QuantSpec(granularity=qstats.PerAxis(-1))), 3)
    states = [obs.update(obs.init(x.expand(3, *x.shape)), x.expand(3, *x.shape), r) for x, r in zip(xs, routes)]
    merged = obs.merge(states[1], states[0])
    for e in range(3):
        rows = torch.cat([x[r[e]] for x, r in zip(xs, routes)]).double().numpy()
        assert merged.count[e].tolist() == [rows.shape[0]] * 6
        if rows.shape[0] == 0:
            assert not merged.total[e].any() and not merged.m2[e].any()
            continue
        np.testing.assert_allclose(merged.mean[e].numpy(), rows.mean(0), rtol=1e-12)
        np.testing.assert_allclose(merged.variance[e].numpy(), rows.var(0), rtol=1e-10)


def _mpmath_lp(rows, p):
    """(mean |x|**p)**(1/p) of each column of ``rows`` (float64 numpy), in 60-digit mpmath."""
    mpmath = pytest.importorskip("mpmath")
    with mpmath.workdps(60):
        return np.array([float(mpmath.power(mpmath.fsum(mpmath.power(abs(mpmath.mpf(float(v))), p) for v in col)
                                            / len(col), mpmath.mpf(1) / p)) for col in rows.T])


@pytest.mark.parametrize("p", [50.0, 200.0, 3.5])
@pytest.mark.parametrize("dtype,top", [(torch.float32, 1e30), (torch.float64, 1e300)], ids=["f32", "f64"])
def test_lp_norm_of_large_p_and_large_values_matches_mpmath(p, dtype, top):
    """The "lp" rule summed |x|**p in float64: p=50 of 1e30 (or p=4 of 1e80) overflowed to inf
    and the range became the largest float32 (scale 1.33e36 for int8 instead of 7.7e27). The scaled
    sum gives mpmath's (E|x|**p)**(1/p) per channel, batches merged in any order."""
    g = torch.Generator().manual_seed(11)
    # per-channel magnitudes from 1 up to ``top``; later batches hold the larger values (rescaling)
    xs = [(torch.randn(5 + i, 3, generator=g, dtype=torch.float64) * torch.tensor([1.0, top ** 0.5, top], dtype=torch.float64)
           * (0.2 + 0.4 * i)).to(dtype) for i in range(3)]
    xs[1][0, 2] = 0.0
    spec = qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(-1))
    obs = qstats.moments(spec, p=p)
    folded = obs.init(xs[0])
    for x in xs:
        folded = obs.update(folded, x)
    parts = [obs.update(obs.init(x), x) for x in xs]
    merged = obs.merge(parts[2], obs.merge(parts[0], parts[1]))
    rows = torch.cat(xs).double().numpy()
    want = _mpmath_lp(rows, p)
    for state in (folded, merged):
        np.testing.assert_allclose(state.lp_norm.numpy(), want, rtol=1e-12)
        assert bool(torch.isfinite(state.lp_sum).all()) and float(state.lp_sum.max()) <= rows.shape[0]
    qp = qstats.compute_qparams(merged, spec, method="lp", k=1.0)
    amax = torch.tensor(np.minimum(want, float(torch.finfo(torch.float32).max)), dtype=torch.float32)
    expected = qstats.qparams_from_minmax(-amax, amax, spec)
    torch.testing.assert_close(qp.scale, expected.scale, rtol=1e-6, atol=0.0)
    assert bool(qp.calibrated.all())


def test_lp_laws_hold_with_large_p_and_growing_magnitudes():
    """qstats.testing's laws (identity, associativity, commutativity, homomorphism) for the
    rescaled Lp sum, with magnitudes whose p-th powers overflow float64."""
    obs = qstats.moments(qstats.QuantSpec(granularity=qstats.PerAxis(0)), p=120.0)
    qstats.testing.check_all(obs, lambda g: torch.randn(6, 8, generator=g) * 1e30, max_examples=5)


def test_the_state_records_p_and_other_orders_are_refused():
    """The state holds p (``lp_order``): compute_qparams(method="lp") reads it, a different p is
    refused, and so are merges and updates of states from moments observers of another p (their
    Lp sums cannot be added). Omitting p matches numpy's (E|x|**3)**(1/3)."""
    x = torch.randn(50, 4, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    spec = qstats.QuantSpec(dtype="int8")
    three, four = qstats.moments(spec, p=3.0), qstats.moments(spec, p=4.0)
    s3, s4 = three.update(three.init(x), x), four.update(four.init(x), x)
    assert torch.equal(s3.lp_order, torch.tensor(3.0, dtype=torch.float64))
    amax = float((np.abs(x.numpy()) ** 3).mean() ** (1 / 3))
    expected = qstats.qparams_from_minmax(torch.tensor(-amax), torch.tensor(amax), spec)
    for options in ({}, {"p": 3.0}, {"p": np.float32(3.0)}):
        got = qstats.compute_qparams(s3, spec, method="lp", **options)
        assert float(got.scale) == pytest.approx(float(expected.scale), rel=1e-6), options
    with pytest.raises(ValueError, match="another order"):
        qstats.compute_qparams(s3, spec, method="lp", p=4.0)
    with pytest.raises(ValueError, match="moments.merge: .*different orders p"):
        three.merge(s3, s4)
    mixed = four.update(s3, x)  # no host read in update: the mixed order is NaN, refused where read
    with pytest.raises(ValueError, match="another order"):
        qstats.compute_qparams(mixed, spec, method="lp")
    with pytest.raises(ValueError, match="moments.merge: .*different orders p"):
        three.merge(mixed, s3)
    with pytest.raises(ValueError, match="moments.merge: .*different orders p"):
        three.merge(three.init(x), four.init(x))


def test_lp_state_round_trips_through_qstats_io(tmp_path):
    """save/load keeps the scaled Lp sum, its absmax and p: the loaded state's range is the saved one's."""
    obs = qstats.moments(qstats.QuantSpec(granularity=qstats.PerAxis(0)), p=60.0)
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(4)) * 1e30
    state = obs.update(obs.init(x), x)
    qstats.save(tmp_path / "m.safetensors", {"s": state})
    loaded = qstats.load(tmp_path / "m.safetensors")["s"]
    for field, a, b in zip(state._fields, state, loaded):
        assert torch.equal(a, b), field
    with pytest.raises(ValueError, match="another order"):
        qstats.compute_qparams(loaded, obs.spec, method="lp", p=4.0)


def test_update_reads_nothing_back_from_the_device():
    """``update`` never syncs the host (docs/design.md): no ``qstats::require`` check and no
    ``.item()``-style read in it; ``merge`` checks the orders."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.add(str(func))
            return func(*args, **(kwargs or {}))

    obs = qstats.moments(qstats.QuantSpec(granularity=qstats.PerAxis(0)), p=6.0)
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(5))
    state = obs.init(x)
    with Ops() as ops:
        obs.update(state, x)
    assert not {op for op in ops.seen if "require" in op or "local_scalar" in op}, ops.seen
    with Ops() as ops:
        obs.merge(state, state)
    assert any("require" in op for op in ops.seen)
