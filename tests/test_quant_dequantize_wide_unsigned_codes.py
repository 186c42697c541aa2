"""qstats.dequantize of integer-target codes held in torch.uint16, uint32 or uint64 (a uint16 target's
natural dtype, codes read from a checkpoint that stores them so): torch has no min/max of these
dtypes, so the range check failed with NotImplementedError. They dequantize as torch.ao's
``torch.dequantize`` of the same codes, and codes outside the range (signed codes sign-extended into
uint64) are still refused."""

from __future__ import annotations

import pytest
import torch

import qstats

WIDE_UNSIGNED = (torch.uint16, torch.uint32, torch.uint64)


def _codes(spec, w):
    obs = qstats.minmax(spec)
    qp = qstats.compute_qparams(obs.update(obs.init(w), w), spec)
    return qp, qstats.quantize(w, qp, spec)


@pytest.mark.parametrize("dtype", WIDE_UNSIGNED, ids=str)
def test_uint8_codes_in_wide_unsigned_dtypes_dequantize_as_torch_ao(dtype):
    w = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))
    spec = qstats.QuantSpec.from_torch_ao(torch.quint8, torch.per_channel_affine, ch_axis=0)
    qp, codes = _codes(spec, w)
    reference = torch.dequantize(torch.quantize_per_channel(w, qp.scale.double(), qp.zero_point.long(), 0,
                                                            torch.quint8))
    assert torch.equal(codes.to(torch.uint8), torch.quantize_per_channel(
        w, qp.scale.double(), qp.zero_point.long(), 0, torch.quint8).int_repr())
    assert torch.equal(qstats.dequantize(codes.to(dtype), qp, spec), reference)


@pytest.mark.parametrize("dtype", WIDE_UNSIGNED, ids=str)
def test_uint16_codes_dequantize_as_int64_arithmetic(dtype):
    w = torch.randn(4, 64, generator=torch.Generator().manual_seed(1)) * 3
    spec = qstats.QuantSpec(dtype="uint16", mapping="asymmetric", granularity=qstats.PerAxis(0))
    qp, codes = _codes(spec, w)
    assert int(codes.max()) > 2**15  # codes int16 could not hold
    expected = (codes.to(torch.int64) - qp.zero_point.to(torch.int64)[:, None]).float() * qp.scale[:, None]
    assert torch.equal(qstats.dequantize(codes.to(dtype), qp, spec), expected)
    batched = torch.func.vmap(lambda c: qstats.dequantize(c, qp, spec))(codes.to(dtype)[None])
    assert torch.equal(batched[0], expected)


def test_signed_codes_sign_extended_into_uint64_are_refused():
    w = torch.randn(4, 16, generator=torch.Generator().manual_seed(2))
    spec = qstats.QuantSpec(dtype="int16")
    qp, codes = _codes(spec, w)
    assert bool((codes < 0).any())
    as_uint64 = codes.to(torch.int64).view(torch.uint64)  # -5 reads 2**64 - 5
    with pytest.raises(ValueError, match=r"\[-32768, 32767\]"):
        qstats.dequantize(as_uint64, qp, spec)
    with pytest.raises(ValueError, match=r"\[-32768, 32767\]"):
        qstats.dequantize(codes.to(torch.int32).view(torch.uint32), qp, spec)
