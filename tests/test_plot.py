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


def test_histogram_plot_of_stacked_states_draws_the_chosen_entry():
    """A stacked state's global scale has one entry per expert: indexing it with the full index
    raised IndexError; an index too short gave a bare 'only one element tensors' error."""
    spec = qstats.QuantSpec(dtype="fp4_e2m1", granularity=qstats.TensorGroup(16))
    torch.manual_seed(0)
    x = torch.randn(3, 4, 32) * torch.tensor([1.0, 4.0, 0.5])[:, None, None]
    obs = qstats.stacked_observer(qstats.histogram(spec, buckets_per_octave=16, octaves=16), 3)
    state = obs.update(obs.init(x), x)
    qparams = qstats.stacked_qparams(state, spec)
    figure = qstats.plot.histogram(state, qparams, spec, index=(1, 2, 1))
    lines = [line.get_xdata()[0] for line in figure.axes[0].get_lines()]
    amax = float(x[1, 2, 16:].abs().max())  # a symmetric block scale maps the block's amax to the format's max
    assert lines == [pytest.approx(-amax, rel=1e-4), pytest.approx(amax, rel=1e-4)]
    with pytest.raises(ValueError, match=r"index \(1,\).*shape \(3, 4, 2\)"):
        qstats.plot.histogram(state, qparams, spec, index=1)


def test_histogram_plot_leaves_pyplot_and_the_backend_alone(tmp_path, monkeypatch):
    """histogram called matplotlib.use("Agg") (a process-wide switch: a notebook's backend changed)
    and left every figure open in pyplot (matplotlib's "more than 20 figures" warning per layer)."""
    import matplotlib
    import matplotlib.pyplot as plt

    switches = []
    monkeypatch.setattr(matplotlib, "use", lambda *args, **kwargs: switches.append(args))
    spec = qstats.QuantSpec(dtype="int8")
    obs = qstats.histogram(spec, buckets_per_octave=8, octaves=16)
    x = torch.randn(1000)
    state = obs.update(obs.init(x), x)
    figures = plt.get_fignums()
    figure = qstats.plot.histogram(state, qstats.compute_qparams(state, spec), spec, tmp_path / "h.png")
    assert switches == [] and plt.get_fignums() == figures
    assert (tmp_path / "h.png").read_bytes()[:4] == b"\x89PNG"
    assert figure.axes[0].get_yscale() == "log"
