"""Resumed ``states`` that are no ``{path: {site: state}}`` tree are refused by name, by
`calibrate_layerwise` (before any checkpoint is read) as by `calibrate`."""

import pytest
import torch

import qstats

RECIPE = qstats.Recipe([qstats.Rule("Linear", sites=("weight",))])


def _meta_model() -> torch.nn.Module:
    with torch.device("meta"):
        return torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])).eval()


@pytest.mark.parametrize("states, named", [([1], r"states must be a dict .* got list"),
                                           ({"0.0": [1]}, r"states\['0.0'\] must be a dict \{site: state\}, got list")])
def test_layerwise_states_that_are_no_tree_raise_a_type_error_naming_them(states, named):
    with pytest.raises(TypeError, match=r"calibrate_layerwise: " + named):
        qstats.calibrate_layerwise(_meta_model(), "no_checkpoint_needed", [torch.zeros(1, 2)], RECIPE, states=states,
                                   progress=False)


def test_calibrate_states_that_are_no_tree_raise_a_type_error_naming_them():
    with pytest.raises(TypeError, match=r"calibrate: states must be a dict .* got list"):
        qstats.calibrate(torch.nn.Linear(2, 2), [torch.zeros(1, 2)], RECIPE, states=[1], progress=False)


def test_calibrate_states_of_a_site_the_recipe_does_not_observe_raise_naming_it():
    with pytest.raises(ValueError, match=r"calibrate: the given states hold site 'input' of module 'other'"):
        qstats.calibrate(torch.nn.Linear(2, 2), [torch.zeros(1, 2)], RECIPE, states={"other": {"input": None}},
                         progress=False)
