"""Deliberately broken observers, one law broken each: check_all must fail each, naming the law.

Each observer is a plain min/max written from docs/write_an_observer.md with one defect; the
reference is the plain min/max itself (which passes) and torch's own extremes (``torch.aminmax``).
"""

from typing import NamedTuple

import pytest
import torch

import qstats
from qstats import testing
from qstats.observers import kit


@kit.register_state
class BrokenLawMinMax(NamedTuple):
    min_val: torch.Tensor
    max_val: torch.Tensor
    count: torch.Tensor


@kit.register_range_rule(BrokenLawMinMax)
def _extremes(state, spec):
    return kit.Range(state.min_val, state.max_val, state.count)


@kit.register_state
class RatioClipState(NamedTuple):
    min_val: torch.Tensor
    max_val: torch.Tensor
    count: torch.Tensor


@kit.register_range_rule(RatioClipState)
def _ratio_clip(state, spec):
    # the extremes times their span over twice the absolute maximum, divided back: 0/0 on an all-zero batch
    amax = torch.maximum(state.min_val.abs(), state.max_val.abs())
    ratio = (state.max_val - state.min_val) / (2 * amax)
    return kit.Range(state.min_val * ratio / ratio, state.max_val * ratio / ratio, state.count)


def plain_minmax(spec, cls=BrokenLawMinMax, init_count=0):
    """The guide's min/max; ``init_count`` 1 breaks the identity (init then counts one batch)."""

    def init_fn(x):
        kit.check_observable(x, "plain_minmax.init")
        shape = kit.qparam_shape(x.shape, spec.granularity)
        return cls(torch.full(shape, torch.inf, device=x.device), torch.full(shape, -torch.inf, device=x.device),
                   torch.full(shape, init_count, dtype=torch.int64, device=x.device))

    def update_fn(state, x, weight=None):
        kit.check_observable(x, "plain_minmax.update")
        if x.numel() == 0:
            return state
        view = kit.checked_view(x, spec.granularity, state.count.shape, "plain_minmax.update").float()
        keep = torch.isfinite(view)
        mask = kit.weight_view(x, weight, spec.granularity)
        if mask is not None:
            keep = keep & (mask != 0)
        low = torch.where(keep, view, torch.inf).amin(dim=(0, -1))
        high = torch.where(keep, view, -torch.inf).amax(dim=(0, -1))
        return cls(torch.minimum(state.min_val, low), torch.maximum(state.max_val, high),
                   state.count + keep.sum(dim=(0, -1)))

    def merge_fn(a, b):
        kit.check_same_shapes(a, b, "plain_minmax.merge")
        return cls(torch.minimum(a.min_val, b.min_val), torch.maximum(a.max_val, b.max_val), a.count + b.count)

    return kit.Observer(init_fn, update_fn, merge_fn, exact=True, spec=spec, name="plain_minmax", state_type=cls)


SPEC = qstats.QuantSpec(dtype="int8")


def make_x(generator):
    return torch.randn(4, 8, generator=generator)


def test_the_plain_minmax_matches_torch_and_passes_every_law():
    obs = plain_minmax(SPEC)
    x = torch.randn(4, 8)
    state = obs.update(obs.init(x), x)
    low, high = torch.aminmax(x)
    assert torch.equal(state.min_val, low) and torch.equal(state.max_val, high)
    testing.check_all(obs, make_x, max_examples=3)


def test_identity_catches_an_init_that_counts_a_batch():
    with pytest.raises(AssertionError, match="identity"):
        testing.check_all(plain_minmax(SPEC, init_count=1), make_x, max_examples=3)


def test_stability_catches_a_range_rule_that_leaves_an_all_zero_batch_uncalibrated():
    # the reference: torch.aminmax of zeros is (0, 0), a zero range that compute_qparams maps to its smallest scale
    obs = plain_minmax(SPEC, RatioClipState)
    zeros = torch.zeros(4, 8)
    assert torch.aminmax(zeros) == (0, 0)
    with pytest.raises(AssertionError, match="stability: .*all-zero batch"):
        testing.check_all(obs, make_x, max_examples=3)


@pytest.mark.parametrize("factory", [qstats.minmax, plain_minmax])
def test_batches_that_are_all_nan_pass_every_law(factory):
    # the reference: torch.aminmax of the finite values of an all-NaN batch is empty, so nothing is
    # observed; compute_qparams raising its documented uncalibrated error (on_uncalibrated="raise") is the
    # spec's policy, not a law broken
    spec = qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0))
    nan = torch.full((4, 8), torch.nan)
    assert torch.isfinite(nan).sum() == 0
    obs = factory(spec)
    state = obs.update(obs.init(nan), nan)
    with pytest.raises(ValueError, match="saw no finite data"):
        qstats.compute_qparams(state, spec)
    testing.check_all(obs, lambda generator: torch.full((4, 8), torch.nan) + torch.randn(4, 8, generator=generator),
                      max_examples=3)


def _broken(defect):
    """The plain min/max with one defect (the plain one passes every law, above)."""
    obs = plain_minmax(SPEC)
    update, merge = obs.update, obs.merge
    if defect == "merge_not_commutative":  # the second state's minimum wins: associative, init its identity
        return obs._replace(merge=lambda a, b: merge(a, b)._replace(
            min_val=torch.where(b.count > 0, b.min_val, a.min_val)))
    if defect == "merge_mean_of_extremes":  # the midpoint of two states' extremes: neither associative nor exact
        def mean_merge(a, b):
            both = (a.count > 0) & (b.count > 0)
            merged = merge(a, b)
            return merged._replace(max_val=torch.where(both, (a.max_val + b.max_val) / 2, merged.max_val))
        return obs._replace(merge=mean_merge)
    if defect == "update_writes_its_state":
        def writes(state, x, weight=None):
            new = update(state, x, weight)
            state.count.copy_(new.count)
            return new
        return obs._replace(update=writes)
    if defect == "update_writes_its_batch":
        def cleans(state, x, weight=None):
            x.abs_()
            return update(state, x, weight)
        return obs._replace(update=cleans)
    if defect == "update_ignores_weight":
        return obs._replace(update=lambda state, x, weight=None: update(state, x))
    if defect == "merge_lets_nan_in":  # update leaves NaN out, merge adds a NaN count marker
        return obs._replace(merge=lambda a, b: merge(a, b)._replace(
            max_val=torch.where(a.count + b.count > 0, torch.maximum(a.max_val, b.max_val), torch.nan)))
    if defect == "update_branches_on_a_value":
        return obs._replace(update=lambda state, x, weight=None:
                            state if x.numel() and bool((x.abs() > 1e30).any()) else update(state, x, weight))
    raise AssertionError(defect)


@pytest.mark.parametrize("defect, law", [
    ("merge_not_commutative", "commutativity|homomorphism"),
    ("merge_mean_of_extremes", "associativity|homomorphism"),
    ("update_writes_its_state", "purity"),
    ("update_writes_its_batch", "purity"),
    ("update_ignores_weight", "stability|homomorphism"),
    ("merge_lets_nan_in", "identity"),
    ("update_branches_on_a_value", "vmap"),
])
def test_check_all_fails_each_broken_observer_naming_its_law(defect, law):
    with pytest.raises(AssertionError, match=f"plain_minmax: ({law})"):
        testing.check_all(_broken(defect), make_x, max_examples=5)
