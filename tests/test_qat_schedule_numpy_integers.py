"""QATSchedule takes numpy integers (milestones read from a config or an array, a step of
``np.arange``) as the Python ints they equal; it refused them ('must be a non-negative int, got
np.int64(10)'; 'step must be an int or an integer tensor, got int64'). The reference: the same schedule
and steps as Python ints, whose phases are Python bools (the module's docstring)."""

import numpy as np
import pytest

import qstats

MILESTONES = (2, 5, 9, 7)


@pytest.mark.parametrize("np_int", [np.int64, np.int32, np.uint16])
def test_numpy_milestones_and_steps_give_the_python_int_phases(np_int):
    reference = qstats.QATSchedule(*MILESTONES, sync_every=3)
    schedule = qstats.QATSchedule(*map(np_int, MILESTONES), sync_every=np_int(3))
    assert schedule == reference and hash(schedule) == hash(reference)
    assert all(type(value) is int for value in (schedule.observe_at, schedule.freeze_ranges_at, schedule.sync_every))
    assert qstats.QATSchedule.from_milestones(np.array(MILESTONES, dtype=np_int)) == qstats.QATSchedule(*MILESTONES)
    for step in range(12):
        phase = schedule(np_int(step))
        assert phase == reference(step)
        assert all(type(flag) is bool for flag in phase)
        assert schedule.sync_at(np_int(step)) is reference.sync_at(step)


@pytest.mark.parametrize("bad", [np.bool_(True), True, 2.0, np.float64(2.0), -1, np.int64(-1)])
def test_what_is_no_non_negative_integer_is_still_refused(bad):
    with pytest.raises(ValueError, match="QATSchedule.observe_at must be a non-negative int"):
        qstats.QATSchedule(observe_at=bad)


@pytest.mark.parametrize("milestones", [5, np.int64(5), "0123", b"0123", 2.5])
def test_from_milestones_refuses_what_is_no_sequence_naming_it(milestones):
    # coremltools' milestones are a list of four ints or None; list(5) failed as "'int' object is not
    # iterable" and "0123" as "observe_at must be a non-negative int, got '0'"
    with pytest.raises(TypeError, match=r"QATSchedule.from_milestones expects a sequence of 4 milestones .* got"):
        qstats.QATSchedule.from_milestones(milestones)
    assert qstats.QATSchedule.from_milestones([0, 1, 2, 3]) == qstats.QATSchedule(0, 1, 2, 3)
    assert qstats.QATSchedule.from_milestones(range(4)) == qstats.QATSchedule(0, 1, 2, 3)
