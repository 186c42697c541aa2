"""A module whose weights are used twice in one forward: its activation sites update once per call,
against torch.ao's MovingAverageMinMaxObserver called on each of its inputs, and its Hessian counts
the rows of both calls; its weight is observed once."""

from __future__ import annotations

import torch
from torch.ao.quantization.observer import MovingAverageMinMaxObserver

import qstats


class SharedTwice(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.shared = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.shared(torch.relu(self.shared(x)))


def test_each_call_of_a_shared_module_is_one_update_as_torch_ao_observes_it():
    torch.manual_seed(0)
    model = SharedTwice().eval()
    batches = [torch.randn(3, 4) * (i + 1) for i in range(3)]
    spec = qstats.QuantSpec.from_torch_ao(dtype=torch.quint8, qscheme=torch.per_tensor_affine)
    recipe = qstats.Recipe([
        qstats.Rule("Linear", sites=("input",), observer=qstats.moving_average_minmax, spec=spec,
                    observer_kwargs={"averaging_constant": 0.1}),
        qstats.Rule("Linear", sites=("output",), observer=qstats.hessian),
        qstats.Rule("Linear", sites=("weight",), observer=qstats.minmax, spec=qstats.QuantSpec(dtype="int8")),
    ])
    states = qstats.calibrate(model, batches, recipe, progress=False)

    reference = MovingAverageMinMaxObserver(averaging_constant=0.1, dtype=torch.quint8)
    outputs = []
    handles = [model.shared.register_forward_pre_hook(lambda module, args: reference(args[0])),
               model.shared.register_forward_hook(lambda module, args, out: outputs.append(out))]
    with torch.no_grad():
        for x in batches:
            model(x)
    for handle in handles:
        handle.remove()
    assert len(outputs) == 2 * len(batches)
    assert torch.equal(states["shared"]["input"].min_val, reference.min_val)
    assert torch.equal(states["shared"]["input"].max_val, reference.max_val)
    rows = torch.cat(outputs).double()
    assert int(states["shared"]["output"].count) == rows.shape[0]
    torch.testing.assert_close(states["shared"]["output"].total.double(), rows.T @ rows, rtol=1e-5, atol=1e-5)
    assert int(states["shared"]["weight"].count) == model.shared.weight.numel()
