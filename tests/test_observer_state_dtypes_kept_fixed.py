"""docs/observers.md: "An update returns its state's dtypes ...: a state converted after ``init`` to ones
the update does not keep (bfloat16 extremes, int32 counts) raises ValueError naming the field". The
constant observers (``fixed_qparams`` and its ``sigmoid_qparams``/``tanh_qparams``, ``placeholder``,
``noop``) and ``recording`` promoted such a state in silence (an int32 count came back int64, bfloat16
recorded values float32), and the result no longer merged with the state it came from."""

from __future__ import annotations

import pytest
import torch

import qstats

SPEC = qstats.QuantSpec(dtype="uint8")
OBSERVERS = {
    "fixed_qparams": lambda: qstats.fixed_qparams(SPEC, 0.1, 0),
    "sigmoid_qparams": lambda: qstats.sigmoid_qparams(SPEC),
    "placeholder": lambda: qstats.placeholder(SPEC),
    "noop": lambda: qstats.noop(SPEC),
    "recording": lambda: qstats.recording(SPEC, capacity=16),
}


@pytest.mark.parametrize("family", sorted(OBSERVERS))
def test_update_keeps_the_state_dtypes_or_names_the_field(family):
    observer = OBSERVERS[family]()
    x = torch.rand(4, 8)
    state = observer.init(x)
    for name, value in zip(state._fields, state):
        converted = state._replace(**{name: value.to(torch.bfloat16 if value.is_floating_point() else torch.int32)})
        try:
            updated = observer.update(converted, x)
        except ValueError as error:
            assert f"state's {name} is a" in str(error)
            continue
        assert [t.dtype for t in updated] == [t.dtype for t in converted], name
        observer.merge(converted, updated)  # merge checks that both states' fields have one dtype
    updated = observer.update(state, x)  # init's dtypes are kept
    assert [t.dtype for t in updated] == [t.dtype for t in state]
