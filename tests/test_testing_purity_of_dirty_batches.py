"""check_purity with a batch holding NaN and ±inf: an update that cleans its input in place
(``x.masked_fill_(~torch.isfinite(x), 0)``) writes only into such a batch, so the laws' clean batches
never showed it, and `check_stability`, whose dirty batch it cleaned, blamed the non-finite policy."""

import torch

import pytest

import qstats
from qstats import testing

SPEC = qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0))


def _cleans_its_batch(factory=qstats.minmax):
    """``factory(SPEC)``, whose update also zeroes the batch's NaN and ±inf in place after observing it."""
    obs = factory(SPEC)

    def update(state, x, weight=None):
        new = obs.update(state, x, weight)
        x.masked_fill_(~torch.isfinite(x), 0.0)
        return new

    return obs._replace(update=update, name="cleans_its_batch")


def _batches():
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(6, 16, generator=generator) for _ in range(3)]


def test_purity_catches_an_update_that_cleans_a_dirty_batch_in_place():
    obs = _cleans_its_batch()
    dirty = torch.tensor([[1.0, float("nan"), float("inf")], [-2.0, float("-inf"), 3.0]])
    obs.update(obs.init(dirty), dirty)
    assert bool(torch.isfinite(dirty).all())  # the defect, seen directly: the batch was written to
    with pytest.raises(AssertionError, match="cleans_its_batch: purity: update modified the input tensor, a batch holding NaN"):
        testing.check_purity(obs, _batches())


@pytest.mark.parametrize("factory", [qstats.minmax, qstats.moments])
def test_stability_leaves_that_to_purity_and_the_observer_without_the_write_passes(factory):
    # its states are the built-in's (NaN and ±inf left out): stability holds; only purity is broken
    # (moments' range reads every value: stability compared the cleaned batch's mask and failed)
    testing.check_stability(_cleans_its_batch(factory), _batches())
    testing.check_purity(factory(SPEC), _batches())
    with pytest.raises(AssertionError, match="purity"):
        testing.check_all(_cleans_its_batch(), lambda g: torch.randn(6, 16, generator=g), max_examples=5)


def test_an_update_that_refuses_nan_with_another_error_fails_stability_naming_it():
    # purity leaves a refused dirty batch to stability, whose message says how to refuse (a ValueError)
    obs = qstats.minmax(SPEC)

    def update(state, x, weight=None):
        if not bool(torch.isfinite(x).all()):
            raise RuntimeError("found a NaN")
        return obs.update(state, x, weight)

    broken = obs._replace(update=update, name="refuses_with_runtime_error")
    testing.check_purity(broken, _batches())
    with pytest.raises(AssertionError, match="refuses_with_runtime_error: stability: update with a batch holding NaN"):
        testing.check_stability(broken, _batches())
