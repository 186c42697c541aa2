"""qstats.testing.strategies.tensors' ``distributions``: a string is one distribution (as check_all's
``laws`` takes a string as one law); tuple("constant") drew 'c' and failed as an unknown distribution.
An unknown or empty ``distributions`` is refused when the strategy is built, naming the argument (an
empty one failed at the first draw as hypothesis' 'Cannot sample from a length-zero sequence').
The reference: a constant draw holds one value (x == x[0]); torch.rand * 2 - 1 lies in [-1, 1)."""

import pytest
from hypothesis import given, settings

from qstats.testing import strategies


@settings(max_examples=20, deadline=None, database=None)
@given(strategies.tensors((4, 8), distributions="constant"))
def test_a_string_is_one_distribution_constant(x):
    assert x.shape == (4, 8) and bool((x == x.reshape(-1)[0]).all())


@settings(max_examples=20, deadline=None, database=None)
@given(strategies.tensors((4, 8), distributions="uniform", min_exponent=0, max_exponent=0))
def test_a_string_is_one_distribution_uniform(x):
    assert bool(((x >= -1) & (x < 1)).all())


@pytest.mark.parametrize("distributions", [(), [], ("gauss",), ("normal", "Normal"), "gauss"])
def test_unknown_or_no_distributions_are_refused_naming_the_argument(distributions):
    with pytest.raises(ValueError, match=r"tensors: distributions must name one or more of \('normal'"):
        strategies.tensors((4, 8), distributions=distributions)
