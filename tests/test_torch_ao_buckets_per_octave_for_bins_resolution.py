"""What `qstats.torch_ao.buckets_per_octave_for_bins` promises (docs/migrating_torch_ao.md): qstats'
buckets over the data's range are nowhere wider than torch.ao's ``HistogramObserver(bins=bins)`` bins
where that range includes zero, and wider by at most ``max|x| / (max - min)`` for data of one sign.
torch.ao's observer of the same data gives its bin width."""

import warnings

import pytest
import torch
import torch.ao.quantization as tq

import qstats
from qstats import torch_ao
from qstats.observers.histogram import histogram_edges

warnings.filterwarnings("ignore")


def _data(kind: str) -> torch.Tensor:
    values = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    return {"gauss": values, "relu": values.relu(), "shifted": values * 3 + 1,
            "positive": 10 + values.abs() / 4, "negative": -10 - values.abs() / 4}[kind]


def _widths(kind: str, bins: int):
    """The widest qstats bucket inside torch.ao's ``[min_val, max_val]``, torch.ao's bin width, and
    the data's largest magnitude over its span."""
    data = _data(kind)
    reference = tq.HistogramObserver(bins=bins)
    reference(data)
    lo, hi = float(reference.min_val), float(reference.max_val)
    spec = qstats.QuantSpec.from_torch_ao(torch.quint8)
    observer = qstats.histogram(spec, torch_ao.buckets_per_octave_for_bins(bins))
    edges, _ = histogram_edges(observer.update(observer.init(data), data))
    inside = (edges[1:] > lo) & (edges[:-1] < hi)
    widest = float((edges[1:] - edges[:-1])[inside].max())
    return widest, (hi - lo) / bins, max(abs(lo), abs(hi)) / (hi - lo)


@pytest.mark.parametrize("bins", (256, 1000, 2048))
@pytest.mark.parametrize("kind", ("gauss", "relu", "shifted"))
def test_no_wider_than_torch_aos_bins_where_the_range_includes_zero(kind, bins):
    widest, torch_ao_width, _ = _widths(kind, bins)
    assert widest <= torch_ao_width


@pytest.mark.parametrize("bins", (256, 2048))
@pytest.mark.parametrize("kind", ("positive", "negative"))
def test_data_of_one_sign_is_wider_by_at_most_its_magnitude_over_its_span(kind, bins):
    widest, torch_ao_width, factor = _widths(kind, bins)
    assert torch_ao_width < widest <= torch_ao_width * factor
