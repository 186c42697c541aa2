"""The coreai_opt convention has integer zero points only: coreai_opt's fake quantization adds the zero
point to ``round(x / scale)`` in code units, so torchao's float zero point (in input units) would shift
every code. Reference: an independent computation (fake quantization of values inside the calibrated
range errs by at most half a step)."""

import pytest
import torch

import qstats


def test_a_float_zero_point_domain_is_refused_under_the_coreai_opt_convention():
    # before: accepted; uint8 asymmetric over [0.5, 3] fake-quantized most values to the range's low end
    with pytest.raises(ValueError, match=r"zero_point_domain 'float' with convention='coreai_opt'"):
        qstats.QuantSpec(dtype="uint8", mapping="asymmetric", zero_point_domain="float", convention="coreai_opt")


def test_the_integer_domain_fake_quantizes_within_half_a_step():
    spec = qstats.QuantSpec(dtype="uint8", mapping="asymmetric", convention="coreai_opt")
    x = torch.linspace(0.5, 3.0, 101)
    obs = qstats.minmax(spec)
    qp = qstats.compute_qparams(obs.update(obs.init(x), x), spec)
    assert (qstats.fake_quantize(x, qp, spec) - x).abs().max() <= qp.scale.max() / 2 * (1 + 1e-4)
