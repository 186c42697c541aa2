"""qparams computed under one recipe, passed with another: every verb refuses them, naming the site,
and the export's refusal says that the tree may come from another recipe (it said only that the
calibration forward never reached the module, which had weight qparams)."""

import pytest
import torch

import qstats


@pytest.fixture(scope="module")
def calibrated():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128)).eval()
    batches = [torch.randn(4, 5, 128) for _ in range(2)]
    w4a16 = qstats.Recipe.from_scheme("W4A16")
    return model, batches, qstats.compute_qparams_tree(qstats.calibrate(model, batches, w4a16, progress=False),
                                                       w4a16, model)


def test_export_names_another_recipe_where_input_qparams_are_missing(calibrated, tmp_path):
    model, _, qparams = calibrated
    assert set(qparams["0"]) == {"weight"}  # W4A16: no input site
    with pytest.raises(ValueError, match=r"0: the recipe calibrates its site\(s\) \['input'\].*another recipe"):
        qstats.export.compressed_tensors(model, qparams, str(tmp_path / "out"), qstats.Recipe.from_scheme("FP8"))


def test_fake_quantized_and_report_refuse_them_naming_the_site(calibrated):
    model, batches, qparams = calibrated
    fp8 = qstats.Recipe.from_scheme("FP8")
    with pytest.raises(ValueError, match=r"module '0' parameter 'weight': qparams of shape \(128, 1\)"):
        with qstats.fake_quantized(model, qparams, fp8):
            model(batches[0])
    with pytest.raises(ValueError, match=r"module '0' parameter 'weight': qparams of shape \(128, 1\)"):
        qstats.report({}, qparams, model=model, recipe=fp8, batches=batches[:1])
