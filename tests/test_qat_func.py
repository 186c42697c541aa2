"""QAT in hand-written torch.func training loops: grad / vmap / compile over `qat.apply`,
observer states and learned ranges threaded through as pure values.

References: torch.ao's ``FakeQuantize`` modules and torch's learnable fake-quant kernels
(``_fake_quantize_learnable_per_tensor_affine`` / ``_per_channel_affine``) in eager per-model
loops, ``nn.BatchNorm2d``, a plain-torch straight-through estimator, and eager execution.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.ao.quantization import FakeQuantize, MovingAverageMinMaxObserver, MovingAveragePerChannelMinMaxObserver
from torch.utils._pytree import tree_leaves, tree_map

import qstats
from qstats import LSQParams, QATPhase, QATSchedule

A_SPEC = qstats.QuantSpec.from_torch_ao(torch.quint8, torch.per_tensor_affine)
W_SPEC = qstats.QuantSpec.from_torch_ao(torch.qint8, torch.per_channel_symmetric, ch_axis=0)


def _mlp():
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def _prepare(model, ste="clipped", weight=None):
    return qstats.qat.prepare(model, weight or qstats.moving_average_minmax(W_SPEC, 0.1),
                              qstats.moving_average_minmax(A_SPEC, 0.1), ste=ste)


class _TorchAo(nn.Module):
    """The `_mlp` network with torch.ao FakeQuantize modules at the points qstats fake-quantizes."""

    def __init__(self, mlp):
        super().__init__()
        self.mlp = mlp
        self.acts = nn.ModuleList(FakeQuantize(observer=MovingAverageMinMaxObserver, quant_min=0, quant_max=255,
                                               dtype=torch.quint8, qscheme=torch.per_tensor_affine,
                                               averaging_constant=0.1) for _ in range(2))
        self.weights = nn.ModuleList(FakeQuantize(
            observer=MovingAveragePerChannelMinMaxObserver, quant_min=-128, quant_max=127, dtype=torch.qint8,
            qscheme=torch.per_channel_symmetric, ch_axis=0, averaging_constant=0.1) for _ in range(2))

    def toggle(self, phase):
        for fq in (*self.acts, *self.weights):
            fq.enable_observer(phase.observe)
            fq.enable_fake_quant(phase.fake_quantize)

    def forward(self, x):
        h = F.relu(F.linear(self.acts[0](x), self.weights[0](self.mlp[0].weight), self.mlp[0].bias))
        return F.linear(self.acts[1](h), self.weights[1](self.mlp[2].weight), self.mlp[2].bias)


def _params(model):
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _assert_trees_close(a, b, **tolerances):
    for x, y in zip(tree_leaves(a), tree_leaves(b), strict=True):
        torch.testing.assert_close(x, y, **tolerances)


def test_vmap_of_grad_over_an_ensemble_matches_torch_ao_modules_per_model():
    """An ensemble (stacked params, stacked states) trained with one vmapped grad step per step,
    against each model trained eagerly with torch.ao FakeQuantize modules and autograd."""
    torch.manual_seed(0)
    models = [_mlp() for _ in range(3)]
    references = [_TorchAo(_mlp()) for _ in models]
    for model, reference in zip(models, references):
        reference.mlp.load_state_dict(model.state_dict())
    qat = _prepare(models[0])
    g = torch.Generator().manual_seed(1)
    params, _ = torch.func.stack_module_state(models)
    params = {k: v.detach() for k, v in params.items()}
    state = tree_map(lambda *t: torch.stack(t), *[qat.init(torch.zeros(1, 6))] * 3)

    def loss_fn(p, s, x, y, phase):
        out, new_state = qat.apply(p, s, x, phase=phase)
        return F.cross_entropy(out, y), (out, new_state)

    step_fn = torch.func.vmap(torch.func.grad(loss_fn, has_aux=True), in_dims=(0, 0, 0, 0, None))
    schedule = QATSchedule(observe_at=0, fake_quantize_at=1, freeze_ranges_at=3)
    for step in range(5):
        x = torch.randn(3, 7, 6, generator=g) * (1 + step)
        y = torch.randint(0, 3, (3, 7), generator=g)
        grads, (out, state) = step_fn(params, state, x, y, schedule(step))
        for i, reference in enumerate(references):
            reference.toggle(schedule(step))
            reference.zero_grad()
            expected = reference(x[i])
            F.cross_entropy(expected, y[i]).backward()
            torch.testing.assert_close(out[i], expected, rtol=1e-6, atol=1e-6)
            for name, grad in grads.items():
                torch.testing.assert_close(grad[i], reference.mlp.get_parameter(name).grad, rtol=1e-5, atol=1e-6)
            with torch.no_grad():
                for p in reference.mlp.parameters():
                    p -= 0.1 * p.grad
        params = {k: v - 0.1 * grads[k] for k, v in params.items()}


def _torch_learnable_forward(params, ranges, x):
    """The `_mlp` forward through torch's learnable fake-quant kernels (LSQ's reference)."""
    h = x
    for name in ("0", "2"):
        if name == "2":
            h = F.relu(h)
        scale, zero_point = ranges["activations"][name]
        h = torch._fake_quantize_learnable_per_tensor_affine(
            h, scale.reshape(1), zero_point.reshape(1), 0, 255, 1 / math.sqrt(h.numel() * 255))
        w = params[f"{name}.weight"]
        w_scale, w_zero_point = ranges["weights"][name]
        w = torch._fake_quantize_learnable_per_channel_affine(
            w, w_scale, w_zero_point, 0, -128, 127, 1 / math.sqrt(w.numel() * 127))
        h = F.linear(h, w, params[f"{name}.bias"])
    return h


def test_lsq_training_loop_matches_torch_learnable_kernels():
    """Weights, weight scales, activation scales and zero points trained together over several
    steps with torch.func.grad: outputs and every gradient equal torch's learnable kernels."""
    torch.manual_seed(0)
    model = _mlp()
    qat = qstats.qat.prepare(model, qstats.minmax(W_SPEC), qstats.minmax(A_SPEC))
    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(16, 6, generator=g) * 2
    state = qat.apply(qat.params(), qat.init(x0), x0, phase=QATPhase(True, False))[1]
    params = _params(model)
    ranges = tree_map(lambda t: t.detach(), qat.learnable_ranges(state, weights=True))
    ref_params = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    ref_ranges = tree_map(lambda t: t.clone().requires_grad_(True), ranges)

    def loss_fn(p, r, x, y):
        out, _ = qat.apply(p, state, x, phase=QATPhase(False, True), ranges=r)
        return F.cross_entropy(out, y), out

    grad_fn = torch.func.grad(loss_fn, argnums=(0, 1), has_aux=True)
    for _ in range(5):
        x = torch.randn(16, 6, generator=g) * 2
        y = torch.randint(0, 3, (16,), generator=g)
        (grads, range_grads), out = grad_fn(params, ranges, x, y)
        expected = _torch_learnable_forward(ref_params, ref_ranges, x)
        F.cross_entropy(expected, y).backward()
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref_params[name].grad, rtol=1e-5, atol=1e-6)
        for kind in ("weights", "activations"):
            for name, (scale_grad, zero_point_grad) in range_grads[kind].items():
                reference = ref_ranges[kind][name]
                torch.testing.assert_close(scale_grad, reference.scale.grad.reshape(scale_grad.shape),
                                           rtol=1e-4, atol=1e-6)
                if kind == "activations":  # symmetric weights keep their zero point fixed
                    torch.testing.assert_close(zero_point_grad, reference.zero_point.grad.reshape(()),
                                               rtol=1e-4, atol=1e-6)
        with torch.no_grad():  # SGD; the weights' zero points stay 0
            params = {k: v - 0.05 * grads[k] for k, v in params.items()}
            ranges = {kind: {name: LSQParams(r.scale - 1e-3 * range_grads[kind][name].scale,
                                             r.zero_point - (kind == "activations") * range_grads[kind][name].zero_point)
                             for name, r in given.items()} for kind, given in ranges.items()}
            for k, p in ref_params.items():
                p -= 0.05 * p.grad
                p.grad = None
            for kind, given in ref_ranges.items():
                for r in given.values():
                    r.scale.sub_(1e-3 * r.scale.grad)
                    if kind == "activations":
                        r.zero_point.sub_(r.zero_point.grad)
                    r.scale.grad = r.zero_point.grad = None


def test_per_expert_qparams_under_vmap_and_compile_match_torch_ao_per_expert():
    """Per-expert weights with per-expert observer states (and per-expert LSQ ranges), vmapped
    and compiled, against one torch.ao FakeQuantize (one learnable kernel call) per expert."""
    experts = 4
    g = torch.Generator().manual_seed(0)
    observer = qstats.moving_average_minmax(W_SPEC, 0.1)
    states = torch.func.vmap(observer.init)(torch.zeros(experts, 5, 7))
    references = [FakeQuantize(observer=MovingAveragePerChannelMinMaxObserver, quant_min=-128, quant_max=127,
                               dtype=torch.qint8, qscheme=torch.per_channel_symmetric, ch_axis=0,
                               averaging_constant=0.1) for _ in range(experts)]

    def loss(w, s, dy):
        y, new_state = qstats.observe_fake_quantize(w, s, observer, QATPhase(True, True))
        return (y * dy).sum(), (y, new_state)

    eager = torch.func.vmap(torch.func.grad(loss, has_aux=True))
    compiled = torch.compile(eager, fullgraph=True, backend="aot_eager")
    for step in range(3):
        w = torch.randn(experts, 5, 7, generator=g) * (1 + step)
        dy = torch.randn(experts, 5, 7, generator=g)
        grads, (y, new_states) = eager(w, states, dy)
        _assert_trees_close(compiled(w, states, dy), (grads, (y, new_states)), rtol=0, atol=0)
        states = new_states
        for e, reference in enumerate(references):
            we = w[e].clone().requires_grad_(True)
            ye = reference(we)
            (ye * dy[e]).sum().backward()
            assert torch.equal(y[e], ye) and torch.equal(grads[e], we.grad)

    ranges = torch.func.vmap(lambda s: qstats.lsq_init(s, W_SPEC))(states)

    def lsq_loss(w, scale, zero_point, dy):
        return (qstats.lsq_fake_quantize(w, LSQParams(scale, zero_point), W_SPEC) * dy).sum()

    lsq_eager = torch.func.vmap(torch.func.grad(lsq_loss, argnums=(0, 1)))
    lsq_compiled = torch.compile(lsq_eager, fullgraph=True, backend="aot_eager")
    w = torch.randn(experts, 5, 7, generator=g) * 3
    dy = torch.randn(experts, 5, 7, generator=g)
    for w_grad, scale_grad in (lsq_eager(w, *ranges, dy), lsq_compiled(w, *ranges, dy)):
        for e in range(experts):
            we = w[e].clone().requires_grad_(True)
            scale = ranges.scale[e].clone().requires_grad_(True)
            out = torch._fake_quantize_learnable_per_channel_affine(
                we, scale, ranges.zero_point[e], 0, -128, 127, 1 / math.sqrt(we.numel() * 127))
            (out * dy[e]).sum().backward()
            assert torch.equal(w_grad[e], we.grad)
            torch.testing.assert_close(scale_grad[e], scale.grad, rtol=1e-5, atol=1e-6)


def test_compiled_functional_training_step_with_lsq_and_batchnorm_matches_eager():
    """The whole step (grad, SGD on params and learned ranges, new state) compiled fullgraph with a
    tensor step, an empty batch and a cumulative batch norm among the steps, equals eager."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4, momentum=None), nn.ReLU(), nn.Flatten(),
                          nn.Linear(4 * 16, 3))
    qat = _prepare(model)
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(6, 1, 6, 6, generator=g)
    state = qat.apply(qat.params(), qat.init(x0), x0, phase=QATPhase(True, False))[1]
    ranges = tree_map(lambda t: t.detach(), qat.learnable_ranges(state))
    schedule = QATSchedule(0, 1, 4, 6)

    def train_step(params, ranges, state, x, y, step):
        def loss(p, r):
            out, new_state = qat.apply(p, state, x, phase=schedule(step), ranges=r)
            return F.cross_entropy(out, y) if out.shape[0] else out.sum(), new_state

        (grads, range_grads), new_state = torch.func.grad(loss, argnums=(0, 1), has_aux=True)(params, ranges)
        params = {k: v - 0.1 * grads[k] for k, v in params.items()}
        return params, tree_map(lambda v, d: v - 1e-3 * d, ranges, range_grads), new_state

    compiled = torch.compile(train_step, fullgraph=True, backend="aot_eager")
    eager_values = compiled_values = (_params(model), ranges, state)
    for step in range(7):
        n = 0 if step == 2 else 6
        x, y = torch.randn(n, 1, 6, 6, generator=g), torch.randint(0, 3, (n,), generator=g)
        eager_values = train_step(*eager_values, x, y, torch.tensor(step))
        compiled_values = compiled(*compiled_values, x, y, torch.tensor(step))
        _assert_trees_close(compiled_values, eager_values, rtol=1e-6, atol=1e-7)
    assert all(torch.isfinite(t).all() for t in tree_leaves(eager_values))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("momentum", [0.1, None])
def test_batchnorm_statistics_with_empty_batches_match_nn_batchnorm(momentum, dtype):
    """nn.BatchNorm counts an empty batch and keeps its statistics; qstats' statistics became NaN
    (the mean and variance of no values), poisoning every later step. A float64 model's statistics
    are computed in float64 (they were rounded through float32)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4, momentum=momentum), nn.Flatten(),
                          nn.Linear(64, 3)).to(dtype)
    qat = _prepare(model)
    reference = nn.BatchNorm2d(4, momentum=momentum).to(dtype).train()
    reference.load_state_dict(model[1].state_dict())
    params = _params(model)
    state = qat.init(torch.zeros(1, 1, 6, 6, dtype=dtype))
    g = torch.Generator().manual_seed(1)
    tolerance = 1e-12 if dtype == torch.float64 else 1e-6
    for n in (5, 0, 4, 0, 3):
        x = (torch.randn(n, 1, 6, 6, generator=g) * 3 + 1).to(dtype)
        out, state = qat.apply(params, state, x, phase=QATPhase(True, False))
        assert out.shape == (n, 3)
        with torch.no_grad():
            reference(model[0](x))
        expected = qstats.qat.BatchNormState(reference.running_mean, reference.running_var,
                                             reference.num_batches_tracked)
        _assert_trees_close(state.batchnorm["1"], expected, rtol=tolerance, atol=tolerance)


def test_empty_batch_leaves_observer_states_and_sends_no_gradient():
    torch.manual_seed(0)
    model = _mlp()
    qat = _prepare(model)
    params = _params(model)
    x = torch.randn(5, 6)
    state = qat.apply(params, qat.init(x), x, phase=QATPhase(True, False))[1]

    def loss(p):
        out, new_state = qat.apply(p, state, torch.empty(0, 6), phase=QATPhase(True, True))
        return out.sum(), new_state

    grads, new_state = torch.func.grad(loss, has_aux=True)(params)
    _assert_trees_close(new_state.activations, state.activations, rtol=0, atol=0)
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads.values())


def test_bf16_autocast_training_matches_torch_ao_modules():
    torch.manual_seed(0)
    model = _mlp()
    reference = _TorchAo(_mlp())
    reference.mlp.load_state_dict(model.state_dict())
    qat = _prepare(model)
    params, state = _params(model), qat.init(torch.zeros(1, 6))
    g = torch.Generator().manual_seed(2)

    def loss_fn(p, s, x, y, phase):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, new_state = qat.apply(p, s, x, phase=phase)
        return F.cross_entropy(out.float(), y), (out, new_state)

    grad_fn = torch.func.grad(loss_fn, has_aux=True)
    schedule = QATSchedule(observe_at=0, fake_quantize_at=1, freeze_ranges_at=3)
    for step in range(5):
        x, y = torch.randn(5, 6, generator=g) * 2, torch.randint(0, 3, (5,), generator=g)
        reference.toggle(schedule(step))
        reference.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected = reference(x)
        F.cross_entropy(expected.float(), y).backward()
        grads, (out, state) = grad_fn(params, state, x, y, schedule(step))
        assert out.dtype == expected.dtype == torch.bfloat16 and torch.equal(out, expected)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, reference.mlp.get_parameter(name).grad, rtol=1e-5, atol=1e-6)
        with torch.no_grad():
            for p in reference.mlp.parameters():
                p -= 0.1 * p.grad
        params = {k: v - 0.1 * grads[k] for k, v in params.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_input_gradient_at_clipping_boundaries_matches_torch(dtype):
    """Values exactly at, just inside and just outside the clipping edges (half codes included):
    the straight-through mask and LSQ's input and range gradients equal torch's kernels."""
    observer = qstats.minmax(A_SPEC)
    calibration = torch.tensor([-1.0, 3.0])
    state = observer.update(observer.init(calibration), calibration)
    qp = qstats.compute_qparams(state, A_SPEC)
    scale, zero_point = qp.scale.item(), int(qp.zero_point)
    codes = torch.tensor([-1.0, -0.51, -0.5, -0.49, 0.0, 255.0, 255.49, 255.5, 255.51, 256.0, 300.0], dtype=torch.float64)
    x = ((codes - zero_point) * scale).to(dtype)
    x = torch.cat([x, x.nextafter(torch.tensor(math.inf, dtype=dtype)), x.nextafter(torch.tensor(-math.inf, dtype=dtype))])

    ours = x.clone().requires_grad_(True)
    y, _ = qstats.observe_fake_quantize(ours, state, observer, QATPhase(False, True))
    y.sum().backward()
    theirs = x.float().clone().requires_grad_(True)  # torch's kernel in float32, the arithmetic qstats uses
    expected = torch.fake_quantize_per_tensor_affine(theirs, scale, zero_point, 0, 255)
    expected.sum().backward()
    assert torch.equal(y, expected.to(dtype)) and torch.equal(ours.grad.float(), theirs.grad)

    ours = x.clone().requires_grad_(True)
    params = LSQParams(torch.tensor(scale, requires_grad=True), torch.tensor(float(zero_point), requires_grad=True))
    qstats.lsq_fake_quantize(ours, params, A_SPEC).sum().backward()
    theirs = x.float().clone().requires_grad_(True)
    ref_scale, ref_zero_point = (torch.tensor([v], requires_grad=True) for v in (scale, float(zero_point)))
    torch._fake_quantize_learnable_per_tensor_affine(
        theirs, ref_scale, ref_zero_point, 0, 255, 1 / math.sqrt(x.numel() * 255)).sum().backward()
    assert torch.equal(ours.grad.float(), theirs.grad)
    torch.testing.assert_close(params.scale.grad, ref_scale.grad.reshape(()), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(params.zero_point.grad, ref_zero_point.grad.reshape(()), rtol=1e-5, atol=1e-6)


def _plain_ste_forward(params, state, x, ste):
    """The `_mlp` forward with fixed qparams from ``state`` and a hand-written straight-through
    estimator around torch's fake-quant ops."""
    def fq(t, qp, spec):
        if spec.granularity == qstats.PerTensor():
            value = torch.fake_quantize_per_tensor_affine(t.detach(), qp.scale.item(), int(qp.zero_point), 0, 255)
            codes = torch.round(t * (1 / qp.scale)) + qp.zero_point
        else:
            value = torch.fake_quantize_per_channel_affine(t.detach(), qp.scale, qp.zero_point, 0, -128, 127)
            codes = torch.round(t * (1 / qp.scale[:, None]))
        lo, hi = spec.qrange
        mask = torch.ones_like(t) if ste == "identity" else ((codes >= lo) & (codes <= hi)).float()
        return value + mask * (t - t.detach())

    h = x
    for name in ("0", "2"):
        if name == "2":
            h = F.relu(h)
        h = fq(h, qstats.compute_qparams(state.activations[name], A_SPEC), A_SPEC)
        w = fq(params[f"{name}.weight"], qstats.compute_qparams(state.weights[name], W_SPEC), W_SPEC)
        h = F.linear(h, w, params[f"{name}.bias"])
    return h


@pytest.mark.parametrize("ste", ["clipped", "identity"])
def test_straight_through_gradients_match_a_plain_torch_estimator(ste):
    torch.manual_seed(0)
    model = _mlp()
    qat = _prepare(model, ste=ste, weight=qstats.minmax(W_SPEC))
    params = _params(model)
    calibration = torch.randn(16, 6)  # narrow ranges, so that the batch below clips
    state = qat.apply(params, qat.init(calibration), calibration, phase=QATPhase(True, False))[1]
    x = torch.randn(16, 6) * 4
    grads = torch.func.grad(lambda p: qat.apply(p, state, x, phase=QATPhase(False, True))[0].pow(2).sum())(params)
    reference = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    _plain_ste_forward(reference, state, x, ste).pow(2).sum().backward()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, reference[name].grad, rtol=1e-5, atol=1e-5)


def test_observer_updates_under_no_grad_equal_those_of_a_grad_step():
    torch.manual_seed(0)
    model = _mlp()
    qat = _prepare(model)
    params = {k: v.requires_grad_(True) for k, v in _params(model).items()}
    x = torch.randn(5, 6)
    state = qat.apply(params, qat.init(x), x, phase=QATPhase(True, False))[1]
    with torch.no_grad():
        out, observed = qat.apply(params, state, x * 3, phase=QATPhase(True, True))
    assert not out.requires_grad
    grad_out, grad_observed = qat.apply(params, state, x * 3, phase=QATPhase(True, True))
    assert grad_out.requires_grad and torch.equal(out, grad_out)
    _assert_trees_close(observed, grad_observed, rtol=0, atol=0)
    assert not any(t.requires_grad for t in tree_leaves(grad_observed))


def test_forward_mode_tangent_equals_the_reverse_mode_straight_through_gradient():
    observer = qstats.minmax(A_SPEC)
    calibration = torch.tensor([-1.0, 3.0])
    state = observer.update(observer.init(calibration), calibration)
    x = torch.tensor([-2.0, -0.5, 0.3, 1.0, 2.9, 5.0])

    def f(t):
        return qstats.observe_fake_quantize(t, state, observer, QATPhase(False, True))[0]

    reverse = torch.func.jacrev(f)(x).diagonal()
    assert torch.equal(reverse, torch.tensor([0.0, 1, 1, 1, 1, 0]))
    assert torch.equal(torch.func.jvp(f, (x,), (torch.ones_like(x),))[1], reverse)
