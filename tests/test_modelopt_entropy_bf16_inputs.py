"""The entropy (KL) range of bf16 data against ModelOpt's ``HistogramCalibrator``: ModelOpt
histograms ``|x|`` of the half-precision values in 2048 linear bins (most of them empty near the top
for bf16, whose 128 values per octave are spaced wider than the bins), qstats in its float-exponent
buckets; the KL search on ModelOpt's own histogram is ModelOpt's bit for bit, and the amaxes of the
two histograms differ as stated in docs/differences.md."""

from __future__ import annotations

import sys
import warnings

import numpy as np
import pytest
import torch

from _shared import distribution

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # ModelOpt warns about untested transformers versions at import
    pytest.importorskip("modelopt.torch.quantization")
    from modelopt.torch.quantization.calib import HistogramCalibrator
    from modelopt.torch.quantization.tensor_quant import FakeTensorQuantFunction

import qstats

H = sys.modules["qstats.observers.histogram"]

pytestmark = pytest.mark.usefixtures("single_thread_quiet")


def _sqnr(x, amax, bits):
    y = FakeTensorQuantFunction.apply(x, torch.tensor(amax, dtype=torch.float32), None, bits, False, True)
    return float(10 * torch.log10((x.double() ** 2).sum() / ((x.double() - y.double()) ** 2).sum()))


# (distribution, seed, bits): qstats' amax relative to ModelOpt's, and the SQNR qstats' amax gains
# (by ModelOpt's quantizer), both as measured over 4 seeds x (gauss, laplace) x (int8, int4), whose
# range docs/differences.md states: the lowest amax, the highest, and the lowest SQNR
CASES = [("gauss", 3, 4, -0.136, 1.26), ("laplace", 0, 8, 0.155, 0.42), ("laplace", 1, 8, 0.075, -0.42)]


@pytest.mark.parametrize("name,seed,bits,relative,gained", CASES, ids=lambda v: str(v))
def test_entropy_of_bf16_data_against_modelopt(name, seed, bits, relative, gained):
    x = distribution(name, 40000, seed).to(torch.bfloat16)
    calibrator = HistogramCalibrator(num_bits=bits)
    calibrator.collect(x)
    theirs = float(calibrator.compute_amax("entropy"))
    # the search on ModelOpt's own histogram is ModelOpt's
    hist = torch.from_numpy(calibrator._calib_hist.int().numpy().astype(np.int64))
    edges = torch.from_numpy(calibrator._calib_bin_edges.numpy()).double()
    assert float(H.entropy_amax(hist, edges, bits)) == theirs
    spec = qstats.QuantSpec(dtype=f"int{bits}", mapping="narrow")
    obs = qstats.histogram(spec)
    qp = qstats.compute_qparams(obs.update(obs.init(x), x), spec, method="entropy")
    ours = float(qp.scale.double() * ((1 << (bits - 1)) - 1))
    assert ours / theirs - 1 == pytest.approx(relative, abs=1e-3)
    assert _sqnr(x.float(), ours, bits) - _sqnr(x.float(), theirs, bits) == pytest.approx(gained, abs=0.01)
