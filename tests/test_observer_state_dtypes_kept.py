"""An update returns a state of the dtypes it was given, or refuses it naming the field: a state converted
after ``init`` (bfloat16 extremes, int32 counts: ``state._replace(min_val=state.min_val.bfloat16())``) came
back promoted to float32 / int64, and then no longer merged with the state it was updated from (merge
checks that both states' fields have one dtype). A float64 state is kept float64."""

from __future__ import annotations

import pytest
import torch

import qstats

SPEC = qstats.QuantSpec(dtype="int4", granularity=qstats.PerAxis(0))
OBSERVERS = {
    "minmax": lambda: qstats.minmax(SPEC),
    "memoryless_minmax": lambda: qstats.memoryless_minmax(SPEC),
    "moving_average_minmax": lambda: qstats.moving_average_minmax(SPEC, 0.5),
    "histogram": lambda: qstats.histogram(SPEC, buckets_per_octave=2, octaves=4),
    "mse": lambda: qstats.mse(SPEC, grid=10),
    "mse_moving_average": lambda: qstats.mse(SPEC, grid=10, mode="moving_average"),
}


def _converted(state):
    """Every (state, field name) with that field converted: floats to bfloat16, integers to int32."""
    for name, value in zip(state._fields, state):
        if name == "factors":  # mse's shrink factors: update refuses other factors already
            continue
        other = torch.bfloat16 if value.is_floating_point() else torch.int32
        yield state._replace(**{name: value.to(other)}), name


@pytest.mark.parametrize("family", sorted(OBSERVERS))
def test_update_keeps_the_state_dtypes_or_names_the_field(family):
    observer = OBSERVERS[family]()
    x = torch.randn(6, 8)
    for state, name in _converted(observer.init(x)):
        try:
            updated = observer.update(state, x)
        except ValueError as error:
            assert f"state's {name} is a" in str(error)
            continue
        # kept: the updated state merges with the one it came from, as init's dtypes do
        assert [t.dtype for t in updated] == [t.dtype for t in state], name
        observer.merge(state, updated)


@pytest.mark.parametrize("family", sorted(OBSERVERS))
def test_float64_extremes_stay_float64(family):
    observer = OBSERVERS[family]()
    x = torch.randn(6, 8)
    state = observer.init(x)
    state = state._replace(min_val=state.min_val.double(), max_val=state.max_val.double())
    updated = observer.update(state, x)
    assert updated.min_val.dtype == updated.max_val.dtype == torch.float64
    lo, hi = x.amin(1).double(), x.amax(1).double()  # per row, as PerAxis(0)
    if family in ("minmax", "memoryless_minmax", "moving_average_minmax", "histogram"):
        assert torch.equal(updated.min_val, lo) and torch.equal(updated.max_val, hi)
    observer.merge(state, updated)
