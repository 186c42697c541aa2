"""ModelOpt's histogram calibrator options and the qstats histogram helpers a migrating user calls
directly (`entropy_amax` on ModelOpt's own histogram, `bucket_counts`): ModelOpt's ``skip_zeros`` is
a zero mask, the candidate range's edge cases agree with ModelOpt's, and bad arguments raise a
ValueError naming them (they failed deep inside torch, or were bucketed silently otherwise)."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # ModelOpt warns about untested transformers versions at import
    pytest.importorskip("modelopt.torch.quantization")
    import modelopt.torch.quantization.calib.histogram as modelopt_histogram
    from modelopt.torch.quantization.calib import HistogramCalibrator

import qstats
from qstats.observers.histogram import bucket_counts, entropy_amax

pytestmark = pytest.mark.usefixtures("single_thread_quiet")


def _sparse_relu(n=20000, seed=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g).clamp(min=0) * (torch.rand(n, generator=g) < 0.3)


def test_skip_zeros_is_a_zero_mask():
    # ModelOpt's skip_zeros=True histograms the nonzero values only; qstats' update with the mask
    # x != 0 gives the state of the nonzero values bit for bit, and its percentile is ModelOpt's
    # within a ModelOpt bin and a qstats bucket (the percentile of all values is far lower)
    x = _sparse_relu()
    nonzero = x[x != 0]
    skipping, reference = HistogramCalibrator(skip_zeros=True), HistogramCalibrator()
    skipping.collect(x)
    reference.collect(nonzero)
    assert torch.equal(skipping._calib_hist, reference._calib_hist)
    theirs = float(skipping.compute_amax("percentile"))

    spec = qstats.QuantSpec(dtype="int8", mapping="narrow")
    obs = qstats.histogram(spec)
    masked = obs.update(obs.init(x), x, x != 0)
    alone = obs.update(obs.init(nonzero), nonzero)
    assert all(torch.equal(a, b) for a, b in zip(masked, alone))
    ours = float(qstats.compute_qparams(masked, spec, method="percentile").scale.double() * spec.qmax)
    absmax = float(nonzero.abs().max())
    assert abs(ours - theirs) <= absmax / 2048 + 2.0 ** math.floor(math.log2(theirs)) / 128
    everything = float(qstats.compute_qparams(obs.update(obs.init(x), x), spec, method="percentile").scale * spec.qmax)
    assert everything < theirs - absmax / 100


def _histogram(seed=0, bins=96):
    rng = np.random.default_rng(seed)
    values = np.abs(rng.standard_t(3, 5000))
    return np.histogram(values, bins=bins, range=(0, values.max()))


@pytest.mark.parametrize("bits,unsigned,stride", [(8, False, 1), (4, True, 3), (3, False, 7)])
def test_entropy_amax_with_the_last_bin_as_start_bin_is_modelopts(bits, unsigned, stride):
    # one candidate, the whole histogram: ModelOpt returns the last edge, whatever the stride
    hist, edges = _histogram()
    theirs = modelopt_histogram._compute_amax_entropy(hist.copy(), edges, bits, unsigned, stride, len(hist))
    ours = entropy_amax(torch.from_numpy(hist), torch.from_numpy(edges), bits, unsigned, len(hist), stride)
    assert float(ours) == pytest.approx(float(theirs), rel=1e-6)


def test_entropy_amax_past_the_last_bin_is_refused_as_modelopt_refuses_it():
    hist, edges = _histogram()
    with pytest.raises(ValueError):  # numpy's argmin of no divergences
        modelopt_histogram._compute_amax_entropy(hist.copy(), edges, 8, False, 1, len(hist) + 1)
    with pytest.raises(ValueError, match="start_bin"):
        entropy_amax(torch.from_numpy(hist), torch.from_numpy(edges), 8, start_bin=len(hist) + 1)


@pytest.mark.parametrize("kwargs,name", [
    (dict(start_bin=0), "start_bin"),
    (dict(start_bin=-5), "start_bin"),
    (dict(start_bin=97), "start_bin"),
    (dict(stride=0), "stride"),
    (dict(num_bits=0), "num_bits"),
    (dict(num_bits=3.5), "num_bits"),
    (dict(edges=100), "bin_edges"),
    (dict(bins=1), "at least 2 bins"),
])
def test_entropy_amax_bad_arguments_raise_naming_them(kwargs, name):
    # each failed deep inside torch or Python (IndexError, RuntimeError, a negative shift count)
    options = {"start_bin": 1 if "bins" in kwargs else 8, **kwargs}
    hist, edges = _histogram(bins=options.pop("bins", 96))
    edges = torch.from_numpy(edges)
    if "edges" in options:
        edges = torch.linspace(0, 1, options.pop("edges"), dtype=torch.float64)
    with pytest.raises(ValueError, match=name):
        entropy_amax(torch.from_numpy(hist), edges, **options)


def _independent_bucket(value: float, bins: int, low: int, high: int) -> int:
    """The magnitude bucket of ``value`` from frexp: 0 below 2**low, the last above 2**high."""
    mantissa, exponent = math.frexp(abs(value))  # value = mantissa * 2**exponent, mantissa in [0.5, 1)
    octave = exponent - 1
    if value == 0 or octave < low:
        return 0
    if octave >= high:
        return (high - low) * bins + 1
    return 1 + (octave - low) * bins + int((2 * mantissa - 1) * bins)


def test_bucket_counts_of_the_documented_shape_at_any_legal_setting():
    values = torch.tensor([0.3, 1.5, 2.5, 3.0, -0.7, 1e-10, 5e30, 3.4e38])
    for bins, (low, high) in ((1, (-126, 128)), (4096, (-1, 1)), (2, (-2, 2))):
        counts, _ = bucket_counts(values.reshape(1, 1, -1), bins=bins, exponent_range=(low, high))
        assert counts.shape == (1, 2, (high - low) * bins + 2)
        expected = torch.zeros_like(counts)
        for v in values.tolist():
            expected[0, int(v > 0), _independent_bucket(v, bins, low, high)] += 1
        assert torch.equal(counts, expected), (bins, low, high)


@pytest.mark.parametrize("kwargs,name", [
    (dict(bins=100), "bins"),  # was bucketed as 64 per octave: counts of another shape than documented
    (dict(bins=0), "bins"),
    (dict(bins=True), "bins"),
    (dict(exponent_range=(5, -5)), "exponent_range"),  # RuntimeError deep inside torch
    (dict(exponent_range=(-200, 200)), "exponent_range"),  # past float32's octaves
    (dict(exponent_range=(2.5, 3.7)), "exponent_range"),  # truncated in silence
    (dict(exponent_range=(1,)), "exponent_range"),
])
def test_bucket_counts_bad_settings_raise_naming_them(kwargs, name):
    view = torch.tensor([0.3, 1.5, -0.7]).reshape(1, 1, 3)
    with pytest.raises(ValueError, match=name):
        bucket_counts(view, **kwargs)
