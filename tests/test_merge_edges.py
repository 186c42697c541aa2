"""Merges of every exact observer qstats exports on edge inputs (a state that saw only NaN/Inf, an empty
batch, one-element batches, ranges that do not overlap, all zeros, bf16 inputs), against an independent
computation over the concatenated data: numpy's extremes, counts, sums and ``x^T x``, and torch.ao's
PerChannelMinMaxObserver. Moving averages (not exact) are checked for identity and commutativity."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from torch.ao.quantization.observer import PerChannelMinMaxObserver

import qstats

SPEC = qstats.QuantSpec(granularity=qstats.PerAxis(0))
INT4 = qstats.QuantSpec(dtype="int4", granularity=qstats.PerAxis(0))


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# (first shard, second shard): 3 channels (rows) of values (columns)
EDGES = {
    "only NaN": lambda: (torch.full((3, 8), float("nan")), _randn(3, 8)),
    "only Inf": lambda: (torch.full((3, 8), float("inf")), _randn(3, 8)),
    "one element": lambda: (_randn(3, 1), _randn(3, 1, seed=1)),
    "disjoint": lambda: (_randn(3, 8) * 1e-3, _randn(3, 8, seed=1) + 100),
    "disjoint signs": lambda: (_randn(3, 8) - 100, _randn(3, 8, seed=1) + 100),
    "bf16": lambda: (_randn(3, 8).bfloat16(), (_randn(3, 8, seed=1) * 4).bfloat16()),
    "empty": lambda: (_randn(3, 0), _randn(3, 8)),
    "zeros": lambda: (torch.zeros(3, 8), _randn(3, 8)),
}


def _merged(observer, a, b):
    init = observer.init(b)
    first, second = observer.update(init, a), observer.update(init, b)
    merged = observer.merge(first, second)
    for state in (first, second):  # init is the identity, bit for bit
        for left, right in ((init, state), (state, init)):
            assert all(torch.equal(x, y) for x, y in zip(observer.merge(left, right), state))
    assert all(torch.equal(x, y) for x, y in zip(merged, observer.merge(second, first)))
    return merged


def _finite(a, b):
    """The concatenation as float64 with NaN where a value is not finite (observers leave those out)."""
    x = torch.cat([a, b], 1).double().numpy()
    return np.where(np.isfinite(x), x, np.nan)


@pytest.mark.parametrize("edge", list(EDGES))
def test_extremes_equal_numpy_and_torch_ao_over_the_concatenation(edge):
    a, b = EDGES[edge]()
    x = _finite(a, b)
    seen = np.isfinite(x).any(1)
    lo = np.where(seen, np.nanmin(np.where(seen[:, None], x, 0), 1), np.inf)
    hi = np.where(seen, np.nanmax(np.where(seen[:, None], x, 0), 1), -np.inf)
    for observer in (qstats.minmax(SPEC), qstats.histogram(SPEC, buckets_per_octave=8, octaves=24)):
        state = _merged(observer, a, b)
        np.testing.assert_array_equal(state.min_val.double().numpy(), lo)
        np.testing.assert_array_equal(state.max_val.double().numpy(), hi)
        if observer.name == "histogram":
            total = int(state.counts.sum() + state.underflow.sum() + state.overflow.sum())
            assert total == int(np.isfinite(x).sum())
    if np.isfinite(x).all():
        reference = PerChannelMinMaxObserver(ch_axis=0, dtype=torch.qint8, qscheme=torch.per_channel_symmetric)
        reference(torch.cat([a, b], 1).float())
        state = _merged(qstats.minmax(SPEC), a, b)
        assert torch.equal(state.min_val.float(), reference.min_val)
        assert torch.equal(state.max_val.float(), reference.max_val)


@pytest.mark.parametrize("edge", list(EDGES))
def test_sums_equal_numpy_over_the_concatenation(edge):
    a, b = EDGES[edge]()
    x = _finite(a, b)
    moments = _merged(qstats.moments(SPEC), a, b)
    np.testing.assert_array_equal(moments.count.numpy(), np.isfinite(x).sum(1))
    np.testing.assert_allclose(moments.total.double().numpy(), np.nansum(x, 1), rtol=1e-5, atol=1e-5)
    m2 = np.nansum((x - np.nanmean(np.where(np.isfinite(x).any(1, keepdims=True), x, 0), 1, keepdims=True)) ** 2, 1)
    np.testing.assert_allclose(moments.m2.double().numpy(), m2, rtol=1e-4, atol=1e-3)
    rows = _finite(a, b).T  # tokens are rows for imatrix and hessian
    imatrix = _merged(qstats.imatrix(), a.T.contiguous(), b.T.contiguous())
    np.testing.assert_allclose(imatrix.square_total.numpy(), np.nansum(rows ** 2, 0), rtol=1e-6)
    hessian = _merged(qstats.hessian(), a.T.contiguous(), b.T.contiguous())
    kept = rows[np.isfinite(rows).all(1)]
    assert int(hessian.count) == len(kept)
    gram = kept.T @ kept
    np.testing.assert_allclose(hessian.total.double().numpy(), gram, rtol=1e-5, atol=1e-5 * max(abs(gram).max(), 1))


@pytest.mark.parametrize("edge", list(EDGES))
def test_mse_merges_choose_what_one_state_of_the_concatenation_chooses(edge):
    # the concatenation in one batch searches the union of the ranges directly; the merge carries
    # each state's losses there
    a, b = EDGES[edge]()
    observer = qstats.mse(INT4, grid=20)
    merged = _merged(observer, a, b)
    whole = observer.update(observer.init(b), torch.cat([a, b], 1))
    assert torch.equal(merged.min_val, whole.min_val) and torch.equal(merged.max_val, whole.max_val)
    assert torch.equal(merged.count, whole.count) and torch.equal(merged.nonfinite, whole.nonfinite)
    assert torch.equal(qstats.compute_qparams(merged, INT4).scale, qstats.compute_qparams(whole, INT4).scale)


def test_mse_states_of_ranges_far_apart_merge_to_one_range_in_every_order():
    observer = qstats.mse(INT4, grid=20)
    shards = [_randn(3, 8, seed=s) * scale for s, scale in enumerate((1e-4, 1.0, 1e4))]
    states = [observer.update(observer.init(shard), shard) for shard in shards]
    scales = set()
    for a, b, c in itertools.permutations(states):
        for merged in (observer.merge(observer.merge(a, b), c), observer.merge(a, observer.merge(b, c))):
            scales.add(tuple(qstats.compute_qparams(merged, INT4).scale.tolist()))
    assert len(scales) == 1


@pytest.mark.parametrize("edge", list(EDGES))
@pytest.mark.parametrize("factory", [lambda: qstats.moving_average_minmax(SPEC, 0.1),
                                     lambda: qstats.mse(INT4, grid=20, mode="moving_average")],
                         ids=["moving_average_minmax", "mse moving average"])
def test_moving_averages_keep_identity_and_commute(edge, factory):
    a, b = EDGES[edge]()
    _merged(factory(), a, b)


@pytest.mark.parametrize("edge", list(EDGES))
def test_stacked_experts_merge_as_each_expert_alone(edge):
    a, b = EDGES[edge]()
    inner = qstats.minmax(SPEC)
    stacked = qstats.stacked_observer(inner, 2)
    merged = _merged(stacked, torch.stack([a, a * 2]), torch.stack([b, b * 2]))
    for expert, factor in enumerate((1, 2)):
        alone = _merged(inner, a * factor, b * factor)
        assert all(torch.equal(x[expert], y) for x, y in zip(merged, alone))
