"""`qstats.plot.histogram` of values far below 1 (weights or activations near 1e-20, from a histogram
state whose octaves resolve them): the figure spans the observed values, as numpy's ``histogram``
of them, and draws their counts in its bins (an absolute 1e-12 floor on the drawn window put every
such value into the two bins around zero)."""

import numpy as np
import pytest
import torch

import qstats

pytest.importorskip("matplotlib")


def _drawn(x, plot_bins):
    """The drawn counts per bin and the bins' edges, read from the figure's filled step curve."""
    spec = qstats.QuantSpec(dtype="int8")
    observer = qstats.histogram(spec, buckets_per_octave=32, octaves=160)  # resolves 2^-80 .. 2^80
    state = observer.update(observer.init(x), x)
    figure = qstats.plot.histogram(state, None, spec, plot_bins=plot_bins)
    (filled,) = figure.axes[0].collections
    top = filled.get_paths()[0].vertices[1 : 1 + 2 * plot_bins]  # (left, count), (right, count) per bin
    counts, inner = top[::2, 1], top[1:-1:2, 0]
    width = (top[-1, 0] - top[0, 0]) / (plot_bins - 1)  # the first and last points are bin centres
    edges = np.concatenate([[top[0, 0] - width / 2], inner, [top[-1, 0] + width / 2]])
    return counts, edges


@pytest.mark.parametrize("magnitude", [1e-16, 1e-20])
def test_small_values_are_drawn_over_their_own_range(magnitude):
    x = torch.randn(20_000, generator=torch.Generator().manual_seed(0)) * magnitude
    values = x.double().numpy()
    counts, edges = _drawn(x, 10)
    reference, reference_edges = np.histogram(values, bins=10)  # the values' own range, as matplotlib's hist
    observed = reference_edges[-1] - reference_edges[0]
    assert edges[0] <= values.min() and edges[-1] >= values.max()
    assert edges[-1] - edges[0] <= 1.1 * observed  # the figure's bins split the values, not a window around 0
    expected, _ = np.histogram(values, bins=edges)
    assert (expected > 0).sum() >= 8
    np.testing.assert_allclose(counts, expected, atol=0.002 * x.numel())


def test_an_all_zero_tensor_is_drawn_in_one_bin():
    x = torch.zeros(100)
    counts, edges = _drawn(x, 9)
    expected, _ = np.histogram(x.double().numpy(), bins=edges)
    assert expected.sum() == 100
    np.testing.assert_allclose(counts, expected, atol=1e-6)
