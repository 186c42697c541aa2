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
    with pytest.raises(AssertionError, match="purity: update modified the weight: state not bit-exact"):
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


# ---------------------------------------------------------------------------------------------
# A new observer author's mistakes (docs/write_an_observer.md): each must fail the law it breaks,
# with a message naming the law, the observer and why.


@qstats.register_state
class LawsReviewMAVState(NamedTuple):
    """A per-channel mean absolute value: float64 sum of |x| and int64 count per parameter."""

    approx_fields = ("abs_total",)
    abs_total: torch.Tensor
    count: torch.Tensor


@qstats.register_range_rule(LawsReviewMAVState)
def _mav_rule(state, spec):
    mean = (state.abs_total / state.count.clamp(min=1)).float()
    return qstats.Range(-3 * mean, 3 * mean, state.count)


def _mav_observer(spec):
    from qstats.observers import kit

    def init_fn(x):
        shape = kit.qparam_shape(x.shape, spec.granularity)
        return LawsReviewMAVState(torch.zeros(shape, dtype=torch.float64, device=x.device),
                                  torch.zeros(shape, dtype=torch.int64, device=x.device))

    def update_fn(state, x, weight=None):
        if x.numel() == 0:
            return state
        view = kit.checked_view(x, spec.granularity, state.count.shape, "mav.update").double()
        keep = torch.isfinite(view)
        mask = kit.weight_view(x, weight, spec.granularity)
        if mask is not None:
            keep = keep & (mask != 0)
        values = torch.where(keep, view.abs(), 0.0)
        return LawsReviewMAVState(state.abs_total + values.sum(dim=(0, -1)), state.count + keep.sum(dim=(0, -1)))

    def merge_fn(a, b):
        kit.check_same_shapes(a, b, "mav.merge")
        return LawsReviewMAVState(a.abs_total + b.abs_total, a.count + b.count)

    return kit.Observer(init_fn, update_fn, merge_fn, exact=True, spec=spec, name="mav")


GRANULARITIES = [qstats.PerTensor(), qstats.PerAxis(0), qstats.PerAxis(-1), qstats.PerGroup(4),
                 qstats.PerBlock((2, 4))]


@pytest.mark.parametrize("granularity", GRANULARITIES, ids=str)
def test_a_correct_user_observer_passes_every_law(granularity):
    testing.check_all(_mav_observer(qstats.QuantSpec(granularity=granularity)), _make_x, max_examples=3)


@pytest.mark.parametrize("granularity", GRANULARITIES, ids=str)
def test_homomorphism_catches_an_update_that_ignores_or_inverts_its_weight_at_any_granularity(granularity):
    """Per channel, per group and per block, batches do not concatenate along dim 0: the masked form
    ``update(s, x, mask) == update(s, x[mask != 0])`` was skipped and a weight was never checked."""
    for obs in (qstats.minmax(qstats.QuantSpec(granularity=granularity)),
                _mav_observer(qstats.QuantSpec(granularity=granularity))):
        ignores = obs._replace(update=lambda s, x, weight=None, obs=obs: obs.update(s, x), name="ignores")
        inverts = obs._replace(
            update=lambda s, x, weight=None, obs=obs: obs.update(s, x, None if weight is None else 1 - weight),
            name="inverts")
        for broken in (ignores, inverts):
            with pytest.raises(AssertionError, match=f"{broken.name}: homomorphism.*weight"):
                testing.check_homomorphism(broken, XS)
            with pytest.raises(AssertionError, match="homomorphism"):
                testing.check_all(broken, _make_x, laws=("homomorphism",), max_examples=3)


def test_identity_catches_an_init_that_reads_the_values_of_x():
    """An init seeded with the extremes of its argument: merge(init(x0), s) == s holds for every
    state s that has seen x0, as every state of the laws had."""
    obs = qstats.minmax(SPEC)

    def init(x):
        state = obs.init(x)
        finite = torch.isfinite(x)  # the extremes of the finite values: only the seeding is wrong
        return state._replace(min_val=torch.where(finite, x, torch.inf).amin(dim=1).float(),
                              max_val=torch.where(finite, x, -torch.inf).amax(dim=1).float())

    broken = obs._replace(init=init, name="seeded")
    with pytest.raises(AssertionError, match="seeded: identity: init.*values"):
        testing.check_identity(broken, XS)
    with pytest.raises(AssertionError, match="identity"):
        testing.check_all(broken, _make_x, max_examples=3)


def test_stability_names_the_law_when_update_refuses_an_empty_batch():
    """The page's own first mistake: without the ``x.numel() == 0`` line the error was the update's
    bare ValueError, naming neither the law, the observer nor the empty batch."""
    obs = _mav_observer(SPEC)

    def update(state, x, weight=None):
        if x.numel() == 0:
            from qstats.observers import kit

            kit.checked_view(x, SPEC.granularity, state.count.shape, "mav.update")
        return obs.update(state, x, weight)

    broken = obs._replace(update=update)
    with pytest.raises(AssertionError, match="mav: stability: update with an empty tensor.*failed.*ValueError"):
        testing.check_stability(broken, XS)


class _AnyField(NamedTuple):
    total: torch.Tensor
    extra: object


_AnyField = qstats.register_state(type("LawsReviewAnyFieldState", (_AnyField,), {}))


@pytest.mark.parametrize("extra", [None, {}, {"a": torch.zeros(())}, (), [torch.zeros(())]],
                         ids=["None", "dict", "dict-of-tensors", "tuple", "list"])
def test_stability_catches_a_field_that_is_not_a_tensor(extra):
    """design.md: no None, dicts, strings or Python numbers; None, containers and empty containers
    have no leaf for the tensor check to see."""
    def init(x):
        return _AnyField(torch.zeros((), dtype=torch.float64), extra)

    def update(state, x, weight=None):
        return _AnyField(state.total + x.double().sum(), state.extra)

    obs = qstats.Observer(init, update, lambda a, b: _AnyField(a.total + b.total, a.extra), exact=True,
                          name="extra")
    with pytest.raises(AssertionError, match="extra: stability: state.extra is a .*; states hold tensors only"):
        testing.check_stability(obs, XS)


def test_check_all_blames_an_update_that_writes_into_its_state_on_purity():
    """An update that accumulates into its state in place broke the identity law first
    (``merge(init, s)`` saw a modified init), whose message pointed at ``merge``."""
    obs = _mav_observer(SPEC)

    def update(state, x, weight=None):
        new = obs.update(state, x, weight)
        state.abs_total.copy_(new.abs_total)
        state.count.copy_(new.count)
        return state

    with pytest.raises(AssertionError, match="purity: update modified the state"):
        testing.check_all(obs._replace(update=update), _make_x, max_examples=3)


def test_a_float32_sum_declared_bit_exact_says_how_to_declare_it():
    obs = _sum_observer()
    state_type = type(obs.init(XS[0]))
    plain = qstats.register_state(NamedTuple("LawsReviewPlainSumState", [("total", torch.Tensor),
                                                                           ("count", torch.Tensor)]))

    def wrap(state):
        return plain(*state)

    def unwrap(state):
        return state_type(*state)

    undeclared = obs._replace(init=lambda x: wrap(obs.init(x)),
                              update=lambda s, x, weight=None: wrap(obs.update(unwrap(s), x, weight)),
                              merge=lambda a, b: wrap(obs.merge(unwrap(a), unwrap(b))))
    generator = torch.Generator().manual_seed(57)
    xs = [torch.randn(6, 64, generator=generator) for _ in range(4)]
    with pytest.raises(AssertionError, match="not bit-exact.*approx_fields"):
        testing.check_homomorphism(undeclared, xs, [[1], [2]])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_vmap_weights_follow_the_device_of_the_batches():
    """check_vmap built its row masks on the CPU: a correct observer of CUDA batches failed
    ``vmap(update, weight)`` on mixing devices."""
    testing.check_vmap(qstats.minmax(qstats.QuantSpec()), [x.cuda() for x in XS])
    testing.check_vmap(_mav_observer(SPEC), [x.cuda() for x in XS])


EXPERTS = 3


def _make_stack(generator):
    return torch.randn(EXPERTS, 6, 8, generator=generator)


STACKED = {
    "minmax_per_channel": (lambda: qstats.minmax(SPEC), True),
    "minmax_per_tensor": (lambda: qstats.minmax(qstats.QuantSpec()), True),
    "histogram": (lambda: qstats.histogram(qstats.QuantSpec()), True),
    "memoryless_minmax": (lambda: qstats.memoryless_minmax(SPEC), False),
    "mav_per_group": (lambda: _mav_observer(qstats.QuantSpec(granularity=qstats.PerGroup(4))), True),
}


@pytest.mark.parametrize("case", sorted(STACKED))
def test_a_stacked_observer_passes_every_law_with_batch_dims(case):
    """``x[:0]`` emptied the expert dimension, row masks covered the experts and vmap(fake_quantize) used
    the per-expert spec on stacked qparams: correct stacked observers failed stability and vmap."""
    make, accumulates = STACKED[case]
    obs = qstats.stacked_observer(make(), EXPERTS)
    testing.check_all(obs, _make_stack, accumulates=accumulates, batch_dims=1, max_examples=2)


def test_a_stacked_hessian_passes_every_law():
    obs = qstats.stacked_observer(qstats.hessian(), EXPERTS)
    testing.check_all(obs, _make_stack, batch_dims=1, max_examples=2)


def test_a_stacked_hessian_vmaps_over_layers():
    """add_masked_gram's vmap rule indexed with a boolean mask, which an outer vmap (layers x experts)
    could not batch; it folds the outer dimension into its op's groups of masks now."""
    obs = qstats.stacked_observer(qstats.hessian(), EXPERTS)
    testing.check_vmap(obs, [_make_stack(torch.Generator().manual_seed(i)) for i in range(3)], batch_dims=1)


def _drops_expert_0(state, new):
    return new._replace(min_val=torch.cat([state.min_val[:1], new.min_val[1:]]),
                        max_val=torch.cat([state.max_val[:1], new.max_val[1:]]))


def _shares_expert_0(state, new):
    return new._replace(max_val=torch.cat([new.max_val.amax(0, keepdim=True), new.max_val[1:]]))


@pytest.mark.parametrize("breaks", [_drops_expert_0, _shares_expert_0], ids=["drops", "shares"])
def test_vmap_catches_a_stacked_update_that_treats_expert_0_apart(breaks):
    """Dropping expert 0's data (or giving it every expert's maximum) is a homomorphism of the stack:
    only comparing expert slices with each other shows it."""
    obs = qstats.stacked_observer(qstats.minmax(SPEC), EXPERTS)
    broken = obs._replace(update=lambda s, x, weight=None: breaks(s, obs.update(s, x, weight)), name="broken")
    xs = [_make_stack(torch.Generator().manual_seed(i)) for i in range(3)]
    for law in (testing.check_identity, testing.check_associative, testing.check_commutative):
        law(broken, xs)
    testing.check_homomorphism(broken, xs, batch_dims=1)
    with pytest.raises(AssertionError, match="broken: vmap over the batch dims"):
        testing.check_vmap(broken, xs, batch_dims=1)


def test_associativity_catches_a_stacked_merge_that_is_not_associative():
    inner = qstats.minmax(SPEC)

    def merge(a, b):  # averages the maxima: commutative, not associative
        new = inner.merge(a, b)
        return new._replace(max_val=(a.max_val + b.max_val) / 2)

    broken = qstats.stacked_observer(inner._replace(merge=merge, name="averaging"), EXPERTS)
    with pytest.raises(AssertionError, match=r"stacked\(averaging\): associativity"):
        testing.check_all(broken, _make_stack, laws=("associative",), batch_dims=1, max_examples=3)


def test_check_all_refuses_a_negative_batch_dims():
    with pytest.raises(ValueError, match="batch_dims"):
        testing.check_all(qstats.minmax(SPEC), _make_x, batch_dims=-1)


def _forgets_on_empty(obs):
    def update(state, x, weight=None):
        if x.numel() == 0:
            return obs.init(x)  # the loader's short last batch wipes what was observed
        return obs.update(state, x, weight)

    return obs._replace(update=update, name="forgets")


def _nan_on_empty(obs):
    def update(state, x, weight=None):
        new = obs.update(state, x, weight)
        # the batch's mean |x| (never above its max) folded into the max: the mean of nothing is NaN
        return new._replace(max_val=torch.maximum(new.max_val, x.abs().float().mean()))

    return obs._replace(update=update, name="nan_on_empty")


@pytest.mark.parametrize("breaks", [_forgets_on_empty, _nan_on_empty], ids=["forgets", "nan"])
def test_stability_catches_an_empty_batch_that_changes_the_state(breaks):
    """design.md (bad input): an empty tensor leaves the state unchanged. Stability compared only the
    structure after an empty batch, so a state reset to init, or one turned NaN, passed every law."""
    obs = qstats.minmax(qstats.QuantSpec())
    broken = breaks(obs)
    seen = obs.update(obs.init(XS[0]), XS[0])
    empty_update = broken.update(seen, XS[0][:0])
    assert not torch.equal(empty_update.max_val, seen.max_val)  # the breakage is real
    with pytest.raises(AssertionError,
                       match=f"{broken.name}: stability: update with an empty tensor.*changed the state"):
        testing.check_stability(broken, XS)
    with pytest.raises(AssertionError, match="stability: update with an empty tensor"):
        testing.check_all(broken, _make_x, laws=("stability",), max_examples=2)


def test_check_all_takes_one_law_by_name():
    """``laws="identity"`` was read as the laws 'i', 'd', 'e', ... and refused as unknown."""
    testing.check_all(qstats.minmax(SPEC), _make_x, laws="identity", max_examples=2)
    forgetful = qstats.minmax(SPEC)._replace(merge=lambda a, b: a, name="forgetful")
    with pytest.raises(AssertionError, match="forgetful: identity"):
        testing.check_all(forgetful, _make_x, laws="identity", max_examples=2)
    with pytest.raises(ValueError, match=r"unknown laws \['purity '\]"):
        testing.check_all(forgetful, _make_x, laws="purity ", max_examples=2)


def test_homomorphism_lets_an_init_that_crashes_on_a_longer_batch_raise():
    """The concatenated batch is the observer's input like any other: an error of ``init`` there
    (not a change of state structure, which skips the concatenation) reaches the author."""
    obs = qstats.minmax(qstats.QuantSpec())

    def init(x):
        if x.shape[0] > 6:
            raise RuntimeError("init: bug for long batches")
        return obs.init(x)

    with pytest.raises(RuntimeError, match="bug for long batches"):
        testing.check_homomorphism(obs._replace(init=init), XS)
