"""`qstats.plot.histogram` of a state and QParams calibrated on a GPU draws them as it draws CPU ones:
its counts against numpy's ``histogram`` of the values on the figure's bins, its clipping lines at
torch.ao's symmetric int8 ends (the GPU state met the figure's CPU grid in ``torch.searchsorted``)."""

import numpy as np
import pytest
import torch

import qstats

pytest.importorskip("matplotlib")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_a_gpu_state_and_qparams_are_drawn():
    spec = qstats.QuantSpec(dtype="int8")
    observer = qstats.histogram(spec, buckets_per_octave=32, octaves=32)
    x = torch.randn(20_000, generator=torch.Generator().manual_seed(0))
    state = observer.update(observer.init(x.cuda()), x.cuda())
    qp = qstats.compute_qparams(state, spec)
    figure = qstats.plot.histogram(state, qp, spec, plot_bins=10)
    lines = [line.get_xdata()[0] for line in figure.axes[0].get_lines()]
    scale = float(qp.scale)
    assert lines == [pytest.approx(-128 * scale), pytest.approx(127 * scale)]
    (filled,) = figure.axes[0].collections
    top = filled.get_paths()[0].vertices[1 : 1 + 20]  # (left, count), (right, count) per bin
    counts, inner = top[::2, 1], top[1:-1:2, 0]
    width = (top[-1, 0] - top[0, 0]) / 9  # the first and last points are bin centres
    edges = np.concatenate([[top[0, 0] - width / 2], inner, [top[-1, 0] + width / 2]])
    expected, _ = np.histogram(x.double().numpy(), bins=edges)
    np.testing.assert_allclose(counts, expected, atol=0.002 * x.numel())
