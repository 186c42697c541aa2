"""`lsq_fake_quantize` with a NaN or +Inf scale, or a NaN learned zero point (what a NaN loss leaves after an
optimizer step), raises a ValueError naming them; it returned NaN everywhere, silently. Reference: torch's
learnable kernel returns NaN everywhere for such a scale and raises for a NaN zero point; -Inf scales are
read as ``spec.eps``, as torch.ao's module clamps them, and still fake-quantize."""

import math

import pytest
import torch

import qstats

SPEC = qstats.QuantSpec.from_torch_ao(torch.quint8, torch.per_tensor_affine)


def _torch(x, scale, zero_point):
    return torch._fake_quantize_learnable_per_tensor_affine(x, scale.reshape(1), zero_point.reshape(1), 0, 255, 1.0)


@pytest.mark.parametrize("scale, zero_point", [(math.nan, 3.0), (math.inf, 3.0), (0.1, math.nan)])
def test_a_diverged_range_raises_naming_it(scale, zero_point):
    x = torch.randn(16)
    scale, zero_point = torch.tensor(scale), torch.tensor(zero_point)
    try:  # what torch's kernel does with it: NaN everywhere, or a RuntimeError (a NaN zero point)
        assert _torch(x, scale, zero_point).isnan().all()
    except RuntimeError:
        assert zero_point.isnan()
    with pytest.raises(ValueError, match=r"lsq_fake_quantize: params hold a NaN or \+Inf scale or a NaN zero point"):
        qstats.lsq_fake_quantize(x, qstats.LSQParams(scale.requires_grad_(True), zero_point), SPEC)


def test_a_nan_in_one_channel_raises_and_finite_ranges_equal_torch():
    x = torch.randn(4, 16)
    spec = qstats.QuantSpec.from_torch_ao(torch.quint8, torch.per_channel_affine, ch_axis=0)
    scale, zero_point = torch.full((4,), 0.02), torch.full((4,), 128.0)
    expected = torch._fake_quantize_learnable_per_channel_affine(x, scale, zero_point, 0, 0, 255, 1.0)
    torch.testing.assert_close(qstats.lsq_fake_quantize(x, qstats.LSQParams(scale, zero_point), spec), expected,
                               rtol=0, atol=0)
    with pytest.raises(ValueError, match="NaN or \\+Inf scale"):
        qstats.lsq_fake_quantize(x, qstats.LSQParams(scale.index_fill(0, torch.tensor([2]), math.nan), zero_point), spec)
    # -Inf: read as eps, as torch.ao's module clamps it before its kernel
    eps = torch.tensor(SPEC.eps)
    ours = qstats.lsq_fake_quantize(x[0], qstats.LSQParams(torch.tensor(-math.inf), torch.tensor(3.0)), SPEC)
    torch.testing.assert_close(ours, _torch(x[0], eps, torch.tensor(3.0)), rtol=0, atol=0)
