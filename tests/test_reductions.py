"""qstats' one reduction (`finite_aminmax`) against an independent computation, eagerly, under
vmap and under torch.compile; and the value checks (`qstats._checks`) in each mode."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import qstats
from qstats._checks import require
from qstats._reductions import finite_aminmax


def _with_nonfinite(x, generator, fraction):
    pick = torch.rand(x.shape, generator=generator)
    x = torch.where(pick < fraction / 3, torch.nan, x)
    x = torch.where((pick >= fraction / 3) & (pick < 2 * fraction / 3), torch.inf, x)
    return torch.where((pick >= 2 * fraction / 3) & (pick < fraction), -torch.inf, x)


def _reference(view, mask):
    """Per parameter, with Python lists: extremes of the finite kept values and both counts."""
    params = view.shape[1:-1]
    rows, num = view.shape[0] * view.shape[-1], params.numel()
    flat = view.movedim(-1, 1).reshape(rows, num).T.double()
    keep = (mask.expand(view.shape) if mask is not None else torch.ones(view.shape, dtype=torch.bool))
    keep = keep.movedim(-1, 1).reshape(rows, num).T
    lo, hi, count, bad = [], [], [], []
    for values, kept in zip(flat.tolist(), keep.tolist()):
        seen = [v for v, k in zip(values, kept) if k]
        finite = [v for v in seen if abs(v) != float("inf") and v == v]
        lo.append(min(finite, default=float("inf")))
        hi.append(max(finite, default=float("-inf")))
        count.append(len(finite))
        bad.append(len(seen) - len(finite))
    as_f32 = lambda v: torch.tensor(v, dtype=torch.float32).reshape(params)  # noqa: E731
    as_i64 = lambda v: torch.tensor(v, dtype=torch.int64).reshape(params)  # noqa: E731
    return as_f32(lo), as_f32(hi), as_i64(count), as_i64(bad)


def _assert_same(got, expected):
    for name, a, b in zip(("min", "max", "count", "nonfinite"), got, expected):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a, b), (name, a, b)


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.integers(0, 5), min_size=3, max_size=4),
    seed=st.integers(0, 2**16),
    masked=st.booleans(),
    fraction=st.sampled_from([0.0, 0.2, 1.0]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]),
)
def test_reduction_equals_a_per_parameter_loop(shape, seed, masked, fraction, dtype):
    generator = torch.Generator().manual_seed(seed)
    view = _with_nonfinite(torch.randn(shape, generator=generator), generator, fraction).to(dtype)
    mask = torch.rand(shape, generator=generator) < 0.6 if masked else None
    _assert_same(finite_aminmax(view, mask), _reference(view.float(), mask))


@pytest.mark.parametrize("params", [(), (1,), (3,), (64, 2)])
def test_finite_extremes_whose_ranges_overflow_float32_are_kept(params):
    """Values all finite, but a parameter's range (max - min) or the sum of the ranges overflows
    float32: the extremes are still the finite ones, nothing counted as non-finite."""
    generator = torch.Generator().manual_seed(0)
    view = torch.randn(2, *params, 5, generator=generator) * 3e38
    view = view.clamp(-3.4e38, 3.4e38)
    _assert_same(finite_aminmax(view), _reference(view, None))
    for low in (-2e38, 0.0):  # each range 4e38 overflows; each 2e38 does not, their sum may
        wide = torch.full((1, *params, 2), 2e38)
        wide[..., 0] = low
        _assert_same(finite_aminmax(wide), _reference(wide, None))


def test_vmap_equals_the_loop_with_shared_values_and_batched_masks():
    generator = torch.Generator().manual_seed(0)
    view = _with_nonfinite(torch.randn(4, 3, 5, generator=generator), generator, 0.2)
    masks = torch.rand(6, 4, 3, 5, generator=generator) < 0.5
    got = torch.vmap(finite_aminmax, in_dims=(None, 0))(view, masks)
    for i, mask in enumerate(masks):
        _assert_same([t[i] for t in got], _reference(view, mask))
    stacked = torch.randn(6, 4, 3, 5, generator=generator)
    got = torch.vmap(finite_aminmax)(stacked)
    for i, one in enumerate(stacked):
        _assert_same([t[i] for t in got], _reference(one, None))


@pytest.mark.parametrize("granularity", [qstats.PerTensor(), qstats.PerAxis(0), qstats.PerGroup(4)], ids=repr)
@pytest.mark.parametrize("dirty", [False, True])
def test_compiled_update_equals_eager(granularity, dirty):
    torch._dynamo.reset()
    obs = qstats.minmax(qstats.QuantSpec(granularity=granularity))
    x = torch.randn(8, 16)
    if dirty:
        x[1, 3], x[5, 0] = torch.nan, torch.inf
    weight = (torch.arange(8) % 3 != 0).float()
    compiled = torch.compile(obs.update, fullgraph=True, backend="aot_eager")
    for w in (None, weight):
        _assert_same(compiled(obs.init(x), x, w), obs.update(obs.init(x), x, w))


def test_raise_policy_raises_eagerly_compiled_and_under_vmap():
    torch._dynamo.reset()
    view = torch.tensor([[[1.0, float("nan")]]])
    with pytest.raises(ValueError, match="non-finite"):
        finite_aminmax(view, nonfinite="raise")
    compiled = torch.compile(lambda v: finite_aminmax(v, nonfinite="raise"), fullgraph=True, backend="aot_eager")
    with pytest.raises(ValueError, match="non-finite"):
        compiled(view)
    with pytest.raises(ValueError, match="non-finite"):
        torch.vmap(lambda v: finite_aminmax(v, nonfinite="raise"))(view.expand(3, 1, 1, 2))
    assert finite_aminmax(torch.ones(1, 1, 2), nonfinite="raise")[2].item() == 2


def test_require_raises_in_every_mode():
    torch._dynamo.reset()
    with pytest.raises(ValueError, match="bad"):
        require(torch.tensor([True, False]), "bad")
    with pytest.raises(ValueError, match="bad"):
        torch.vmap(lambda c: require(c, "bad"))(torch.tensor([[True], [False]]))
    compiled = torch.compile(lambda c: require(c, "bad"), fullgraph=True, backend="aot_eager")
    with pytest.raises(ValueError, match="bad"):
        compiled(torch.tensor([False]))
    assert torch.equal(require(torch.tensor([True]), "bad"), torch.tensor([True]))


def test_uncalibrated_raises_eagerly_and_in_a_compiled_graph_and_reports_under_vmap():
    torch._dynamo.reset()
    spec = qstats.QuantSpec(granularity=qstats.PerAxis(0))
    obs = qstats.minmax(spec)
    state = obs.init(torch.zeros(3, 4))  # nothing observed
    with pytest.raises(ValueError, match="3 of 3"):
        qstats.compute_qparams(state, spec)
    compiled = torch.compile(lambda s: qstats.compute_qparams(s, spec), fullgraph=True, backend="aot_eager")
    with pytest.raises(ValueError, match="uncalibrated"):
        compiled(state)
    stacked = torch.vmap(obs.init)(torch.zeros(2, 3, 4))
    qp = torch.vmap(lambda s: qstats.compute_qparams(s, spec))(stacked)
    assert not qp.calibrated.any() and torch.equal(qp.scale, torch.ones(2, 3))
    meta = obs.init(torch.empty(3, 4, device="meta"))
    assert qstats.compute_qparams(meta, spec).scale.device.type == "meta"


def test_ops_pass_opcheck():
    view = torch.randn(3, 2, 5)
    mask = torch.rand(3, 2, 5) < 0.5
    for args in ((view, None, False), (view, mask, False)):
        torch.library.opcheck(torch.ops.qstats.finite_aminmax.default, args)
    torch.library.opcheck(torch.ops.qstats.require.default, (torch.tensor([True]), "m"))
    torch.library.opcheck(torch.ops.qstats.require_calibrated.default, (torch.tensor([True]), "m"))
    bits = torch.randint(0, 1 << 20, (3, 2, 5), dtype=torch.int32)
    torch.library.opcheck(torch.ops.qstats.bucket_counts.default, (bits, mask, 12, 0, 1 << 9))
    weights = torch.rand(3, 2, 5)
    torch.library.opcheck(torch.ops.qstats.error_sum.default, (view, weights, mask, 2.4, False))
    rows, keep = torch.randn(1, 6, 4), torch.rand(1, 2, 6) < 0.5
    torch.library.opcheck(torch.ops.qstats.add_masked_grams.default, (torch.zeros(1, 2, 4, 4), rows, keep))
    torch.library.opcheck(torch.ops.qstats.warn_unfactored_hessian.default, (torch.tensor([False]), "w", 0))


def test_every_qstats_op_is_pt2_compliant():
    """torch.compile(fullgraph=True) of an update under only_allow_pt2_compliant_ops (custom_op's ops
    carry the tag; an op defined without it is refused there)."""
    names = [name for name in dir(torch.ops.qstats) if not name.startswith("_")]
    assert {"finite_aminmax", "require", "require_calibrated", "bucket_counts", "error_sum"} <= set(names)
    for name in names:
        packet = getattr(torch.ops.qstats, name)
        if hasattr(packet, "default"):
            assert torch.Tag.pt2_compliant_tag in packet.default.tags, name
    spec = qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0))
    obs = qstats.minmax(spec)
    x = torch.randn(4, 8)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(only_allow_pt2_compliant_ops=True):
        got = torch.compile(obs.update, fullgraph=True)(obs.init(x), x)
    assert torch.equal(got.max_val, x.amax(dim=1)) and torch.equal(got.min_val, x.amin(dim=1))


def test_a_reloaded_module_defines_its_ops_again():
    """importlib.reload (a notebook's autoreload) of a module defining qstats ops: the op works after,
    equal to torch's own reduction."""
    import importlib

    import qstats._checks
    import qstats._reductions

    importlib.reload(qstats._reductions)
    importlib.reload(qstats._checks)
    x = torch.randn(6, 5)
    lo, hi, count, nonfinite = qstats._reductions.finite_aminmax(x.reshape(1, -1))
    assert torch.equal(lo, x.amin()) and torch.equal(hi, x.amax()) and int(count) == 30
    vmapped = torch.vmap(lambda v: qstats._reductions.finite_aminmax(v.reshape(1, -1))[1])(x)
    assert torch.equal(vmapped, x.amax(dim=1).reshape(6))


@pytest.mark.parametrize("factory", [qstats.minmax, qstats.memoryless_minmax, qstats.moving_average_minmax, qstats.mse])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_float8_inputs_observe_as_their_float32_values(factory, dtype):
    """float8 inputs crashed (ATen has no float8 aminmax); their values are float32 values exactly."""
    spec = qstats.QuantSpec(granularity=qstats.PerAxis(0))
    obs = factory(spec)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0)).to(dtype)
    got = obs.update(obs.init(x), x)
    expected = obs.update(obs.init(x.float()), x.float())
    for name, a, b in zip(got._fields, got, expected):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("factory", [qstats.minmax, qstats.memoryless_minmax, qstats.mse])
def test_float64_values_past_float32_count_as_nonfinite(factory):
    """The extremes are float32: a float64 value past its range became an Inf extreme, counted as
    finite, and the state read as uncalibrated. It is now left out and counted, as an Inf is."""
    x = torch.tensor([[1e300, -2.0, 1.0], [0.5, -1e300, 0.25]], dtype=torch.float64)
    lo, hi, count, bad = finite_aminmax(x.reshape(1, -1))
    assert (lo.item(), hi.item(), count.item(), bad.item()) == (-2.0, 1.0, 4, 2)
    spec = qstats.QuantSpec(dtype="int8", mapping="asymmetric")
    obs = factory(spec)
    state = obs.update(obs.init(x), x)
    clean = x[x.abs() < 1e30]
    expected = qstats.minmax(spec).update(qstats.minmax(spec).init(clean), clean)
    assert state.min_val.item() == -2.0 and state.max_val.item() == 1.0
    if factory is qstats.minmax:
        qp, want = qstats.compute_qparams(state, spec), qstats.compute_qparams(expected, spec)
        assert torch.equal(qp.scale, want.scale) and state.nonfinite.item() == 2
    with pytest.raises(ValueError, match="non-finite"):
        strict = factory(qstats.QuantSpec(dtype="int8", nonfinite="raise"))
        strict.update(strict.init(x), x)


def test_a_view_of_fewer_than_two_dims_is_refused_naming_its_shape():
    """A 1-d tensor is its own observation and group dimension: three values were counted nine
    times ``(count 9)``, or, with a NaN, failed in count_nonzero on a repeated dim."""
    for values in ([1.0, 2.0, 3.0], [1.0, float("nan"), 3.0], 2.0):
        with pytest.raises(ValueError, match=r"canonical view.*got shape \((3,)?\)"):
            finite_aminmax(torch.tensor(values))
    # the same values as a per-tensor canonical view: 3 finite values, counted once
    lo, hi, count, bad = finite_aminmax(torch.tensor([[1.0, float("nan"), 3.0]]))
    assert (lo.item(), hi.item(), count.item(), bad.item()) == (1.0, 3.0, 2, 1)
