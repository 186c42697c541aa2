"""LSQ range gradients of a batch holding NaN, against torch.ao's learnable fake-quant kernels: torch
counts a NaN as clipped below (scale gradient ``qmin - zero_point``, zero point ``-scale``); qstats'
forward keeps the NaN (docs/qat.md), and its range gradients were NaN, even where the NaN is selected
away (``torch.where``, a padding mask) and its upstream gradient is 0: one such value ended the
learned range."""

import pytest
import torch

import qstats

X = torch.tensor([[0.5, float("nan"), -1.0, 3.0], [2.0, -0.7, float("nan"), 0.1]])


def _theirs(x, scale, zero_point, qmin, qmax, upstream, axis):
    x, scale, zero_point = (t.clone().requires_grad_(True) for t in (x, scale, zero_point))
    if axis is None:
        y = torch._fake_quantize_learnable_per_tensor_affine(x, scale, zero_point, qmin, qmax, 1.0)
    else:
        y = torch._fake_quantize_learnable_per_channel_affine(x, scale, zero_point, axis, qmin, qmax, 1.0)
    y.backward(upstream)
    return x.grad, scale.grad, zero_point.grad


def _ours(x, scale, zero_point, spec, upstream, masked):
    x, scale, zero_point = (t.clone().requires_grad_(True) for t in (x, scale, zero_point))
    y = qstats.lsq_fake_quantize(x, qstats.LSQParams(scale, zero_point), spec, grad_scale=None)
    if masked:  # the NaN positions selected away: their upstream gradient is 0
        y = torch.where(torch.isnan(y), 0.0, y)
    y.backward(upstream)
    return x.grad, scale.grad, zero_point.grad


@pytest.mark.parametrize("masked", [False, True], ids=["summed", "masked"])
@pytest.mark.parametrize("per_channel", [False, True], ids=["per_tensor", "per_channel"])
@pytest.mark.parametrize("mapping", ["asymmetric", "symmetric"])
def test_range_gradients_of_a_batch_with_nan_are_torch_aos(mapping, per_channel, masked):
    dtype, qmin, qmax = ("uint8", 0, 255) if mapping == "asymmetric" else ("int8", -128, 127)
    spec = qstats.QuantSpec(dtype, mapping, granularity=qstats.PerAxis(0) if per_channel else qstats.PerTensor())
    shape = (2,) if per_channel else ()
    scale = torch.full(shape, 0.03)
    zero_point = torch.full(shape, 100.0 if mapping == "asymmetric" else 0.0)
    upstream = torch.where(torch.isnan(X), 0.0, torch.linspace(0.5, 2.0, 8).reshape(2, 4)) if masked else torch.ones(2, 4)
    axis = 0 if per_channel else None
    their_x, their_scale, their_zero_point = _theirs(X, scale.reshape(-1), zero_point.reshape(-1), qmin, qmax,
                                                     upstream, axis)
    our_x, our_scale, our_zero_point = _ours(X, scale, zero_point, spec, upstream, masked)
    assert torch.equal(our_x, their_x)
    # torch's CPU kernel forms (code - zero_point) * scale - x with one rounding (docs/differences.md)
    torch.testing.assert_close(our_scale.reshape(-1), their_scale, rtol=2e-5, atol=1e-6)
    if mapping == "asymmetric":
        torch.testing.assert_close(our_zero_point.reshape(-1), their_zero_point, rtol=1e-6, atol=1e-6)
