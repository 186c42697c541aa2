"""`qstats.testing` on observers that carry a spec but hold no quantization statistic (placeholder,
noop, recording, and a user's counting observer): the laws of update and merge run, the checks of
compute_qparams and fake_quantize are left out with one warning that says why, and a broken merge
of such an observer still fails."""

import warnings
from typing import NamedTuple

import pytest
import torch

import qstats
from qstats import testing
from qstats.observers import kit

SPEC = qstats.QuantSpec(dtype="uint8", mapping="asymmetric")


def _make_x(generator):
    return torch.randn(4, 8, generator=generator)


@kit.register_state
class UserCountState(NamedTuple):
    count: torch.Tensor  # int64 scalar: values seen


def _user_counter(spec=SPEC):
    """A user's pass-through observer: counts values, carries a spec, registers no range rule."""

    def init_fn(x):
        return UserCountState(torch.zeros((), dtype=torch.int64, device=x.device))

    def update_fn(state, x, weight=None):
        if weight is None:
            return UserCountState(state.count + x.numel())
        keep = kit.weight_view(x, weight, qstats.PerTensor()) != 0
        return UserCountState(state.count + keep.sum())

    def merge_fn(a, b):
        return UserCountState(a.count + b.count)

    return kit.Observer(init_fn, update_fn, merge_fn, exact=True, spec=spec, name="user_counter")


OBSERVERS = {
    "placeholder": lambda: qstats.placeholder(SPEC),
    "noop": lambda: qstats.noop(SPEC),
    "recording": lambda: qstats.recording(SPEC, capacity=16),
    "user_counter": _user_counter,
}


def _skip_warnings(caught):
    return [w for w in caught if "holds no quantization statistic" in str(w.message)]


@pytest.mark.parametrize("name", sorted(OBSERVERS))
def test_check_all_runs_the_update_and_merge_laws_and_says_once_why_qparams_are_left_out(name):
    obs = OBSERVERS[name]()
    with pytest.raises(TypeError):  # the premise: compute_qparams refuses the state
        x = torch.randn(4, 8)
        qstats.compute_qparams(obs.update(obs.init(x), x), SPEC)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        testing.check_all(obs, _make_x, max_examples=3)
    skipped = _skip_warnings(caught)
    assert len(skipped) == 1, [str(w.message) for w in caught]
    message = str(skipped[0].message)
    assert name in message and "compute_qparams" in message
    assert skipped[0].filename == __file__  # points at the caller's line


@pytest.mark.parametrize("law", [testing.check_purity, testing.check_vmap])
@pytest.mark.parametrize("name", sorted(OBSERVERS))
def test_qparams_laws_called_alone_leave_the_qparams_checks_out_with_a_warning(name, law):
    obs = OBSERVERS[name]()
    xs = [torch.randn(4, 8) for _ in range(3)]
    with pytest.warns(UserWarning, match="holds no quantization statistic"):
        law(obs, xs)


def test_a_statistic_free_observer_with_a_broken_merge_still_fails_the_laws():
    obs = _user_counter()
    broken = obs._replace(merge=lambda a, b: a, name="forgetful_counter")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(AssertionError, match="forgetful_counter"):
            testing.check_all(broken, _make_x, max_examples=3)


def test_an_observer_whose_qparams_fail_otherwise_is_still_reported():
    # a ValueError of compute_qparams (not a state without statistics) is the law's to report
    minmax = qstats.minmax(SPEC)

    def update_fn(state, x, weight=None):
        return minmax.update(state, x, weight)._replace(count=torch.zeros_like(state.count))

    uncounted = minmax._replace(update=update_fn, name="uncounted")
    xs = [torch.randn(4, 8) for _ in range(3)]
    with pytest.raises(ValueError):
        qstats.compute_qparams(uncounted.update(uncounted.init(xs[0]), xs[0]), SPEC)
    with pytest.raises((ValueError, AssertionError)):
        testing.check_vmap(uncounted, xs)


@kit.register_state
class BuggyRuleState(NamedTuple):
    min_val: torch.Tensor
    max_val: torch.Tensor


@qstats.register_range_rule(BuggyRuleState)
def _buggy_rule(state, spec, **options):
    return qstats.qparams_from_minmax(state.min_val, spec)  # a bug: max_val left out (a TypeError)


def test_a_range_rule_raising_a_typeerror_of_its_own_fails_the_law_instead_of_being_skipped():
    # a user's rule with a bug is no state without statistics: the law reports it, no warning hides it
    def init_fn(x):
        return BuggyRuleState(torch.tensor(float("inf")), torch.tensor(float("-inf")))

    def update_fn(state, x, weight=None):
        return BuggyRuleState(torch.minimum(state.min_val, x.amin()), torch.maximum(state.max_val, x.amax()))

    def merge_fn(a, b):
        return BuggyRuleState(torch.minimum(a.min_val, b.min_val), torch.maximum(a.max_val, b.max_val))

    obs = kit.Observer(init_fn, update_fn, merge_fn, exact=True, spec=SPEC, name="buggy_rule")
    xs = [torch.randn(4, 8) for _ in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "holds no quantization statistic" warning
        with pytest.raises(TypeError):
            testing.check_purity(obs, xs)
