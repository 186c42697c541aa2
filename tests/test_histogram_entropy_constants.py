"""The histogram's ``"entropy"`` search on a constant tensor against ModelOpt's HistogramCalibrator.

A constant not on a bucket edge was modelled as spread over its bucket (1/128 octave below it), so
the KL search clipped it: 0.2988 for a tensor of 0.3 (int8 and int4), where ModelOpt's amax is
0.29985, one of its 2048 bins below the value. Its bucket is now the one point it is."""

from __future__ import annotations

import warnings

import pytest
import torch

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # ModelOpt warns about untested transformers versions at import
    pytest.importorskip("modelopt.torch.quantization")
    from modelopt.torch.quantization.calib import HistogramCalibrator

import qstats

pytestmark = pytest.mark.usefixtures("single_thread_quiet")


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("value", [0.3, -0.3, -5.1, 1.3e-3])
@pytest.mark.parametrize("numel", [1, 100])
def test_entropy_amax_of_a_constant_is_modelopts_within_one_bin(value, bits, numel):
    x = torch.full((numel,), value)
    calibrator = HistogramCalibrator(num_bits=bits)
    calibrator.collect(x)
    theirs = float(calibrator.compute_amax("entropy"))
    spec = qstats.QuantSpec(dtype=f"int{bits}", mapping="narrow")  # ModelOpt's grid: step amax / maxbound
    observer = qstats.histogram(spec)
    qparams = qstats.compute_qparams(observer.update(observer.init(x), x), spec, method="entropy")
    ours = float(qparams.scale.double() * spec.qmax)
    assert ours == pytest.approx(theirs, abs=abs(value) / 2048 * 1.001, rel=0)
