"""`QATModel.apply(..., layer_phases={path: QATPhase})` switches observation and fake quantization of one
submodule's layers, as torch.ao's ``submodule.apply(disable_fake_quant)`` / ``disable_observer`` /
``enable_fake_quant``: outputs, gradients and ranges equal torch.ao ``FakeQuantize`` modules wired
around the same layers, step by step."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.ao.quantization import disable_fake_quant, disable_observer, enable_fake_quant, enable_observer

import qstats
from _qat_torch_ao_reference import ACT_SPEC, W_SPEC, activation_fake_quant, weight_fake_quant


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 8), nn.ReLU()), nn.Linear(8, 3))


class _FakeQuantized(nn.Module):
    """One Linear with torch.ao FakeQuantize modules on its input and weight."""

    def __init__(self, layer: nn.Linear):
        super().__init__()
        self.layer, self.input_fake_quant, self.weight_fake_quant = layer, activation_fake_quant(), weight_fake_quant()

    def forward(self, x):
        return F.linear(self.input_fake_quant(x), self.weight_fake_quant(self.layer.weight), self.layer.bias)


def _reference(model):
    return nn.Sequential(_FakeQuantized(model[0]), nn.ReLU(), nn.Sequential(_FakeQuantized(model[2][0]), nn.ReLU()),
                         _FakeQuantized(model[3]))


OFF, FROZEN = qstats.QATPhase(observe=True, fake_quantize=False), qstats.QATPhase(observe=False, fake_quantize=True)
# each step: (torch.ao toggles applied to (submodule path, function), then qstats' layer_phases)
STEPS = [
    ([], None),
    ([("2", disable_fake_quant)], {"2": OFF}),
    ([("0", disable_observer)], {"2": OFF, "0": FROZEN}),
    ([("2", enable_fake_quant), ("3", disable_fake_quant), ("3", disable_observer)],
     {"0": FROZEN, "3": qstats.QATPhase(observe=False, fake_quantize=False)}),
    ([("0", enable_observer), ("", disable_fake_quant), ("3", enable_observer)], {"": OFF}),
]


def test_layer_phases_train_as_torch_ao_per_module_toggles():
    qat = qstats.qat.prepare(_model(), qstats.moving_average_minmax(W_SPEC, 0.01),
                             qstats.moving_average_minmax(ACT_SPEC, 0.01))
    reference = _reference(_model())
    params = {name: p.detach().clone() for name, p in qat.params().items()}
    state = qat.init(torch.zeros(1, 4))
    gen = torch.Generator().manual_seed(1)

    def loss_fn(p, s, x, y, layer_phases):
        out, new_state = qat.apply(p, s, x, layer_phases=layer_phases)
        return F.cross_entropy(out, y), (out, new_state)

    grad_fn = torch.func.grad(loss_fn, has_aux=True)
    for step, (toggles, layer_phases) in enumerate(STEPS):
        for path, toggle in toggles:
            reference.get_submodule(path).apply(toggle)
        x, y = torch.randn(6, 4, generator=gen) * (step + 1), torch.randint(0, 3, (6,), generator=gen)
        reference.zero_grad()
        expected = reference(x)
        F.cross_entropy(expected, y).backward()
        grads, (out, state) = grad_fn(params, state, x, y, layer_phases)
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6, msg=f"step {step}")
        for name, grad in grads.items():
            layer, _, field = name.rpartition(".")
            torch.testing.assert_close(grad, reference.get_submodule(layer).layer.get_parameter(field).grad,
                                       rtol=1e-5, atol=1e-6, msg=f"step {step}: {name}")
        params = {name: p - 0.1 * grads[name] for name, p in params.items()}
        with torch.no_grad():
            for p in reference.parameters():
                p -= 0.1 * p.grad
        for layer in ("0", "2.0", "3"):  # the ranges: frozen where the observer is off
            module = reference.get_submodule(layer)
            for kind, fake_quant, spec in (("weights", module.weight_fake_quant, W_SPEC),
                                           ("activations", module.input_fake_quant, ACT_SPEC)):
                qp = qstats.compute_qparams(getattr(state, kind)[layer], spec)
                torch.testing.assert_close(qp.scale, fake_quant.scale.reshape(qp.scale.shape), rtol=1e-6, atol=0,
                                           msg=f"step {step}: {kind} of {layer}")


def test_without_layer_phases_every_layer_follows_the_phase():
    qat = qstats.qat.prepare(_model(), qstats.minmax(W_SPEC), qstats.minmax(ACT_SPEC))
    x = torch.randn(5, 4)
    state = qat.init(x)
    for phase in (qstats.QATPhase(), OFF):
        out, new_state = qat.apply(qat.params(), state, x, phase=phase)
        same, same_state = qat.apply(qat.params(), state, x, phase=phase, layer_phases={"": phase})
        assert torch.equal(out, same)
        assert all(torch.equal(a, b) for a, b in zip(torch.utils._pytree.tree_leaves(new_state),
                                                     torch.utils._pytree.tree_leaves(same_state)))


def test_layer_phases_naming_no_layer_or_no_phase_raise():
    qat = qstats.qat.prepare(_model(), qstats.minmax(W_SPEC), qstats.minmax(ACT_SPEC))
    x = torch.randn(5, 4)
    state = qat.init(x)
    with pytest.raises(ValueError, match=r"layer_phases names '1'.*'2\.0'"):  # the ReLU: nothing to switch
        qat.apply(qat.params(), state, x, layer_phases={"1": OFF})
    with pytest.raises(ValueError, match=r"layer_phases names '2\.0\.weight'"):
        qat.apply(qat.params(), state, x, layer_phases={"2.0.weight": OFF})
    with pytest.raises(TypeError, match="layer_phases maps module paths"):
        qat.apply(qat.params(), state, x, layer_phases={"2": False})


def test_layer_phases_compile_fullgraph_as_eager():
    qat = qstats.qat.prepare(_model(), qstats.minmax(W_SPEC), qstats.minmax(ACT_SPEC))
    x = torch.randn(5, 4)
    state = qat.apply(qat.params(), qat.init(x), x, phase=OFF)[1]

    def step(params, state, x):
        return qat.apply(params, state, x, layer_phases={"2": OFF, "3": FROZEN})

    eager = step(qat.params(), state, x * 2)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(qat.params(), state, x * 2)
    assert all(torch.equal(a, b) for a, b in zip(torch.utils._pytree.tree_leaves(eager),
                                                 torch.utils._pytree.tree_leaves(compiled)))
    assert not torch.equal(eager[0], qat.apply(qat.params(), state, x * 2)[0])  # the switches change the output
