"""Observers by name (`qstats.observers.register` / `get` / `registered`) and recipes from plain
data: a rule naming its observer calibrates exactly as the rule holding the factory."""

import json

import pytest
import torch

import qstats
from qstats.observers import registry


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 4)).eval()


def _batches():
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(5, 8, generator=generator) for _ in range(3)]


def test_qstats_observers_are_registered_under_their_names():
    names = qstats.observers.registered()
    for name in ("minmax", "memoryless_minmax", "moving_average_minmax", "histogram", "mse", "moments", "imatrix"):
        assert name in names
    assert qstats.observers.get("minmax") is qstats.minmax
    assert qstats.observers.get("moving_average_minmax") is qstats.moving_average_minmax
    assert qstats.observers.get("histogram") is qstats.histogram
    assert qstats.observers.get("imatrix")(qstats.QuantSpec()).name == "imatrix"


def test_unknown_names_are_refused_listing_the_registered_ones():
    with pytest.raises(ValueError, match="unknown observer 'minmaxx'.*moving_average_minmax"):
        qstats.observers.get("minmaxx")
    with pytest.raises(ValueError, match="Rule.observer: unknown observer 'minmaxx'"):
        qstats.Rule("Linear", observer="minmaxx")


def test_registering_a_name_twice_raises_unless_replaced():
    def clipped(spec, clip=1.0):
        return qstats.minmax(spec)._replace(name="clipped")

    def other(spec):
        return qstats.minmax(spec)

    try:
        assert qstats.observers.register("test_clipped", clipped) is clipped
        qstats.observers.register("test_clipped", clipped)  # the same factory again: no change
        with pytest.raises(ValueError, match="registered already"):
            qstats.observers.register("test_clipped", other)
        qstats.observers.register("test_clipped", other, replace=True)
        assert qstats.observers.get("test_clipped") is other
        with pytest.raises(ValueError, match="registered already"):
            qstats.observers.register("minmax", other)
        with pytest.raises(TypeError):
            qstats.observers.register("", other)
        with pytest.raises(TypeError):
            qstats.observers.register("test_not_callable", 3)
    finally:
        registry._FACTORIES.pop("test_clipped", None)


def _states_equal(a, b):
    assert a.keys() == b.keys()
    for path in a:
        assert a[path].keys() == b[path].keys()
        for site in a[path]:
            for x, y in zip(a[path][site], b[path][site]):
                assert torch.equal(x, y), (path, site)


def test_a_rule_naming_its_observer_equals_the_rule_holding_the_factory():
    spec = qstats.QuantSpec("uint8", "asymmetric")
    by_factory = qstats.Recipe([
        qstats.Rule("Linear", sites=("weight",), observer=qstats.minmax, spec=spec),
        qstats.Rule("Linear", sites=("input",), observer=qstats.moving_average_minmax, spec=spec,
                    observer_kwargs={"averaging_constant": 0.1}),
    ])
    by_name = qstats.Recipe([
        qstats.Rule("Linear", sites=("weight",), observer="minmax", spec=spec),
        qstats.Rule("Linear", sites=("input",), observer="moving_average_minmax", spec=spec,
                    observer_kwargs={"averaging_constant": 0.1}),
    ])
    model = _model()
    _states_equal(qstats.calibrate(model, _batches(), by_name, progress=False),
                  qstats.calibrate(model, _batches(), by_factory, progress=False))


def test_recipe_from_plain_data_round_trips_through_json():
    data = json.loads(json.dumps({
        "rules": [
            {"targets": "Linear", "sites": ["weight"], "observer": "minmax",
             "spec": {"dtype": "int8", "granularity": {"PerAxis": {"axis": 0}}}},
            {"targets": "re:2", "sites": ["input"], "observer": "histogram",
             "spec": {"dtype": "uint8", "mapping": "asymmetric"}, "qparams_kwargs": {"method": "l2"}},
            {"targets": "Linear", "sites": ["input"], "observer": "moving_average_minmax",
             "observer_kwargs": {"averaging_constant": 0.5}, "spec": {"dtype": "uint8", "mapping": "asymmetric"}},
        ],
        "ignore": ["1"],
    }))
    recipe = qstats.Recipe.from_dict(data)
    written = qstats.Recipe([
        qstats.Rule("Linear", sites=("weight",), spec=qstats.QuantSpec(granularity=qstats.PerAxis(0))),
        qstats.Rule("re:2", sites=("input",), observer=qstats.histogram, spec=qstats.QuantSpec("uint8", "asymmetric"),
                    qparams_kwargs={"method": "l2"}),
        qstats.Rule("Linear", sites=("input",), observer=qstats.moving_average_minmax,
                    observer_kwargs={"averaging_constant": 0.5}, spec=qstats.QuantSpec("uint8", "asymmetric")),
    ], ignore=["1"])
    assert recipe.rules == written.rules and recipe.ignore == written.ignore
    model = _model()
    _states_equal(qstats.calibrate(model, _batches(), recipe, progress=False),
                  qstats.calibrate(model, _batches(), written, progress=False))


def test_plain_data_specs_from_presets_and_compressed_tensors_args():
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationArgs

    args = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 16}
    recipe = qstats.Recipe.from_dict({"rules": [
        {"targets": "Linear", "sites": ["weight"], "spec": {"compressed_tensors": args}},
        {"targets": "Linear", "sites": ["input"], "spec": {"preset": "fp8_token"}},
    ]})
    assert recipe.rules[0].spec == qstats.QuantSpec.from_compressed_tensors(QuantizationArgs(**args))
    assert recipe.rules[1].spec == qstats.preset("fp8_token")
    assert qstats.Recipe.from_dict({"scheme": "W4A16", "ignore": ["lm_head"]}).rules == \
        qstats.Recipe.from_scheme("W4A16", ignore=["lm_head"]).rules


@pytest.mark.parametrize("data, match", [
    ({"rules": [{"targets": "Linear", "observer": "nope"}]}, r"rules\[0\].*unknown observer 'nope'"),
    ({"rules": [{"targets": "Linear", "obsrver": "minmax"}]}, r"rules\[0\] has unknown keys \['obsrver'\]"),
    ({"rules": [], "ignor": []}, r"unknown keys \['ignor'\]"),
    ({"rules": [{"targets": "Linear", "spec": {"granularity": "PerEverything"}}]}, "unknown granularity 'PerEverything'"),
])
def test_bad_plain_data_is_refused_naming_the_problem(data, match):
    with pytest.raises(ValueError, match=match):
        qstats.Recipe.from_dict(data)


def test_a_single_ignore_name_is_one_target_not_its_characters():
    """``ignore: lm_head`` (a YAML scalar) ignores the module ``lm_head``, as ``Recipe(ignore="lm_head")``."""
    rules = [{"targets": "Linear", "sites": ["weight"], "observer": "minmax",
              "spec": {"dtype": "int8", "granularity": {"PerAxis": {"axis": 0}}}}]
    linear = torch.nn.Linear(4, 4)
    recipe = qstats.Recipe.from_dict({"rules": rules, "ignore": "lm_head"})
    assert recipe.ignore == qstats.Recipe([], ignore="lm_head").ignore == ("lm_head",)
    assert recipe.rule_for("lm_head", "weight", linear) is None
    assert recipe.rule_for("proj", "weight", linear) is not None
    config = {"config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8}}}, "ignore": "lm_head"}
    assert qstats.Recipe.from_compressed_tensors(config).ignore == ("lm_head",)


def test_granularity_arguments_that_are_not_a_mapping_are_refused_naming_the_granularity():
    with pytest.raises(ValueError, match=r"granularity 'PerAxis': arguments must be a mapping"):
        qstats.Recipe.from_dict({"rules": [{"targets": "Linear", "spec": {"granularity": {"PerAxis": 0}}}]})


def test_from_scheme_takes_the_schemes_own_targets_unless_given():
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    scheme = QuantizationScheme(targets=["re:.*down$"], weights=QuantizationArgs(num_bits=4, strategy="channel"))
    assert qstats.Recipe.from_scheme(scheme).rules[0].targets == ("re:.*down$",)
    assert qstats.Recipe.from_scheme(scheme, targets="Linear").rules[0].targets == ("Linear",)
    assert qstats.Recipe.from_scheme("W4A16").rules[0].targets == ("Linear",)


def test_unknown_observer_error_says_how_to_register_one():
    with pytest.raises(ValueError, match=r"unknown observer 'rms_rangee'.*\(add one with "
                                         r"qstats\.observers\.register\(name, factory\)\)"):
        qstats.Rule("Linear", observer="rms_rangee")


def test_an_alias_of_a_builtin_factory_keeps_its_name_for_export():
    """``name_of`` picked the first name in sorted order: registering qstats.minmax under an alias that
    sorts first ("absmax") renamed it, and the llm-compressor export wrote no observer for its sites."""
    from types import SimpleNamespace

    from qstats.export.config import llm_compressor_observers

    site = SimpleNamespace(rule=qstats.Rule("Linear", observer=qstats.minmax), kind="activation")
    plan = SimpleNamespace(sites={"fc": {"input": site}})
    try:
        qstats.observers.register("absmax", qstats.minmax)
        assert qstats.observers.get("absmax") is qstats.minmax
        assert registry.name_of(qstats.minmax) == "minmax"
        assert llm_compressor_observers(plan) == {"fc": {"input": ("static_minmax", {})}}
    finally:
        registry._FACTORIES.pop("absmax", None)


@pytest.mark.parametrize("bad", ("MinMaxState", int, tuple, dict, qstats.MinMaxState(*[torch.zeros(())] * 4)), ids=repr)
def test_register_range_rule_refuses_what_is_not_a_namedtuple_state_class(bad):
    """A string, a plain class or a state instance used to be registered silently (the rule was
    never found): a TypeError names what it got. The registry keeps the built-in rules."""
    with pytest.raises(TypeError, match=r"register_range_rule expects a NamedTuple state class, got "):
        qstats.register_range_rule(bad)
    with pytest.raises(TypeError, match="register_range_rule\\(MinMaxState\\): the rule must be callable, got 'rule'"):
        qstats.register_range_rule(qstats.MinMaxState)("rule")
    spec = qstats.QuantSpec.from_torch_ao()
    obs = qstats.minmax(spec)
    x = torch.tensor([-1.0, 2.0])
    scale = qstats.compute_qparams(obs.update(obs.init(x), x), spec).scale
    reference = torch.ao.quantization.MinMaxObserver()
    reference(x)
    assert torch.equal(scale.reshape(1), reference.calculate_qparams()[0])


def test_a_second_state_type_of_the_same_name_is_refused_naming_the_first():
    """The error said only that the name was taken, not by which class, so the author could not
    tell which of two modules to rename."""
    from typing import NamedTuple

    class RegistryReviewTwinState(NamedTuple):
        total: torch.Tensor

    qstats.register_state(RegistryReviewTwinState)
    twin = NamedTuple("RegistryReviewTwinState", [("total", torch.Tensor)])
    twin.__module__ = "someone_elses.observers"
    with pytest.raises(ValueError, match=r"'RegistryReviewTwinState' is already registered, by "
                       r"(tests\.)?test_observer_registry\..*<locals>\.RegistryReviewTwinState"):
        qstats.register_state(twin)
    assert qstats.observers._base.state_types()["RegistryReviewTwinState"] is RegistryReviewTwinState
