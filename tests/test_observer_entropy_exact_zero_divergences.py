"""`entropy_amax` (ModelOpt's KL calibration) where a candidate's divergence is exactly 0 in ModelOpt 0.47's
``_compute_amax_entropy``: ModelOpt takes the last minimum, so a later exact 0 wins the tie. qstats' closed
form gave such a candidate -4e-16 (outliers folded into a last bin that holds the only count below it),
a strict minimum, and picked an earlier edge (amax 1.61 where ModelOpt's is 8.03)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qstats.observers.histogram import entropy_amax

calib = pytest.importorskip("modelopt.torch.quantization.calib.histogram")
calib_entropy = calib.entropy


def _theirs(hist, edges, bits, unsigned, start, stride) -> float:
    return float(calib._compute_amax_entropy(hist.copy(), edges, bits, unsigned, stride=stride, start_bin=start))


def _ours(hist, edges, bits, unsigned, start, stride) -> float:
    amax = entropy_amax(torch.tensor(hist), torch.tensor(edges), num_bits=bits, unsigned=unsigned, start_bin=start,
                        stride=stride)
    return float(np.float32(amax.item()))  # ModelOpt returns the edge as a float32 tensor


def _modelopt_divergences(monkeypatch, hist, edges, bits, unsigned, start, stride) -> list:
    """ModelOpt's divergence of every candidate, in order (its scipy ``entropy`` calls, recorded)."""
    recorded = []

    def entropy(p, q):
        recorded.append(float(calib_entropy(p, q)))
        return recorded[-1]

    monkeypatch.setattr(calib, "entropy", entropy)
    try:
        _theirs(hist, edges, bits, unsigned, start, stride)
    finally:
        monkeypatch.undo()
    return recorded


@pytest.mark.parametrize("hist, bits, unsigned, start, stride", [
    ([55, 50, 45, 15, 2, 0], 4, False, 1, 2),
    ([43, 0, 10, 17, 2, 41, 18, 4, 12, 45, 25, 21, 34, 24], 8, True, 3, 1),
])
def test_exact_zero_divergence_ties_pick_the_last_as_modelopt(hist, bits, unsigned, start, stride):
    hist = np.array(hist, dtype=np.int64)
    edges = np.linspace(0.0, 9.0, len(hist) + 1)
    assert _ours(hist, edges, bits, unsigned, start, stride) == _theirs(hist, edges, bits, unsigned, start, stride)


def test_small_histograms_against_modelopt(monkeypatch):
    """Fuzzed small histograms (dense, sparse, single-bin, decreasing), every width, start bin and stride:
    qstats' amax is the edge of the last candidate whose ModelOpt divergence is its minimum, to 1e-12
    (ModelOpt's own last minimum, but where two divergences are equal but for ModelOpt's rounding,
    0.12271591496916966 and ...989, either may win). Histograms where ModelOpt's divergence is NaN (every
    bin below a candidate empty) are left out: numpy's argmin picks the NaN, qstats never does
    (differences.md)."""
    rng = np.random.default_rng(0)
    differing, compared = [], 0
    for trial in range(400):
        nb, kind = int(rng.integers(2, 40)), trial % 4
        if kind == 0:
            hist = rng.integers(0, 50, nb).astype(np.int64)
        elif kind == 1:
            hist = (rng.random(nb) < 0.3) * rng.integers(1, 9, nb)
        elif kind == 2:
            hist = np.zeros(nb, np.int64)
            hist[rng.integers(0, nb)] = 5
        else:
            hist = np.sort(rng.integers(0, 100, nb))[::-1].copy()
        edges = np.linspace(0, float(rng.random() * 10 + 0.1), nb + 1)
        bits, unsigned = int(rng.choice([2, 3, 4, 8])), bool(rng.integers(0, 2))
        start, stride = int(rng.integers(1, nb + 1)), int(rng.integers(1, 4))
        if hist[1:].sum() == 0:
            continue
        args = (hist, edges, bits, unsigned, start, stride)
        divergences = _modelopt_divergences(monkeypatch, *args)
        if any(np.isnan(divergences)):
            continue
        compared += 1
        lowest = min(divergences)
        last = max(k for k, d in enumerate(divergences) if d <= lowest + 1e-12)
        if _ours(*args) != float(np.float32(edges[start + last * stride])):
            differing.append((hist.tolist(), bits, unsigned, start, stride))
    assert compared > 250 and differing == []
