"""qstats.plot.histogram's arguments: plot_bins a positive int (else a ValueError naming it), and
the saved file in the format its path's suffix names."""

import numpy as np
import pytest
import torch

import qstats

pytest.importorskip("matplotlib")


def _state():
    spec = qstats.QuantSpec(dtype="int8")
    obs = qstats.histogram(spec, buckets_per_octave=16, octaves=16)
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    return obs.update(obs.init(x), x), spec


@pytest.mark.parametrize("plot_bins", [0, -1, True, 2.5, "10"])
def test_plot_bins_that_are_not_a_positive_int_are_refused_by_name(plot_bins):
    """0 and -1 drew an empty figure, True one bin; 2.5 and "10" failed inside torch.linspace."""
    state, spec = _state()
    with pytest.raises(ValueError, match="plot_bins must be a positive int"):
        qstats.plot.histogram(state, None, spec, plot_bins=plot_bins)


@pytest.mark.parametrize("plot_bins", [1, 50, np.int64(7)])
def test_plot_bins_draws_that_many_bins(plot_bins):
    state, spec = _state()
    figure = qstats.plot.histogram(state, None, spec, plot_bins=plot_bins)
    (filled,) = figure.axes[0].collections
    # a step="mid" fill over n centres has 2n vertices on each of its two sides (plus closing points)
    centres = {float(x) for x in filled.get_paths()[0].vertices[:, 0]}
    assert len(centres) >= int(plot_bins)


@pytest.mark.parametrize("suffix", ["pdf", "svg", "jpg"])
def test_the_saved_file_is_in_the_format_its_suffix_names(tmp_path, suffix):
    """A PNG was written whatever the suffix: "h.pdf" held PNG bytes no PDF viewer opens."""
    state, spec = _state()
    figure = qstats.plot.histogram(state, None, spec, tmp_path / f"h.{suffix}")
    figure.savefig(tmp_path / f"reference.{suffix}", dpi=100)  # matplotlib's own choice of format
    assert (tmp_path / f"h.{suffix}").read_bytes()[:4] == (tmp_path / f"reference.{suffix}").read_bytes()[:4]


@pytest.mark.parametrize("name", ["h", "model.layers.0.mlp"])
def test_a_path_whose_suffix_names_no_format_is_saved_as_png(tmp_path, name):
    state, spec = _state()
    qstats.plot.histogram(state, None, spec, tmp_path / name)
    assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
