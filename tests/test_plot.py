"""qstats.plot.histogram writes a PNG with the distribution and each method's clipping range."""

import pytest
import torch

import qstats

pytest.importorskip("matplotlib")


def test_histogram_plot_writes_a_png(tmp_path):
    g = torch.Generator().manual_seed(0)
    x = torch.distributions.StudentT(3.0).sample((20000,))
    spec = qstats.QuantSpec(dtype="int8")
    obs = qstats.histogram(spec, buckets_per_octave=32, octaves=32)
    state = obs.update(obs.init(x), x)
    qparams = {method: qstats.compute_qparams(state, spec, method=method) for method in ("minmax", "l2", "percentile")}
    path = tmp_path / "hist.png"
    figure = qstats.plot.histogram(state, qparams, spec, path)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    labels = [text.get_text() for text in figure.axes[0].get_legend().get_texts()]
    assert len(labels) == 4 and labels[1].startswith("minmax")
    # the drawn clipping lines are the quantization range of each method
    lines = [line.get_xdata()[0] for line in figure.axes[0].get_lines()]
    qp = qparams["l2"]
    assert lines[2] == pytest.approx(-128 * float(qp.scale)) and lines[3] == pytest.approx(127 * float(qp.scale))
    del g


def test_histogram_plot_per_channel_needs_an_index(tmp_path):
    spec = qstats.QuantSpec(granularity=qstats.PerAxis(0))
    obs = qstats.histogram(spec, buckets_per_octave=8, octaves=16)
    x = torch.randn(2, 500)
    state = obs.update(obs.init(x), x)
    qp = qstats.compute_qparams(state, spec)
    with pytest.raises(ValueError, match="index"):
        qstats.plot.histogram(state, qp, spec)
    qstats.plot.histogram(state, qp, spec, tmp_path / "c1.png", index=1)
    assert (tmp_path / "c1.png").exists()
    with pytest.raises(TypeError, match="HistogramState"):
        qstats.plot.histogram(qstats.minmax(spec).init(x), qp, spec)

def test_histogram_plot_draws_the_two_level_clipping_range():
    pytest.importorskip("matplotlib")
    torch.manual_seed(0)
    spec = qstats.QuantSpec(dtype="fp4_e2m1", granularity=qstats.TensorGroup(16))
    x = torch.randn(4, 32) * 3
    obs = qstats.histogram(spec, buckets_per_octave=16, octaves=16)
    state = obs.update(obs.init(x), x)
    qparams = qstats.compute_qparams(state, spec)
    figure = qstats.plot.histogram(state, qparams, spec, index=(1, 0))
    lines = [line.get_xdata()[0] for line in figure.axes[0].get_lines()]
    # a symmetric block scale maps the block's largest magnitude to the format's maximum
    amax = float(x[1, :16].abs().max())
    assert lines == [pytest.approx(-amax, rel=1e-4), pytest.approx(amax, rel=1e-4)]
