"""QAT: shared modules under several names, bf16 models, several optimizer steps.

References: ``nn.BatchNorm1d`` in train mode, ``torch.nn.Module.load_state_dict`` (strict) and
``torch.func.functional_call`` of the float model.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import qstats
from qstats import QATPhase


class _Universal(nn.Module):
    """One block applied three times, registered under three names (ALBERT / universal transformer)."""

    def __init__(self):
        super().__init__()
        block = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.ReLU())
        self.layers = nn.ModuleList([block] * 3)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _prepare(model):
    return qstats.qat.prepare(model, qstats.minmax(qstats.QuantSpec("int8", granularity=qstats.PerAxis(0))), None)


def test_a_module_registered_under_several_names_round_trips_through_a_strict_state_dict():
    # torch.fx keeps the first name of a module registered several times: qat.state_dict lacked
    # layers.1.* and layers.2.*, so a strict load_state_dict raised "Missing key(s)" mid-training.
    torch.manual_seed(0)
    model = _Universal()
    reference = copy.deepcopy(model).train()  # deepcopy keeps the sharing
    qat = _prepare(model)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(6, 4, generator=g) * (1 + i) for i in range(3)]
    params = {name: p.detach() + 0.05 for name, p in qat.params().items()}
    reference.load_state_dict(params, strict=False)
    state = qat.init(batches[0])
    with torch.no_grad():
        for x in batches:  # float steps: the batch norm sees what nn.BatchNorm1d sees, 3 calls a step
            out, state = qat.apply(params, state, x, phase=QATPhase(True, False))
            torch.testing.assert_close(out, reference(x), rtol=1e-5, atol=1e-6)
    saved = qat.state_dict(params, state)
    loaded = _Universal()
    loaded.load_state_dict(saved)  # strict
    for name, expected in reference.state_dict().items():
        torch.testing.assert_close(saved[name], expected, rtol=1e-5, atol=1e-6, msg=name)
    assert int(loaded.layers[2][1].num_batches_tracked) == 9
    assert loaded.layers[1] is loaded.layers[0]


def test_parameters_under_every_name_of_a_shared_module_are_taken_as_functional_call_takes_them():
    # qat.apply refused layers.1.0.weight ("which the model does not have") though the model has it;
    # functional_call of the float model ties it to layers.0.0.weight.
    torch.manual_seed(0)
    model = _Universal()
    qat = _prepare(model)
    x = torch.randn(6, 4)
    float_phase = QATPhase(observe=False, fake_quantize=False, freeze_batchnorm=True)
    state = qat.init(x)
    halves = {id(p): p.detach() * 0.5 for p in model.parameters()}
    given = {name: halves[id(p)] for name, p in model.named_parameters(remove_duplicate=False)}  # one tensor per tie
    out, _ = qat.apply(given, state, x, phase=float_phase)
    torch.testing.assert_close(out, torch.func.functional_call(copy.deepcopy(model).eval(), given, (x,)),
                               rtol=1e-6, atol=1e-6)
    alone, _ = qat.apply({"layers.1.0.weight": given["layers.0.0.weight"]}, state, x, phase=float_phase)
    tied = torch.func.functional_call(copy.deepcopy(model).eval(), {"layers.1.0.weight": given["layers.0.0.weight"]}, (x,))
    torch.testing.assert_close(alone, tied, rtol=1e-6, atol=1e-6)
    # the model is left as it was (functional_call given every name of the one module would restore the
    # value given into it), and two values for one tensor raise, as functional_call's ties do
    assert all(isinstance(p, nn.Parameter) for p in model.parameters())
    assert model.layers[2][0].weight is model.layers[0][0].weight
    torch.testing.assert_close(qat.apply(qat.params(), state, x, phase=float_phase)[0], copy.deepcopy(model).eval()(x))
    with pytest.raises(ValueError, match="'layers.1.0.weight' and 'layers.0.0.weight', names of one tensor"):
        qat.apply({"layers.0.0.weight": given["layers.0.0.weight"], "layers.1.0.weight": torch.zeros(4, 4)},
                  state, x, phase=float_phase)


def test_the_rewritten_forward_called_without_its_state_or_phase_names_them():
    # qat.module(x) read None.activations: a bare AttributeError from inside the graph
    model = nn.Sequential(nn.BatchNorm1d(4), nn.Linear(4, 4))
    qat = qstats.qat.prepare(model, qstats.minmax(qstats.QuantSpec("int8")), qstats.minmax(qstats.QuantSpec("int8")))
    x = torch.randn(3, 4)
    state = qat.init(x)
    with pytest.raises(TypeError, match="qat_state must be a QATState"):
        qat.module(x)
    with pytest.raises(TypeError, match="qat_phase must be a QATPhase"):
        qat.module(x, qat_state=state)
    out, _ = qat.module(x, qat_state=state, qat_phase=QATPhase())
    assert out.shape == (3, 4)
