"""Pure QAT: qstats.observe_fake_quantize, qstats.qat.prepare and QATSchedule.

References: torch.ao's ``FakeQuantize`` and ``FusedMovingAvgObsFakeQuantize`` modules (outputs,
gradients, observer ranges, observer/fake-quant toggles), ``nn.BatchNorm2d`` in train and eval
mode, and eager execution for ``torch.func.grad`` / ``vmap`` / ``torch.compile``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.ao.quantization import (
    FakeQuantize,
    FusedMovingAvgObsFakeQuantize,
    MovingAverageMinMaxObserver,
    MovingAveragePerChannelMinMaxObserver,
    PerChannelMinMaxObserver,
)

import qstats
from qstats import QATPhase, QATSchedule

ACT_SPEC = qstats.QuantSpec.from_torch_ao(torch.quint8, torch.per_tensor_affine)
W_SPEC = qstats.QuantSpec.from_torch_ao(torch.qint8, torch.per_channel_symmetric, ch_axis=0)


def _act_fq(fused=False):
    cls = FusedMovingAvgObsFakeQuantize if fused else FakeQuantize
    return cls(observer=MovingAverageMinMaxObserver, quant_min=0, quant_max=255, dtype=torch.quint8,
               qscheme=torch.per_tensor_affine)


def _weight_fq():
    return FakeQuantize(observer=MovingAveragePerChannelMinMaxObserver, quant_min=-128, quant_max=127,
                        dtype=torch.qint8, qscheme=torch.per_channel_symmetric, ch_axis=0)


# ------------------------------------------------------------------------------------------------
# One tensor


@pytest.mark.parametrize("fused", [False, True])
def test_observe_fake_quantize_matches_torch_ao_fake_quantize(fused):
    g = torch.Generator().manual_seed(0)
    reference = _act_fq(fused)
    observer = qstats.moving_average_minmax(ACT_SPEC, 0.01)
    state = observer.init(torch.zeros(3, 5))
    # (observe, fake_quantize) per step; torch.ao toggles its module the same way.
    phases = [(True, False), (True, True), (True, True), (False, True), (False, True)]
    for step, (observe, fq) in enumerate(phases):
        reference.enable_observer(observe)
        reference.enable_fake_quant(fq)
        x = torch.randn(3, 5, generator=g) * (1 + step)
        dy = torch.randn(3, 5, generator=g)
        xr = x.clone().requires_grad_(True)
        yr = reference(xr)
        yr.backward(dy)
        xq = x.clone().requires_grad_(True)
        y, state = qstats.observe_fake_quantize(xq, state, observer, QATPhase(observe, fq))
        y.backward(dy)
        torch.testing.assert_close(y, yr, rtol=0, atol=0)
        torch.testing.assert_close(xq.grad, xr.grad, rtol=0, atol=0)
        qp = qstats.compute_qparams(state, ACT_SPEC)
        scale, zero_point = reference.calculate_qparams()
        torch.testing.assert_close(qp.scale.reshape(-1), scale.reshape(-1), rtol=0, atol=0)
        torch.testing.assert_close(qp.zero_point.reshape(-1), zero_point.reshape(-1).to(torch.int32), rtol=0, atol=0)
    assert bool((xq.grad == 0).any())  # the last step clipped some values (range frozen, x grew)


@pytest.mark.parametrize("fake_quantize", [True, torch.tensor(True)])
def test_observer_without_a_spec_is_refused_clearly_when_fake_quantizing(fake_quantize):
    # imatrix, hessian, noop, recording: no QuantSpec. The error was compute_qparams' "spec must be
    # a QuantSpec, got NoneType", or an AttributeError under a tensor flag
    observer = qstats.imatrix()
    x = torch.randn(4, 6)
    with pytest.raises(TypeError, match="imatrix observer has no QuantSpec"):
        qstats.observe_fake_quantize(x, observer.init(x), observer, QATPhase(True, fake_quantize))
    y, state = qstats.observe_fake_quantize(x, observer.init(x), observer, QATPhase(True, False))  # observing is fine
    assert y is x


def test_straight_through_modes():
    observer = qstats.minmax(qstats.QuantSpec(dtype="int4"))
    ref_x = torch.linspace(-1, 1, 9)
    state = observer.update(observer.init(ref_x), ref_x)
    x = torch.tensor([-3.0, -0.5, 0.2, 0.9, 4.0], requires_grad=True)
    y, _ = qstats.observe_fake_quantize(x, state, observer, QATPhase(False, True), ste="clipped")
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.tensor([0.0, 1.0, 1.0, 1.0, 0.0]))
    x.grad = None
    y2, _ = qstats.observe_fake_quantize(x, state, observer, QATPhase(False, True), ste="identity")
    y2.sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(5))
    torch.testing.assert_close(y2, y)
    with pytest.raises(ValueError, match="ste"):
        qstats.observe_fake_quantize(x, state, observer, QATPhase(), ste="round")


def test_tensor_flags_equal_python_flags():
    g = torch.Generator().manual_seed(1)
    observer = qstats.moving_average_minmax(qstats.QuantSpec("uint4", "asymmetric"), 0.1)
    schedule = QATSchedule(observe_at=1, fake_quantize_at=2, freeze_ranges_at=4)
    s_py = s_t = observer.init(torch.zeros(8))
    for step in range(6):
        x = torch.randn(8, generator=g)
        y_py, s_py = qstats.observe_fake_quantize(x, s_py, observer, schedule(step))
        y_t, s_t = qstats.observe_fake_quantize(x, s_t, observer, schedule(torch.tensor(step)))
        torch.testing.assert_close(y_t, y_py, rtol=0, atol=0)
        for a, b in zip(s_t, s_py):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_vmap_over_stacked_states():
    spec = qstats.QuantSpec("int8")
    observer = qstats.minmax(spec)
    xs = torch.randn(3, 10)
    states = qstats.MinMaxState(*(torch.stack(t) for t in zip(*[observer.init(xs[0])] * 3)))
    phase = QATPhase(True, True)
    ys, new = torch.func.vmap(lambda s, x: qstats.observe_fake_quantize(x, s, observer, phase))(states, xs)
    for i in range(3):
        y, s = qstats.observe_fake_quantize(xs[i], observer.init(xs[i]), observer, phase)
        torch.testing.assert_close(ys[i], y)
        torch.testing.assert_close(new.max_val[i], s.max_val)


def test_uncalibrated_fake_quant_raises_in_eager():
    observer = qstats.minmax(qstats.QuantSpec("int8"))
    x = torch.randn(4)
    with pytest.raises(ValueError, match="uncalibrated"):
        qstats.observe_fake_quantize(x, observer.init(x), observer, QATPhase(observe=False, fake_quantize=True))


# ------------------------------------------------------------------------------------------------
# Whole models


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


class _TorchAoMLP(nn.Module):
    """The same network with torch.ao FakeQuantize modules at the same points."""

    def __init__(self, mlp):
        super().__init__()
        self.mlp = mlp
        self.a1, self.a2 = _act_fq(), _act_fq()
        self.w1, self.w2 = _weight_fq(), _weight_fq()

    def forward(self, x):
        h = F.linear(self.a1(x), self.w1(self.mlp.fc1.weight), self.mlp.fc1.bias)
        return F.linear(self.a2(F.relu(h)), self.w2(self.mlp.fc2.weight), self.mlp.fc2.bias)


def _prepare_mlp(model):
    return qstats.qat.prepare(
        model,
        weight_observer=qstats.moving_average_minmax(W_SPEC, 0.01),
        activation_observer=qstats.moving_average_minmax(ACT_SPEC, 0.01),
    )


def test_model_training_matches_torch_ao_fake_quant_modules():
    torch.manual_seed(0)
    model = _MLP()
    reference = _TorchAoMLP(_MLP())
    reference.mlp.load_state_dict(model.state_dict())
    qat = _prepare_mlp(model)
    g = torch.Generator().manual_seed(2)
    x0 = torch.randn(5, 6, generator=g)
    state = qat.init(x0)
    params = {k: v.detach().clone() for k, v in qat.params().items()}
    schedule = QATSchedule(observe_at=0, fake_quantize_at=1, freeze_ranges_at=3)

    def loss_fn(params, state, x, y, phase):
        out, new_state = qat.apply(params, state, x, phase=phase)
        return F.cross_entropy(out, y), new_state

    grad_fn = torch.func.grad(loss_fn, has_aux=True)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(5):
        x = torch.randn(5, 6, generator=g) * 2
        y = torch.randint(0, 3, (5,), generator=g)
        phase = schedule(step)
        for fq in (reference.a1, reference.a2, reference.w1, reference.w2):
            fq.enable_observer(phase.observe)
            fq.enable_fake_quant(phase.fake_quantize)
        optimizer.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        grads, state = grad_fn(params, state, x, y, phase)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, reference.mlp.get_parameter(name).grad, rtol=1e-5, atol=1e-6, msg=name)
        optimizer.step()
        params = {k: v - 0.1 * grads[k] for k, v in params.items()}
    for key, fq in (("fc1", reference.a1), ("fc2", reference.a2)):
        qp = qstats.compute_qparams(state.activations[key], ACT_SPEC)
        torch.testing.assert_close(qp.scale.reshape(-1), fq.scale.reshape(-1), rtol=1e-6, atol=0)


class _SharedLayerMLP(nn.Module):
    """Calls the same Linear twice (a weight-tied / recurrent block)."""

    def __init__(self):
        super().__init__()
        self.block = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        return self.head(F.relu(self.block(F.relu(self.block(x)))))


def _minmax_weight_fq():
    return FakeQuantize(observer=PerChannelMinMaxObserver, quant_min=-128, quant_max=127, dtype=torch.qint8,
                        qscheme=torch.per_channel_symmetric, ch_axis=0)


def test_layer_called_twice_observes_both_inputs_as_torch_ao():
    # torch.ao: the shared layer's one activation FakeQuantize sees both calls' inputs. qstats used
    # to read the step's input state at each call and keep only the last call's update, so the
    # first input's range was lost (and the layer was listed twice).
    torch.manual_seed(0)
    model = _SharedLayerMLP()
    act_block, act_head = _act_fq(), _act_fq()
    weight_block, weight_head = _minmax_weight_fq(), _minmax_weight_fq()

    def reference(params, x):
        w_block = weight_block(params["block.weight"])
        h = F.linear(act_block(x), w_block, params["block.bias"])
        h = F.linear(act_block(F.relu(h)), w_block, params["block.bias"])
        return F.linear(act_head(F.relu(h)), weight_head(params["head.weight"]), params["head.bias"])

    qat = qstats.qat.prepare(model, weight_observer=qstats.minmax(W_SPEC),
                             activation_observer=qstats.moving_average_minmax(ACT_SPEC, 0.01))
    assert qat.layers == ("block", "head")
    g = torch.Generator().manual_seed(3)
    state = qat.init(torch.randn(4, 6, generator=g))
    params = {k: v.detach().clone() for k, v in qat.params().items()}
    schedule = QATSchedule(observe_at=0, fake_quantize_at=1, freeze_ranges_at=3)
    for step in range(4):
        x = torch.randn(4, 6, generator=g) * (step + 1)
        phase = schedule(step)
        for fq in (act_block, act_head, weight_block, weight_head):
            fq.enable_observer(phase.observe)
            fq.enable_fake_quant(phase.fake_quantize)
        ref_params = {k: v.clone().requires_grad_(True) for k, v in params.items()}
        expected = reference(ref_params, x)
        expected.pow(2).sum().backward()

        grads, out, state = _squared_loss_step(qat, params, state, x, phase)
        torch.testing.assert_close(out, expected.detach(), rtol=1e-5, atol=1e-6)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref_params[name].grad, rtol=1e-5, atol=1e-5, msg=name)
        for key, fq in (("block", act_block), ("head", act_head)):
            activation = state.activations[key]
            torch.testing.assert_close(activation.min_val, fq.activation_post_process.min_val, rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(activation.max_val, fq.activation_post_process.max_val, rtol=1e-6, atol=1e-7)
        params = {k: v - 0.05 * grads[k] for k, v in params.items()}


class _SharedBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.BatchNorm1d(4)
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.norm(self.fc(self.norm(x)))


def test_batchnorm_called_twice_updates_its_statistics_twice_as_nn_batchnorm():
    torch.manual_seed(0)
    model = _SharedBatchNorm()
    qat = qstats.qat.prepare(model)
    assert qat.batchnorm_layers == ("norm",)
    reference = _SharedBatchNorm()
    reference.load_state_dict(model.state_dict())
    reference.train()
    x = torch.randn(8, 4) * 3 + 1
    state = qat.init(x)
    for step in range(2):
        out, state = qat.apply(qat.params(), state, x * (step + 1), phase=QATPhase(False, False, False))
        torch.testing.assert_close(out, reference(x * (step + 1)))
    norm = state.batchnorm["norm"]
    torch.testing.assert_close(norm.running_mean, reference.norm.running_mean)
    torch.testing.assert_close(norm.running_var, reference.norm.running_var)
    assert int(norm.num_batches_tracked) == int(reference.norm.num_batches_tracked) == 4


def test_apply_is_pure():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 16, 2))
    qat = _prepare_mlp(model)
    x = torch.randn(3, 1, 6, 6)
    state = qat.init(x)
    state, params = qat.apply(qat.params(), state, x, phase=QATPhase(True, False))[1], qat.params()
    before_state = [t.clone() for t in torch.utils._pytree.tree_leaves(state)]
    before_model = {k: v.clone() for k, v in model.state_dict().items()}
    qat.apply(params, state, x, phase=QATPhase(True, True))
    for a, b in zip(torch.utils._pytree.tree_leaves(state), before_state):
        assert torch.equal(a, b)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before_model[k]), k


def test_state_checkpoints_with_qstats_save_and_resumes_the_same(tmp_path):
    """A QAT state (observer states, batch-norm statistics) saved with qstats.save and loaded back
    continues training exactly as the state kept in memory."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 16, 2))
    qat = _prepare_mlp(model)
    batches = [torch.randn(3, 1, 6, 6) for _ in range(3)]
    state = qat.apply(qat.params(), qat.init(batches[0]), batches[0], phase=QATPhase(True, True))[1]
    qstats.save(tmp_path / "qat.safetensors", state)
    loaded = qstats.load(tmp_path / "qat.safetensors")
    assert isinstance(loaded, qstats.QATState) and set(loaded.batchnorm) == {"1"}
    for x in batches[1:]:
        out, state = qat.apply(qat.params(), state, x, phase=QATPhase(True, True))
        out_loaded, loaded = qat.apply(qat.params(), loaded, x, phase=QATPhase(True, True))
        assert torch.equal(out, out_loaded)
    for a, b in zip(torch.utils._pytree.tree_leaves(state), torch.utils._pytree.tree_leaves(loaded)):
        assert torch.equal(a, b)


def test_batchnorm_train_and_frozen_match_nn_batchnorm():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4, momentum=0.2), nn.ReLU(), nn.Flatten(), nn.Linear(16, 2))
    with torch.no_grad():
        model[1].weight.uniform_(0.5, 1.5)
        model[1].bias.uniform_(-0.5, 0.5)
    qat = qstats.qat.prepare(model)  # batch norm only: no observers, float layers
    reference = nn.BatchNorm2d(4, momentum=0.2)
    reference.load_state_dict(model[1].state_dict())
    x = torch.randn(5, 2, 4, 4)
    state = qat.init(x)
    conv = model[0](x)
    for step in range(3):
        xs = x * (step + 1)
        conv = model[0](xs)
        out, state = qat.apply(qat.params(), state, xs, phase=QATPhase(False, False, False))
        reference.train()
        expected = model[4](model[3](F.relu(reference(conv))))
        torch.testing.assert_close(out, expected)
        bn = state.batchnorm["1"]
        torch.testing.assert_close(bn.running_mean, reference.running_mean)
        torch.testing.assert_close(bn.running_var, reference.running_var)
        assert int(bn.num_batches_tracked) == int(reference.num_batches_tracked)
    frozen_out, frozen_state = qat.apply(qat.params(), state, x, phase=QATPhase(False, False, True))
    reference.eval()
    torch.testing.assert_close(frozen_out, model[4](model[3](F.relu(reference(model[0](x))))))
    assert torch.equal(frozen_state.batchnorm["1"].running_mean, state.batchnorm["1"].running_mean)
    # Tensor flag: same results through torch.where.
    out_t, state_t = qat.apply(qat.params(), state, x, phase=QATPhase(False, False, torch.tensor(True)))
    torch.testing.assert_close(out_t, frozen_out)


def test_compiled_step_has_no_graph_breaks_and_matches_eager():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 16, 3))
    qat = _prepare_mlp(model)
    x = torch.randn(6, 1, 6, 6)
    y = torch.randint(0, 3, (6,))
    state = qat.init(x)
    state = qat.apply(qat.params(), state, x, phase=QATPhase(True, False))[1]
    params = {k: v.detach() for k, v in qat.params().items()}

    def loss_fn(params, state, x, y, phase):
        out, new_state = qat.apply(params, state, x, phase=phase)
        return F.cross_entropy(out, y), new_state

    eager = torch.func.grad(loss_fn, has_aux=True)
    compiled = torch.compile(eager, fullgraph=True, backend="aot_eager")  # fullgraph: a break raises
    for phase in (QATPhase(True, True), QATSchedule(0, 0, 5, 8)(torch.tensor(6))):
        grads_e, state_e = eager(params, state, x, y, phase)
        grads_c, state_c = compiled(params, state, x, y, phase)
        for k in grads_e:
            torch.testing.assert_close(grads_c[k], grads_e[k], rtol=1e-5, atol=1e-6)
        for a, b in zip(torch.utils._pytree.tree_leaves(state_c), torch.utils._pytree.tree_leaves(state_e)):
            torch.testing.assert_close(a, b)


def test_compiled_step_recompiled_for_other_shapes_matches_eager():
    """A compiled QAT loss recompiles with dynamic shapes when the batch size (a last, smaller
    batch) or the model changes; inductor then failed to generate the ``torch.cond`` the
    reduction used ("expected [s17] to have been codegen-ed"). Every shape matches eager."""
    torch._dynamo.reset()
    phase = QATPhase(True, True)

    def run(model, batches):
        qat = _prepare_mlp(model)
        params = {k: v.detach().requires_grad_() for k, v in qat.params().items()}
        state = qat.init(batches[0][0])

        def loss_fn(params, state, x, y):
            out, new_state = qat.apply(params, state, x, phase=phase)
            return F.cross_entropy(out, y), new_state

        compiled = torch.compile(loss_fn, fullgraph=True)
        state_e = state_c = state
        for x, y in batches:
            loss_e, state_e = loss_fn(params, state_e, x, y)
            grads_e = torch.autograd.grad(loss_e, list(params.values()))
            loss_c, state_c = compiled(params, state_c, x, y)
            grads_c = torch.autograd.grad(loss_c, list(params.values()))
            torch.testing.assert_close(loss_c, loss_e)
            for a, b in zip(grads_c, grads_e):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
            for a, b in zip(torch.utils._pytree.tree_leaves(state_c), torch.utils._pytree.tree_leaves(state_e)):
                assert torch.equal(a, b)

    torch.manual_seed(0)
    run(_MLP(), [(torch.randn(n, 6), torch.randint(0, 3, (n,))) for n in (8, 12, 5)])
    wider = nn.Sequential(nn.Linear(10, 8), nn.ReLU(), nn.Linear(8, 3))  # another model, same code
    run(wider, [(torch.randn(n, 10), torch.randint(0, 3, (n,))) for n in (7, 9)])
    torch._dynamo.reset()


def test_learned_ranges_replace_observer_ranges():
    torch.manual_seed(0)
    qat = _prepare_mlp(_MLP())
    x = torch.randn(7, 6)
    state = qat.init(x)
    state = qat.apply(qat.params(), state, x, phase=QATPhase(True, True))[1]
    ranges = qat.learnable_ranges(state)
    assert set(ranges["activations"]) == {"fc1", "fc2"}
    frozen = QATPhase(False, True)
    out_obs, _ = qat.apply(qat.params(), state, x, phase=frozen)
    out_lsq, _ = qat.apply(qat.params(), state, x, phase=frozen, ranges=ranges)
    torch.testing.assert_close(out_lsq, out_obs)  # initialised from the states: same forward
    out_lsq.sum().backward()
    scale = ranges["activations"]["fc1"].scale
    assert scale.grad is not None and bool(torch.isfinite(scale.grad))
    # The input of fc1 is x itself: its range gradient is LSQ's on x.
    s = scale.detach().clone().requires_grad_(True)
    z = ranges["activations"]["fc1"].zero_point.detach().clone().requires_grad_(True)
    fq = qstats.lsq_fake_quantize(x, qstats.LSQParams(s, z), ACT_SPEC)
    w = qstats.fake_quantize(qat.params()["fc1.weight"], qstats.compute_qparams(state.weights["fc1"], W_SPEC), W_SPEC)
    h = F.relu(F.linear(fq, w, qat.params()["fc1.bias"]))
    hq = qstats.fake_quantize(h, qstats.compute_qparams(state.activations["fc2"], ACT_SPEC), ACT_SPEC)
    w2 = qstats.fake_quantize(qat.params()["fc2.weight"], qstats.compute_qparams(state.weights["fc2"], W_SPEC), W_SPEC)
    F.linear(hq, w2, qat.params()["fc2.bias"]).sum().backward()
    torch.testing.assert_close(scale.grad, s.grad)


def test_ranges_that_name_no_quantized_point_raise_value_error():
    # A misspelt kind or layer, or weight ranges for a model without a weight observer, used to be
    # ignored silently: training "learned" ranges that were never used.
    torch.manual_seed(0)
    model = _MLP()
    qat = qstats.qat.prepare(model, activation_observer=qstats.moving_average_minmax(ACT_SPEC, 0.01))
    x = torch.randn(7, 6)
    state = qat.apply(qat.params(), qat.init(x), x, phase=QATPhase(True, False))[1]
    ranges = qat.learnable_ranges(state)
    fc1 = ranges["activations"]["fc1"]
    for bad in ({"activation": {"fc1": fc1}}, {"activations": {"fc_1": fc1}}, {"weights": {"fc1": fc1}}):
        with pytest.raises(ValueError, match="ranges"):
            qat.apply(qat.params(), state, x, phase=QATPhase(False, True), ranges=bad)
    # A subset of the points is fine: the others keep the observers' ranges.
    out, _ = qat.apply(qat.params(), state, x, phase=QATPhase(False, True), ranges={"activations": {"fc1": fc1}})
    expected, _ = qat.apply(qat.params(), state, x, phase=QATPhase(False, True))
    torch.testing.assert_close(out, expected)


def test_prepare_and_apply_errors():
    with pytest.raises(TypeError, match="Observer"):
        qstats.qat.prepare(_MLP(), weight_observer="minmax")
    with pytest.raises(ValueError, match="no layer"):
        qstats.qat.prepare(nn.Sequential(nn.ReLU()))
    assert qstats.qat.prepare(_MLP(), layers=nn.Linear).layers == ("fc1", "fc2")  # one type
    for bad in ((), ("Linear",), 3):  # an empty tuple quantized nothing; names and numbers: isinstance's error
        with pytest.raises(TypeError, match="layers must be nn.Module subclasses"):
            qstats.qat.prepare(_MLP(), layers=bad)
    for bad in ("bogus", -1.0, True):  # refused by prepare, not at the first apply with learned ranges
        with pytest.raises(ValueError, match="grad_scale must be"):
            qstats.qat.prepare(_MLP(), grad_scale=bad)

    class DataDependent(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(2, 2)

        def forward(self, x):
            return self.fc(x) if x.sum() > 0 else x

    with pytest.raises(TypeError, match="cannot trace DataDependent"):
        qstats.qat.prepare(DataDependent())
    qat = _prepare_mlp(_MLP())
    state = qat.init(torch.randn(2, 6))
    broken = state._replace(activations={"fc1": state.activations["fc1"]})
    with pytest.raises(ValueError, match="state.activations has keys"):
        qat.apply(qat.params(), broken, torch.randn(2, 6))
    with pytest.raises(TypeError, match="QATState"):
        qat.apply(qat.params(), dict(state._asdict()), torch.randn(2, 6))


class _TiedAutoencoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc, self.dec = nn.Linear(4, 4), nn.Linear(4, 4)
        self.dec.weight = self.enc.weight

    def forward(self, x):
        return self.dec(F.relu(self.enc(x)))


def test_params_with_names_the_model_does_not_have_raise():
    # torch.func.functional_call ignored a misspelt or prefixed name ("module.enc.weight" from a DDP
    # checkpoint): apply ran the model's own tensor and that parameter's gradient was zero
    torch.manual_seed(0)
    model = _TiedAutoencoder()
    qat = qstats.qat.prepare(model, weight_observer=qstats.minmax(W_SPEC))
    x = torch.randn(3, 4)
    state = qat.init(x)
    for name in ("enc.wieght", "module.enc.weight"):
        with pytest.raises(ValueError, match=rf"params names \['{name}'\], which the model does not have"):
            qat.apply({name: torch.zeros(4, 4)}, state, x)
    with pytest.raises(TypeError, match="params must be a dict"):
        qat.apply(list(qat.params().values()), state, x)
    tied = {"dec.weight": torch.randn(4, 4)}  # the tied name is the model's too: both uses take it
    out, _ = qat.apply(tied, state, x, phase=QATPhase(False, False))
    torch.testing.assert_close(out, torch.func.functional_call(model, tied, (x,)), rtol=0, atol=0)


class _SubclassedLinear(nn.Linear):
    """A Linear defined outside torch.nn with the stock forward (a project's own layer type)."""


class _SubclassedBatchNorm(nn.BatchNorm1d):
    pass


class _SubclassedMLP(nn.Module):
    def __init__(self, linear=_SubclassedLinear, norm=_SubclassedBatchNorm):
        super().__init__()
        self.fc1, self.norm, self.fc2 = linear(6, 8), norm(8), nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(F.relu(self.norm(self.fc1(x))))


def test_subclasses_of_the_layers_are_quantized():
    # torch.fx traces through modules defined outside torch.nn: a subclass of nn.Linear became a
    # bare F.linear that prepare never saw, and was left in float (its batch norm kept hidden buffers)
    torch.manual_seed(0)
    mixed = qstats.qat.prepare(nn.Sequential(_SubclassedLinear(4, 4), nn.Linear(4, 2)), qstats.minmax(W_SPEC))
    assert mixed.layers == ("0", "1")  # was ("1",): the subclass silently stayed in float
    model = _SubclassedMLP()
    plain = _SubclassedMLP(nn.Linear, nn.BatchNorm1d)
    plain.load_state_dict(model.state_dict())
    qat, reference = _prepare_mlp(model), _prepare_mlp(plain)
    assert qat.layers == reference.layers == ("fc1", "fc2")
    assert qat.batchnorm_layers == reference.batchnorm_layers == ("norm",)
    x = torch.randn(5, 6)
    state, ref_state = qat.init(x), reference.init(x)
    for phase in (QATPhase(True, False), QATPhase(True, True)):
        out, state = qat.apply(qat.params(), state, x, phase=phase)
        expected, ref_state = reference.apply(reference.params(), ref_state, x, phase=phase)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
    for a, b in zip(torch.utils._pytree.tree_leaves(state), torch.utils._pytree.tree_leaves(ref_state)):
        assert torch.equal(a, b)


class _LoRALinear(nn.Linear):
    """A LoRA layer: its own forward runs the Linear's through ``super().forward``."""

    def __init__(self, in_features, out_features, rank=2):
        super().__init__(in_features, out_features)
        self.A, self.B = nn.Linear(in_features, rank, bias=False), nn.Linear(rank, out_features, bias=False)

    def forward(self, x):
        return super().forward(x) + self.B(self.A(x))


class _ScaledLinear(nn.Linear):
    def forward(self, x):
        return F.linear(x, self.weight, self.bias) * 2


class _MaskedLinear(nn.Linear):
    def forward(self, x):
        return F.linear(x, self.weight * 0.5, self.bias)


class _OwnBatchNorm(nn.BatchNorm1d):
    def forward(self, x):
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, True, 0.1, self.eps)


def _feeds_a_layer_or_is_a_weight(graph_module, node) -> bool:
    """Whether a torch.ao FakeQuantize node quantizes what qstats does: a weight, or a layer's input."""
    def layer_input(user):
        if user.op == "call_function":
            return user.target is F.linear and user.args[0] is node
        return user.op == "call_module" and hasattr(graph_module.get_submodule(user.target), "weight_fake_quant")
    return node.args[0].op == "get_attr" or all(layer_input(user) for user in node.users)


def test_subclass_with_its_own_forward_fake_quantizes_the_weight_it_gives_f_linear():
    # torch.fx traces through such forwards to a bare F.linear on self.weight, which prepare never
    # saw: the base weight of a LoRA layer and its input stayed in float without a word (layers were
    # ("0.A", "0.B")). torch.ao's prepare_qat_fx fake-quantizes that F.linear's weight and input.
    from torch.ao.quantization import QConfig, QConfigMapping
    from torch.ao.quantization.quantize_fx import prepare_qat_fx

    torch.manual_seed(0)
    model = nn.Sequential(_LoRALinear(6, 5), nn.ReLU(), _ScaledLinear(5, 3))
    qat = _prepare_mlp(model)
    assert qat.layers == ("0", "0.A", "0.B", "2")
    qconfig = QConfig(  # _act_fq() and _weight_fq()
        activation=FakeQuantize.with_args(observer=MovingAverageMinMaxObserver, quant_min=0, quant_max=255,
                                          dtype=torch.quint8, qscheme=torch.per_tensor_affine),
        weight=FakeQuantize.with_args(observer=MovingAveragePerChannelMinMaxObserver, quant_min=-128, quant_max=127,
                                      dtype=torch.qint8, qscheme=torch.per_channel_symmetric, ch_axis=0))
    reference = prepare_qat_fx(copy.deepcopy(model), QConfigMapping().set_global(qconfig), (torch.randn(2, 6),))
    # torch.ao also fake-quantizes outputs (of each F.linear before the sum and the scaling): not those
    unmatched = [reference.get_submodule(node.target) for node in reference.graph.nodes if node.op == "call_module"
                 and isinstance(reference.get_submodule(node.target), FakeQuantize)
                 and not _feeds_a_layer_or_is_a_weight(reference, node)]
    assert len(unmatched) == 4
    g = torch.Generator().manual_seed(4)
    state = qat.init(torch.randn(4, 6, generator=g))
    params = {k: v.detach().clone() for k, v in qat.params().items()}
    schedule = QATSchedule(observe_at=0, fake_quantize_at=1, freeze_ranges_at=3)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.05)
    for step in range(5):
        x, phase = torch.randn(4, 6, generator=g) * (step + 1), schedule(step)
        for fq in (m for m in reference.modules() if isinstance(m, FakeQuantize)):
            fq.enable_observer(phase.observe and fq not in unmatched)
            fq.enable_fake_quant(phase.fake_quantize and fq not in unmatched)
        optimizer.zero_grad()
        expected = reference(x)
        expected.pow(2).sum().backward()

        grads, out, state = _squared_loss_step(qat, params, state, x, phase)
        torch.testing.assert_close(out, expected.detach(), rtol=1e-5, atol=1e-6)
        assert set(grads) == {name for name, _ in reference.named_parameters()}
        for name, grad in grads.items():
            torch.testing.assert_close(grad, reference.get_parameter(name).grad, rtol=1e-5, atol=1e-5, msg=name)
        optimizer.step()
        params = {k: v - 0.05 * grads[k] for k, v in params.items()}


def test_subclass_forward_that_prepare_cannot_rewrite_is_named_in_a_warning():
    # a batch norm's own forward (in-place buffers) stayed impure without a word; a weight changed before F.linear
    # (a mask, DoRA) is a call of a computed weight, fake-quantized as torch.ao's prepare_qat_fx does
    # (tests/test_qat_functional_transposed_and_buffer_weights.py), no longer named as a layer in float
    model = nn.Sequential(_MaskedLinear(4, 4), _OwnBatchNorm(4), nn.Linear(4, 2))
    with pytest.warns(UserWarning, match=r"batch norms \['1'\] have their own forward") as record:
        qat = qstats.qat.prepare(model, weight_observer=qstats.minmax(W_SPEC))
    assert not any("stay in float" in str(w.message) for w in record)
    assert qat.layers == ("0.linear", "2")


@pytest.mark.parametrize("padding_mode", ["reflect", "replicate", "circular"])
def test_conv_padded_otherwise_than_with_zeros_matches_torch_ao_qat_conv(padding_mode):
    # prepare raised "padding_mode='reflect' is not supported"; torch.ao's QAT Conv2d pads the
    # fake-quantized input and convolves with the fake-quantized weight
    from torch.ao.nn.qat import Conv2d as QATConv2d
    from torch.ao.quantization import QConfig

    torch.manual_seed(0)
    conv = nn.Conv2d(2, 3, 3, padding=1, padding_mode=padding_mode)
    qat = _prepare_mlp(nn.Sequential(conv))
    act = _act_fq()
    conv.qconfig = QConfig(activation=None, weight=FakeQuantize.with_args(
        observer=MovingAveragePerChannelMinMaxObserver, quant_min=-128, quant_max=127, dtype=torch.qint8,
        qscheme=torch.per_channel_symmetric, ch_axis=0))
    reference = QATConv2d.from_float(conv)
    x = torch.randn(2, 2, 5, 5)
    state = qat.init(x)
    for phase in (QATPhase(True, False), QATPhase(True, True), QATPhase(False, True)):
        for fq in (act, reference.weight_fake_quant):
            fq.enable_observer(phase.observe)
            fq.enable_fake_quant(phase.fake_quantize)
        out, state = qat.apply(qat.params(), state, x * 2, phase=phase)
        torch.testing.assert_close(out, reference(act(x * 2)), rtol=1e-5, atol=1e-6)


def test_layers_inside_modules_fx_keeps_whole_are_named_in_a_warning():
    # torch.fx does not trace into torch.nn's modules: the Linears of a TransformerEncoderLayer
    # stayed in float without a word (torch.ao's prepare_qat swaps them)
    model = nn.Sequential(nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), nn.Linear(8, 2))
    with pytest.warns(UserWarning, match=r"'0.linear1', '0.linear2', '0.self_attn.out_proj'.*stay in float"):
        qat = qstats.qat.prepare(model, weight_observer=qstats.minmax(W_SPEC))
    assert qat.layers == ("1",)


class _OptionalMask(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, mask=None):
        h = self.fc(x)
        return F.scaled_dot_product_attention(h, h, h, attn_mask=mask)


class _VariadicInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, *inputs):
        return self.fc(inputs[0]) + inputs[1]


class _KeywordInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, **options):
        return self.fc(x)


@pytest.mark.parametrize("cls", [_OptionalMask, _VariadicInputs, _KeywordInputs])
def test_forward_with_optional_or_variadic_inputs(cls):
    # the QAT inputs were appended as positional parameters: after `mask=None` and `**options`
    # the generated forward was a SyntaxError; after `*inputs` they were keyword-only, never given
    torch.manual_seed(0)
    model = cls()
    qat = qstats.qat.prepare(model, weight_observer=qstats.minmax(W_SPEC),
                             activation_observer=qstats.moving_average_minmax(ACT_SPEC, 0.01))
    x = torch.randn(2, 3, 4)
    inputs = (x, x) if cls is _VariadicInputs else (x,)
    state = qat.init(*inputs)
    out, state = qat.apply(qat.params(), state, *inputs, phase=QATPhase(True, False))
    torch.testing.assert_close(out, model(*inputs), rtol=0, atol=0)
    out, _ = qat.apply(qat.params(), state, *inputs, phase=QATPhase(False, True))
    w = qstats.fake_quantize(model.fc.weight, qstats.compute_qparams(state.weights["fc"], W_SPEC), W_SPEC)
    xq = qstats.fake_quantize(x, qstats.compute_qparams(state.activations["fc"], ACT_SPEC), ACT_SPEC)
    h = F.linear(xq, w, model.fc.bias)
    expected = {_OptionalMask: lambda: F.scaled_dot_product_attention(h, h, h), _VariadicInputs: lambda: h + x,
                _KeywordInputs: lambda: h}[cls]()
    torch.testing.assert_close(out, expected)


# ------------------------------------------------------------------------------------------------
# Schedule


def test_schedule_phases_follow_milestones():
    schedule = QATSchedule.from_milestones([2, 4, 7, 9])
    for step in range(12):
        phase = schedule(step)
        assert phase.observe == (2 <= step < 7)
        assert phase.fake_quantize == (step >= 4)
        assert phase.freeze_batchnorm == (step >= 9)
        tensor_phase = schedule(torch.tensor(step))
        assert [bool(f) for f in tensor_phase] == list(phase)
    assert [s for s in range(12) if schedule.sync_at(s)] == [6]
    periodic = QATSchedule(observe_at=0, fake_quantize_at=0, freeze_ranges_at=10, sync_every=4)
    assert [s for s in range(12) if periodic.sync_at(s)] == [3, 7, 9]


def test_schedule_validation():
    with pytest.raises(ValueError, match="fake_quantize_at"):
        QATSchedule(observe_at=5, fake_quantize_at=2)
    with pytest.raises(ValueError, match="freeze_ranges_at"):
        QATSchedule(observe_at=0, fake_quantize_at=5, freeze_ranges_at=3)
    with pytest.raises(ValueError, match="4 milestones"):
        QATSchedule.from_milestones([1, 2, 3])
    with pytest.raises(ValueError, match="sync_every"):
        QATSchedule(sync_every=0)
    with pytest.raises(TypeError, match="integer"):
        QATSchedule()(torch.tensor(1.0))


def test_vmap_over_an_ensemble_of_models():
    torch.manual_seed(0)
    models = [_MLP() for _ in range(3)]
    qats = [_prepare_mlp(m) for m in models]
    x = torch.randn(5, 6)
    states = [q.init(x) for q in qats]
    states = [q.apply(q.params(), s, x, phase=QATPhase(True, False))[1] for q, s in zip(qats, states)]
    params, _ = torch.func.stack_module_state(models)
    stacked = torch.utils._pytree.tree_map(lambda *t: torch.stack(t), *states)
    phase = QATPhase(True, True)
    out, new = torch.func.vmap(lambda p, s: qats[0].apply(p, s, x, phase=phase))(params, stacked)
    for i, (q, s) in enumerate(zip(qats, states)):
        expected, expected_state = q.apply(q.params(), s, x, phase=phase)
        torch.testing.assert_close(out[i], expected)
        torch.testing.assert_close(new.activations["fc2"].max_val[i], expected_state.activations["fc2"].max_val)


def test_apply_uses_the_given_parameters():
    torch.manual_seed(0)
    qat = _prepare_mlp(_MLP())
    x = torch.randn(4, 6)
    state = qat.apply(qat.params(), qat.init(x), x, phase=QATPhase(True, False))[1]
    own, _ = qat.apply(qat.params(), state, x, phase=QATPhase(False, True))
    copies, _ = qat.apply({k: v.clone() for k, v in qat.params().items()}, state, x, phase=QATPhase(False, True))
    torch.testing.assert_close(own, copies, rtol=0, atol=0)
    changed = dict(qat.params(), **{"fc2.bias": qat.params()["fc2.bias"] + 1.0})
    shifted, _ = qat.apply(changed, state, x, phase=QATPhase(False, False))
    plain, _ = qat.apply(qat.params(), state, x, phase=QATPhase(False, False))
    torch.testing.assert_close(shifted, plain + 1.0)


def _squared_loss_step(qat, params, state, x, phase):
    """``(grads, output, new state)`` of ``sum(qat.apply(...) ** 2)`` through ``torch.func.grad``."""
    def loss_fn(params, state):
        out, new_state = qat.apply(params, state, x, phase=phase)
        return out.pow(2).sum(), (out, new_state)

    grads, (out, state) = torch.func.grad(loss_fn, has_aux=True)(params, state)
    return grads, out, state
