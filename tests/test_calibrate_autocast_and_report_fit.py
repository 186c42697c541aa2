"""calibrate / observing / report: a model calibrated inside torch.autocast, and report's
errors for QParams that do not fit a tensor. Statistics are compared with llm-compressor's own
Hessian accumulation (float32, outside autocast)."""

import warnings

import pytest
import torch

import qstats

helpers = pytest.importorskip("llmcompressor.modifiers.gptq.helpers")


INT8 = qstats.QuantSpec(dtype="int8")


def _two_layers() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).eval()


def _llmcompressor_hessian(module: torch.nn.Module, inputs) -> torch.Tensor:
    """llm-compressor's unnormalised GPTQ Hessian (``2 * X^T X``, float32) of ``module``'s inputs."""
    features = inputs[0].shape[-1]
    hessian, samples = torch.zeros(features, features), torch.zeros((), dtype=torch.int64)
    for x in inputs:
        hessian, samples = helpers.accumulate_hessian(x, module, hessian, samples)
    return hessian


@pytest.mark.parametrize("driver", ["calibrate", "observing"])
def test_hessian_under_autocast_keeps_float32_products(driver):
    """Under ``torch.autocast("cpu", bfloat16)`` the hooks' X^T X was an autocast matmul, in bf16
    (relative errors ~1e-3); the first layer's fp32 inputs now give llm-compressor's float32 Hessian."""
    model = _two_layers()
    batches = [torch.randn(4, 16, 64) for _ in range(3)]
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("input",), observer=qstats.hessian, spec=INT8)])
    with torch.autocast("cpu", dtype=torch.bfloat16), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if driver == "calibrate":
            states = qstats.calibrate(model, batches, recipe, progress=False)
        else:
            with qstats.observing(model, recipe) as session, torch.no_grad():
                for x in batches:
                    model(x)
            states = session.states
    expected = _llmcompressor_hessian(model[0], batches)
    torch.testing.assert_close(2 * states["0"]["input"].total, expected, rtol=1e-5, atol=1e-4)
    assert int(states["0"]["input"].count) == 3 * 4 * 16


def test_hessian_under_autocast_resumes_outside_it():
    """States calibrated inside autocast resume outside it as if calibrated at once in float32."""
    model = _two_layers()
    batches = [torch.randn(2, 8, 64) for _ in range(2)]
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("input",), observer=qstats.hessian, spec=INT8)])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        first = qstats.calibrate(model, batches[:1], recipe, progress=False)
    both = qstats.calibrate(model, batches[1:], recipe, states=first, progress=False)
    torch.testing.assert_close(2 * both["0"]["input"].total, _llmcompressor_hessian(model[0], batches),
                               rtol=1e-5, atol=1e-4)


def test_report_names_the_site_whose_qparams_do_not_fit_the_tensor():
    """An activation spec indexed by rows (PerAxis(0)) calibrated on 3 rows, measured on 2: report
    raised fake_quantize's bare "qparams of shape (3,) do not match ..." naming no module or site."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8)).eval()
    spec = qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0))
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("weight", "input"), observer=qstats.minmax, spec=spec)])
    states = qstats.calibrate(model, [torch.randn(3, 8)], recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    with pytest.raises(ValueError, match=r"report: module '0' site 'input': qparams of shape \(3,\)"):
        qstats.report(states, qparams, model=model, recipe=recipe, batches=[torch.randn(2, 8)])
    wrong = {**qparams, "2": {**qparams["2"], "weight": qparams["0"]["input"]}}  # 3 scales for 8 rows
    with pytest.raises(ValueError, match=r"report: module '2' parameter 'weight'"):
        qstats.report(states, wrong, model=model, recipe=recipe)


def test_report_warns_when_the_observation_weight_fits_no_activation():
    """calibrate warns that a (batch, tokens + 1) mask fits no activation; report measured the
    padding silently with it. A fitting mask still warns nowhere, and leaves the padding out
    (SQNR of the kept tokens, computed here with torch.ao's fake quantization)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8)).eval()
    spec = qstats.QuantSpec(dtype="uint8", mapping="asymmetric")
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("input",), observer=qstats.minmax, spec=spec)])
    x = torch.randn(2, 5, 8)
    x[1, 3:] *= 100  # padding far outside the kept range
    mask = torch.ones(2, 5)
    mask[1, 3:] = 0
    states = qstats.calibrate(model, [x], recipe, progress=False, observation_weight=lambda _: mask)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    wrong = torch.ones(2, 6)
    with pytest.warns(UserWarning, match="fits no"):
        qstats.report(states, qparams, model=model, recipe=recipe, batches=[x], observation_weight=lambda _: wrong)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        row = qstats.report(states, qparams, model=model, recipe=recipe, batches=[x],
                            observation_weight=lambda _: mask)[0]
    qp = qparams["0"]["input"]
    kept = x[mask != 0]
    quantized = torch.fake_quantize_per_tensor_affine(kept, float(qp.scale), int(qp.zero_point), 0, 255)
    expected = 10 * torch.log10(kept.pow(2).sum() / (kept - quantized).pow(2).sum())
    assert row.sqnr_db == pytest.approx(float(expected), rel=1e-5)
    assert row.clipped_fraction == 0.0
