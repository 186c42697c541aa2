"""qstats.report names bad arguments: batches without the model and recipe that would run them,
and an observation_weight that is not a callable."""

import pytest
import torch

import qstats


def _calibrated():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8)).eval()
    recipe = qstats.Recipe.from_scheme("W8A8")
    batches = [torch.randn(2, 16)]
    states = qstats.calibrate(model, batches, recipe, progress=False)
    return model, recipe, batches, states, qstats.compute_qparams_tree(states, recipe, model)


def test_batches_without_model_and_recipe_are_refused():
    """They were ignored: every activation row came back unmeasured, with no word why."""
    _, _, batches, states, qparams = _calibrated()
    with pytest.raises(ValueError, match="batches are measured through the model"):
        qstats.report(states, qparams, batches=batches)


def test_an_observation_weight_that_is_not_callable_is_refused_by_name():
    """An attention mask passed itself (not a function of the batch) failed with a bare
    "'Tensor' object is not callable" from inside the forward loop."""
    model, recipe, batches, states, qparams = _calibrated()
    with pytest.raises(TypeError, match="observation_weight must be a callable"):
        qstats.report(states, qparams, model, recipe, batches, observation_weight=torch.ones(2))
    rows = qstats.report(states, qparams, model, recipe, batches, observation_weight=lambda batch: torch.ones(2))
    assert all(row.sqnr_db is not None for row in rows)


def test_qparams_of_a_site_the_recipe_does_not_observe_on_this_model_are_refused():
    """States of another model (module "0" here a ReLU) gave rows with no measurement and no word
    why; compute_qparams_tree and fake_quantized refuse the same trees."""
    model, recipe, batches, states, qparams = _calibrated()
    other = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(16, 8)).eval()
    with pytest.raises(ValueError, match="observes no site 'weight' of module '0'"):
        qstats.report(states, qparams, other, recipe, batches)
    with pytest.raises(ValueError, match="observes no site 'weight' of module '0'"):
        with qstats.fake_quantized(other, qparams, recipe):
            pass


@pytest.mark.parametrize("entry", ["state", None])
def test_a_states_entry_that_is_not_a_mapping_of_sites_is_named(entry):
    """A module's state given in place of its ``{site: state}`` mapping (or None) raises a TypeError
    naming the entry, before any site is measured."""
    model, recipe, _, states, qparams = _calibrated()
    bad = {**states, "0": states["0"]["weight"] if entry == "state" else None}
    got = "MinMaxState" if entry == "state" else "NoneType"
    with pytest.raises(TypeError, match=rf"report: states\['0'\] must be a mapping \{{site: state\}}, got {got}"):
        qstats.report(bad, qparams, model, recipe)


def test_sites_with_qparams_and_no_state_get_a_measured_row():
    """A states tree holding only the weight, beside the qparams of weight and input: the input
    was measured (one forward) and then dropped, with no row and no word. Its row now comes after the
    states' rows, with the SQNR of the values the forward feeds it, computed here from torch's own
    fake-quantize kernel; what only its state gives (min, max) is None."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8)).eval()
    spec = qstats.QuantSpec(dtype="int8", mapping="asymmetric")
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("weight", "input"), observer=qstats.minmax, spec=spec)])
    batches = [torch.randn(2, 16)]
    states = qstats.calibrate(model, batches, recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    weights_only = {"0": {"weight": states["0"]["weight"]}}
    rows = qstats.report(weights_only, qparams, model, recipe, batches)
    assert [(row.module, row.site) for row in rows] == [("0", "weight"), ("0", "input")]
    assert rows[1].observer == "minmax" and rows[1].min is None and rows[1].max is None
    qp, x = qparams["0"]["input"], batches[0]
    expected = torch.fake_quantize_per_tensor_affine(x, float(qp.scale), int(qp.zero_point), *spec.qrange)
    sqnr = 10 * torch.log10((x.double() ** 2).sum() / ((x.double() - expected.double()) ** 2).sum())
    assert abs(rows[1].sqnr_db - float(sqnr)) < 1e-3
    # without model and recipe: the row holds what the qparams give
    bare = qstats.report(weights_only, qparams)
    assert (bare[1].module, bare[1].site, bare[1].observer, bare[1].coverage) == ("0", "input", "-", 1.0)


def test_a_state_without_qparams_is_refused_before_any_batch_runs():
    """The refusal came after the model had run over every batch (a long wait on a real calibration
    set for an error known from the trees alone)."""
    model, recipe, batches, states, qparams = _calibrated()
    del qparams["0"]["input"]
    forwards = []
    model[0].register_forward_hook(lambda *args: forwards.append(1))
    with pytest.raises(ValueError, match="qparams has no entry for module '0' site 'input'"):
        qstats.report(states, qparams, model, recipe, (b for b in batches * 3))
    assert forwards == []
