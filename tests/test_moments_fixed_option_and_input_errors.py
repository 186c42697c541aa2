"""Bad arguments to the moments, fixed and placeholder observers get a TypeError that names the
public call and what it takes: an option ``compute_qparams`` does not know (torch.ao's
FixedQParamsObserver computes nothing, so its constants take no option), and an input that is no
observable tensor, on an empty batch too (minmax, imatrix and hessian refuse them there)."""

import re

import pytest
import torch

import qstats


def _moments_state(p=4.0):
    obs = qstats.moments(qstats.QuantSpec(dtype="int8"), p=p)
    x = torch.randn(64, generator=torch.Generator().manual_seed(0))
    return obs.update(obs.init(x), x), obs.spec


@pytest.mark.parametrize("method, option, known", [
    ("mean_std", "kk", "['k']"),
    ("mean_std", "p", "['k']"),   # p belongs to method "lp"
    ("rms", "num_bins", "['k']"),
    ("lp", "q", "['k', 'p']"),
])
def test_moments_method_refuses_an_option_it_does_not_take(method, option, known):
    state, spec = _moments_state()
    message = f"compute_qparams: moments method '{method}' takes the options {known}, got ['{option}']"
    with pytest.raises(TypeError, match=re.escape(message)):
        qstats.compute_qparams(state, spec, method=method, **{option: 3})


def test_moments_options_still_reach_the_method():
    # the ranges computed independently (mean +- 2 std; the L3 norm), mapped by the spec's arithmetic
    x = torch.randn(64, generator=torch.Generator().manual_seed(0)).double()
    std = x.std(unbiased=False)
    state, spec = _moments_state()
    expected = qstats.qparams_from_minmax((x.mean() - 2 * std).clamp(max=0).float(),
                                          (x.mean() + 2 * std).clamp(min=0).float(), spec)
    assert torch.allclose(qstats.compute_qparams(state, spec, method="mean_std", k=2).scale, expected.scale, rtol=1e-6)
    state3, spec3 = _moments_state(p=3.0)
    amax = x.abs().pow(3).mean().pow(1 / 3).float()
    expected = qstats.qparams_from_minmax(-amax, amax, spec3)
    assert torch.allclose(qstats.compute_qparams(state3, spec3, method="lp", k=1, p=3.0).scale, expected.scale, rtol=1e-6)


def test_fixed_qparams_take_no_option_as_torch_ao():
    from torch.ao.quantization.observer import default_fixed_qparams_range_0to1_observer

    reference = default_fixed_qparams_range_0to1_observer()
    scale, zero_point = reference.calculate_qparams()  # torch.ao's takes no argument either
    obs = qstats.sigmoid_qparams()
    state = obs.init(torch.zeros(3))
    with pytest.raises(TypeError, match=r"compute_qparams: a FixedQParamsState takes no options, got \['k'\]"):
        qstats.compute_qparams(state, obs.spec, k=3)
    qp = qstats.compute_qparams(state, obs.spec)
    assert torch.equal(qp.scale.reshape(1), scale) and torch.equal(qp.zero_point.reshape(1), zero_point)


@pytest.mark.parametrize("x", [[1.0, 2.0], torch.empty(0, 8, dtype=torch.bool),
                               torch.empty(0, 8, dtype=torch.complex64)], ids=["list", "empty-bool", "empty-complex"])
def test_moments_update_refuses_what_it_cannot_observe_on_empty_batches_too(x):
    obs = qstats.moments(qstats.QuantSpec())
    state = obs.init(torch.zeros(4, 8))
    with pytest.raises(TypeError, match=r"moments.update: (expected a tensor, got list|cannot observe a tensor of dtype)"):
        obs.update(state, x)
    # as minmax's update refuses them at once when they hold values
    if isinstance(x, torch.Tensor):
        with pytest.raises(TypeError, match="cannot observe"):
            obs.update(state, torch.zeros(4, 8, dtype=x.dtype))


def test_moments_update_of_an_empty_batch_keeps_the_state():
    obs = qstats.moments(qstats.QuantSpec())
    state = obs.update(obs.init(torch.zeros(4, 8)), torch.ones(4, 8))
    assert obs.update(state, torch.empty(0, 8)) is state


@pytest.mark.parametrize("factory", [qstats.placeholder, qstats.noop])
def test_placeholder_update_refuses_a_list(factory):
    obs = factory()
    state = obs.init(torch.zeros(3))
    with pytest.raises(TypeError, match=rf"{obs.name}.update: expected a tensor, got list"):
        obs.update(state, [1.0, 2.0])
    assert int(obs.update(state, torch.zeros(2, 3)).count) == 6
