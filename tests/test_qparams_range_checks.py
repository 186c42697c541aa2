"""qparams_from_minmax / compute_qparams on ranges that are not ranges: a reversed range, a float64
end past float32, a Python number. Each raises an error that names the problem (torch.ao's observers
assert ``min_val <= max_val``); the range checks share the one check of uncalibrated entries (one
host read, reported rather than raised under vmap)."""

import pytest
import torch
from torch.ao.quantization.observer import MinMaxObserver, PerChannelMinMaxObserver

import qstats

PER_CHANNEL = qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0))


def test_a_reversed_range_is_named_as_torch_ao_refuses_it():
    lo, hi = torch.tensor([-1.0, 2.0]), torch.tensor([1.0, 1.0])
    with pytest.raises(AssertionError, match="min"):
        PerChannelMinMaxObserver()._calculate_qparams(lo, hi)
    with pytest.raises(ValueError, match="min_val > max_val"):
        qstats.qparams_from_minmax(lo, hi, PER_CHANNEL)


def test_a_state_holding_a_reversed_range_is_named_in_compute_qparams():
    state = qstats.MinMaxState(torch.tensor(2.0), torch.tensor(1.0), torch.tensor(4), torch.tensor(0))
    spec = qstats.QuantSpec(dtype="int8")
    with pytest.raises(AssertionError):
        MinMaxObserver()._calculate_qparams(state.min_val, state.max_val)
    with pytest.raises(ValueError, match="min_val > max_val"):
        qstats.compute_qparams(state, spec)


def test_fallback_still_reports_a_reversed_range_as_uncalibrated():
    spec = qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0), on_uncalibrated="fallback")
    qp = qstats.qparams_from_minmax(torch.tensor([-1.0, 2.0]), torch.tensor([1.0, 1.0]), spec)
    assert qp.calibrated.tolist() == [True, False] and float(qp.scale[1]) == 1.0


def test_uncalibrated_entries_keep_their_message():
    inf = torch.tensor([float("inf")])
    with pytest.raises(ValueError, match="saw no finite data"):
        qstats.qparams_from_minmax(inf, -inf, PER_CHANNEL)


def test_float64_ends_past_float32_are_named_and_others_equal_float32():
    big = torch.tensor([1e300], dtype=torch.float64)
    with pytest.raises(ValueError, match="past the float32 range"):
        qstats.qparams_from_minmax(-big, big, PER_CHANNEL)
    lo, hi = torch.tensor([-1.5, -2.0], dtype=torch.float64), torch.tensor([1.0, 3e30], dtype=torch.float64)
    want_scale, want_zero_point = PerChannelMinMaxObserver(dtype=torch.qint8, qscheme=torch.per_channel_symmetric)._calculate_qparams(lo.float(), hi.float())
    spec = qstats.QuantSpec.from_torch_ao(torch.qint8, torch.per_channel_symmetric)
    qp = qstats.qparams_from_minmax(lo, hi, spec)
    assert torch.equal(qp.scale, want_scale) and torch.equal(qp.zero_point.long(), want_zero_point.long())


@pytest.mark.parametrize("ends", [(-1.0, 1.0), (torch.tensor(-1.0), 1.0), (torch.tensor([False]), torch.tensor([True]))],
                         ids=["floats", "float_max", "bool"])
def test_ends_that_are_not_real_tensors_raise_type_error_naming_them(ends):
    with pytest.raises(TypeError, match="(min_val|max_val) must be a real tensor"):
        qstats.qparams_from_minmax(*ends, qstats.QuantSpec(dtype="int8"))


def test_under_vmap_a_reversed_range_is_reported_not_raised():
    # stacked experts: an expert's bad range is reported in QParams.calibrated (stacked_qparams
    # equals torch.vmap(compute_qparams)); the eager call on the same entry raises
    spec = qstats.QuantSpec(dtype="int8")
    lo, hi = torch.tensor([-1.0, 2.0]), torch.tensor([1.0, 1.0])
    qp = torch.vmap(lambda a, b: qstats.qparams_from_minmax(a, b, spec))(lo, hi)
    assert qp.calibrated.tolist() == [True, False]
    reference = MinMaxObserver(dtype=torch.qint8)._calculate_qparams(lo[:1], hi[:1])
    assert torch.equal(qp.scale[:1], reference[0])
