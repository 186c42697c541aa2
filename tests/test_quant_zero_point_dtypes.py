"""Zero points held in any integer dtype (compressed-tensors' int8, torchao's ``zero_point_dtype``)
or as whole floats: `quantize`/`fake_quantize` equal torch's fake-quant ops, whose zero points they
are; narrow dtypes used to wrap the range check's bounds (int8 3 <= 255 read False, so a valid zero
point was refused). A fractional zero point of an integer grid is refused (torch truncates it)."""

import warnings

import pytest
import torch

import qstats

warnings.filterwarnings("ignore")

X = torch.linspace(-1.3, 1.1, 97)
SCALE = torch.tensor(0.01)

CASES = [
    # (torch.ao dtype, zero point, its dtype)
    (torch.quint8, 3, torch.int8),
    (torch.quint8, 100, torch.int8),
    (torch.quint8, 200, torch.uint8),
    (torch.quint8, 3, torch.int16),
    (torch.qint8, 5, torch.uint8),
    (torch.qint8, -100, torch.int8),
    (torch.qint8, -7, torch.int16),
    (torch.qint8, -7, torch.int64),
    (torch.qint8, -7, torch.float32),
    (torch.quint8, 42, torch.float64),
]


@pytest.mark.parametrize("dtype, zero_point, zero_point_dtype", CASES, ids=str)
def test_zero_points_of_any_dtype_equal_torch_fake_quantize(dtype, zero_point, zero_point_dtype):
    spec = qstats.QuantSpec.from_torch_ao(dtype, torch.per_tensor_affine)
    qmin, qmax = spec.qrange
    zp = torch.tensor(zero_point, dtype=zero_point_dtype)
    qp = qstats.QParams(SCALE, zp, torch.tensor(1.0), torch.tensor(True))
    expected = torch.fake_quantize_per_tensor_affine(X, SCALE, torch.tensor(zero_point, dtype=torch.int32), qmin, qmax)
    assert torch.equal(qstats.fake_quantize(X, qp, spec), expected)
    assert torch.equal(qstats.dequantize(qstats.quantize(X, qp, spec), qp, spec), expected)


def test_zero_points_of_narrow_dtypes_under_vmap():
    spec = qstats.QuantSpec.from_torch_ao(torch.quint8, torch.per_tensor_affine)
    zps = torch.tensor([3, 100], dtype=torch.int8)

    def run(zp):
        return qstats.fake_quantize(X, qstats.QParams(SCALE, zp, torch.tensor(1.0), torch.tensor(True)), spec)

    expected = torch.stack([torch.fake_quantize_per_tensor_affine(X, SCALE, z.int(), 0, 255) for z in zps])
    assert torch.equal(torch.vmap(run)(zps), expected)


@pytest.mark.parametrize("zero_point", (3.5, 0.25, -7.75))
def test_fractional_zero_points_of_integer_grids_are_refused(zero_point):
    spec = qstats.QuantSpec.from_torch_ao(torch.qint8, torch.per_tensor_affine)
    qp = qstats.QParams(SCALE, torch.tensor(zero_point), torch.tensor(1.0), torch.tensor(True))
    # torch truncates the zero point: its values lie on the grid of int(zero_point), qstats' did not
    truncated = torch.fake_quantize_per_tensor_affine(X, SCALE, torch.tensor(int(zero_point), dtype=torch.int32), -128, 127)
    assert not torch.equal(((X / SCALE).round() + zero_point).clamp(-128, 127).sub(zero_point).mul(SCALE), truncated)
    for function in (qstats.fake_quantize, qstats.quantize):
        with pytest.raises(ValueError, match="whole numbers"):
            function(X, qp, spec)
