"""`qstats.register_range_rule` refuses a second rule for a state class unless ``replace=True``, as
`qstats.observers.register` refuses a second factory for a name: a user's rule registered for a built-in
state (``MinMaxState``) would otherwise change every minmax observer's scales in the process, silently."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

import qstats


class _AbsMaxState(NamedTuple):
    amax: torch.Tensor


def _rule(state, spec):
    return qstats.observers.kit.Range(-state.amax, state.amax, torch.tensor(True))


def _half(state, spec):
    return qstats.observers.kit.Range(-state.amax / 2, state.amax / 2, torch.tensor(True))


def test_a_second_rule_for_a_state_class_is_refused_unless_replace():
    qstats.register_range_rule(_AbsMaxState)(_rule)
    qstats.register_range_rule(_AbsMaxState)(_rule)  # the same rule again (a module imported twice): no change
    spec = qstats.QuantSpec(dtype="int8")
    state = _AbsMaxState(torch.tensor(2.54))
    before = qstats.compute_qparams(state, spec).scale
    with pytest.raises(ValueError, match=r"_AbsMaxState has a range rule already \(_rule\); pass replace=True"):
        qstats.register_range_rule(_AbsMaxState)(_half)
    assert torch.equal(qstats.compute_qparams(state, spec).scale, before)
    qstats.register_range_rule(_AbsMaxState, replace=True)(_half)
    assert torch.equal(qstats.compute_qparams(state, spec).scale, before / 2)  # 2.54 / 127, then 1.27 / 127


def test_a_rule_for_a_built_in_state_is_refused():
    minmax = qstats.minmax(qstats.QuantSpec(dtype="int8"))
    with pytest.raises(ValueError, match=r"MinMaxState has a range rule already"):
        qstats.register_range_rule(type(minmax.init(torch.zeros(2))))(lambda state, spec: None)
    x = torch.tensor([-1.0, 2.54])
    assert torch.equal(qstats.compute_qparams(minmax.update(minmax.init(x), x), minmax.spec).scale,
                       torch.tensor(2.54 / 127.5))
