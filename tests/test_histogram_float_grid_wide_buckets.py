"""Histogram "mse"/"l2" on floating-point targets where buckets are wide: the values past the
resolved octaves (default 2**24) share one overflow bucket up to the maximum. Scored at bucket
centres only, that bucket's mass sat at its centre and clipping above it looked free: fp8 ranges
clipped to 2.4 times the full range's squared error. Compared with ModelOpt's HistogramCalibrator
"mse" (its FP8 call fixed, as tests/test_modelopt_searches_zero_points_and_histograms.py does),
scored by ModelOpt's own FP8 fake quantizer."""

from __future__ import annotations

import warnings
from unittest import mock

import pytest
import torch

import qstats

pytestmark = pytest.mark.usefixtures("single_thread_quiet")


@pytest.mark.parametrize("method", ["mse", "l2"])
@pytest.mark.parametrize("magnitude", [1e7, 3e7])  # about 9% and 58% of the values past 2**24
def test_fp8_search_with_values_past_the_resolved_octaves_scores_as_modelopts(magnitude, method):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pytest.importorskip("modelopt.torch.quantization")
        import modelopt.torch.quantization.calib.histogram as modelopt_histogram
        from modelopt.torch.quantization.tensor_quant import ScaledE4M3Function

    x = torch.randn(20000, generator=torch.Generator().manual_seed(0)) * magnitude
    calibrator = modelopt_histogram.HistogramCalibrator(num_bits=(4, 3))
    calibrator.collect(x)

    def fixed(inputs, amax, exponent_bits, mantissa_bits):  # ModelOpt 0.47 passes (4, 3) as (bias, E)
        return ScaledE4M3Function.apply(inputs, amax, None, exponent_bits, mantissa_bits)

    with mock.patch.object(modelopt_histogram, "scaled_e4m3", fixed):
        theirs = calibrator.compute_amax("mse")
    spec = qstats.QuantSpec(dtype="fp8_e4m3fn", zero_point_domain="none")
    obs = qstats.histogram(spec)
    state = obs.update(obs.init(x), x)
    assert int(state.overflow.sum()) > 0.05 * x.numel()  # the case: an overflow bucket holding many values
    ours = qstats.compute_qparams(state, spec, method=method).scale.reshape(()) * 448

    def sqnr(amax):  # ModelOpt's own FP8 fake quantizer
        y = ScaledE4M3Function.apply(x, amax.float(), None, 4, 3)
        return float(10 * torch.log10((x.double() ** 2).sum() / ((x - y).double() ** 2).sum()))

    # within 0.1 dB: the overflow bucket is one uniform bucket [2**24, max] (31.53 against 31.60 dB at
    # 1e7; the old centre-point scoring gave 29.28)
    assert sqnr(ours) >= sqnr(theirs) - 0.1, (float(ours), float(theirs), sqnr(ours), sqnr(theirs))
