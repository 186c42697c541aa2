"""torch.compile and torch.vmap of the public API, angles the contract suite leaves out: compiled
updates over batches of changing length (0 and 1 rows included) for every observer of
tests/observer_cases.py, compiled stacked observers (the stride-0 shared-activation path too),
compiled `stacked_qparams` and vmapped `fake_quantize`, `vmap(init)`, stacked updates in bf16/fp16
with an expert that gets no rows, and the straight-through gradient of a vmapped `fake_quantize`
(torch's fake-quant op is the reference). Compiled with backend="eager" (dynamo's tracing, cheap):
inductor's numerics are `check_compile`'s (tests/test_contract.py)."""

import dataclasses

import pytest
import torch
import torch._dynamo
from observer_cases import CASES

import qstats
from qstats import tree as qtree
from qstats.testing import assert_states_equal

# observers whose state is shaped by the rows (per-axis 0, groups, blocks, tokens) refuse other lengths
_ROWS_FREE = [c for c in CASES if not any(k in c[0] for k in ("axis0", "group", "block", "mx", "token"))]


def _ids(cases):
    return [c[0] for c in cases]


@pytest.mark.parametrize("case", _ROWS_FREE, ids=_ids(_ROWS_FREE))
def test_compiled_update_over_changing_batch_lengths_equals_eager(case):
    """dynamic=True: dynamo specialises 0- and 1-row batches and generalises the others; every
    length, weighted (an all-zero weight too) or not, gives the eager state."""
    name, factory, make_x, *_ = case
    torch._dynamo.reset()
    obs = factory()
    g = torch.Generator().manual_seed(0)
    x0 = make_x(g)
    compiled = torch.compile(obs.update, fullgraph=True, backend="eager", dynamic=True)
    state = obs.update(obs.init(x0), x0)
    for rows in (0, 1, 2, 5, 12):
        x = torch.randn((rows,) + tuple(x0.shape[1:]), generator=g) * 3
        assert_states_equal(compiled(state, x), obs.update(state, x), message=f"{name}: {rows} rows")
        weight = (torch.arange(rows) % 2).float()
        assert_states_equal(compiled(state, x, weight), obs.update(state, x, weight),
                            message=f"{name}: {rows} rows, weighted")
        zero = torch.zeros(rows)
        assert_states_equal(compiled(state, x, zero), obs.update(state, x, zero),
                            message=f"{name}: {rows} rows, zero weight")


@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_vmap_of_init_equals_the_loop(case):
    name, factory, make_x, *_ = case
    obs = factory()
    g = torch.Generator().manual_seed(1)
    xs = torch.stack([make_x(g) for _ in range(3)])
    assert_states_equal(torch.vmap(obs.init)(xs), qtree.stack([obs.init(x) for x in xs]), message=name)


def _fallback(spec):
    return dataclasses.replace(spec, on_uncalibrated="fallback")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_stacked_half_precision_with_an_unrouted_expert_equals_the_loop(case, dtype):
    """Expert 1 gets no rows: its state is the loop's, its qparams the fallback, flagged uncalibrated
    (fixed qparams are calibrated without data),
    and `fake_quantize` vmapped over the experts is the per-expert one."""
    name, factory, make_x, *_ = case
    obs = factory()
    g = torch.Generator().manual_seed(2)
    xs = torch.stack([make_x(g) for _ in range(3)]).to(dtype)
    mask = (torch.rand(3, xs.shape[1], generator=g) > 0.5).float()
    mask[1] = 0
    stacked = qstats.stacked_observer(obs, 3)
    got = stacked.update(stacked.init(xs), xs, mask)
    assert_states_equal(got, qtree.stack([obs.update(obs.init(x), x, m) for x, m in zip(xs, mask)]), message=name)
    shared = xs[0].expand(3, *xs[0].shape)
    assert_states_equal(stacked.update(stacked.init(shared), shared, mask),
                        qtree.stack([obs.update(obs.init(xs[0]), xs[0], m) for m in mask]), message=f"{name}: shared")
    spec = obs.spec
    if spec is None or not hasattr(spec, "on_uncalibrated") or "imatrix" == name or "hessian" == name:
        return
    if name in ("placeholder", "noop", "recording"):
        return
    qparams = qstats.stacked_qparams(got, spec)
    looped = [qstats.compute_qparams(s, _fallback(spec)) for s in qtree.unstack(got)]
    assert_states_equal(qparams, qtree.stack(looped), message=f"{name}: qparams")
    if not name.startswith("fixed_qparams"):  # fixed qparams need no data
        assert not bool(qparams.calibrated[1].any())
    quantized = torch.vmap(lambda x, qp: qstats.fake_quantize(x, qp, spec))(xs, qparams)
    assert torch.equal(quantized, torch.stack([qstats.fake_quantize(x, qp, spec) for x, qp in zip(xs, looped)]))


_SPECS = {
    "int8": qstats.QuantSpec(),
    "uint8-asym-axis0": qstats.QuantSpec(dtype="uint8", mapping="asymmetric", granularity=qstats.PerAxis(0)),
    "int4-group16": qstats.QuantSpec(dtype="int4", granularity=qstats.PerGroup(16)),
    "fp8": qstats.QuantSpec(dtype="fp8_e4m3fn"),
    "nvfp4": qstats.preset("nvfp4"),
    "mxfp4": qstats.preset("mxfp4"),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("key", list(_SPECS))
def test_compiled_stacked_observer_qparams_and_fake_quantize_equal_eager(key, dtype):
    """torch.compile(fullgraph=True) of a stacked update (its own and a shared stride-0 stack under
    a routing mask), of `stacked_qparams` and of a vmapped `fake_quantize`."""
    torch._dynamo.reset()
    spec = _SPECS[key]
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(8, 64, generator=g) * 3).to(dtype)
    xs = torch.stack([x, x * 2, x * 0.5])
    stacked = qstats.stacked_observer(qstats.minmax(spec), 3)
    update = torch.compile(stacked.update, fullgraph=True, backend="eager")
    state = stacked.update(stacked.init(xs), xs)
    assert_states_equal(update(stacked.init(xs), xs), state)
    mask = torch.ones(3, 8)
    mask[1, :4] = 0
    shared = x.expand(3, *x.shape)
    assert_states_equal(update(stacked.init(shared), shared, mask), stacked.update(stacked.init(shared), shared, mask))
    qparams = qstats.stacked_qparams(state, spec)
    compiled_qparams = torch.compile(lambda s: qstats.stacked_qparams(s, spec), fullgraph=True, backend="eager")
    assert_states_equal(compiled_qparams(state), qparams)
    quantize = torch.vmap(lambda a, qp: qstats.fake_quantize(a, qp, spec))
    assert torch.equal(torch.compile(quantize, fullgraph=True, backend="eager")(xs, qparams), quantize(xs, qparams))


def _stacked_weight_qparams():
    spec = qstats.QuantSpec(granularity=qstats.PerAxis(0))
    w = torch.randn(3, 4, 8, generator=torch.Generator().manual_seed(4)) * 2
    obs = qstats.stacked_observer(qstats.minmax(spec), 3)
    return spec, w, qstats.stacked_qparams(obs.update(obs.init(w), w), spec)


def _torch_ste_grad(w, qparams, spec):
    """The straight-through gradient of torch's per-channel fake-quant op, expert by expert."""
    qmin, qmax = spec.qrange
    grads = []
    for x, scale, zero_point in zip(w, qparams.scale, qparams.zero_point):
        x = x.detach().clone().requires_grad_(True)
        torch.fake_quantize_per_channel_affine(x, scale, zero_point.int(), 0, qmin, qmax).sum().backward()
        grads.append(x.grad)
    return torch.stack(grads)


def test_gradient_through_vmapped_fake_quantize_is_torch_straight_through():
    """docs/qat.md and fake_quantize's docstring: composes with torch.func.grad and vmap (the gradient
    was 0: requires_grad reads False inside vmap, and the straight-through term was left out)."""
    spec, w, qparams = _stacked_weight_qparams()
    w = w * 1.5  # some values clip: their gradient is 0
    want = _torch_ste_grad(w, qparams, spec)
    assert 0 < want.sum() < want.numel()
    got = torch.func.grad(lambda W: torch.vmap(lambda x, qp: qstats.fake_quantize(x, qp, spec))(W, qparams).sum())(w)
    assert torch.equal(got, want)


def test_backward_through_vmapped_fake_quantize_is_torch_straight_through():
    spec, w, qparams = _stacked_weight_qparams()
    w = (w * 1.5).requires_grad_(True)
    torch.vmap(lambda x, qp: qstats.fake_quantize(x, qp, spec))(w, qparams).sum().backward()
    assert torch.equal(w.grad, _torch_ste_grad(w, qparams, spec))


def test_per_sample_gradient_of_fake_quantize_under_vmap_is_torch_straight_through():
    """vmap(grad(...)) (grad innermost) sees requires_grad and keeps the straight-through term."""
    spec, w, qparams = _stacked_weight_qparams()
    w = w * 1.5
    got = torch.vmap(torch.func.grad(lambda x, qp: qstats.fake_quantize(x, qp, spec).sum()))(w, qparams)
    assert torch.equal(got, _torch_ste_grad(w, qparams, spec))


def _qat_ensemble():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    qat = qstats.qat.prepare(
        model,
        weight_observer=qstats.memoryless_minmax(qstats.QuantSpec("int4", "symmetric", granularity=qstats.PerAxis(0))),
        activation_observer=qstats.moving_average_minmax(qstats.QuantSpec("uint8", "asymmetric"), 0.05),
    )
    params = {name: torch.stack([p.detach(), p.detach() * 0.9]) for name, p in qat.params().items()}
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(5))
    y = x.sum(-1, keepdim=True).sin()
    state = qat.init(x[:1])
    phase = qstats.QATPhase(observe=True, fake_quantize=True)

    def loss_fn(member, state):
        out, new_state = qat.apply(member, state, x, phase=phase)
        return torch.nn.functional.mse_loss(out, y), new_state

    looped = [torch.func.grad(loss_fn, has_aux=True)({n: p[i] for n, p in params.items()}, state)[0] for i in range(2)]
    return loss_fn, params, qtree.stack([state, state]), {n: torch.stack([g[n] for g in looped]) for n in params}


def test_qat_ensemble_per_member_gradients_under_vmap_equal_the_loop():
    loss_fn, params, states, looped = _qat_ensemble()
    grads = torch.vmap(torch.func.grad(loss_fn, has_aux=True))(params, states)[0]
    for name in params:
        torch.testing.assert_close(grads[name], looped[name], rtol=1e-5, atol=1e-7)


def test_qat_ensemble_gradient_of_the_vmapped_step_equals_the_loop():
    """docs/qat.md: a training step works with torch.func.grad and vmap; an ensemble's summed loss."""
    loss_fn, params, states, looped = _qat_ensemble()
    assert looped["0.weight"].abs().sum() > 0
    grads = torch.func.grad(lambda p: torch.vmap(loss_fn)(p, states)[0].sum())(params)
    for name in params:
        torch.testing.assert_close(grads[name], looped[name], rtol=1e-5, atol=1e-7)


def test_float64_input_past_float32_keeps_torchs_fake_quantized_values():
    """The straight-through term of a float64 input is formed in float64: a float32 copy of 1e39 is
    Inf, and Inf - Inf made the output NaN where torch's per-channel fake quant gives the values."""
    spec = qstats.QuantSpec.from_torch_ao(torch.qint8, torch.per_channel_symmetric, False, None, None, 2**-23, 0)
    x = torch.tensor([[1e39, -5e38], [1e30, 3.0]], dtype=torch.float64)
    scale, zero_point = torch.tensor([1e37, 1e37]), torch.zeros(2, dtype=torch.int32)
    obs = qstats.minmax(spec)
    qparams = qstats.compute_qparams(obs.update(obs.init(x), x), spec)._replace(scale=scale, zero_point=zero_point)
    want = torch.fake_quantize_per_channel_affine(x, scale, zero_point, 0, -128, 127)
    assert torch.equal(qstats.fake_quantize(x, qparams, spec), want)


def test_fake_quantize_vmapped_over_experts_differentiates_in_forward_mode_and_around_vmap():
    """fake_quantized's stacked-expert weights vmap fake_quantize over the experts: jvp, and grad of a
    vmap around that, get the straight-through derivative."""
    spec, w, qparams = _stacked_weight_qparams()
    w = w * 1.5
    want = _torch_ste_grad(w, qparams, spec)

    def stacked(v):
        return torch.vmap(lambda x, qp: qstats.fake_quantize(x, qp, spec))(v, qparams)

    assert torch.equal(torch.func.jvp(stacked, (w,), (torch.ones_like(w),))[1], want)
    assert torch.equal(torch.func.grad(lambda v: torch.vmap(stacked)(v).sum())(w[None])[0], want)
