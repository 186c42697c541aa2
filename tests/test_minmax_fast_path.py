"""The eager fast path of the min/max observers (a finite, unmasked batch: counts as Python ints,
`qstats._reductions.finite_aminmax(..., int_counts=True)`) against the path every other input
takes (counts as tensors, forced here with a NaN or a mask that keeps everything): the same
states, bit for bit, and states that share no memory with the ones they came from."""

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from _shared import bit_equal

import qstats

OBSERVERS = {
    "minmax": qstats.minmax,
    "memoryless": qstats.memoryless_minmax,
    "moving_average": lambda spec: qstats.moving_average_minmax(spec, averaging_constant=0.3),
}
GRANULARITIES = [qstats.PerTensor(), qstats.PerAxis(0), qstats.PerToken(), qstats.PerGroup(4)]


def _assert_same(a, b):
    assert type(a) is type(b)
    for name, left, right in zip(a._fields, a, b):
        assert bit_equal(left, right), (name, left, right)


@pytest.mark.parametrize("kind", OBSERVERS)
@pytest.mark.parametrize("granularity", GRANULARITIES, ids=repr)
def test_int_counts_give_the_tensor_count_states(kind, granularity):
    """A batch observed as it is (int counts) and the same batch with an all-ones weight (tensor
    counts, the masked path) give the same states after two updates."""
    obs = OBSERVERS[kind](qstats.QuantSpec(granularity=granularity))
    g = torch.Generator().manual_seed(0)
    x1, x2 = torch.randn(2, 6, 8, generator=g) * 3
    ones = torch.ones(6, 8)
    fast = obs.update(obs.update(obs.init(x1), x1), x2)
    slow = obs.update(obs.update(obs.init(x1), x1, ones), x2, ones)
    _assert_same(fast, slow)


@pytest.mark.parametrize("kind", OBSERVERS)
def test_updated_states_share_no_memory_with_the_old_ones(kind):
    obs = OBSERVERS[kind](qstats.QuantSpec(granularity=qstats.PerAxis(0)))
    x = torch.randn(6, 8)
    old = obs.init(x)
    new = obs.update(old, x)
    pointers = {t.untyped_storage().data_ptr() for t in old}
    assert not pointers & {t.untyped_storage().data_ptr() for t in new}
    assert all(0 not in t.stride() for t in new if t.ndim)


@pytest.mark.parametrize("kind", OBSERVERS)
@pytest.mark.parametrize("rows", [False, True], ids=["unmasked", "row-masked"])
def test_states_with_other_count_dtypes_come_back_as_before(kind, rows):
    """A state built with int32 counts and float64 extremes (not what init gives) ends with the
    dtypes the tensor-count path (a NaN in a masked-out row, or an all-ones value mask) gives it."""
    obs = OBSERVERS[kind](qstats.QuantSpec(granularity=qstats.PerTensor() if rows else qstats.PerAxis(0)))
    x = torch.randn(6, 8)
    state = obs.init(x)
    odd = type(state)(*(t.double() if t.is_floating_point() else t.int() for t in state))
    if rows:
        weight = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 1.0])
        dirty = x.clone()
        dirty[2, 0] = float("nan")
        fast, slow = obs.update(odd, x, weight), obs.update(odd, dirty, weight)
    else:
        fast, slow = obs.update(odd, x), obs.update(odd, x, torch.ones(6, 8))
    _assert_same(fast, slow)
    assert all(t.dtype == torch.int64 for t in fast if not t.is_floating_point())


@pytest.mark.parametrize("kind", OBSERVERS)
def test_unbatched_x_under_vmap_gives_batched_dense_states(kind):
    """A tensor captured from outside vmap, observed into stacked states: the states come out
    batched and dense (the int-count path is taken outside transforms only)."""
    obs = OBSERVERS[kind](qstats.QuantSpec(granularity=qstats.PerAxis(0)))
    x = torch.randn(6, 8)
    states = torch.vmap(obs.init)(torch.zeros(3, 6, 8))
    states = torch.vmap(lambda s: obs.update(s, x))(states)
    for name, field in zip(states._fields, states):
        assert field.shape[0] == 3 and 0 not in field.stride(), (name, field.stride())
    expected = obs.update(obs.init(x), x)
    for e in range(3):
        _assert_same(type(states)(*(t[e] for t in states)), expected)


def test_no_tangent_reaches_the_state_under_forward_ad():
    obs = qstats.minmax(qstats.QuantSpec(granularity=qstats.PerAxis(0)))
    x = torch.randn(6, 8)
    with fwAD.dual_level():
        dual = fwAD.make_dual(x, torch.ones_like(x))
        state = obs.update(obs.init(x), dual)
        assert all(fwAD.unpack_dual(t).tangent is None for t in state)


@pytest.mark.parametrize("kind", OBSERVERS)
@pytest.mark.parametrize("granularity", [qstats.PerTensor(), qstats.PerAxis(-1)], ids=repr)
def test_row_masks_with_int_counts_give_the_tensor_count_states(kind, granularity):
    """Per-row weights (tokens routed or not): finite rows (int counts, kept rows counted) and the
    same rows with a NaN in an excluded row (tensor counts) give the same states."""
    obs = OBSERVERS[kind](qstats.QuantSpec(granularity=granularity))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(12, 8, generator=g)
    weight = (torch.rand(12, generator=g) < 0.6).float()
    weight[3] = 0.0
    dirty = x.clone()
    dirty[3, 2] = float("nan")
    state = obs.init(x)
    _assert_same(obs.update(state, x, weight), obs.update(state, dirty, weight))
    stacked = qstats.stacked_observer(obs, 3)
    routed = (torch.rand(3, 12, generator=g) < 0.5).float()
    routed[:, 3] = 0.0
    shared, shared_dirty = x.expand(3, 12, 8), dirty.expand(3, 12, 8)
    s0 = stacked.init(shared)
    _assert_same(stacked.update(s0, shared, routed), stacked.update(s0, shared_dirty, routed))
