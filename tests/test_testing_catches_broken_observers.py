"""qstats.testing against broken observers the law checks used to pass, and correct observers
they must not fail."""

from typing import NamedTuple

import pytest
import torch

import qstats
from qstats import testing

SPEC = qstats.QuantSpec(granularity=qstats.PerAxis(0))
XS = [torch.randn(6, 8, generator=torch.Generator().manual_seed(i)) for i in range(4)]


def _make_x(generator):
    return torch.randn(6, 8, generator=generator)


def test_purity_catches_a_merge_that_writes_into_its_second_argument():
    obs = qstats.minmax(SPEC)

    def merge(a, b):
        new = obs.merge(a, b)
        b.min_val.copy_(new.min_val)
        b.max_val.copy_(new.max_val)
        return new

    with pytest.raises(AssertionError, match="purity: merge modified its second argument"):
        testing.check_purity(obs._replace(merge=merge), [x.clone() for x in XS])


def test_purity_catches_an_update_that_modifies_its_weight():
    obs = qstats.minmax(qstats.QuantSpec())

    def update(state, x, weight=None):
        new = obs.update(state, x, weight)
        if weight is not None:
            weight.zero_()
        return new

    broken = obs._replace(update=update)
    with pytest.raises(AssertionError, match="purity: update modified the weight"):
        testing.check_purity(broken, XS)
    with pytest.raises(AssertionError, match="purity: update modified the weight"):
        testing.check_all(broken, _make_x, laws=("purity",), max_examples=3)


def test_stability_catches_a_state_that_follows_a_float64_input():
    obs = qstats.minmax(qstats.QuantSpec())

    def update(state, x, weight=None):
        new = obs.update(state, x, weight)
        # a float64 batch widens the state to float64 (narrower inputs keep float32)
        dtype = torch.promote_types(new.min_val.dtype, x.dtype)
        return new._replace(min_val=new.min_val.to(dtype), max_val=new.max_val.to(dtype))

    with pytest.raises(AssertionError, match="stability: update with a torch.float64 tensor"):
        testing.check_stability(obs._replace(update=update), XS)


def test_homomorphism_catches_an_update_that_ignores_its_weight():
    obs = qstats.minmax(qstats.QuantSpec())

    def update(state, x, weight=None):
        return obs.update(state, x)  # padding rows are observed

    broken = obs._replace(update=update)
    with pytest.raises(AssertionError, match=r"update\(s, x, mask\)"):
        testing.check_homomorphism(broken, XS)
    with pytest.raises(AssertionError, match="homomorphism"):
        testing.check_all(broken, _make_x, laws=("homomorphism",), max_examples=3)


def test_homomorphism_catches_a_per_channel_update_that_is_not_a_homomorphism():
    """Per channel (PerAxis(0)) batches do not concatenate along dim 0; they do along dim 1."""
    obs = qstats.moments(SPEC)

    def update(state, x, weight=None):
        batch = obs.update(obs.init(x), x, weight)
        # adds each batch's mean as if it were one value: the sequential fold and the merge of
        # per-group folds agree, the concatenation of two batches does not
        mean = batch.total / batch.count.clamp(min=1)
        one = torch.ones_like(batch.count)
        return obs.merge(state, batch._replace(count=one, total=mean, m2=torch.zeros_like(mean)))

    broken = obs._replace(update=update)
    with pytest.raises(AssertionError, match="cat"):
        testing.check_homomorphism(broken, XS)


def test_laws_hold_for_a_weight_observer_bound_to_its_shape():
    """imatrix_mse with importance data takes only tensors of its weight's shape: the
    concatenation form is skipped, not failed."""
    activations = torch.randn(5, 8, generator=torch.Generator().manual_seed(0))
    imatrix = qstats.imatrix()
    importance = imatrix.update(imatrix.init(activations), activations)
    obs = qstats.imatrix_mse(qstats.QuantSpec(dtype="int4", granularity=qstats.PerAxis(0)), (6, 8), importance)
    testing.check_all(obs, _make_x, max_examples=3)


@qstats.register_state
class LawsReviewSumState(NamedTuple):
    """A user's float32 sum of x per tensor (signed: it can cancel to nearly zero)."""

    approx_fields = ("total",)
    total: torch.Tensor
    count: torch.Tensor


def _sum_observer():
    def init_fn(x):
        return LawsReviewSumState(torch.zeros(()), torch.zeros((), dtype=torch.int64))

    def update_fn(state, x, weight=None):
        keep = torch.ones(x.shape[0]) if weight is None else (weight != 0).float()
        values = x.float() * keep.reshape((-1,) + (1,) * (x.ndim - 1))
        count = keep.sum().long() * (x[0].numel() if x.shape[0] else 0)
        return LawsReviewSumState(state.total + values.sum(), state.count + count)

    def merge_fn(a, b):
        return LawsReviewSumState(a.total + b.total, a.count + b.count)

    return qstats.Observer(init_fn, update_fn, merge_fn, exact=True, name="sum")


@pytest.mark.parametrize("seed", [57, 147])
def test_a_float32_sum_that_cancels_is_compared_to_the_magnitude_of_its_terms(seed):
    """Two batches whose float32 sums nearly cancel: the result's rounding error is that of its
    terms (~1e-7 of them), far above 1e-5 of the nearly zero result."""
    obs = _sum_observer()
    generator = torch.Generator().manual_seed(seed)
    xs = [torch.randn(6, 64, generator=generator) for _ in range(4)]
    # an independent check that the terms do round differently: float64 says which is closer
    left = obs.merge(obs.update(obs.init(xs[1]), xs[1]), obs.update(obs.init(xs[2]), xs[2])).total
    joined = obs.update(obs.init(xs[1]), torch.cat([xs[1], xs[2]])).total
    assert not torch.equal(left, joined)
    assert float((left - joined).abs()) < 1e-6 * float(torch.cat([xs[1], xs[2]]).double().abs().sum())
    testing.check_homomorphism(obs, xs, [[1], [2]])
    testing.check_associative(obs, xs)
