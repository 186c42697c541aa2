"""`qstats.report` on weights whose squares leave float32's range, against an independent float64
SQNR of compressed-tensors' fake quantization under the same scales: float32/bf16 weights near
1e-23 (their squares underflow float32, and so does torch.ao's ``compute_sqnr``) and float64 weights
past float32's maximum (finite values, not NaN/Inf)."""

import math
import warnings

import pytest
import torch

import qstats

warnings.filterwarnings("ignore")
pytest.importorskip("compressed_tensors")
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402
from compressed_tensors.quantization.lifecycle.forward import fake_quantize as ct_fake_quantize  # noqa: E402

ARGS = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")


def _report_and_reference(dtype, magnitude):
    """The report's weight row and compressed-tensors' fake-quantized weight (rounded to the model's dtype)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32)).to(dtype).eval()
    with torch.no_grad():
        model[0].weight.mul_(magnitude)
    spec = qstats.QuantSpec.from_compressed_tensors(ARGS)
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("weight",), spec=spec)])
    states = qstats.calibrate(model, [torch.ones(1, 64, dtype=dtype)], recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    (row,) = qstats.report(states, qparams, model, recipe).rows
    weight, qp = model[0].weight.detach(), qparams["0"]["weight"]
    quantized = ct_fake_quantize(weight, qp.scale[:, None], qp.zero_point[:, None], ARGS).to(dtype)
    return row, weight, quantized, qp


def _sqnr(x, quantized):
    x = x.double()
    return 10 * math.log10(float(x.pow(2).sum()) / float((x - quantized.double()).pow(2).sum()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weights_near_1e_23_have_their_float64_sqnr(dtype):
    """Their squares underflow float32 to 0: 0 signal and 0 noise gave an SQNR of inf (no error)."""
    row, weight, quantized, _ = _report_and_reference(dtype, 1e-22)
    assert float(weight.abs().max()) < 1e-22 and not torch.equal(weight, quantized)
    expected = _sqnr(weight, quantized)
    assert 40 < expected < 60
    assert row.sqnr_db == pytest.approx(expected, rel=1e-6)


def test_float64_weights_past_float32s_range_are_measured_not_counted_nonfinite():
    """A float32 copy made every weight above 3.4e38 an Inf: 1501 of 2048 were left out as
    non-finite, and the SQNR of the rest (48 dB) hid the clipping of the others (3.9 dB)."""
    row, weight, quantized, qp = _report_and_reference(torch.float64, 1e40)
    assert float(weight.abs().max()) > 1e38
    codes = torch.round(weight / qp.scale[:, None])  # in float64, as fake_quantize divides a float64 weight
    assert row.nonfinite == 0
    assert row.sqnr_db == pytest.approx(_sqnr(weight, quantized), rel=1e-6)
    assert row.clipped_fraction == float(((codes < -128) | (codes > 127)).double().mean()) > 0.5
