"""The reduction under torch.compile: a decomposition the compiler fuses into one pass must give
exactly what the eager custom op gives (extremes of the finite, unmasked values and both counts)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import qstats
from qstats import _native, _reductions
from qstats._reductions import (
    _finite_aminmax_impl,
    _finite_first_aminmax,
    _traceable_finite_aminmax,
    finite_aminmax,
)


@pytest.fixture(autouse=True)
def _fresh_compile_caches():
    # every observer's update shares one code object; without a reset, the tests together would
    # pass dynamo's recompile limit for it and a fullgraph compile would refuse to run
    torch._dynamo.reset()
    yield


def _assert_same(got, expected):
    for name, a, b in zip(("min", "max", "count", "nonfinite"), got, expected):
        assert a.dtype == b.dtype, name
        assert a.shape == b.shape, name
        assert torch.equal(a, b), (name, a, b)


def _with_nonfinite(x, generator, fraction=0.1):
    pick = torch.rand(x.shape, generator=generator)
    x = torch.where(pick < fraction / 3, torch.nan, x)
    x = torch.where((pick >= fraction / 3) & (pick < 2 * fraction / 3), torch.inf, x)
    return torch.where((pick >= 2 * fraction / 3) & (pick < fraction), -torch.inf, x)


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.integers(0, 5), min_size=3, max_size=4),
    seed=st.integers(0, 2**16),
    masked=st.booleans(),
    nonfinite=st.sampled_from([0.0, 0.2, 1.0]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
)
def test_decomposition_equals_custom_op(shape, seed, masked, nonfinite, dtype):
    generator = torch.Generator().manual_seed(seed)
    view = _with_nonfinite(torch.randn(shape, generator=generator), generator, nonfinite).to(dtype)
    mask = (torch.rand(shape, generator=generator) < 0.6) if masked else None
    _assert_same(_traceable_finite_aminmax(view, mask), _finite_aminmax_impl(view, mask, 0))


# The extremes-first form (compiled, on CPU): plain extremes, the opaque fallback op on "every
# extreme finite"; it must pick either branch exactly.
EXTREMES_FIRST = [pytest.param(_finite_first_aminmax, id="fallback-op")]


@pytest.mark.parametrize("reduction", EXTREMES_FIRST)
@settings(max_examples=40, deadline=None)
@given(
    shape=st.lists(st.integers(0, 5), min_size=3, max_size=4),
    seed=st.integers(0, 2**16),
    nonfinite=st.sampled_from([0.0, 0.05, 1.0]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]),
)
def test_extremes_first_reductions_equal_custom_op(reduction, shape, seed, nonfinite, dtype):
    generator = torch.Generator().manual_seed(seed)
    view = _with_nonfinite(torch.randn(shape, generator=generator), generator, nonfinite).to(dtype)
    _assert_same(reduction(view), _finite_aminmax_impl(view, None, 0))


@pytest.mark.parametrize("reduction", EXTREMES_FIRST)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_extremes_first_reductions_with_a_range_that_overflows(reduction, dtype):
    # both extremes finite, their difference not: the flag sends it down the full path, still exact
    big = torch.finfo(dtype).max
    view = torch.tensor([[[-big, 0.0, big], [1.0, 2.0, 3.0]]], dtype=dtype)
    _assert_same(reduction(view), _finite_aminmax_impl(view, None, 0))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize(
    "granularity", [qstats.PerTensor(), qstats.PerAxis(0), qstats.PerGroup(4)], ids=["tensor", "axis", "group"]
)
def test_compiled_unmasked_update_equals_eager_on_both_branches(backend, granularity):
    obs = qstats.minmax(qstats.QuantSpec(dtype="int8", granularity=granularity))
    compiled = torch.compile(obs.update, fullgraph=True, backend=backend)
    generator = torch.Generator().manual_seed(2)
    clean = torch.randn(6, 8, generator=generator)
    dirty = _with_nonfinite(clean, generator, 0.2)
    state = obs.init(clean)
    for x in (clean, dirty, clean):  # one compiled graph, both branches, in either order
        for a, b in zip(compiled(state, x), obs.update(state, x)):
            assert torch.equal(a, b)


def test_compiled_update_traced_outside_vmap_still_serves_grad():
    # the branch is picked when tracing; a later call under a transform retraces on the full path
    obs = qstats.minmax(qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0)))

    def max_val(w):
        return obs.update(obs.init(w), w).max_val

    compiled = torch.compile(max_val)
    x = torch.randn(4, 6, 5)
    assert torch.equal(compiled(x), max_val(x))
    stacked = torch.randn(3, 4, 6, 5)
    assert torch.equal(torch.vmap(compiled)(stacked), torch.vmap(max_val)(stacked))
    torch.func.grad(lambda w: (compiled(w) * w[:, 0, 0]).sum())(x)  # no error under grad


def test_counts_beyond_float32_exact_range_sum_in_int64():
    # 2**24 + 3 values per parameter: a float32 count would stop at 2**24.
    view = torch.zeros(1, 1, 2**24 + 3)
    view[0, 0, 5] = torch.nan
    got = _traceable_finite_aminmax(view, None)
    assert int(got[2]) == 2**24 + 2 and int(got[3]) == 1
    _assert_same(got, _finite_aminmax_impl(view, None, 0))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_vmapped_experts_equal_eager(backend):
    generator = torch.Generator().manual_seed(0)
    experts = _with_nonfinite(torch.randn(4, 6, 8, generator=generator), generator, 0.1)
    spec = qstats.QuantSpec(dtype="int8", mapping="symmetric", granularity=qstats.PerAxis(0), on_uncalibrated="fallback")
    obs = qstats.minmax(spec)

    def one_expert(w):
        state = obs.update(obs.init(w), w)
        return state, qstats.compute_qparams(state, spec)

    eager = torch.vmap(one_expert)(experts)
    compiled = torch.compile(torch.vmap(one_expert), fullgraph=True, backend=backend)(experts)
    for got, expected in zip(compiled, eager):
        for a, b in zip(got, expected):
            assert torch.equal(a, b)


@pytest.mark.parametrize(
    "backend, granularity",
    [
        ("aot_eager", qstats.PerAxis(0)),
        ("inductor", qstats.PerAxis(0)),
        ("aot_eager", qstats.PerTensor()),
        ("aot_eager", qstats.PerGroup(4)),
    ],
    ids=["aot_eager-axis", "inductor-axis", "aot_eager-tensor", "aot_eager-group"],
)
@pytest.mark.parametrize("dirty", [None, 0, 2], ids=["clean", "first-slice-dirty", "last-slice-dirty"])
def test_compiled_vmap_takes_the_fallback_for_every_slice_when_one_is_not_finite(backend, granularity, dirty):
    # one flag per slice under vmap; the fallback op sees them all and serves every slice
    generator = torch.Generator().manual_seed(3)
    experts = torch.randn(3, 5, 8, generator=generator)
    if dirty is not None:
        experts[dirty] = _with_nonfinite(experts[dirty], generator, 0.3)
    obs = qstats.minmax(qstats.QuantSpec(dtype="int8", granularity=granularity))

    def one_expert(w):
        return obs.update(obs.init(w), w)

    compiled = torch.compile(torch.vmap(one_expert), fullgraph=True, backend=backend)
    expected = [one_expert(w) for w in experts]
    got = compiled(experts)
    for field, values in zip(got._fields, got):
        assert torch.equal(values, torch.stack([getattr(e, field) for e in expected])), field


def test_fallback_op_under_eager_vmap_equals_the_loop():
    generator = torch.Generator().manual_seed(4)
    views = torch.randn(3, 2, 4, 5, generator=generator)
    views[1] = _with_nonfinite(views[1], generator, 0.3)
    got = torch.vmap(_finite_first_aminmax)(views)
    for i, view in enumerate(views):
        _assert_same([t[i] for t in got], _finite_aminmax_impl(view, None, 0))
    # a shared view with a flag per slice: any False flag runs the full reduction for all
    from qstats._reductions import _nonfinite_fallback_op

    shared = torch.vmap(lambda finite: _nonfinite_fallback_op(views[1], finite))(torch.tensor([True, False]))
    for i in range(2):
        _assert_same([t[i] for t in shared], _finite_aminmax_impl(views[1], None, 0))


@pytest.mark.parametrize(
    "granularity", [qstats.PerTensor(), qstats.PerAxis(-1), qstats.PerGroup(4)], ids=["tensor", "axis", "group"]
)
def test_compiled_masked_update_equals_eager(granularity):
    generator = torch.Generator().manual_seed(1)
    x = _with_nonfinite(torch.randn(5, 3, 8, generator=generator), generator, 0.1)
    weight = (torch.rand(5, 3, generator=generator) < 0.5).float()
    obs = qstats.minmax(qstats.QuantSpec(dtype="int8", granularity=granularity))
    state = obs.init(x)
    compiled = torch.compile(obs.update, fullgraph=True, backend="aot_eager")
    for a, b in zip(compiled(state, x, weight), obs.update(state, x, weight)):
        assert torch.equal(a, b)


def test_compiled_raise_policy_still_raises():
    spec = qstats.QuantSpec(dtype="int8", nonfinite="raise")
    obs = qstats.minmax(spec)
    x = torch.tensor([1.0, torch.nan])
    compiled = torch.compile(obs.update, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(obs.init(x), torch.tensor([1.0, 2.0])).max_val, torch.tensor(2.0))
    with pytest.raises(ValueError, match="non-finite"):
        compiled(obs.init(x), x)


def test_eager_and_compiled_public_function_agree_on_empty():
    view = torch.empty(0, 3, 4)
    expected = finite_aminmax(view)
    got = torch.compile(finite_aminmax, fullgraph=True, backend="aot_eager")(view)
    _assert_same(got, expected)


def test_custom_ops_pass_opcheck():
    # fake kernels, strides, aliasing and the vmap rule of every qstats custom op
    g = torch.Generator().manual_seed(0)
    for view in (torch.randn(3, 4, 5, generator=g), torch.randn(1, 200, 3, generator=g)):
        for mask in (None, torch.rand(view.shape, generator=g) < 0.5):
            torch.library.opcheck(torch.ops.qstats.finite_aminmax.default, (view, mask, 0))
        for finite in (True, False):
            torch.library.opcheck(torch.ops.qstats.nonfinite_fallback.default, (view, torch.tensor(finite)))
    for view in (torch.randn(1, 1024, 96, generator=g), torch.randn(1, 30, 5, generator=g)):  # native, ATen
        for dtype in (torch.float32, torch.bfloat16):
            torch.library.opcheck(torch.ops.qstats.row_extremes.default, (view.to(dtype),))
    for params in (3, 4096):  # full-resolution and folded bucket layouts
        view = torch.randn(2, params, 3, generator=g)
        torch.library.opcheck(torch.ops.qstats.float_bucket_counts.default, (view, None, 7, -24, 24))
        torch.library.opcheck(torch.ops.qstats.float_bucket_counts_extremes.default, (view, 7, -24, 24))


@pytest.mark.parametrize("granularity", [qstats.PerTensor(), qstats.PerAxis(0)], ids=["tensor", "axis"])
def test_compiled_raise_policy_per_granularity(granularity):
    obs = qstats.minmax(qstats.QuantSpec(dtype="int8", granularity=granularity, nonfinite="raise"))
    x = torch.randn(4, 8)
    compiled = torch.compile(obs.update, fullgraph=True)
    for a, b in zip(compiled(obs.init(x), x), obs.update(obs.init(x), x)):
        assert torch.equal(a, b)


def test_compiled_histogram_update_with_many_parameters():
    obs = qstats.histogram(qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0)))
    w = torch.randn(256, 16)
    compiled = torch.compile(obs.update, fullgraph=True)
    for a, b in zip(compiled(obs.init(w), w), obs.update(obs.init(w), w)):
        assert torch.equal(a, b)


@pytest.mark.skipif(not _native.available(), reason="no C++ compiler: the native kernel is not built")
@pytest.mark.parametrize("form", ["vmap", "stacked"])
@pytest.mark.parametrize("dirty", [None, 0, 3], ids=["clean", "first-expert-dirty", "last-expert-dirty"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_compiled_experts_large_enough_for_the_native_op_equal_eager(form, dirty, dtype):
    """Stacks large enough that the compiled update calls the native op (one flag for every
    expert; the full reduction when one is not finite): the same states as the eager loop."""
    generator = torch.Generator().manual_seed(5)
    experts = torch.randn(4, 128, 160, generator=generator)
    if dirty is not None:
        experts[dirty] = _with_nonfinite(experts[dirty], generator, 0.01)
    experts = experts.to(dtype)
    assert _native.applies(experts.reshape(1, 4 * 128, 160))
    obs = qstats.minmax(qstats.QuantSpec(dtype="int8", mapping="symmetric", granularity=qstats.PerAxis(0)))
    if form == "vmap":
        function = torch.vmap(lambda w: obs.update(obs.init(w), w))
    else:
        stacked = qstats.stacked_observer(obs, 4)
        function = lambda w: stacked.update(stacked.init(w), w)  # noqa: E731
    calls = []
    original = _reductions._row_extremes_op

    def counting(view):
        calls.append(view.shape)
        return original(view)

    _reductions._row_extremes_op = counting
    try:
        got = torch.compile(function, fullgraph=True)(experts)
    finally:
        _reductions._row_extremes_op = original
    assert calls, "the compiled update did not take the native op"
    expected = [obs.update(obs.init(w), w) for w in experts]
    for field, values in zip(got._fields, got):
        assert torch.equal(values, torch.stack([getattr(e, field) for e in expected])), field


def test_assume_constant_result_sets_torchs_own_mark():
    """`qstats._torch_features.assume_constant_result` marks a function as torch's own function
    does (without importing the compiler): the same attributes, the same function returned."""
    from qstats._torch_features import assume_constant_result

    def ours():
        return True

    def torchs():
        return True

    assert torch.compiler.assume_constant_result(torchs) is torchs
    import sys

    loaded = sys.modules.pop("torch._dynamo")  # the path a process takes before the compiler loads
    try:
        assert assume_constant_result(ours) is ours
    finally:
        sys.modules["torch._dynamo"] = loaded
    assert vars(ours) == vars(torchs) and vars(ours)


def test_import_leaves_the_compiler_unloaded_and_compile_still_takes_the_marks():
    """``import qstats`` does not import ``torch._dynamo`` (about two seconds); a compile started
    afterwards still treats the marked functions as constants: a fullgraph compile of an update
    that calls the native op equals eager."""
    import subprocess
    import sys

    script = r"""
import sys
import torch
import qstats
from qstats import _native, _reductions
assert "torch._dynamo" not in sys.modules, "import qstats loaded the compiler"
obs = qstats.minmax(qstats.QuantSpec(dtype="int8", mapping="symmetric", granularity=qstats.PerAxis(0)))
w = torch.randn(512, 256, generator=torch.Generator().manual_seed(0))
calls = []
original = _reductions._row_extremes_op
_reductions._row_extremes_op = lambda view: calls.append(1) or original(view)
got = torch.compile(obs.update, fullgraph=True)(obs.init(w), w)
assert (not _native.available()) or calls, "the compiled update did not take the native op"
for a, b in zip(got, obs.update(obs.init(w), w)):
    assert torch.equal(a, b)
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
