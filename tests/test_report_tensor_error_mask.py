"""`qstats.reporting.tensor_error`'s ``mask``: one that broadcasts to the tensor leaves its entries
out (against a float64 SQNR of torch's fake quantization of the kept values); one that does not is
a ValueError naming both shapes."""

import math

import pytest
import torch

import qstats
from qstats.reporting import tensor_error


def _int8():
    spec = qstats.QuantSpec("int8", "symmetric")
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(0))
    observer = qstats.minmax(spec)
    return x, spec, qstats.compute_qparams(observer.update(observer.init(x), x[:, :3]), spec)


def test_a_mask_with_a_trailing_one_leaves_out_its_tokens():
    x, spec, qp = _int8()
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]])
    signal, noise, clipped, total, nonfinite = tensor_error(x, qp, spec, mask[:, :, None])
    kept = x[mask.bool()]
    quantized = torch.fake_quantize_per_tensor_affine(kept, float(qp.scale), int(qp.zero_point), -128, 127)
    assert total == kept.numel() and nonfinite == 0
    assert signal == pytest.approx(float(kept.double().pow(2).sum()), rel=1e-6)
    assert noise == pytest.approx(float((kept - quantized).double().pow(2).sum()), rel=1e-5)
    codes = torch.round(kept / qp.scale)
    assert clipped == int(((codes < -128) | (codes > 127)).sum())
    assert math.isfinite(10 * math.log10(signal / noise))


@pytest.mark.parametrize("shape", [(2, 5), (5, 2, 1), (3, 16)])
def test_a_mask_that_does_not_broadcast_to_the_tensor_is_refused_naming_both_shapes(shape):
    """A [batch, tokens] mask of [batch, tokens, features] values failed inside torch's expand."""
    x, spec, qp = _int8()
    with pytest.raises(ValueError, match=rf"mask of shape \({shape[0]}, .*tensor's shape \(2, 5, 16\)"):
        tensor_error(x, qp, spec, torch.ones(shape))
