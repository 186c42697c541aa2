"""qstats.dequantize refuses integer-target codes outside the spec's range, as torchao's
``dequantize_affine`` refuses codes of another dtype: int8 codes viewed as uint8 bytes (-56 reads
200) or int4 codes packed two to a byte dequantized to values off the grid without an error.
Codes in range, in any integer or float dtype, dequantize as ``(q - zero_point) * scale``."""

from __future__ import annotations

import pytest
import torch

import qstats

quant_primitives = pytest.importorskip("torchao.quantization.quant_primitives")


def _weight_qparams(spec):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 32, generator=g)
    obs = qstats.minmax(spec)
    return w, qstats.compute_qparams(obs.update(obs.init(w), w), spec)


def test_int8_codes_read_as_uint8_are_refused_as_torchao_refuses_them():
    spec = qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0))
    w, qp = _weight_qparams(spec)
    codes = qstats.quantize(w, qp, spec)
    assert codes.dtype == torch.int8 and bool((codes < 0).any())
    as_bytes = codes.view(torch.uint8)
    with pytest.raises(AssertionError):  # the reference refuses codes of another dtype
        quant_primitives.dequantize_affine(as_bytes, (1, 32), qp.scale, qp.zero_point, torch.int8)
    with pytest.raises(ValueError, match=r"\[-128, 127\]"):
        qstats.dequantize(as_bytes, qp, spec)


def test_packed_int4_codes_are_refused():
    spec = qstats.QuantSpec(dtype="int4", granularity=qstats.PerTensor())
    w, qp = _weight_qparams(spec)
    codes = qstats.quantize(w, qp, spec).to(torch.int16)
    packed = (codes[:, ::2] & 0xF) | ((codes[:, 1::2] & 0xF) << 4)
    with pytest.raises(ValueError, match=r"'int4'.*\[-8, 7\].*unpack"):
        qstats.dequantize(packed, qp, spec)
    with pytest.raises(ValueError, match="whole numbers"):
        qstats.dequantize(codes.float() + 0.5, qp, spec)


@pytest.mark.parametrize("code_dtype", (torch.int8, torch.int16, torch.int32, torch.int64, torch.float32))
def test_codes_in_range_of_any_dtype_dequantize_as_torchao(code_dtype):
    spec = qstats.QuantSpec(dtype="int4", mapping="asymmetric", granularity=qstats.PerAxis(0), convention="torchao")
    w, qp = _weight_qparams(spec)
    codes = qstats.quantize(w, qp, spec)
    expected = quant_primitives.dequantize_affine(
        codes.to(torch.int8), (1, 32), qp.scale, qp.zero_point, torch.int8, quant_min=-8, quant_max=7
    )
    assert torch.equal(qstats.dequantize(codes.to(code_dtype), qp, spec), expected)
