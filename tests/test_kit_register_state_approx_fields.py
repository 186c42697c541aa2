"""register_state checks a state's ``approx_fields``, the float sums the laws of qstats.testing
compare to tolerance: ``("square_total")`` without its comma is a string, whose letters the laws
read as field names (so the sum was compared bit for bit), and a misspelled name was dropped the
same way, silently."""

from typing import NamedTuple

import pytest
import torch

from qstats.observers import kit
from qstats.testing import _laws


def _state_class(name: str, approx):
    cls = NamedTuple(name, [("square_total", torch.Tensor), ("count", torch.Tensor)])
    cls.approx_fields = approx
    return cls


def test_a_string_is_refused_naming_the_missing_comma():
    cls = _state_class("ApproxStringState", "square_total")
    # what the laws would read from it: its letters, not the field
    assert "square_total" not in _laws._declared_approx_fields(cls(torch.zeros(2), torch.zeros(2)))
    with pytest.raises(TypeError, match=r"ApproxStringState.approx_fields must be a tuple .*needs its comma"):
        kit.register_state(cls)


def test_a_name_that_is_not_a_field_is_refused():
    with pytest.raises(ValueError, match=r"approx_fields names \['square_totl'\], which are not fields"):
        kit.register_state(_state_class("ApproxTypoState", ("square_totl",)))
    with pytest.raises(TypeError, match="must be a tuple of field names"):
        kit.register_state(_state_class("ApproxNumberState", (1,)))


def test_field_names_and_every_float_field_are_taken():
    for name, approx in (("ApproxTupleState", ("square_total",)), ("ApproxListState", ["square_total"]),
                         ("ApproxAllState", ("*",)), ("ApproxNoneState", ())):
        cls = kit.register_state(_state_class(name, approx))
        assert kit.register_state(cls) is cls
