"""qstats.plot.histogram of a two-level (NVFP4-like) state: the clipping range it draws."""

import pytest
import torch

import qstats


def test_histogram_plot_draws_the_two_level_clipping_range():
    pytest.importorskip("matplotlib")
    torch.manual_seed(0)
    spec = qstats.QuantSpec(dtype="fp4_e2m1", granularity=qstats.TensorGroup(16))
    x = torch.randn(4, 32) * 3
    obs = qstats.histogram(spec, bins=16, octaves=16)
    state = obs.update(obs.init(x), x)
    qparams = qstats.compute_qparams(state, spec)
    figure = qstats.plot.histogram(state, qparams, spec, index=(1, 0))
    lines = [line.get_xdata()[0] for line in figure.axes[0].get_lines()]
    # a symmetric block scale maps the block's largest magnitude to the format's maximum
    amax = float(x[1, :16].abs().max())
    assert lines == [pytest.approx(-amax, rel=1e-4), pytest.approx(amax, rel=1e-4)]
