"""`QATModel.apply(layer_phases=...)` naming a module the model holds under two paths (one Linear at
``0`` and ``2`` of a Sequential) by its second path switches it, as torch.ao's
``model[2].apply(disable_fake_quant)`` switches the one object (and its FakeQuantize modules) that both
paths hold; it raised that the path held no quantized layer."""

import torch
from torch import nn
from torch.ao.quantization import disable_fake_quant, disable_observer

import qstats
from test_qat_layer_phases import OFF, _FakeQuantized
from _qat_torch_ao_reference import ACT_SPEC, W_SPEC


def _model():
    torch.manual_seed(0)
    shared = nn.Linear(4, 4)
    return nn.Sequential(shared, nn.ReLU(), shared, nn.Linear(4, 3))


def test_a_shared_module_is_switched_by_its_second_path_as_torch_ao():
    qat = qstats.qat.prepare(_model(), qstats.moving_average_minmax(W_SPEC, 0.01),
                             qstats.moving_average_minmax(ACT_SPEC, 0.01))
    model = _model()
    shared = _FakeQuantized(model[0])
    reference = nn.Sequential(shared, nn.ReLU(), shared, _FakeQuantized(model[3]))
    state = qat.init(torch.zeros(1, 4))
    gen = torch.Generator().manual_seed(1)
    steps = [([], None), ([("2", disable_fake_quant)], {"2": OFF}),
             ([("2", disable_observer)], {"2": qstats.QATPhase(observe=False, fake_quantize=False)})]
    for step, (toggles, layer_phases) in enumerate(steps):
        for path, toggle in toggles:
            reference.get_submodule(path).apply(toggle)
        x = torch.randn(6, 4, generator=gen) * (step + 1)
        with torch.no_grad():
            expected = reference(x)
            out, state = qat.apply(qat.params(), state, x, layer_phases=layer_phases)
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6, msg=f"step {step}")
        for kind, fake_quant, spec in (("weights", shared.weight_fake_quant, W_SPEC),
                                       ("activations", shared.input_fake_quant, ACT_SPEC)):
            qp = qstats.compute_qparams(getattr(state, kind)["0"], spec)
            torch.testing.assert_close(qp.scale, fake_quant.scale.reshape(qp.scale.shape), rtol=1e-6, atol=0,
                                       msg=f"step {step}: {kind}")


class _Scaled(nn.Module):
    """A block whose forward computes its weight (``self.w * 0.5``), the call's points named under the block."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        return torch.nn.functional.linear(x, self.w * 0.5).relu()


def test_the_computed_weight_calls_of_a_shared_module_are_switched_by_its_second_path():
    # the calls' points are named under the first path ("0.linear", "0.linear_1"): "2" raised that it held
    # no quantized layer, where a shared Linear's points follow either path (the test above)
    torch.manual_seed(0)
    block = _Scaled()
    qat = qstats.qat.prepare(nn.Sequential(block, nn.ReLU(), block, nn.Linear(4, 3)),
                             qstats.moving_average_minmax(W_SPEC, 0.01), qstats.moving_average_minmax(ACT_SPEC, 0.01))
    assert qat.layers == ("0.linear", "0.linear_1", "3")
    state = qat.init(torch.zeros(1, 4))
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    frozen = qstats.QATPhase(observe=False, fake_quantize=False)
    out, after = qat.apply(qat.params(), state, x, layer_phases={"2": frozen})
    for key in ("0.linear", "0.linear_1"):  # the one object, as torch.ao's model[2].apply(...) switches it
        assert torch.equal(after.activations[key].max_val, state.activations[key].max_val), key
        assert torch.equal(after.weights[key].max_val, state.weights[key].max_val), key
    assert not torch.equal(after.activations["3"].max_val, state.activations["3"].max_val)
    expected, _ = qat.apply(qat.params(), state, x, layer_phases={"0": frozen})
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
