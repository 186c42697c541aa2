"""A stacked observer's update refused for one expert's shapes names the stacks the caller passed
(``[E, ...]``): the plain observer's message, raised inside ``torch.vmap``, named only one expert's
slice (weight ``(4, 8, 2)`` for the ``(3, 4, 8, 2)`` passed)."""

import pytest
import torch

import qstats

SPEC = qstats.QuantSpec(granularity=qstats.PerAxis(0))


def _stacked():
    obs = qstats.stacked_observer(qstats.minmax(SPEC), 3)
    w = torch.randn(3, 4, 8, generator=torch.Generator().manual_seed(0))
    return obs, obs.update(obs.init(w), w), w


def test_a_weight_of_another_shape_is_named_as_passed():
    obs, state, w = _stacked()
    with pytest.raises(ValueError, match=r"stacked_observer: per expert of x \(3, 4, 8\) and weight \(3, 4, 8, 2\)"):
        obs.update(state, w, torch.ones(3, 4, 8, 2))
    with pytest.raises(ValueError, match=r"per expert of x \(3, 4, 8\) and weight \(3, 5\).*weight of shape \(5,\)"):
        obs.update(state, w, torch.ones(3, 5))


def test_an_expert_tensor_of_another_size_is_named_as_passed():
    obs, state, _ = _stacked()
    with pytest.raises(ValueError, match=r"stacked_observer: per expert of x \(3, 5, 8\), less their leading expert "
                                         r"dimension 3: minmax.update"):
        obs.update(state, torch.randn(3, 5, 8))
    # what the plain observer says of one expert's slice, which the stacked message carries
    plain = qstats.minmax(SPEC)
    w = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"minmax.update: a tensor of shape \(5, 8\)"):
        plain.update(plain.update(plain.init(w), w), torch.randn(5, 8))
