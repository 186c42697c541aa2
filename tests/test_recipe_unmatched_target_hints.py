"""A rule whose targets match no module says so (before: "no module it matches has such a parameter",
as if a module matched), and a target or ignore entry naming a module or class in other letter case
gets a hint: names are case-sensitive, as in compressed-tensors' own matching."""

import warnings

import torch
from compressed_tensors.utils import is_match

import qstats


def _model():
    return torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))


def _warnings(recipe, model):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        recipe.resolve(model)
    return [str(w.message) for w in caught if str(w.message).startswith("Recipe:")]


def test_a_target_in_other_case_matches_nothing_as_in_compressed_tensors_and_is_hinted():
    model = _model()
    # the reference: compressed-tensors matches class names case-sensitively
    assert not any(is_match(path, module, ["linear"]) for path, module in model.named_modules())
    assert is_match("0", model[0], ["Linear"])
    spec = qstats.QuantSpec(dtype="int8")
    (message,) = _warnings(qstats.Recipe([qstats.Rule("linear", sites=("weight",), spec=spec)]), model)
    assert "no module matches its targets" in message
    assert "names are case-sensitive: did you mean 'Linear'?" in message


def test_an_ignore_entry_in_other_case_is_hinted():
    model = _model()
    assert not any(is_match(path, module, ["relu"]) for path, module in model.named_modules())
    spec = qstats.QuantSpec(dtype="int8")
    messages = _warnings(qstats.Recipe([qstats.Rule("Linear", sites=("weight",), spec=spec)], ignore=("relu",)), model)
    (message,) = [m for m in messages if "'relu'" in m]
    assert "ignores nothing" in message and "did you mean 'ReLU'?" in message


def test_a_matched_module_without_the_site_keeps_its_reason():
    spec = qstats.QuantSpec(dtype="int8")
    (message,) = _warnings(qstats.Recipe([qstats.Rule("ReLU", sites=("weight",), spec=spec)]), _model())
    assert "no module it matches has such a parameter" in message and "case-sensitive" not in message
