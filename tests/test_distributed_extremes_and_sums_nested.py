"""`qstats.distributed.extremes_and_sums` declared for a state whose extremes sit in a nested
NamedTuple (``ext.min_val`` / ``ext.max_val``, the dotted names `register_reduce_ops` gives a
callable): the extremes take min / max as the top-level ``min_val`` / ``max_val`` do, so the
elementwise merge that ``all_reduce`` applies equals the observer's ``merge`` (law 8,
`qstats.testing.check_distributed`) and ``torch.amin`` / ``amax`` of all the data. They were
summed, as "every other field"."""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

import qstats
from qstats import distributed, testing
from qstats.observers import kit


@kit.register_state
class NestedExtremesOfSums(NamedTuple):
    min_val: torch.Tensor
    max_val: torch.Tensor


@kit.register_state
class ExtremesAndSumsNestedState(NamedTuple):
    ext: NestedExtremesOfSums
    count: torch.Tensor


distributed.register_reduce_ops(ExtremesAndSumsNestedState, distributed.extremes_and_sums)


def _observer():
    def init_fn(x):
        return ExtremesAndSumsNestedState(
            NestedExtremesOfSums(torch.full((), torch.inf), torch.full((), -torch.inf)), torch.zeros((), dtype=torch.int64))

    def update_fn(state, x, weight=None):
        low, high, count, _ = kit.observe_extremes(x, weight, qstats.QuantSpec(), (), "nested_extremes.update")
        return ExtremesAndSumsNestedState(
            NestedExtremesOfSums(torch.minimum(state.ext.min_val, low), torch.maximum(state.ext.max_val, high)),
            state.count + count)

    def merge_fn(a, b):
        kit.check_same_shapes(a, b, "nested_extremes.merge")
        return ExtremesAndSumsNestedState(
            NestedExtremesOfSums(torch.minimum(a.ext.min_val, b.ext.min_val), torch.maximum(a.ext.max_val, b.ext.max_val)),
            a.count + b.count)

    return kit.Observer(init_fn, update_fn, merge_fn, exact=True, spec=qstats.QuantSpec(), name="nested_extremes")


def test_nested_extremes_take_min_and_max_as_the_merge_does():
    obs = _observer()
    xs = [torch.randn(4 + rank, 6, generator=torch.Generator().manual_seed(rank)) * (rank + 1) for rank in range(3)]
    state = obs.update(obs.init(xs[0]), xs[0])
    assert distributed.reduce_ops(state) == {"ext.min_val": "min", "ext.max_val": "max", "count": "sum"}
    testing.check_distributed(obs, xs)  # the declared ops applied elementwise equal obs.merge
    merged = functools.reduce(obs.merge, [obs.update(obs.init(x), x) for x in xs])
    everything = torch.cat([x.reshape(-1) for x in xs])
    assert torch.equal(merged.ext.min_val, everything.amin()) and torch.equal(merged.ext.max_val, everything.amax())
