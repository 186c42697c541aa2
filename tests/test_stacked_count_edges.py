"""stacked_observer's expert count: any integer (numpy, 0-d tensor), the states of the Python int."""

import numpy as np
import pytest
import torch

import qstats


@pytest.mark.parametrize("count", [np.int64(3), np.int32(3), torch.tensor(3), torch.tensor(3, dtype=torch.int16)],
                         ids=["np.int64", "np.int32", "tensor-int64", "tensor-int16"])
def test_stacked_observer_takes_any_integer(count):
    spec = qstats.QuantSpec(granularity=qstats.PerAxis(0))
    x = torch.randn(3, 5, 4, generator=torch.Generator().manual_seed(0))
    x[1, 2, 0] = float("nan")
    mask = torch.tensor([[1, 0, 1, 1, 1], [1, 1, 1, 0, 1], [0, 0, 1, 1, 1]])
    reference = qstats.stacked_observer(qstats.minmax(spec), 3)
    obs = qstats.stacked_observer(qstats.minmax(spec), count)
    expected = reference.update(reference.init(x), x, mask)
    got = obs.update(obs.init(x), x, mask)
    assert type(got) is type(expected)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert obs.name == reference.name
    with pytest.raises(ValueError, match="leading expert dimension 3"):
        obs.init(torch.zeros(4, 5))


@pytest.mark.parametrize("count", [True, np.bool_(True), torch.tensor(True), 3.0, torch.tensor(3.0), "3", None,
                                   0, np.int64(0), torch.tensor(-2)])
def test_stacked_observer_refuses_other_counts(count):
    with pytest.raises(ValueError, match="num_experts must be a positive int"):
        qstats.stacked_observer(qstats.minmax(qstats.QuantSpec()), count)


def test_stacked_qparams_refuses_a_state_of_zero_experts():
    """A state of 0 experts (an empty slice of a stack) has no qparams: stacked_observer takes no
    0-expert stack, and stacked_qparams gave empty QParams (global scale of shape (0,)) in silence."""
    spec = qstats.QuantSpec(granularity=qstats.PerAxis(0))
    obs = qstats.stacked_observer(qstats.minmax(spec), 2)
    x = torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(0))
    state = obs.update(obs.init(x), x)
    per_expert = [qstats.compute_qparams(type(state)(*(field[e] for field in state)), spec) for e in range(2)]
    stacked = qstats.stacked_qparams(state, spec)
    assert all(torch.equal(stacked.scale[e], per_expert[e].scale) for e in range(2))
    with pytest.raises(ValueError, match="0 experts"):
        qstats.stacked_qparams(type(state)(*(field[:0] for field in state)), spec)
