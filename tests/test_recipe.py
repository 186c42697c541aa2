"""qstats.Recipe and its Plan: rule resolution (first rule wins, ignore, class names as
compressed-tensors matches them, rules that select nothing), and a Plan resolved once serving
calibrate, compute_qparams_tree, fake_quantized, report and the export with the results of the
recipe itself."""

import dataclasses
import json
import warnings

import pytest
import torch

import qstats
from qstats.recipe import Plan

WEIGHT_SPEC = qstats.QuantSpec(dtype="int8", mapping="symmetric", granularity=qstats.PerAxis(0))
INPUT_SPEC = qstats.QuantSpec(dtype="int8", mapping="symmetric")


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3)).eval()


def _recipe():
    return qstats.Recipe([qstats.Rule("Linear", sites=("weight",), spec=WEIGHT_SPEC),
                          qstats.Rule("Linear", sites=("input",), spec=INPUT_SPEC)])


def _batches():
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(4, 6, generator=generator) * (i + 1) for i in range(3)]


def test_recipe_resolution_first_rule_wins_and_ignore():
    model = torch.nn.Sequential(
        torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    )
    first = qstats.QuantSpec(dtype="int8")
    second = qstats.QuantSpec(dtype="int4")
    recipe = qstats.Recipe(
        [
            qstats.Rule(r"re:1\.\d+", sites=("weight",), spec=first),
            qstats.Rule("Linear", sites=("weight", "input"), spec=second),
        ],
        ignore=["1.1"],
    )
    sites = recipe.sites(model)
    assert list(sites) == ["0", "1.0"]
    assert sites["0"]["weight"].spec == second
    assert sites["1.0"]["weight"].spec == first
    assert sites["1.0"]["input"].spec == second
    assert recipe.rule_for("1.1", "weight") is None
    states = qstats.calibrate(model, [torch.randn(3, 2)], recipe, progress=False)
    observers = recipe.observers(states, model)
    specs = recipe.specs(states, model)
    assert observers["1.0"]["weight"].spec == first and specs["0"]["input"] == second


def test_class_targets_match_subclasses_like_compressed_tensors():
    match = pytest.importorskip("compressed_tensors.utils.match")
    torch.manual_seed(0)
    # nn.MultiheadAttention's out_proj is a NonDynamicallyQuantizableLinear, a subclass of nn.Linear
    model = torch.nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16).eval()
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("weight",))])
    expected = [name for name, module in model.named_modules() if match.is_match(name, module, "Linear")]
    assert "self_attn.out_proj" in expected
    assert list(recipe.sites(model)) == expected
    assert recipe.rule_for("self_attn.out_proj", "weight", model.self_attn.out_proj) is recipe.rules[0]


def test_rules_that_select_nothing_warn_naming_the_site():
    """A misspelt site or target selects nothing; the recipe says so instead of observing less."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    typo_site = qstats.Recipe([qstats.Rule(targets="Linear", sites=("wieght", "input"), spec=qstats.QuantSpec())])
    with pytest.warns(UserWarning, match=r"selects no site \['wieght'\]"):
        sites = typo_site.sites(model)
    assert {site for entry in sites.values() for site in entry} == {"input"}
    typo_target = qstats.Recipe([qstats.Rule(targets="Lienar", sites=("weight",), spec=qstats.QuantSpec())])
    with pytest.warns(UserWarning, match=r"\['Lienar'\] selects no site \['weight'\]"):
        assert typo_target.sites(model) == {}
    fine = qstats.Recipe([qstats.Rule(targets="Linear", sites=("weight", "input"), spec=qstats.QuantSpec())])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert set(fine.sites(model)) == {"0", "2"}


class _Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.q_proj(x) + self.k_proj(x)


def test_plan_holds_each_site_with_its_kind_the_modules_and_fused_groups():
    model = torch.nn.Sequential(_Attention()).eval()
    recipe = qstats.Recipe([
        qstats.Rule("_Attention", sites=("q", "k", "v", "output")),
        qstats.Rule("Linear", sites=("weight", "bias", "input")),
    ])
    with pytest.warns(UserWarning, match=r"selects no site \['v'\]"):
        plan = recipe.resolve(model)
    assert plan.model is model and plan.recipe is recipe
    assert plan.modules["0.q_proj"] is model[0].q_proj
    kinds = {(path, site): found.kind for path, entry in plan.sites.items() for site, found in entry.items()}
    assert kinds == {
        ("0", "q"): "projection", ("0", "k"): "projection", ("0", "output"): "output",
        ("0.q_proj", "weight"): "parameter", ("0.q_proj", "bias"): "parameter", ("0.q_proj", "input"): "input",
        ("0.k_proj", "weight"): "parameter", ("0.k_proj", "bias"): "parameter", ("0.k_proj", "input"): "input",
    }
    assert plan.hooked_module("0", "k") is model[0].k_proj and plan.hooked_module("0", "output") is model[0]
    assert torch.equal(plan.parameter("0.q_proj", "bias"), model[0].q_proj.bias)
    assert plan.fused_groups == ()
    # read-only: a plan is computed once and shared
    with pytest.raises(TypeError):
        plan.sites["0"]["q"] = None
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.sites = {}
    # Recipe.sites: the same sites, as plain dicts
    with pytest.warns(UserWarning):
        sites = recipe.sites(model)
    assert {(path, site): found.kind for path, entry in sites.items() for site, found in entry.items()} == kinds
    assert type(sites) is dict and all(type(entry) is dict for entry in sites.values())


def _outputs(model, qparams, recipe, x):
    with torch.no_grad(), qstats.fake_quantized(model, qparams, recipe):
        return model(x)


def test_every_consumer_takes_a_plan_and_resolves_a_recipe_once(tmp_path, monkeypatch):
    model, recipe, batches = _model(), _recipe(), _batches()
    resolved = []
    resolve = qstats.Recipe.resolve

    def counting(self, on):
        resolved.append(on)
        return resolve(self, on)

    monkeypatch.setattr(qstats.Recipe, "resolve", counting)
    states = qstats.calibrate(model, batches, recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    out = _outputs(model, qparams, recipe, batches[0])
    report = qstats.report(states, qparams, model, recipe, batches)
    config = qstats.export.compressed_tensors(model, qparams, str(tmp_path / "recipe"), recipe)
    assert len(resolved) == 5 and all(on is model for on in resolved)  # once per call

    plan = recipe.resolve(model)
    assert isinstance(plan, Plan) and len(resolved) == 6
    plan_states = qstats.calibrate(model, batches, plan, progress=False)
    plan_qparams = qstats.compute_qparams_tree(plan_states, plan)
    plan_out = _outputs(model, plan_qparams, plan, batches[0])
    plan_report = qstats.report(plan_states, plan_qparams, recipe=plan, batches=batches)
    plan_config = qstats.export.compressed_tensors(model, plan_qparams, str(tmp_path / "plan"), plan)
    assert len(resolved) == 6  # nothing resolved again

    for path, entry in states.items():
        for site, state in entry.items():
            assert all(torch.equal(a, b) for a, b in zip(state, plan_states[path][site])), (path, site)
            assert all(torch.equal(a, b) for a, b in zip(qparams[path][site], plan_qparams[path][site]))
    assert torch.equal(out, plan_out)
    assert report.rows == plan_report.rows and report.rows[0].sqnr_db is not None
    assert json.dumps(config, sort_keys=True) == json.dumps(plan_config, sort_keys=True)
    with open(tmp_path / "recipe" / "model.safetensors", "rb") as a, open(tmp_path / "plan" / "model.safetensors", "rb") as b:
        assert a.read() == b.read()


def test_a_plan_of_another_model_is_refused():
    plan = _recipe().resolve(_model())
    other = _model()
    with pytest.raises(ValueError, match="another model"):
        qstats.calibrate(other, _batches(), plan, progress=False)
    with pytest.raises(ValueError, match="another model"):
        qstats.compute_qparams_tree({}, plan, other)
    with pytest.raises(ValueError, match="another model"):
        with qstats.fake_quantized(other, {}, plan):
            pass
    with pytest.raises(TypeError, match="Recipe or Plan"):
        qstats.compute_qparams_tree({}, "Linear", other)
    with pytest.raises(TypeError, match="nn.Module"):
        qstats.compute_qparams_tree({}, _recipe())


# --------------------------------------------------------------------------------------------
# shared sites: torch.ao's ReuseInputObserver


class _Reshape(torch.nn.Module):
    def forward(self, x):
        return x.reshape(x.shape[0], -1, 2)


class _Triple(torch.nn.Module):
    def forward(self, x):
        return 3 * x


def test_shared_output_reuses_the_input_observer_as_torch_ao_fx_does():
    """torch.ao FX with ``reshape`` under ReuseInputObserver (as its default qconfig mappings set
    it): the reshape's output shares the observer instance of its input (the Linear's output).
    The recipe sharing ``1:output`` with ``0:output`` gives both torch.ao's qparams of that one
    observer."""
    from torch.ao.quantization import QConfigMapping, default_qconfig, default_reuse_input_qconfig
    from torch.ao.quantization.quantize_fx import prepare_fx

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(8, 6)

        def forward(self, x):
            return self.linear(x).reshape(x.shape[0], -1, 2)

    torch.manual_seed(0)
    reference = Model().eval()
    batches = [torch.randn(4, 8, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    mapping = QConfigMapping().set_global(default_qconfig).set_object_type("reshape", default_reuse_input_qconfig)
    prepared = prepare_fx(reference, mapping, example_inputs=(batches[0],))
    for x in batches:
        prepared(x)
    node_targets = [n.target for n in prepared.graph.nodes if n.op == "call_module" and "activation_post_process" in str(n.target)]
    assert len(node_targets) == 3  # input, linear output, reshape output
    linear_obs, reshape_obs = prepared.get_submodule(node_targets[1]), prepared.get_submodule(node_targets[2])
    assert linear_obs is reshape_obs  # one instance observes both
    assert isinstance(linear_obs, torch.ao.quantization.MinMaxObserver)
    scale, zero_point = linear_obs.calculate_qparams()

    model = torch.nn.Sequential(reference.linear, _Reshape()).eval()
    spec = qstats.QuantSpec.from_torch_ao(linear_obs.dtype, linear_obs.qscheme, quant_min=linear_obs.quant_min,
                                          quant_max=linear_obs.quant_max)
    recipe = qstats.Recipe([qstats.Rule(("0", "1"), sites=("output",), observer="minmax", spec=spec)],
                           shared={"1:output": "0:output"})
    plan = recipe.resolve(model)
    assert plan.state_keys("1", "output") == (("0", "output"), ("1", "output"))
    states = qstats.calibrate(model, batches, plan, progress=False)  # one state, threaded through both sites
    assert states["0"]["output"] is states["1"]["output"]
    qparams = qstats.compute_qparams_tree(states, plan)
    for path in ("0", "1"):
        assert torch.equal(qparams[path]["output"].scale.reshape(()), scale.reshape(()))
        assert torch.equal(qparams[path]["output"].zero_point.reshape(()).to(zero_point.dtype), zero_point.reshape(()))


@pytest.mark.parametrize("reference_cls, observer", [
    (torch.ao.quantization.MinMaxObserver, "minmax"),
    (torch.ao.quantization.MovingAverageMinMaxObserver, "moving_average_minmax"),
])
def test_shared_sites_observe_both_tensors_into_one_state(reference_cls, observer):
    """A shared state holds both sites' tensors in call order, as one torch.ao observer instance
    called on both (PT2E's SharedQuantizationSpec), whatever the values (the second is 3x the first)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), _Triple()).eval()
    batches = [torch.randn(4, 8, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    reference = reference_cls(dtype=torch.quint8)
    with torch.no_grad():
        for x in batches:
            y = model[0](x)
            reference(y)
            reference(model[1](y))
    scale, zero_point = reference.calculate_qparams()
    spec = qstats.QuantSpec.from_torch_ao(torch.quint8, torch.per_tensor_affine)
    recipe = qstats.Recipe([qstats.Rule(("0", "1"), sites=("output",), observer=observer, spec=spec)],
                           shared={"1:output": "0:output"})
    plan = recipe.resolve(model)
    states = qstats.calibrate(model, batches, plan, progress=False)
    qparams = qstats.compute_qparams_tree(states, plan)
    for path in ("0", "1"):
        assert torch.equal(qparams[path]["output"].scale.reshape(()), scale.reshape(()))
        assert torch.equal(qparams[path]["output"].zero_point.reshape(()).to(zero_point.dtype), zero_point.reshape(()))
    # not shared: each site has its own range
    unshared = qstats.Recipe(recipe.rules).resolve(model)
    alone = qstats.compute_qparams_tree(qstats.calibrate(model, batches, unshared, progress=False), unshared)
    assert not torch.equal(alone["0"]["output"].scale, alone["1"]["output"].scale)
    assert plan.share_states(states)["0"]["output"] is states["0"]["output"]  # shared already: unchanged


@pytest.mark.parametrize("shared, match", [
    ({"1:output": "0:weight"}, "is a parameter"),
    ({"1:output": "2:output"}, "observes no site 'output' of module '2'"),
    ({"1output": "0:output"}, "must be '<module path>:<site>'"),
    ({"1:output": "0:output", "0:output": "1:input"}, "itself shares"),
])
def test_bad_shared_sites_are_refused(shared, match):
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), _Triple())
    with pytest.raises(ValueError, match=match):
        qstats.Recipe([qstats.Rule(("0", "1"), sites=("weight", "input", "output"))], shared=shared).resolve(model)


def test_shared_sites_need_one_observer_and_spec():
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), _Triple())
    recipe = qstats.Recipe([qstats.Rule("0", sites=("output",)), qstats.Rule("1", sites=("output",), observer="histogram")],
                           shared={"1:output": "0:output"})
    with pytest.raises(ValueError, match="same observer"):
        recipe.resolve(model)


def test_ignore_entries_that_match_no_module_warn_naming_them():
    """A misspelt ignore entry ignores nothing, so the module it meant is observed: the recipe says so."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    rules = [qstats.Rule(targets="Linear", sites=("weight",), spec=qstats.QuantSpec())]
    typo = qstats.Recipe(rules, ignore=["2", "haed", "re:1\\d", "ReLU"])
    with pytest.warns(UserWarning, match=r"ignore entry 'haed' matches no module") as caught:
        assert set(typo.sites(model)) == {"0"}
    unmatched = [str(w.message) for w in caught if "ignore entry" in str(w.message)]
    assert len(unmatched) == 2 and "'re:1\\\\d'" in unmatched[1]
    fine = qstats.Recipe(rules, ignore=["2", "re:[12]", "ReLU", "Sequential"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert set(fine.sites(model)) == {"0"}
        qstats.Recipe.from_scheme("W8A8").resolve(model)  # no ignore entries of its own


@pytest.mark.parametrize("dtype", [torch.bfloat16, "bfloat16", "torch.float16"])
def test_from_dict_scheme_passes_observed_dtype_and_the_schemes_own_targets(dtype):
    """``{"scheme": ..., "observed_dtype": ...}`` was accepted and dropped (qparams computed in
    float32, not in the weights' dtype), and the scheme's own targets were replaced by "Linear"."""
    name = dtype if isinstance(dtype, torch.dtype) else getattr(torch, dtype.removeprefix("torch."))
    recipe = qstats.Recipe.from_dict({"scheme": "FP8", "observed_dtype": dtype})
    assert recipe.rules == qstats.Recipe.from_scheme("FP8", observed_dtype=name).rules
    assert {rule.spec.compute_dtype for rule in recipe.rules} == {str(name).removeprefix("torch.")}
    scheme = {"targets": ["re:.*mlp.*"], "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}}
    assert qstats.Recipe.from_dict({"scheme": scheme}).rules[0].targets == ("re:.*mlp.*",)


def test_static_group_activations_of_a_compressed_tensors_config_are_refused():
    """A checkpoint config with static per-group inputs (what llm-compressor's oneshot writes for
    them, though compressed-tensors' forward cannot apply those scales) used to give a run-time
    site, calibrated and exported as dynamic; it is refused, naming the configuration. Dynamic
    groups, NVFP4's two-level inputs and per-group specs of hand-written rules still take their
    scales at run time."""
    quantization = pytest.importorskip("compressed_tensors.quantization")
    from compressed_tensors.quantization.quant_scheme import NVFP4

    def config(inputs):
        scheme = quantization.QuantizationScheme(
            targets=["Linear"], weights=quantization.QuantizationArgs(num_bits=8, strategy="channel"),
            input_activations=inputs)
        return quantization.QuantizationConfig(config_groups={"group_0": scheme}).model_dump()

    group = dict(num_bits=8, symmetric=False, strategy="group", group_size=16)
    model = torch.nn.Sequential(torch.nn.Linear(32, 8)).eval()
    static = config(quantization.QuantizationArgs(**group, dynamic=False))
    with pytest.raises(ValueError, match=r"from_compressed_tensors: the input args: static per-group activations"):
        qstats.Recipe.from_compressed_tensors(static)
    for inputs in (quantization.QuantizationArgs(**group, dynamic=True), NVFP4["input_activations"]):
        plan = qstats.Recipe.from_compressed_tensors(config(inputs)).resolve(model)
        assert plan.sites["0"]["input"].runtime and not plan.sites["0"]["weight"].runtime
    hand_written = qstats.QuantSpec.from_compressed_tensors(quantization.QuantizationArgs(**group))
    for spec in (qstats.preset("mxfp8"), hand_written):
        own = qstats.Recipe([qstats.Rule("Linear", sites=("input",), spec=spec)]).resolve(model)
        assert own.sites["0"]["input"].runtime
