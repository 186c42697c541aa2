"""A range rule (`qstats.register_range_rule`) returns a `Range` or `QParams`; another result (a plain
``(lo, hi)`` tuple, as a newcomer writes first) is refused by `compute_qparams` naming the state and
what to return, where it raised an AttributeError from inside qstats."""

from typing import NamedTuple

import pytest
import torch

import qstats
from qstats.observers import kit


class _AbsmaxState(NamedTuple):
    amax: torch.Tensor


def _register(rule):
    state_type = type("AbsmaxState", (_AbsmaxState,), {})
    qstats.register_state(state_type)
    qstats.register_range_rule(state_type)(rule)
    return state_type


def test_a_rule_returning_a_plain_tuple_is_refused_naming_range():
    state_type = _register(lambda state, spec: (-state.amax, state.amax))
    with pytest.raises(TypeError, match=r"range rule of AbsmaxState returned a tuple; a rule returns .*Range"):
        qstats.compute_qparams(state_type(torch.tensor(2.0)), qstats.QuantSpec(dtype="int8"))


def test_a_rule_returning_a_range_gives_the_symmetric_int8_scale():
    state_type = _register(lambda state, spec: kit.Range(-state.amax, state.amax, torch.tensor(True)))
    qp = qstats.compute_qparams(state_type(torch.tensor(2.0)), qstats.QuantSpec(dtype="int8"))
    assert torch.equal(qp.scale, torch.tensor(2.0 / 127.5))  # torch.ao: max(-min, max) / ((qmax - qmin) / 2)
