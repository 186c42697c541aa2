"""check_all on observers that clean their input in place or break two laws on different examples:
the law is named in one AssertionError."""

import math

import pytest
import torch

import qstats
from qstats import testing

pytest.importorskip("hypothesis")

SPEC = qstats.QuantSpec(granularity=qstats.PerAxis(0))
MINMAX = qstats.minmax(SPEC)


def _make_x(generator):
    return torch.randn(4, 8, generator=generator)


def _cleans_its_input(state, x, weight=None):
    new = MINMAX.update(state, x, weight)
    torch.nan_to_num_(x, 0.0)  # a bug: rewrites the caller's batch (an activation of the model)
    return new


def _dirty_batches(index):
    generator = torch.Generator().manual_seed(index)
    xs = [torch.randn(4, 8, generator=generator) for _ in range(3)]
    xs[index][0, :3] = torch.tensor([math.nan, math.inf, -math.inf])
    return xs


@pytest.mark.parametrize("index", [0, 1])
def test_purity_catches_an_update_that_cleans_non_finite_values_of_its_batch_in_place(index):
    xs = _dirty_batches(index)
    copies = [x.clone() for x in xs]
    broken = MINMAX._replace(update=_cleans_its_input, name="cleans")
    broken.update(broken.init(copies[index]), copies[index])
    assert not torch.equal(torch.isnan(copies[index]), torch.isnan(xs[index]))  # the premise: it writes into x
    with pytest.raises(AssertionError, match="cleans: purity: update modified the input tensor"):
        testing.check_purity(broken, xs)


def test_check_all_catches_an_update_that_cleans_non_finite_values_of_its_batch_in_place():
    broken = MINMAX._replace(update=_cleans_its_input, name="cleans")
    with pytest.raises(AssertionError, match="cleans: purity: update modified the input tensor"):
        testing.check_all(broken, _make_x, laws="purity", max_examples=30)


def _averaging_merge(a, b):
    merged = MINMAX.merge(a, b)  # a bug: the mean of two maxima is not associative
    both = torch.isfinite(a.max_val) & torch.isfinite(b.max_val)
    return merged._replace(max_val=torch.where(both, (a.max_val + b.max_val) / 2, merged.max_val))


def _nan_on_nan(state, x, weight=None):
    new = MINMAX.update(state, x, weight)  # a bug: a NaN in the batch makes the range NaN
    return new._replace(max_val=torch.where(torch.isnan(x).any(), math.nan, new.max_val))


@pytest.mark.parametrize("laws", [testing.LAWS, ("stability", "identity", "associative", "homomorphism")])
def test_check_all_reports_one_assertion_error_when_examples_break_different_laws(laws, hypothesis_shrinks):
    # batches with a NaN break stability, the others associativity and homomorphism: hypothesis finds
    # several failures (while shrinking: it stops generating at its first); check_all raises one, the
    # AssertionError naming its law, not a group of them
    broken = MINMAX._replace(update=_nan_on_nan, merge=_averaging_merge, name="twice_broken")
    with pytest.raises(AssertionError, match="twice_broken: stability"):
        testing.check_stability(broken, _dirty_batches(0))
    with pytest.raises(AssertionError, match="twice_broken: associativity"):
        testing.check_associative(broken, [torch.randn(4, 8) for _ in range(3)])
    with pytest.raises(AssertionError, match=r"twice_broken: (stability|associativity|homomorphism|purity)"):
        testing.check_all(broken, _make_x, laws=laws, max_examples=30)


def test_purity_names_the_law_when_compute_qparams_refuses_the_merged_state():
    broken = MINMAX._replace(update=_nan_on_nan, name="nan_range")
    xs = _dirty_batches(0)
    state = broken.update(broken.init(xs[0]), xs[0])
    with pytest.raises(ValueError) as refusal:  # the premise: compute_qparams refuses a NaN range
        qstats.compute_qparams(state, SPEC)
    assert "purity" not in str(refusal.value)
    with pytest.raises(ValueError, match="nan_range: purity: compute_qparams of a merged state: "):
        testing.check_purity(broken, xs)
