"""qstats.mse's ``steps`` option: the number of shrink candidates, validated at construction."""

import numpy as np
import pytest
import torch

import qstats


@pytest.mark.parametrize("steps", [3, np.int64(7), 40])
def test_steps_sets_the_candidates_one_minus_i_over_grid(steps):
    spec = qstats.QuantSpec(dtype="int8")
    obs = qstats.mse(spec, grid=50, steps=steps)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    state = obs.update(obs.init(x), x)
    expected = torch.tensor([max(1 - i / 50, 0.0) for i in range(int(steps))], dtype=torch.float64)
    assert torch.equal(state.factors, expected)


@pytest.mark.parametrize("steps", [True, False, 2.5, 0, -1, "5", 3.0])
def test_a_steps_that_is_no_positive_int_raises_naming_steps(steps):
    # True searched one candidate in silence, 2.5 failed inside range(), 0 and -1 blamed maxshrink * grid
    with pytest.raises(ValueError, match="steps must be a positive int"):
        qstats.mse(qstats.QuantSpec(dtype="int8"), steps=steps)
