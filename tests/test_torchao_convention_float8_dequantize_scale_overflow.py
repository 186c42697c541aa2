"""Float8 codes dequantized under a float32 scale that is Inf, NaN or so large that a code's value
overflows float32, against torchao's ``_dequantize_affine_float8`` and compressed-tensors' ``dequantize``.

Both references multiply the float8 code by the float32 scale and keep the product: +-Inf for an Inf
scale (NaN at code 0), +-Inf where ``code * scale`` overflows. qstats' float codes saturated at float32's
largest value whatever the scale dtype, which hid such a scale (3.4e38 where both give Inf).
"""

import warnings

import pytest
import torch

import qstats

warnings.filterwarnings("ignore")

qp_lib = pytest.importorskip("torchao.quantization.quant_primitives")
ct_forward = pytest.importorskip("compressed_tensors.quantization.lifecycle.forward")
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402

FLOAT8 = [torch.float8_e4m3fn, torch.float8_e5m2]
SCALES = [float("inf"), float("nan"), 1e38, 3.0e36, 1.0]


def _codes(float8_dtype):
    top = torch.finfo(float8_dtype).max
    return torch.tensor([[0.0, 1.0, -top, top, 2.0, -0.5, 0.25, -3.0]]).to(float8_dtype)


def _qparams(scale):
    return qstats.QParams(scale=scale, zero_point=torch.zeros_like(scale, dtype=torch.int32),
                          global_scale=torch.tensor(1.0), calibrated=torch.ones_like(scale, dtype=torch.bool))


def _same(ours, theirs):
    assert ours.dtype == theirs.dtype
    assert torch.equal(ours.isnan(), theirs.isnan())
    assert torch.equal(ours[~ours.isnan()], theirs[~theirs.isnan()])


@pytest.mark.parametrize("float8_dtype", FLOAT8)
@pytest.mark.parametrize("scale", SCALES)
def test_torchao_float8_dequantize_keeps_the_product(float8_dtype, scale):
    codes = _codes(float8_dtype)
    scale_t = torch.tensor(scale)
    spec = qstats.QuantSpec.from_torchao(float8_dtype)
    theirs = qp_lib._dequantize_affine_float8(codes, scale_t, torch.float32)
    _same(qstats.dequantize(codes, _qparams(scale_t), spec), theirs)


@pytest.mark.parametrize("float8_dtype", FLOAT8)
def test_torchao_float8_per_row_scales(float8_dtype):
    """One overflowing row beside finite ones: only that row's values are Inf, as torchao's."""
    from torchao.quantization import granularity as tao_granularity

    codes = _codes(float8_dtype).expand(3, -1).contiguous()
    scale_t = torch.tensor([[1.0], [float("inf")], [1e38]])
    spec = qstats.QuantSpec.from_torchao(float8_dtype, granularity=tao_granularity.PerRow())
    theirs = qp_lib._dequantize_affine_float8(codes, scale_t, torch.float32)
    _same(qstats.dequantize(codes, _qparams(scale_t.reshape(-1)), spec), theirs)
    assert torch.isfinite(theirs[0]).all() and not torch.isfinite(theirs[1:]).all()  # the case tested


@pytest.mark.parametrize("scale", SCALES)
def test_compressed_tensors_float8_dequantize_keeps_the_product(scale):
    codes = _codes(torch.float8_e4m3fn)
    args = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="tensor")
    spec = qstats.QuantSpec.from_compressed_tensors(args, observed_dtype=torch.float32)
    scale_t = torch.tensor(scale)
    theirs = ct_forward.dequantize(codes, scale_t.reshape(1), torch.zeros(1), args=args)
    _same(qstats.dequantize(codes, _qparams(scale_t), spec), theirs)


def test_torchao_float8_fake_quantize_under_an_infinite_scale():
    """fake_quantize of float32 values under an Inf scale: torchao's codes are 0, its values NaN."""
    x = torch.tensor([[1.0, -2.0, 0.0, 3e38]])
    scale_t = torch.tensor(float("inf"))
    spec = qstats.QuantSpec.from_torchao(torch.float8_e4m3fn)
    codes = qp_lib._quantize_affine_float8(x, scale_t, torch.float8_e4m3fn)
    theirs = qp_lib._dequantize_affine_float8(codes, scale_t, torch.float32)
    assert theirs.isnan().all()
    _same(qstats.fake_quantize(x, _qparams(scale_t), spec), theirs)
