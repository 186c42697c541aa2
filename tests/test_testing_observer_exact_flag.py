"""The laws read an Observer's ``exact`` flag as a bool; one that is not (None, "no", 0, 1) is a
TypeError naming ``exact``. It was read by its truth: exact=None skipped the homomorphism law (an
order-dependent update whose state changes when the data is split passed check_all), exact="no"
checked an order-dependent observer as exact (failing homomorphism, not the flag). The reference:
the update's state of two batches folded vs of their concatenation, computed with torch."""

import pytest
import torch

from qstats import testing
from test_testing_broken_observers_one_law_each import SPEC, make_x, plain_minmax


def _halving():
    """The plain min/max whose update halves the maximum it had before each batch: order-dependent."""
    obs = plain_minmax(SPEC)

    def update(state, x, weight=None):
        new = obs.update(obs.init(x), x, weight)
        seen = (state.count > 0) & (new.count > 0)
        high = torch.where(seen, torch.maximum(state.max_val / 2, new.max_val), torch.maximum(state.max_val, new.max_val))
        return new._replace(min_val=torch.minimum(state.min_val, new.min_val), max_val=high,
                            count=state.count + new.count)

    return obs._replace(update=update)


def test_the_halving_update_changes_with_the_split():
    obs, a, b = _halving(), torch.tensor([[4.0]]), torch.tensor([[1.0]])
    folded = obs.update(obs.update(obs.init(a), a), b)
    whole = obs.update(obs.init(a), torch.cat([a, b]))
    assert float(folded.max_val) == max(4.0 / 2, 1.0) and float(whole.max_val) == float(torch.cat([a, b]).max())


@pytest.mark.parametrize("flag", [None, "no", 0, 1])
def test_check_all_refuses_an_exact_that_is_no_bool(flag):
    with pytest.raises(TypeError, match=f"plain_minmax's exact must be True or False .*got {flag!r}"):
        testing.check_all(_halving()._replace(exact=flag), make_x, max_examples=3)


@pytest.mark.parametrize("law", [testing.check_associative, testing.check_homomorphism, testing.check_identity])
def test_each_law_refuses_it(law):
    generator = torch.Generator().manual_seed(0)
    with pytest.raises(TypeError, match="exact must be True or False"):
        law(_halving()._replace(exact=None), [make_x(generator) for _ in range(3)])


def test_declared_false_it_passes_and_true_it_fails_homomorphism():
    testing.check_all(_halving()._replace(exact=False), make_x, max_examples=3)
    with pytest.raises(AssertionError, match="plain_minmax: homomorphism"):
        testing.check_all(_halving(), make_x, max_examples=10)
