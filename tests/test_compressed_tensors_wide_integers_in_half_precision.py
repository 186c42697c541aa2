"""Asymmetric integer targets wider than a bf16/fp16 observed dtype's integers, compressed-tensors' convention.

compressed-tensors 0.19 computes zero points in the observed weight's dtype, clamped to the code range
there: past 256 (bfloat16) or 2048 (float16) the largest code ``2**(b-1) - 1`` rounds up to ``2**(b-1)``,
outside the signed range, and that is the zero point of every all-negative row or group. qstats'
``compute_qparams`` gave the same zero point, which its own ``fake_quantize``, ``quantize`` and
``dequantize`` then refused as "hand-made or corrupt qparams". Such specs are refused at construction,
naming compute_dtype. (Symmetric ones keep zero points of 0; their stored codes saturate at quant_max:
test_formats.py::test_codes_of_half_precision_compute_stay_in_the_range.)
"""

from __future__ import annotations

import pytest
import torch

import qstats

ct_quantization = pytest.importorskip("compressed_tensors.quantization")
ct_forward = pytest.importorskip("compressed_tensors.quantization.lifecycle.forward")
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread_quiet")


def _weight(dtype):
    w = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    w[0] = -w[0].abs() - 0.01  # an all-negative row
    return w.to(dtype)


@pytest.mark.parametrize("num_bits, dtype", [(10, torch.bfloat16), (12, torch.bfloat16), (14, torch.bfloat16),
                                             (13, torch.float16), (15, torch.float16)], ids=str)
def test_zero_points_past_the_range_in_half_precision_are_refused(num_bits, dtype):
    args = ct_quantization.QuantizationArgs(num_bits=num_bits, symmetric=False, strategy="channel")
    w = _weight(dtype)
    scale, zero_point = calculate_qparams(w.amin(dim=1), w.amax(dim=1), args)
    assert int(zero_point[0]) == 2 ** (num_bits - 1)  # one past the largest signed code
    with pytest.raises(ValueError, match="compute_dtype"):
        qstats.QuantSpec.from_compressed_tensors(args, observed_dtype=dtype)


@pytest.mark.parametrize("num_bits, dtype", [(9, torch.bfloat16), (12, torch.float16), (12, torch.float32)], ids=str)
def test_widest_targets_each_dtype_holds_still_equal_compressed_tensors(num_bits, dtype):
    args = ct_quantization.QuantizationArgs(num_bits=num_bits, symmetric=False, strategy="channel")
    w = _weight(dtype)
    scale, zero_point = calculate_qparams(w.amin(dim=1), w.amax(dim=1), args)
    spec = qstats.QuantSpec.from_compressed_tensors(args, observed_dtype=dtype)
    obs = qstats.memoryless_minmax(spec)
    qp = qstats.compute_qparams(obs.update(obs.init(w), w), spec)
    assert torch.equal(qp.zero_point.long(), zero_point.long())
    theirs = ct_forward.fake_quantize(w, scale.unsqueeze(1), zero_point.unsqueeze(1), args).to(dtype)
    assert torch.equal(qstats.fake_quantize(w, qp, spec), theirs)
    codes = qstats.quantize(w, qp, spec)
    assert torch.equal(codes.float(), ct_forward.quantize(w, scale.unsqueeze(1), zero_point.unsqueeze(1), args).float())
    assert torch.equal(qstats.dequantize(codes, qp, spec, dtype=dtype), theirs)
