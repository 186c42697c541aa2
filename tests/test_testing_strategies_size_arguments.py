"""qstats.testing.strategies refuse sizes and exponents that are no integers, negative counts and
reversed ranges with a ValueError naming the function and argument; hypothesis' own errors named its
``min_value``/``max_size`` (splits(4.0): 'Expected int but got max_size=3.0'), and splits(-2), splits(True)
drew no split in silence. The reference for the accepted ones: the claims of each docstring."""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from qstats.testing import strategies


def _randn(generator):
    return torch.randn(2, 3, generator=generator)


@pytest.mark.filterwarnings("ignore::hypothesis.errors.NonInteractiveExampleWarning")  # batches draws to check
@pytest.mark.parametrize("build, message", [
    (lambda: strategies.splits(4.0), "splits: count must be a non-negative int, got 4.0"),
    (lambda: strategies.splits(-2), "splits: count must be a non-negative int, got -2"),
    (lambda: strategies.splits(True), "splits: count must be a non-negative int, got True"),
    (lambda: strategies.splits(4, -1), "splits: min_cuts must be a non-negative int, got -1"),
    (lambda: strategies.magnitudes(3, 1), r"magnitudes: min_exponent \(3\) must not exceed max_exponent \(1\)"),
    (lambda: strategies.magnitudes(0.5, 2), "magnitudes: min_exponent must be an int, got 0.5"),
    (lambda: strategies.tensors((2,), min_exponent=3, max_exponent=1), r"tensors: min_exponent \(3\) must not exceed"),
    (lambda: strategies.batches(_randn, 5, 3).example(), r"batches: min_size \(5\) must not exceed max_size \(3\)"),
    (lambda: strategies.batches(_randn, -1, 3).example(), "batches: min_size must be an int of at least 0, got -1"),
])
def test_bad_sizes_are_refused_naming_the_argument(build, message):
    with pytest.raises(ValueError, match=message):
        build()


@settings(max_examples=30, deadline=None, database=None)
@given(st.data())
def test_accepted_arguments_draw_what_the_docstrings_claim(data):
    count, min_cuts = data.draw(st.integers(0, 6)), data.draw(st.integers(0, 7))
    cuts = data.draw(strategies.splits(count, min_cuts))
    assert cuts == sorted(set(cuts)) and all(1 <= cut <= count - 1 for cut in cuts)
    assert len(cuts) >= min(min_cuts, max(count - 1, 0))
    exponent = math.log2(data.draw(strategies.magnitudes(-3, 2)))
    assert exponent == int(exponent) and -3 <= exponent <= 2
    xs = data.draw(strategies.batches(_randn, 1, 2))
    assert 1 <= len(xs) <= 2 and all(x.shape == (2, 3) for x in xs)
