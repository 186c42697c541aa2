"""kit.observe_extremes of rows that hold no values (a trailing dimension of size 0) under a row
weight: nothing seen (the identities of min and max, zero counts), where reshaping the rows to
``[-1, ...]`` raised a RuntimeError inside qstats."""

import pytest
import torch

import qstats
from qstats.observers import kit


@pytest.mark.parametrize("shape, granularity, weight_dims", [
    ((4, 0), qstats.PerTensor(), 1),
    ((4, 0, 3), qstats.PerAxis(-1), 1),
    ((4, 0, 3), qstats.PerAxis(-1), 2),
    ((4, 3, 0), qstats.PerAxis(1), 1),
])
def test_rows_without_values_under_a_weight_are_nothing_seen(shape, granularity, weight_dims):
    x = torch.randn(shape)
    weight = torch.ones(shape[:weight_dims])
    spec = qstats.QuantSpec(granularity=granularity)
    params = kit.qparam_shape(x.shape, granularity)
    low, high, count, nonfinite = kit.observe_extremes(x, weight, spec, params, "test.update")
    # no value seen, per parameter: the identities of min and max, zero counts
    assert torch.equal(low, torch.full(params, torch.inf))
    assert torch.equal(high, torch.full(params, -torch.inf))
    assert torch.equal(count, torch.zeros(params, dtype=torch.int64))
    assert torch.equal(nonfinite, torch.zeros(params, dtype=torch.int64))


def test_a_kit_observer_takes_an_empty_batch_with_its_routing_mask_under_vmap():
    # an observer written on kit.observe_extremes, updated per expert with a batch of no values
    spec = qstats.QuantSpec(granularity=qstats.PerAxis(-1))

    def update(state, x, weight):
        low, high, count, _ = kit.observe_extremes(x, weight, spec, state[0].shape, "experts.update")
        return torch.minimum(state[0], low), torch.maximum(state[1], high), state[2] + count

    start = (torch.full((2, 3), torch.inf), torch.full((2, 3), -torch.inf), torch.zeros(2, 3, dtype=torch.int64))
    x, mask = torch.randn(2, 5, 0, 3), torch.ones(2, 5)
    low, high, count = torch.func.vmap(update)(start, x, mask)
    assert torch.equal(low, start[0]) and torch.equal(high, start[1]) and torch.equal(count, start[2])
