"""The histogram drop-in's ``state_dict`` loaded into torch.ao's ``HistogramObserver`` (``strict=False``,
as for the min/max drop-ins): torch.ao's observer keeps the observed counts, continues calibrating,
and a fresh drop-in loads the same checkpoint back. torch.ao's ``HistogramObserver`` fed the same
data is the reference."""

import warnings

import pytest
import torch
import torch.ao.quantization as tq

from qstats import torch_ao

warnings.filterwarnings("ignore")


def _data(kind: str) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    data = torch.randn(4, 4096, generator=generator)
    if kind == "relu":
        return data.relu()
    if kind == "laplace":
        return torch.sign(data) * -torch.log(torch.rand(4, 4096, generator=generator))
    return data


def _into_torch_ao(drop_in) -> tq.HistogramObserver:
    loaded = tq.default_histogram_observer()
    result = loaded.load_state_dict(drop_in.state_dict(), strict=False)
    assert "histogram" not in result.missing_keys
    return loaded


@pytest.mark.parametrize("kind", ("gauss", "relu", "laplace"))
def test_calibrated_histogram_loads_into_torch_ao_with_its_counts(kind):
    """torch.ao's observer kept its own empty histogram beside the drop-in's extremes: the counts
    were lost, and calibration continued as if the first batches had not been seen."""
    data = _data(kind)
    ours, direct = torch_ao.default_histogram_observer(), tq.default_histogram_observer()
    for batch in data[:3]:
        ours(batch)
        direct(batch)
    loaded = _into_torch_ao(ours)
    assert torch.equal(loaded.min_val, direct.min_val) and torch.equal(loaded.max_val, direct.max_val)
    assert float(loaded.histogram.sum()) == data[:3].numel()
    assert torch.equal(loaded.histogram, loaded.histogram.round())
    # each value moves within its qstats bucket: the cumulative counts agree to 0.1% of the total
    difference = (loaded.histogram.cumsum(0) - direct.histogram.cumsum(0)).abs().max()
    assert float(difference) <= 1e-3 * data[:3].numel()
    assert abs(float(loaded.calculate_qparams()[0] / direct.calculate_qparams()[0]) - 1) <= 0.02
    loaded(data[3])
    direct(data[3])
    assert float(loaded.histogram.sum()) == data.numel()
    assert abs(float(loaded.calculate_qparams()[0] / direct.calculate_qparams()[0]) - 1) <= 0.02


@pytest.mark.parametrize("value", (0.0, 3.0, -0.5))
def test_one_repeated_value_lands_in_torch_ao_bin(value):
    data = torch.full((2, 7), value)
    ours, direct = torch_ao.default_histogram_observer(), tq.default_histogram_observer()
    for batch in data:
        ours(batch)
        direct(batch)
    loaded = _into_torch_ao(ours)
    assert torch.equal(loaded.histogram, direct.histogram)
    assert all(torch.equal(a, b) for a, b in zip(loaded.calculate_qparams(), direct.calculate_qparams()))


def test_uncalibrated_histogram_loads_into_torch_ao_and_it_observes_on():
    """The empty buffers of a drop-in that saw nothing became torch.ao's min_val/max_val, and its
    next forward failed ('Boolean value of Tensor with no values is ambiguous')."""
    loaded = _into_torch_ao(torch_ao.default_histogram_observer())
    fresh = tq.default_histogram_observer()
    for observer in (loaded, fresh):
        assert torch.equal(observer.histogram, torch.zeros(2048))
    batch = _data("gauss")[0]
    loaded(batch)
    fresh(batch)
    assert torch.equal(loaded.histogram, fresh.histogram)
    assert all(torch.equal(a, b) for a, b in zip(loaded.calculate_qparams(), fresh.calculate_qparams()))


@pytest.mark.parametrize("batches", (0, 3))
def test_histogram_checkpoint_loads_back_into_a_drop_in(batches):
    """torch.ao's bins are saved beside qstats' buckets; a fresh drop-in loads the checkpoint
    strictly and goes on as the one that saved it."""
    data = _data("laplace")
    saved = torch_ao.default_histogram_observer()
    for batch in data[:batches]:
        saved(batch)
    fresh = torch_ao.default_histogram_observer()
    fresh.load_state_dict(saved.state_dict())
    for observer in (saved, fresh):
        observer(data[3])
    assert all(torch.equal(a, b) for a, b in zip(saved.state, fresh.state))
    assert all(torch.equal(a, b) for a, b in zip(saved.calculate_qparams(), fresh.calculate_qparams()))
