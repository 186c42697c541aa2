"""`_formats.encode` / `decode` take a format as `round_to_format` does: a name (``"fp4_e2m1"``), a torch
float8 dtype or ``torch.float4_e2m1fn_x2``, or a FloatFormat (a name or dtype raised AttributeError:
``'str' object has no attribute 'torch_dtype'``). Codes against torchao's unpacked fp4/fp6 kernels
and torch's float8 casts."""

import pytest
import torch

from qstats import _formats

kernels = pytest.importorskip("torchao.prototype.mx_formats.kernels")

EMULATED = {
    "fp4_e2m1": (kernels.f32_to_f4_unpacked, kernels.f4_unpacked_to_f32, 4),
    "fp6_e2m3": (kernels.f32_to_f6_e2m3_unpacked, kernels.f6_e2m3_unpacked_to_f32, 6),
    "fp6_e3m2": (kernels.f32_to_f6_e3m2_unpacked, kernels.f6_e3m2_unpacked_to_f32, 6),
}
X = torch.tensor([0.0, -0.0, 0.3, -0.25, 0.75, 1.25, -1.75, 2.5, 3.5, -5.0, 7.0, 30.0, -1e30, 1e-30])


@pytest.mark.parametrize("name", list(EMULATED))
def test_encode_and_decode_take_a_format_name(name):
    to_codes, to_float, bits = EMULATED[name]
    assert torch.equal(_formats.encode(X, name), to_codes(X))
    codes = torch.arange(2**bits, dtype=torch.uint8)
    assert torch.equal(_formats.decode(codes, name), to_float(codes))


def test_encode_and_decode_take_torch_dtypes():
    fp4 = getattr(torch, "float4_e2m1fn_x2", None)
    if fp4 is not None:
        assert torch.equal(_formats.encode(X, fp4), kernels.f32_to_f4_unpacked(X))
        codes = torch.arange(16, dtype=torch.uint8)
        assert torch.equal(_formats.decode(codes, fp4), kernels.f4_unpacked_to_f32(codes))
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        reference = X.clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max).to(dtype)
        assert torch.equal(_formats.encode(X, dtype).view(torch.uint8), reference.view(torch.uint8))
        assert torch.equal(_formats.decode(reference, dtype), reference.float())


def test_an_unknown_format_name_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown float format 'fp5'"):
        _formats.encode(X, "fp5")
    with pytest.raises(ValueError, match="unknown float format 'fp5'"):
        _formats.decode(torch.zeros(2, dtype=torch.uint8), "fp5")
