"""A lazy module (``torch.nn.LazyLinear``) has no weight before its first forward: calibrating it is
refused by name, without running the model, and once it ran its states equal plain torch's
min/max of its weight and of its inputs."""

from __future__ import annotations

import pytest
import torch

import qstats

SPEC = qstats.QuantSpec(dtype="int8", mapping="symmetric")
RECIPE = qstats.Recipe([qstats.Rule(("LazyLinear", "Linear"), sites=("weight", "input"), spec=SPEC)])


def test_an_uninitialized_lazy_parameter_is_refused_by_name_then_calibrates_as_plain_torch():
    # it raised torch's "Attempted to use an uninitialized parameter in <method 'detach' ...>", naming
    # neither the module nor the site
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.LazyLinear(16), torch.nn.ReLU(), torch.nn.Linear(16, 8)).eval()
    batches = [torch.randn(3, 32) for _ in range(2)]
    hooks = [dict(module._forward_pre_hooks) for module in model]  # the lazy module's own
    for enter in (lambda: qstats.calibrate(model, batches, RECIPE, progress=False),
                  lambda: qstats.observing(model, RECIPE).__enter__()):
        with pytest.raises(ValueError, match=r"parameter 'weight' of module '0' \(LazyLinear\) is not initialized"):
            enter()
    assert isinstance(model[0], torch.nn.LazyLinear)  # not run: still lazy, no hook left
    assert [dict(module._forward_pre_hooks) for module in model] == hooks

    with torch.no_grad():
        model(batches[0])  # the lazy module makes its weight
    states = qstats.calibrate(model, batches, RECIPE, progress=False)
    assert torch.equal(states["0"]["weight"].min_val, model[0].weight.min())
    assert torch.equal(states["0"]["weight"].max_val, model[0].weight.max())
    inputs = torch.stack(batches)
    assert torch.equal(states["0"]["input"].min_val, inputs.min())
    assert torch.equal(states["0"]["input"].max_val, inputs.max())
