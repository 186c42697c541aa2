"""Defects found in review of model calibration, recipes, reports and plots; each test failed before
its fix and checks against a reference library (torch, compressed-tensors) or plain torch arithmetic."""

import math
import warnings

import pytest
import torch

import qstats


class _Masked(torch.nn.Module):
    def __init__(self, features):
        super().__init__()
        self.proj = torch.nn.Linear(features, 3)

    def forward(self, x, attention_mask):
        return self.proj(x)


@pytest.mark.parametrize(
    "axis, shape, mask",
    [
        # PerAxis(1) on [B, T, H] with T == H: one set of parameters per token position
        (1, (2, 4, 4), [[1, 1, 1, 0], [1, 1, 0, 0]]),
        # PerAxis(0): one per sequence, while the kept tokens (2) happen to equal the batch size
        (0, (2, 3, 4), [[1, 1, 0], [0, 0, 0]]),
    ],
)
def test_observation_weight_on_an_axis_of_the_masked_dims(axis, shape, mask):
    """Padding is masked per position of the axis the parameters follow, not by flattening tokens."""
    torch.manual_seed(0)
    x = torch.randn(*shape)
    mask = torch.tensor(mask)
    model = _Masked(shape[-1]).eval()
    spec = qstats.QuantSpec(granularity=qstats.PerAxis(axis), on_uncalibrated="fallback")
    recipe = qstats.Recipe([qstats.Rule("proj", sites=("input",), spec=spec)])
    batches = [{"x": x, "attention_mask": mask}]
    states = qstats.calibrate(model, batches, recipe, progress=False, observation_weight=lambda b: b["attention_mask"])
    keep = mask.bool()[..., None].expand(x.shape)
    others = tuple(d for d in range(x.ndim) if d != axis)
    expected_min = torch.where(keep, x, torch.inf).amin(others)
    expected_max = torch.where(keep, x, -torch.inf).amax(others)
    state = states["proj"]["input"]
    assert torch.equal(state.min_val, expected_min)
    assert torch.equal(state.max_val, expected_max)


class _Attention(torch.nn.Module):
    """Called with its hidden states by keyword; returns a tuple, like transformers' attention."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, hidden_states, attention_mask=None):
        return self.proj(hidden_states), None


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = _Attention()

    def forward(self, x):
        return self.attention(hidden_states=x)[0]


def test_fake_quantized_applies_keyword_inputs_and_tuple_outputs_like_torch():
    torch.manual_seed(0)
    model = _Block().eval()
    spec = qstats.QuantSpec.from_torch_ao(dtype=torch.quint8, qscheme=torch.per_tensor_affine)
    recipe = qstats.Recipe([qstats.Rule("_Attention", sites=("input", "output"), spec=spec)])
    batches = [torch.randn(5, 4) for _ in range(2)]
    states = qstats.calibrate(model, batches, recipe, progress=False)
    assert sorted(states["attention"]) == ["input", "output"]
    qparams = qstats.compute_qparams_tree(states, recipe, model)

    def torch_fake_quant(x, qp):
        return torch.fake_quantize_per_tensor_affine(x, float(qp.scale), int(qp.zero_point), 0, 255)

    x = torch.randn(5, 4) * 2
    with torch.no_grad():
        expected_input = torch_fake_quant(x, qparams["attention"]["input"])
        expected = torch_fake_quant(model.attention.proj(expected_input), qparams["attention"]["output"])
        seen = []
        handle = model.attention.proj.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
        with qstats.fake_quantized(model, qparams, recipe):
            out = model(x)
        handle.remove()
    assert torch.equal(seen[0], expected_input)
    assert torch.equal(out, expected)
    with torch.no_grad():  # and everything is removed on exit
        assert torch.equal(model(x), model.attention.proj(x))


def test_report_leaves_padding_out_with_a_float_zero_point():
    """Zero is not representable with a float zero point: padding must not count as noise or clipping."""
    torch.manual_seed(0)
    model = _Masked(4).eval()
    spec = qstats.QuantSpec(
        dtype="uint8", mapping="asymmetric", zero_point_domain="float", granularity=qstats.PerAxis(-1)
    )
    recipe = qstats.Recipe([qstats.Rule("proj", sites=("input",), spec=spec)])
    x = torch.rand(2, 5, 4) + 1.0
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    batches = [{"x": x, "attention_mask": mask}]
    weight = lambda batch: batch["attention_mask"]  # noqa: E731
    states = qstats.calibrate(model, batches, recipe, progress=False, observation_weight=weight)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    row = qstats.report(states, qparams, model=model, recipe=recipe, batches=batches, observation_weight=weight).rows[0]

    qp = qparams["proj"]["input"]
    kept = x[mask.bool()]
    quantized = torch.fake_quantize_per_channel_affine(kept, qp.scale, qp.zero_point, 1, 0, 255)
    expected_sqnr = 10 * math.log10(float(kept.pow(2).sum()) / float((kept - quantized).pow(2).sum()))
    assert row.clipped_fraction == 0.0  # every kept value lies within the calibrated range
    assert row.sqnr_db == pytest.approx(expected_sqnr, rel=1e-5)


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


def test_sites_that_saw_no_data_are_named():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2)).eval()
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("weight", "input"))])
    with pytest.warns(qstats.UncalibratedWarning, match=r"batches was empty.*0\.input, 2\.input"):
        states = qstats.calibrate(model, [], recipe, progress=False)
    assert sorted(states["0"]) == ["weight"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qstats.calibrate(model, [torch.randn(2, 4)], recipe, progress=False)
    with pytest.raises(TypeError, match="observation_weight"):
        qstats.calibrate(model, [torch.randn(2, 4)], recipe, progress=False, observation_weight=lambda b: [1, 1])


def test_histogram_plot_draws_the_two_level_clipping_range():
    pytest.importorskip("matplotlib")
    torch.manual_seed(0)
    spec = qstats.QuantSpec(dtype="fp4_e2m1", granularity=qstats.TensorGroup(16))
    x = torch.randn(4, 32) * 3
    obs = qstats.histogram(spec, bins=16, octaves=16)
    state = obs.update(obs.init(x), x)
    qparams = qstats.compute_qparams(state, spec)
    figure = qstats.plot.histogram(state, qparams, spec, index=(1, 0))
    lines = [line.get_xdata()[0] for line in figure.axes[0].get_lines()]
    # a symmetric block scale maps the block's largest magnitude to the format's maximum
    amax = float(x[1, :16].abs().max())
    assert lines == [pytest.approx(-amax, rel=1e-4), pytest.approx(amax, rel=1e-4)]


def test_resumed_states_of_another_model_or_observer_are_refused_naming_the_site():
    torch.manual_seed(0)
    spec = qstats.QuantSpec(granularity=qstats.PerAxis(0))
    small = torch.nn.Sequential(torch.nn.Linear(4, 3)).eval()
    wide = torch.nn.Sequential(torch.nn.Linear(4, 5)).eval()
    weights = qstats.Recipe([qstats.Rule("Linear", sites=("weight",), spec=spec)])
    other = qstats.calibrate(wide, [], weights, progress=False)
    # a weight state of another shape was kept as is, and its qparams had 5 channels for 3
    with pytest.raises(ValueError, match=r"states\['0'\]\['weight'\].*\(5,\) .*\(3,\)"):
        qstats.calibrate(small, [torch.randn(2, 4)], weights, states=other, progress=False)
    inputs = qstats.Recipe([qstats.Rule("Linear", sites=("input",))])
    states = qstats.calibrate(small, [torch.randn(2, 4)], inputs, progress=False)
    histograms = qstats.Recipe([qstats.Rule("Linear", sites=("input",), observer=qstats.histogram)])
    with pytest.raises(TypeError, match=r"module '0' site 'input'.*HistogramState"):
        qstats.calibrate(small, [torch.randn(2, 4)], histograms, states=states, progress=False)


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


def test_observer_error_with_a_custom_constructor_is_raised_unchanged():
    # calibrate prefixes observer errors with the module and site by rebuilding them from a
    # message; an error type built from other arguments surfaced as an unrelated TypeError
    class ShapeMismatch(ValueError):
        def __init__(self, expected, got):
            super().__init__(f"expected {expected}, got {got}")
            self.expected, self.got = expected, got

    base = qstats.minmax(qstats.QuantSpec("int8"))

    def update(state, x, weight=None):
        raise ShapeMismatch((4,), tuple(x.shape))

    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("input",), observer=lambda spec, **kw: base._replace(update=update))])
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    with pytest.raises(ShapeMismatch) as caught:
        qstats.calibrate(model, [torch.randn(2, 4)], recipe, progress=False)
    assert caught.value.got == (2, 4)

    def plain(state, x, weight=None):
        raise ValueError("bad state")

    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("input",), observer=lambda spec, **kw: base._replace(update=plain))])
    with pytest.raises(ValueError, match=r"module '0' site 'input': bad state"):
        qstats.calibrate(model, [torch.randn(2, 4)], recipe, progress=False)
