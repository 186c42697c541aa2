"""qstats.report's clipped_fraction for float formats: a value is clipped where saturation changes
its code, i.e. where rounding to the nearest value of the format's grid continued one step past its
maximum (fp8 e4m3's 480, fp4's 8) would pick that next value, as integer codes count those that
round outside the range. A scaled 448.0001 rounds to fp8's 448 with or without the clamp."""

import pytest
import torch

import qstats

pytest.importorskip("compressed_tensors")
from compressed_tensors.quantization import preset_name_to_scheme  # noqa: E402
from compressed_tensors.quantization.lifecycle.forward import fake_quantize as ct_fake_quantize  # noqa: E402


def _weight_row(scheme, out_features=512):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, out_features)).eval()
    recipe = qstats.Recipe.from_scheme(scheme)
    states = qstats.calibrate(model, [torch.randn(2, 256)], recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    (row,) = [row for row in qstats.report(states, qparams, model, recipe) if row.site == "weight"]
    return model[0].weight.detach(), qparams["0"]["weight"], row


def _clipped_by_nearest(scaled, grid):
    """The fraction of ``scaled`` whose nearest value on ``grid`` (non-negative, extended one step
    past the format's maximum) is that extra step."""
    nearest = (scaled.abs().reshape(-1, 1) - grid).abs().argmin(dim=1)
    return float((nearest == len(grid) - 1).double().mean())


def test_fp8_per_channel_weights_scaled_to_their_maximum_are_not_clipped():
    """Each channel's amax maps to 448 up to float rounding (448.00003): counted as clipped (0.00057
    of the weights, about half the channels' maxima) though the clamp changes no code."""
    weight, qp, row = _weight_row("FP8_DYNAMIC")
    scale = qp.scale.reshape(-1, 1)
    args = preset_name_to_scheme("FP8_DYNAMIC", ["Linear"]).weights
    scaled = weight / scale
    assert float(scaled.abs().max()) > 448  # some maxima do land past 448 by a rounding error
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = torch.cat([codes[torch.isfinite(codes) & (codes >= 0)].unique(), torch.tensor([480.0])])
    assert row.clipped_fraction == _clipped_by_nearest(scaled, grid) == 0.0
    # compressed-tensors' fake quantization of those maxima is the channel's amax itself
    quantized = ct_fake_quantize(weight, scale, torch.zeros_like(scale), args)
    assert torch.allclose(quantized.abs().amax(dim=1), weight.abs().amax(dim=1), rtol=1e-6)


@pytest.mark.parametrize("scheme", ["NVFP4A16", "MXFP4A16"])
def test_fp4_weights_count_the_values_that_round_past_six(scheme):
    """NVFP4's fp8-rounded block scales put block maxima up to 6.375: these round to 6 either way,
    but were counted as clipped (3% of the weights). MX's power-of-two scales (mantissa rounded,
    then floored) put maxima between 6 and 7: these too round to 6 (0.2% were counted)."""
    weight, qp, row = _weight_row(scheme)
    blocks = weight.reshape(weight.shape[0], qp.scale.shape[1], -1)
    step = qp.scale.float()
    if scheme == "NVFP4A16":
        step = step / qp.global_scale.float()  # compressed-tensors' two-level step
    scaled = blocks / step[..., None]
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0])
    expected = _clipped_by_nearest(scaled, grid)
    assert row.clipped_fraction == pytest.approx(expected, abs=1e-12)


def test_fp8_weights_under_a_smaller_scale_count_the_values_past_464():
    """Under half the calibrated scales, the values whose nearest grid value is past 448 are clipped."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512)).eval()
    recipe = qstats.Recipe.from_scheme("FP8_DYNAMIC")
    states = qstats.calibrate(model, [torch.randn(2, 256)], recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    qp = qparams["0"]["weight"]
    qparams["0"]["weight"] = qp._replace(scale=qp.scale / 2)
    (row,) = [row for row in qstats.report(states, qparams, model, recipe) if row.site == "weight"]
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = torch.cat([codes[torch.isfinite(codes) & (codes >= 0)].unique(), torch.tensor([480.0])])
    scaled = model[0].weight.detach() / (qp.scale.reshape(-1, 1) / 2)
    expected = _clipped_by_nearest(scaled, grid)
    assert expected > 0.001 and row.clipped_fraction == pytest.approx(expected, abs=1e-12)
