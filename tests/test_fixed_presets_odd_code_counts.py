"""tanh_qparams on integer codes of an odd count (narrow int8's 255, as ModelOpt's int8; narrow int4's
15; a custom [0, 254]): the zero point centres [-1, 1) on the codes, so every value of it fake-quantizes
within half a step, where torch's own quint8/qint8 presets stay within one step. Its zero point was
round(127.5) = 128 (Python rounds half to even): the top code stood 1.5 steps below 1, and saturated
tanh outputs near 1 lost three times the error of the centred choice."""

import pytest
import torch

import qstats

_VALUES = torch.cat([torch.linspace(-1.0, 1.0, 20001)[:-1], torch.tensor([0.9999, -0.9999])])


def _max_error(scale: float, zero_point: int, quant_min: int, quant_max: int) -> float:
    """torch's fake quantization of [-1, 1) under the given constants, its largest error in steps."""
    quantized = torch.fake_quantize_per_tensor_affine(_VALUES, scale, zero_point, quant_min, quant_max)
    return float((quantized - _VALUES).abs().max()) / scale


def test_torch_presets_stay_within_one_step():
    # the reference bound: torch.ao's tanh constants, quint8 and qint8 (torch's quantized tanh)
    assert _max_error(2 / 256, 128, 0, 255) < 1.0
    assert _max_error(2 / 256, 0, -128, 127) < 1.0


@pytest.mark.parametrize("spec", [
    qstats.QuantSpec(dtype="int8", mapping="narrow"),
    qstats.QuantSpec(dtype="int4", mapping="narrow"),
    qstats.QuantSpec(dtype="int8", mapping="narrow", convention="torchao"),
    qstats.QuantSpec.from_torch_ao(torch.quint8, quant_min=0, quant_max=254),
    qstats.QuantSpec.from_torch_ao(torch.qint8, quant_min=-64, quant_max=62),
], ids=["narrow-int8", "narrow-int4", "narrow-int8-torchao", "quint8-0-254", "qint8-127-codes"])
def test_tanh_preset_of_an_odd_code_count_is_within_half_a_step(spec):
    obs = qstats.tanh_qparams(spec)
    qp = qstats.compute_qparams(obs.init(_VALUES), spec)
    quant_min, quant_max = spec.qrange
    assert (quant_max - quant_min + 1) % 2 == 1
    scale, zero_point = float(qp.scale), int(qp.zero_point)
    assert scale == pytest.approx(2 / (quant_max - quant_min + 1), rel=1e-6)
    assert _max_error(scale, zero_point, quant_min, quant_max) <= 0.5 + 1e-4
    # qstats' own fake quantization of the preset equals torch's with those constants
    reference = torch.fake_quantize_per_tensor_affine(_VALUES, scale, zero_point, quant_min, quant_max)
    torch.testing.assert_close(qstats.fake_quantize(_VALUES, qp, spec), reference, rtol=0, atol=1e-7)


def test_saturated_tanh_outputs_keep_their_error_at_half_a_step():
    # the outputs of a saturating tanh (most values near -1 and 1) under narrow int8
    spec = qstats.QuantSpec(dtype="int8", mapping="narrow")
    outputs = torch.tanh(torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 4)
    qp = qstats.compute_qparams(qstats.tanh_qparams(spec).init(outputs), spec)
    error = (qstats.fake_quantize(outputs, qp, spec) - outputs).abs().max()
    assert float(error) <= float(qp.scale) / 2 * (1 + 1e-4)
