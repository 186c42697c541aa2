"""The counts `qstats.plot.histogram` draws against numpy's ``histogram`` (what matplotlib's ``hist``
draws) of the observed values, on the figure's own bins: every value drawn, in its bin, for
constant tensors and values narrower than a histogram bucket (weights near 1, as a norm layer's)."""

import numpy as np
import pytest
import torch

import qstats

pytest.importorskip("matplotlib")


def _drawn(x, plot_bins):
    """The drawn counts per bin and the bins' edges, read from the figure's filled step curve."""
    spec = qstats.QuantSpec(dtype="int8")
    observer = qstats.histogram(spec, buckets_per_octave=32, octaves=32)
    state = observer.update(observer.init(x), x)
    figure = qstats.plot.histogram(state, None, spec, plot_bins=plot_bins)
    (filled,) = figure.axes[0].collections
    top = filled.get_paths()[0].vertices[1 : 1 + 2 * plot_bins]  # (left, count), (right, count) per bin
    counts, inner = top[::2, 1], top[1:-1:2, 0]  # the right ends of all but the last bin are inner edges
    width = (top[-1, 0] - top[0, 0]) / (plot_bins - 1)  # the first and last points are bin centres
    edges = np.concatenate([[top[0, 0] - width / 2], inner, [top[-1, 0] + width / 2]])
    return counts, edges


@pytest.mark.parametrize("value", [0.7, -0.05, 1000.0, 3.0])
def test_a_constant_tensor_is_drawn_in_one_bin_holding_every_value(value):
    """A constant's bucket was spread over the whole bucket (0.7: ~1e-11 values per bin drawn, an
    empty log-scale figure); 1000's window was narrower than float64 resolves (no bin at all)."""
    x = torch.full((100,), value)
    counts, edges = _drawn(x, 9)
    expected, _ = np.histogram(x.double().numpy(), bins=edges)
    assert expected.sum() == 100
    np.testing.assert_allclose(counts, expected, atol=1e-6)


def test_values_narrower_than_a_bucket_are_all_drawn_where_they_are():
    """Uniform values in [0.98, 1.02]: the bucket [0.96875, 0.984375) was drawn as if spread over its
    whole width, and 7% of the values fell outside the figure (the first bin drew 28% of its count)."""
    x = 0.98 + 0.04 * torch.rand(200_000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    counts, edges = _drawn(x, 4)
    expected, _ = np.histogram(x.numpy(), bins=edges)
    assert expected.sum() == x.numel()
    assert counts.sum() == pytest.approx(x.numel(), rel=1e-9)
    np.testing.assert_allclose(counts, expected, rtol=0.02)
