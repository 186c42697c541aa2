"""Errors and warnings raised inside an `observing` session name ``observing``, and those of a
`calibrate` call name ``calibrate``: resumed states that are no tree, an observer's error at a site,
a resumed parameter state of another shape, a batch weight that fits no activation (each used to
name the other function)."""

from __future__ import annotations

import pytest
import torch

import qstats


def _model_and_recipe():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3)).eval()
    spec = qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(-1))
    return model, qstats.Recipe([qstats.Rule("Linear", sites=("weight", "input"), spec=spec)])


@pytest.mark.parametrize("caller", ["observing", "calibrate"])
def test_bad_resumed_states_name_the_function_called(caller):
    model, recipe = _model_and_recipe()
    bad_parameter = {"0": {"weight": qstats.minmax(qstats.QuantSpec(granularity=qstats.PerAxis(-1))).init(torch.ones(2, 5))}}

    def run(states):
        if caller == "calibrate":
            return qstats.calibrate(model, [torch.randn(2, 4)], recipe, states=states, progress=False)
        with qstats.observing(model, recipe, states=states):
            pass

    with pytest.raises(TypeError, match=rf"^{caller}: states must be a dict"):
        run([1])
    with pytest.raises(ValueError, match=rf"^{caller}: the given states\['0'\]\['weight'\] is not a minmax state"):
        run(bad_parameter)


def test_an_error_at_a_site_names_the_session():
    model, recipe = _model_and_recipe()
    # a resumed input state of 5 channels: the observer refuses the 4 channels of the batch
    states = {"0": {"input": qstats.minmax(qstats.QuantSpec(granularity=qstats.PerAxis(-1))).init(torch.ones(2, 5))}}
    with qstats.observing(model, recipe, states=states):
        with pytest.raises(ValueError, match=r"^observing: module '0' site 'input': minmax.update"):
            with torch.no_grad():
                model(torch.randn(2, 4))
    with pytest.raises(ValueError, match=r"^calibrate: module '0' site 'input': minmax.update"):
        qstats.calibrate(model, [torch.randn(2, 4)], recipe, states=states, progress=False)


def test_a_weight_that_fits_no_activation_is_named_by_the_function_called():
    model, recipe = _model_and_recipe()
    x = torch.randn(2, 4)
    with pytest.warns(UserWarning, match=r"^calibrate: the observation weight of shape \(7,\) fits no"):
        qstats.calibrate(model, [x], recipe, progress=False, observation_weight=lambda batch: torch.ones(7))
    with qstats.observing(model, recipe) as session, torch.no_grad():
        with pytest.warns(UserWarning, match=r"^observing: the observation weight of shape \(7,\) fits no"):
            with session.weighted(torch.ones(7)):
                model(x)
