"""An observer that keeps something between calls (a running maximum in a closure, outside its state)
breaks purity: the same inputs give another state once larger data was observed. check_purity passed
it (its two calls in a row agree, the maximum being idempotent), and check_all failed it as hypothesis'
FlakyStrategyDefinition or FlakyFailure, naming no law. The reference is torch.amax of the batches."""

import pytest
import torch

from qstats import testing
from test_testing_broken_observers_one_law_each import SPEC, make_x, plain_minmax


def _leaky(where):
    """The guide's plain min/max whose update (or merge) of states that saw data also takes the largest
    maximum it ever returned, kept in a closure."""
    obs = plain_minmax(SPEC)
    kept = []

    def remember(new, seen):
        kept[:] = [new.max_val if not kept else torch.maximum(kept[0], new.max_val)]
        return new._replace(max_val=torch.where(seen, kept[0], new.max_val))

    if where == "update":
        return obs._replace(update=lambda state, x, weight=None: remember(obs.update(state, x, weight),
                                                                          state.count > 0))
    return obs._replace(merge=lambda a, b: remember(obs.merge(a, b), (a.count > 0) & (b.count > 0)))


def _batches():
    generator = torch.Generator().manual_seed(0)
    return [make_x(generator) for _ in range(3)]


@pytest.mark.parametrize("where", ["update", "merge"])
def test_the_leaky_observer_is_wrong_against_torch(where):
    obs, xs = _leaky(where), _batches()
    obs.update(obs.init(xs[0]), xs[0] * 4)  # larger data observed first
    obs.merge(obs.update(obs.init(xs[0]), xs[0] * 4), obs.update(obs.init(xs[0]), xs[0] * 4))
    state = obs.merge(obs.update(obs.init(xs[0]), xs[0]), obs.update(obs.init(xs[1]), xs[1]))
    state = obs.update(state, xs[2])
    assert float(state.max_val) > float(torch.amax(torch.stack(xs)))


@pytest.mark.parametrize("where", ["update", "merge"])
def test_check_purity_fails_an_observer_keeping_a_maximum_between_calls(where):
    with pytest.raises(AssertionError, match=f"plain_minmax: purity: {where} gave another state .* global or a closure"):
        testing.check_purity(_leaky(where), _batches())


@pytest.mark.parametrize("where", ["update", "merge"])
def test_check_all_fails_it_naming_purity_not_hypothesis_flakiness(where):
    with pytest.raises(AssertionError, match=r"plain_minmax: purity: .*\(or make_x\) may keep something between calls"):
        testing.check_all(_leaky(where), make_x, max_examples=10)


def test_the_plain_minmax_still_passes_purity():
    testing.check_purity(plain_minmax(SPEC), _batches())
    testing.check_all(plain_minmax(SPEC), make_x, laws="purity", max_examples=5)
