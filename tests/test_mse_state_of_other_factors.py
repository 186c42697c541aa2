"""qstats.mse's update refuses a state of an observer searching other shrink factors, even with as
many candidates (the losses of this observer's factors would go to the other factors' columns)."""

import pytest
import torch

import qstats
from qstats.observers.mse import shrink_factors


def test_a_state_of_other_shrink_factors_with_as_many_candidates_is_refused():
    spec = qstats.QuantSpec(dtype="int4")
    defaults, other = qstats.mse(spec), qstats.mse(spec, grid=50, maxshrink=0.4)
    assert len(shrink_factors(0.2, 100)) == len(shrink_factors(0.4, 50))  # 20 candidates each
    x = torch.randn(256, generator=torch.Generator().manual_seed(0))
    state = defaults.update(defaults.init(x), x)
    with pytest.raises(ValueError, match="other shrink factors"):
        other.update(state, x)


def test_a_state_of_the_same_factors_updates_as_one_search_over_both_batches():
    """The check lets the observer's own states through: two batches' losses equal one search's
    over their concatenation (a fixed reference)."""
    spec = qstats.QuantSpec(dtype="int4")
    obs = qstats.mse(spec, reference=(torch.tensor(-3.0), torch.tensor(3.0)))
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(128, generator=g), torch.randn(128, generator=g)
    both = obs.update(obs.init(a), torch.cat([a, b]))
    split = obs.update(obs.update(obs.init(a), a), b)
    assert torch.allclose(split.loss, both.loss, rtol=1e-6)
    assert torch.equal(split.factors, both.factors)
