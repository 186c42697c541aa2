"""Contract suite: every observer of tests/observer_cases.py through every law (qstats.testing),
and proof that each law check catches the bug it is meant to catch."""

from typing import NamedTuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from observer_cases import CASES

import qstats
from qstats import testing
from qstats.testing import strategies
from qstats.observers.minmax import MinMaxState

MAX_EXAMPLES = 10
# vmap checks run update/merge/compute_qparams/fake_quantize batched and looped: fewer examples.
EXAMPLES_PER_LAW = {"vmap": 4}
# torch.compile is slow on small machines: compile only these cases.
COMPILE_CASES = ("minmax/axis0", "moving_average_minmax/tensor")


def _unpack(case):
    name, factory, make_x, *rest = case
    return name, factory, make_x, (rest[0] if rest else {})


@pytest.mark.parametrize("law", testing.LAWS)
@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_law(case, law):
    name, factory, make_x, options = _unpack(case)
    examples = EXAMPLES_PER_LAW.get(law, MAX_EXAMPLES)
    testing.check_all(factory(), make_x, laws=(law,), max_examples=examples, **options)


@pytest.mark.parametrize("case", [c for c in CASES if c[0] in COMPILE_CASES], ids=list(COMPILE_CASES))
def test_compile(case):
    name, factory, make_x, options = _unpack(case)
    generator = torch.Generator().manual_seed(0)
    testing.check_compile(factory(), [make_x(generator) for _ in range(2)], approx_fields=options.get("approx_fields"))


def test_case_list_is_well_formed():
    names = [case[0] for case in CASES]
    assert len(names) == len(set(names)), "duplicate case names"
    for case in CASES:
        name, factory, make_x, options = _unpack(case)
        assert set(options) <= {"accumulates", "approx_fields", "exact"}, name
        obs = factory()
        assert isinstance(obs, qstats.Observer), name
        assert isinstance(make_x(torch.Generator().manual_seed(0)), torch.Tensor), name


def test_every_registered_state_type_has_a_case():
    registered = {name for name, cls in qstats.observers.state_types().items() if cls.__module__.startswith("qstats.")}
    covered = set()
    for case in CASES:
        name, factory, make_x, options = _unpack(case)
        covered.add(type(factory().init(make_x(torch.Generator().manual_seed(0)))).__name__)
    assert not registered - covered, f"state types without a case in tests/observer_cases.py: {registered - covered}"


# ---------------------------------------------------------------------------------------------
# Every check can fail: broken observers built from minmax, one bug each.

SPEC = qstats.QuantSpec(granularity=qstats.PerAxis(0))
XS = [torch.randn(6, 8, generator=torch.Generator().manual_seed(i)) for i in range(4)]


def _minmax():
    return qstats.minmax(SPEC)


def test_identity_catches_a_merge_that_adds_a_count():
    obs = _minmax()

    def merge(a, b):
        return obs.merge(a, b)._replace(count=a.count + b.count + 1)

    with pytest.raises(AssertionError, match="identity"):
        testing.check_identity(obs._replace(merge=merge), XS)


def test_associativity_catches_an_averaging_merge():
    obs = _minmax()

    def merge(a, b):
        both = (a.count > 0) & (b.count > 0)
        mean = (a.min_val + b.min_val) / 2
        min_val = torch.where(both, mean, torch.minimum(a.min_val, b.min_val))
        return obs.merge(a, b)._replace(min_val=min_val)

    with pytest.raises(AssertionError, match="associativity"):
        testing.check_associative(obs._replace(merge=merge), XS)


def test_commutativity_catches_a_left_biased_merge():
    obs = _minmax()

    def merge(a, b):
        seen = a.count > 0
        return obs.merge(a, b)._replace(
            min_val=torch.where(seen, a.min_val, b.min_val), max_val=torch.where(seen, a.max_val, b.max_val)
        )

    broken = obs._replace(merge=merge)
    testing.check_identity(broken, XS)  # identity and associativity still hold
    testing.check_associative(broken, XS)
    with pytest.raises(AssertionError, match="commutativity"):
        testing.check_commutative(broken, XS)


def test_homomorphism_catches_an_order_dependent_observer_declared_exact():
    obs = qstats.moving_average_minmax(SPEC, 0.5)
    with pytest.raises(AssertionError, match="homomorphism"):
        testing.check_homomorphism(obs._replace(exact=True), XS)


def test_homomorphism_catches_a_latest_batch_observer_in_the_sequential_form():
    obs = qstats.memoryless_minmax(SPEC)
    testing.check_homomorphism(obs, XS, accumulates=False)
    with pytest.raises(AssertionError, match="sequential"):
        testing.check_homomorphism(obs, XS)


def test_homomorphism_concatenation_form_catches_a_batch_counting_update():
    obs = qstats.minmax(qstats.QuantSpec())

    def update(state, x, weight=None):
        new = obs.update(state, x, weight)
        return new._replace(nonfinite=new.nonfinite + 1)  # counts batches, not values

    def merge(a, b):
        return obs.merge(a, b)

    broken = obs._replace(update=update, merge=merge)
    with pytest.raises(AssertionError, match="cat"):
        testing.check_homomorphism(broken, XS, splits=[])


def test_purity_catches_an_in_place_update():
    obs = _minmax()

    def update(state, x, weight=None):
        new = obs.update(state, x, weight)
        state.min_val.copy_(new.min_val)
        return new

    with pytest.raises(AssertionError, match="purity: update modified the state"):
        testing.check_purity(obs._replace(update=update), XS)


def test_purity_catches_an_update_that_modifies_its_input():
    obs = _minmax()

    def update(state, x, weight=None):
        new = obs.update(state, x, weight)
        x.clamp_(-1, 1)
        return new

    with pytest.raises(AssertionError, match="purity: update modified the input"):
        testing.check_purity(obs._replace(update=update), [x.clone() for x in XS])


def test_stability_catches_a_dtype_change():
    obs = _minmax()

    def update(state, x, weight=None):
        new = obs.update(state, x, weight)
        return new._replace(count=new.count.to(torch.int32))

    with pytest.raises(AssertionError, match="stability"):
        testing.check_stability(obs._replace(update=update), XS)


def test_stability_catches_low_precision_accumulation():
    obs = _minmax()

    def update(state, x, weight=None):
        new = obs.update(state, x, weight)
        return new._replace(min_val=new.min_val.to(x.dtype))  # keeps the input's precision

    with pytest.raises(AssertionError, match="bfloat16"):
        testing.check_stability(obs._replace(update=update), XS)


class _UnregisteredState(NamedTuple):
    min_val: torch.Tensor


def test_stability_catches_an_unregistered_state_type():
    obs = _minmax()
    broken = obs._replace(init=lambda x: _UnregisteredState(obs.init(x).min_val))
    with pytest.raises(AssertionError, match="not registered"):
        testing.check_stability(broken, XS)


def test_vmap_catches_a_host_sync():
    obs = _minmax()

    def update(state, x, weight=None):
        new = obs.update(state, x, weight)
        if float(new.max_val.max().item()) > 1e30:  # a Python branch on a tensor value
            return state
        return new

    with pytest.raises(AssertionError, match="vmap"):
        testing.check_vmap(obs._replace(update=update), XS)


def test_vmap_catches_a_batch_dependent_update():
    obs = _minmax()
    calls = []

    def update(state, x, weight=None):
        calls.append(1)
        new = obs.update(state, x, weight)
        return new._replace(count=new.count + len(calls))  # differs between the loop and one vmap call

    with pytest.raises(AssertionError, match="vmap"):
        testing.check_vmap(obs._replace(update=update), XS)


def test_compile_catches_a_graph_break():
    obs = _minmax()

    def update(state, x, weight=None):
        new = obs.update(state, x, weight)
        if new.count.sum().item() < 0:  # data-dependent branch: a graph break under fullgraph
            return state
        return new

    with pytest.raises(AssertionError, match="torch.compile"):
        testing.check_compile(obs._replace(update=update), XS, backend="eager")


def test_check_all_reports_the_failing_law():
    obs = qstats.moving_average_minmax(SPEC, 0.5)._replace(exact=True)
    with pytest.raises(AssertionError, match="homomorphism"):
        testing.check_all(obs, lambda g: torch.randn(6, 8, generator=g), laws=("homomorphism",), max_examples=5)
    # Declared order-dependent, it passes: homomorphism skipped, associativity to tolerance.
    testing.check_all(obs, lambda g: torch.randn(6, 8, generator=g), exact=False, max_examples=5)


# ---------------------------------------------------------------------------------------------
# A user's own observer with a float sum: the harness compares it to tolerance.


@qstats.register_state
class ContractTestAbsSumState(NamedTuple):
    """Sum of |x| and count per tensor (a toy mean-absolute-value observer)."""

    abs_sum: torch.Tensor
    count: torch.Tensor
    approx_fields = ("abs_sum",)


@qstats.register_range_rule(ContractTestAbsSumState)
def _abs_sum_rule(state, spec):
    mean = state.abs_sum / state.count.clamp(min=1)
    return qstats.Range(-2 * mean, 2 * mean, state.count > 0)


def _abs_sum_observer(spec):
    def init_fn(x):
        return ContractTestAbsSumState(torch.zeros((), dtype=torch.float32, device=x.device),
                                       torch.zeros((), dtype=torch.int64, device=x.device))

    def update_fn(state, x, weight=None):
        keep = torch.isfinite(x)  # NaN and Inf are left out
        if weight is not None:
            keep = keep & (weight != 0).reshape(weight.shape + (1,) * (x.ndim - weight.ndim))
        values = torch.where(keep, x.float().abs(), 0.0)
        return ContractTestAbsSumState(state.abs_sum + values.sum(), state.count + keep.sum())

    def merge_fn(a, b):
        return ContractTestAbsSumState(a.abs_sum + b.abs_sum, a.count + b.count)

    return qstats.Observer(init_fn, update_fn, merge_fn, exact=True, spec=spec, name="abs_sum")


def test_a_user_observer_with_float_sums_passes_every_law():
    obs = _abs_sum_observer(qstats.QuantSpec())
    testing.check_all(obs, lambda g: torch.randn(5, 7, generator=g), max_examples=MAX_EXAMPLES)


def test_assert_states_equal_tolerance_applies_only_to_approx_fields():
    a = ContractTestAbsSumState(torch.tensor(1000.0), torch.tensor(3))
    close = ContractTestAbsSumState(torch.tensor(1000.0 + 1e-3), torch.tensor(3))
    far = ContractTestAbsSumState(torch.tensor(1000.1), torch.tensor(3))
    testing.assert_states_equal(close, a)  # abs_sum is approximate: 1e-6 relative
    with pytest.raises(AssertionError, match="abs_sum"):
        testing.assert_states_equal(far, a)
    with pytest.raises(AssertionError, match="bit-exact"):
        testing.assert_states_equal(close, a, approx_fields=())
    with pytest.raises(AssertionError, match="count"):
        testing.assert_states_equal(a._replace(count=torch.tensor(4)), a)
    inf = MinMaxState(torch.tensor([torch.inf]), torch.tensor([1.0]), torch.tensor([1]), torch.tensor([0]))
    with pytest.raises(AssertionError, match="infinite"):
        testing.assert_states_equal(inf._replace(min_val=torch.tensor([-torch.inf])), inf, approx_fields="*")


@settings(max_examples=50, deadline=None, database=None)
@given(data=st.data(), count=st.integers(1, 6))
def test_homomorphism_draws_always_split_where_they_can(data, count):
    """check_all's homomorphism law draws at least one cut (with none, the merged fold is the
    sequential fold and the law holds for any observer)."""
    cuts = data.draw(strategies.splits(count, min_cuts=1))
    assert cuts == sorted(set(cuts)) and all(0 < c < count for c in cuts)
    assert len(cuts) >= (1 if count >= 2 else 0)


# ---------------------------------------------------------------------------------------------
# The kit's checks name the problem (docs/write_an_observer.md: "clear TypeErrors and ValueErrors").


def test_check_same_shapes_refuses_states_of_different_types():
    """zip() over the fields stopped at the shorter state: a two-field state of float32 fields passed
    as a MinMaxState, and other mixes were reported as a dtype difference of some field."""
    from qstats.observers import kit

    a = MinMaxState(torch.zeros(3), torch.zeros(3), torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64))
    other = ContractTestAbsSumState(torch.zeros(3), torch.zeros(3))
    with pytest.raises(TypeError, match="obs.merge: .*MinMaxState.*ContractTestAbsSumState"):
        kit.check_same_shapes(a, other, "obs.merge")
    with pytest.raises(TypeError, match="obs.merge: .*MinMaxState.*tuple"):
        kit.check_same_shapes(a, tuple(a), "obs.merge")
    with pytest.raises(TypeError, match="obs.merge: expected NamedTuple states, got Tensor"):
        kit.check_same_shapes(torch.zeros(3), torch.zeros(3), "obs.merge")
    kit.check_same_shapes(a, a, "obs.merge")


def test_extremes_init_refuses_what_it_cannot_build():
    from qstats.observers import kit

    with pytest.raises(TypeError, match="expected a QuantSpec"):
        kit.extremes_init(MinMaxState, "int8")
    with pytest.raises(TypeError, match="extremes_init.*NamedTuple"):
        kit.extremes_init(tuple, qstats.QuantSpec())
