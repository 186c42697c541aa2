"""A quantized torch dtype (``torch.qint8``, ...) as ``zp_dtype`` holds no plain integer zero point:
compressed-tensors' ``calculate_qparams`` fails with it, so `QuantSpec.from_compressed_tensors`
refuses it (a ValueError naming zp_dtype) instead of reproducing qparams that library cannot give."""

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.utils import calculate_qparams

import qstats


@pytest.mark.parametrize("zp_dtype", [torch.qint8, torch.qint32])
def test_quantized_zp_dtype_is_refused_where_compressed_tensors_cannot_compute_with_it(zp_dtype):
    args = dict(num_bits=8, symmetric=False, strategy="tensor", zp_dtype=zp_dtype)
    with pytest.raises(RuntimeError):
        calculate_qparams(torch.tensor([-1.0]), torch.tensor([2.0]), QuantizationArgs(**args))
    with pytest.raises(ValueError, match="zp_dtype"):
        qstats.QuantSpec.from_compressed_tensors(args)


def test_a_plain_signed_zp_dtype_holding_the_range_is_still_accepted():
    args = dict(num_bits=8, symmetric=False, strategy="tensor", zp_dtype=torch.int16)
    expected = calculate_qparams(torch.tensor([-1.0]), torch.tensor([2.0]), QuantizationArgs(**args))
    spec = qstats.QuantSpec.from_compressed_tensors(args)
    qp = qstats.qparams_from_minmax(torch.tensor([-1.0]), torch.tensor([2.0]), spec)
    assert torch.equal(qp.scale, expected[0].float()) and torch.equal(qp.zero_point, expected[1].to(torch.int32))
