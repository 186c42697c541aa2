"""`qstats.histogram`'s ``max_state_bytes``: a positive int checked when the observer is built, and
a bound on the counts of each tensor ``init`` sees, so per expert under `qstats.stacked_observer`
(docs/observers.md)."""

import math

import pytest
import torch

import qstats


@pytest.mark.parametrize("bound", [None, "256MB", math.nan, 0, -1, True, 2.5e8])
def test_a_bound_that_is_no_positive_int_is_refused_when_the_observer_is_built(bound):
    with pytest.raises(ValueError, match="max_state_bytes"):
        qstats.histogram(qstats.QuantSpec(), max_state_bytes=bound)


def test_the_bound_applies_to_each_expert_of_a_stack():
    spec = qstats.QuantSpec(granularity=qstats.PerAxis(0))
    weight = torch.randn(4, 16, 8)
    one_expert = 16 * 2 * 12 * 8 * 8  # 16 channels x 2 signs x 12 octaves x 8 buckets x int64
    fits = qstats.stacked_observer(qstats.histogram(spec, 8, 12, max_state_bytes=one_expert), 4)
    state = fits.init(weight)
    assert state.counts.nbytes == 4 * one_expert
    refused = qstats.stacked_observer(qstats.histogram(spec, 8, 12, max_state_bytes=one_expert - 1), 4)
    with pytest.raises(ValueError, match="per expert"):
        refused.init(weight)
