"""Asymmetric int32 targets: the zero point of a range spanning 2**32 codes is computed without
wrapping, so every value in the range survives fake quantization (torch.ao's int32 arithmetic wraps
and clips the larger negative side)."""

import pytest
import torch

import qstats


@pytest.mark.parametrize("convention", ("default", "torch_ao"))
@pytest.mark.parametrize("shift", (0.0, -500.0, -3000.0))
def test_int32_asymmetric_range_is_kept(convention, shift):
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 1e3 + shift
    if convention == "torch_ao":
        spec = qstats.QuantSpec.from_torch_ao(torch.qint32, torch.per_tensor_affine)
    else:
        spec = qstats.QuantSpec(dtype="int32", mapping="asymmetric")
    obs = qstats.minmax(spec)
    qp = qstats.compute_qparams(obs.update(obs.init(x), x), spec)
    # independent: float32 scales hold int32 steps only to float32 precision (an end can land a few
    # dozen of 2**32 codes outside), so the error stays within a float32 rounding of the range
    error = (qstats.fake_quantize(x, qp, spec) - x).abs().max()
    assert error <= 1e-6 * float(x.max() - x.min()), error
