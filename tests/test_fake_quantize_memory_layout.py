"""`qstats.fake_quantize` and `qstats.lsq_fake_quantize` give their result in the input's memory layout
(channels_last, transposed), as torch's fake-quant ops do, with the same values: a channels_last
convolution fed a contiguous fake-quantized weight runs in the other layout, and its gradients round
otherwise (tests/test_qat_channels_last.py)."""

from __future__ import annotations

import pytest
import torch

import qstats

SPEC = qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0))


def _inputs():
    torch.manual_seed(0)
    weight = torch.randn(8, 4, 3, 3).to(memory_format=torch.channels_last)
    return {"channels_last": weight, "transposed": torch.randn(16, 8).T, "contiguous": torch.randn(8, 6)}


@pytest.mark.parametrize("layout", ["channels_last", "transposed", "contiguous"])
def test_fake_quantize_keeps_the_layout_and_values_of_torch_fake_quantize(layout):
    x = _inputs()[layout]
    observer = qstats.minmax(SPEC)
    qp = qstats.compute_qparams(observer.update(observer.init(x), x), SPEC)
    ours = qstats.fake_quantize(x, qp, SPEC)
    theirs = torch.fake_quantize_per_channel_affine(x, qp.scale, qp.zero_point, 0, -128, 127)
    assert ours.stride() == theirs.stride() == x.stride()
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("layout", ["channels_last", "transposed"])
def test_lsq_fake_quantize_keeps_the_layout_and_gradients_of_torch_learnable_fake_quantize(layout):
    x = _inputs()[layout].requires_grad_()
    scale = (x.detach().abs().amax(dim=tuple(range(1, x.ndim))) / 127).requires_grad_()
    zero_point = torch.zeros(x.shape[0], requires_grad=True)
    ours = qstats.lsq_fake_quantize(x, qstats.LSQParams(scale, zero_point), SPEC, grad_scale=1.0)
    theirs = torch._fake_quantize_learnable_per_channel_affine(x, scale, zero_point, 0, -128, 127, 1.0)
    assert ours.stride() == theirs.stride() == x.stride()
    assert torch.equal(ours, theirs)
    upstream = torch.randn_like(x)
    ours_grads = torch.autograd.grad(ours, (x, scale), upstream)
    theirs_grads = torch.autograd.grad(theirs, (x, scale), upstream)
    assert torch.equal(ours_grads[0], theirs_grads[0])
    # the scale gradient sums many terms; torch forms each with a fused multiply-add (docs/differences.md, LSQ)
    torch.testing.assert_close(ours_grads[1], theirs_grads[1], rtol=1e-4, atol=5e-5)

