"""`QATSchedule` of integer tensor steps of every width against the milestones compared as Python
integers (coremltools' step counter is a Python int): milestones past a narrow dtype's range are
not wrapped into it."""

import pytest
import torch

import qstats

MILESTONES = (3, 300, 1000, 200)  # observe, fake-quantize, freeze ranges, freeze batch norm


def _expected(step):
    observe_at, fake_quantize_at, freeze_ranges_at, freeze_batchnorm_at = MILESTONES
    return (observe_at <= step < freeze_ranges_at, step >= fake_quantize_at, step >= freeze_batchnorm_at)


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64], ids=str)
def test_tensor_steps_of_every_integer_dtype_compare_as_integers(dtype):
    """An int8 step compared with milestone 300 in int8 (300 wraps to 44): step 100 fake-quantized
    and froze batch norm (1000 wraps to -24: it stopped observing)."""
    schedule = qstats.QATSchedule.from_milestones(list(MILESTONES))
    top = min(torch.iinfo(dtype).max, 1200)
    steps = torch.arange(0, top + 1, dtype=torch.int64).to(dtype)
    phase = schedule(steps)
    got = list(zip(*(flag.tolist() for flag in phase)))
    assert got == [_expected(step) for step in range(top + 1)]
    assert all(flag.dtype == torch.bool for flag in phase)
    assert tuple(bool(flag) for flag in schedule(torch.tensor(100, dtype=dtype))) == tuple(schedule(100))


@pytest.mark.parametrize("dtype", [torch.complex64, torch.float16, torch.bool], ids=str)
def test_tensor_steps_that_are_not_integers_are_refused(dtype):
    with pytest.raises(TypeError, match="must hold an integer"):
        qstats.QATSchedule()(torch.zeros((), dtype=dtype))


@pytest.mark.parametrize("milestones", [(0, 5, 10**20, 2**63), (2**63, 2**64, 2**64, None), (0, 0, 2**63 - 1, 10**30)])
def test_milestones_past_int64_are_never_reached_by_a_tensor_step(milestones):
    """A milestone past int64's range ("never", as a Python int step reads it) raised OverflowError
    ('int too big to convert') for every tensor step: expected from Python's own comparisons."""
    schedule = qstats.QATSchedule(*milestones)
    observe_at, fake_quantize_at, freeze_ranges_at, freeze_batchnorm_at = milestones
    steps = [0, 3, 7, 12, 2**62, 2**63 - 1]
    expected = [(observe_at <= step < freeze_ranges_at, step >= fake_quantize_at,
                 freeze_batchnorm_at is not None and step >= freeze_batchnorm_at) for step in steps]
    phase = schedule(torch.tensor(steps))
    assert list(zip(*(flag.tolist() for flag in phase))) == expected
    assert [tuple(schedule(step)) for step in steps] == expected
