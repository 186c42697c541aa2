"""An error raised while `fake_quantized` computes the scales of a run-time scaled activation site
(per token, per group, a dynamic per-tensor rule) names the module and site in front of its
message, as `calibrate` and `report` name it for the same tensor, and as it is named for the
calibrated sites (docs/calibrate.md)."""

from __future__ import annotations

import warnings

import pytest
import torch

import qstats


def _message(run) -> str:
    with pytest.raises(ValueError) as raised:
        run()
    return str(raised.value)


@pytest.mark.parametrize("granularity", [qstats.PerToken(), qstats.PerGroup(4), qstats.PerTensor()],
                         ids=["token", "group", "tensor"])
def test_a_refused_run_time_range_is_named_by_module_and_site(granularity):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)).eval()
    spec = qstats.QuantSpec(dtype="int8", granularity=granularity, nonfinite="raise")
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("input",), spec=spec, dynamic=True)])
    states = qstats.calibrate(model, [torch.randn(4, 8)], recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    assert qparams["1"]["input"] is None  # run-time scales
    x = torch.randn(4, 8)
    x[0, 0] = float("inf")

    def run_fake_quantized():
        with qstats.fake_quantized(model, qparams, recipe), torch.no_grad():
            model(x)

    got = _message(run_fake_quantized)
    calibrated = _message(lambda: qstats.calibrate(model, [x], recipe, progress=False))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reported = _message(lambda: qstats.report(states, qparams, model=model, recipe=recipe, batches=[x]))
    site = "module '0' site 'input': "
    assert got.startswith("fake_quantized: " + site), got
    assert calibrated.startswith("calibrate: " + site) and reported.startswith("report: " + site)
    assert got.split(site, 1)[1] == calibrated.split(site, 1)[1] == reported.split(site, 1)[1]
