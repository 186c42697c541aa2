"""`qstats.plot.histogram`'s ``index=`` takes any integer component it accepts (Python, numpy, a
one-element torch tensor) as that int: a ``torch.tensor([1])`` component selected a histogram that
kept a dimension and failed inside ``torch.searchsorted``."""

import numpy as np
import pytest
import torch

import qstats

pytest.importorskip("matplotlib")


def _per_channel():
    spec = qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0))
    observer = qstats.histogram(spec, buckets_per_octave=8, octaves=16)
    x = torch.randn(3, 500, generator=torch.Generator().manual_seed(0)) * torch.tensor([[1.0], [5.0], [20.0]])
    state = observer.update(observer.init(x), x)
    return x, state, qstats.compute_qparams(state, spec), spec


@pytest.mark.parametrize("index", [1, np.int64(1), torch.tensor(1), torch.tensor([1]), (torch.tensor([1]),)])
def test_an_integer_index_component_draws_that_channel(index):
    x, state, qp, spec = _per_channel()
    figure = qstats.plot.histogram(state, qp, spec, index=index)
    lines = [line.get_xdata()[0] for line in figure.axes[0].get_lines()]
    scale = float(qp.scale[1])  # torch.ao's symmetric int8 grid: codes -128 and 127 around zero point 0
    assert lines == [pytest.approx(-128 * scale), pytest.approx(127 * scale)]
    assert figure.axes[0].get_title().startswith(f"{x.shape[1]} values")
