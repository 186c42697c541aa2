"""Inputs torch.ao's observers treat otherwise than the drop-in (docs/differences.md): a bool tensor
(torch.ao casts it to float, qstats refuses it), a 1-D tensor per channel (torch.ao fails, qstats
gives every element its channel, as torch.ao's observer of the same values as a column) and integer
tensors in a histogram (torch.ao's ``histc`` fails, qstats counts them as torch.ao counts their float
values)."""

import warnings

import pytest
import torch
import torch.ao.quantization as tq

import qstats
from qstats import torch_ao

warnings.filterwarnings("ignore")


def test_bool_input_is_refused_where_torch_ao_casts_it():
    reference = tq.MinMaxObserver()
    reference(torch.tensor([True, False]))
    assert float(reference.max_val) == 1.0
    with pytest.raises(TypeError, match="bool"):
        torch_ao.QstatsObserver(qstats.minmax)(torch.tensor([True, False]))


def test_one_dimensional_per_channel_input_is_one_channel_per_element():
    values = torch.tensor([0.5, -2.0, 3.0])
    with pytest.raises(IndexError):
        tq.PerChannelMinMaxObserver()(values)
    reference = tq.PerChannelMinMaxObserver()
    reference(values[:, None])
    ours = torch_ao.QstatsObserver(qstats.minmax, qscheme=torch.per_channel_affine)
    ours(values)
    assert all(torch.equal(a, b) for a, b in zip(ours.calculate_qparams(), reference.calculate_qparams()))


@pytest.mark.parametrize("dtype", (torch.int8, torch.uint8, torch.int64))
def test_integer_input_to_the_histogram_counts_its_values(dtype):
    values = torch.arange(-20, 40).clamp(min=0 if dtype == torch.uint8 else -20).to(dtype)
    with pytest.raises(NotImplementedError):
        tq.HistogramObserver()(values)
    ours, as_float = torch_ao.default_histogram_observer(), torch_ao.default_histogram_observer()
    ours(values)
    as_float(values.float())
    assert all(torch.equal(a, b) for a, b in zip(ours.state, as_float.state))
    reference = tq.default_histogram_observer()
    reference(values.float())
    assert torch.equal(ours.state.min_val, reference.min_val) and torch.equal(ours.state.max_val, reference.max_val)


@pytest.mark.parametrize("empty", (torch.empty(0), torch.empty(0, 5), torch.empty(4, 0)))
def test_an_empty_tensor_of_another_rank_is_skipped_as_torch_ao_skips_it(empty):
    """torch.ao's observers return an empty input untouched; the per-channel drop-in along axis 1 raised
    on a 1-d empty tensor (its axis out of range) before observing nothing."""
    x = torch.randn(4, 5)
    ours = torch_ao.QstatsObserver(qstats.minmax, qscheme=torch.per_channel_affine, ch_axis=1)
    reference = tq.PerChannelMinMaxObserver(qscheme=torch.per_channel_affine, ch_axis=1)
    for observer in (ours, reference):
        for batch in (empty, x, empty, 3 * x):
            observer(batch)
    assert all(torch.equal(a, b) for a, b in zip(ours.calculate_qparams(), reference.calculate_qparams()))
