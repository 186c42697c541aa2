"""check_all's ``laws``, ``exact``, ``accumulates`` and ``compile`` arguments: an empty ``laws`` checked
no law and passed any observer (a merge that halves the maxima, which check_all fails by default),
``exact="no"`` (a truthy string) checked an order-dependent observer as exact, and ``accumulates=None``
skipped the sequential homomorphism silently; ``laws=None`` failed as "'NoneType' object is not
iterable". Each is refused, naming the argument."""

import pytest
import torch

import qstats
from qstats import testing

pytest.importorskip("hypothesis")

MINMAX = qstats.minmax(qstats.QuantSpec(granularity=qstats.PerAxis(0)))


def _make_x(generator):
    return torch.randn(4, 8, generator=generator)


def _halves_the_maxima():
    def merge(a, b):  # the mean of two maxima: neither associative nor a homomorphism
        merged = MINMAX.merge(a, b)
        both = torch.isfinite(a.max_val) & torch.isfinite(b.max_val)
        return merged._replace(max_val=torch.where(both, (a.max_val + b.max_val) / 2, merged.max_val))

    return MINMAX._replace(merge=merge, name="halves")


def test_the_broken_merge_fails_check_all():
    with pytest.raises(AssertionError, match="halves"):
        testing.check_all(_halves_the_maxima(), _make_x, max_examples=5)


@pytest.mark.parametrize("laws", [(), [], set()])
def test_no_law_is_refused(laws):
    with pytest.raises(ValueError, match="laws is empty, so no law would be checked"):
        testing.check_all(_halves_the_maxima(), _make_x, laws=laws, max_examples=5)


def test_laws_that_are_no_names_are_refused():
    with pytest.raises(TypeError, match="laws must be a law's name or a collection of them"):
        testing.check_all(MINMAX, _make_x, laws=None)


@pytest.mark.parametrize("name, value", [("exact", "no"), ("exact", 1), ("accumulates", None), ("accumulates", "False"),
                                         ("compile", "yes")])
def test_flags_that_are_not_bools_are_refused(name, value):
    with pytest.raises(TypeError, match=f"check_all: {name} must be True"):
        testing.check_all(MINMAX, _make_x, max_examples=2, **{name: value})



def _writes_its_state():
    def update(state, x, weight=None):
        new = MINMAX.update(state, x, weight)
        state.max_val.copy_(new.max_val)  # a bug: writes into the state it was given
        return new

    return MINMAX._replace(update=update, name="writes")


@pytest.mark.parametrize("laws", [lambda: (law for law in ("identity", "purity")),
                                  lambda: {"identity": 1, "purity": 2}.keys()])
def test_laws_from_a_generator_or_dict_keys_are_run(laws):
    testing.check_all(MINMAX, _make_x, laws=laws(), max_examples=2)
    with pytest.raises(AssertionError, match="writes: purity: update modified the state"):
        testing.check_all(_writes_its_state(), _make_x, laws=laws(), max_examples=2)
