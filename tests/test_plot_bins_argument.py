"""qstats.plot.histogram's plot_bins: a positive int, else a ValueError naming it."""

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
