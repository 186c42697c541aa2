"""qstats.round_to_format takes a format by name (the names QuantSpec.dtype takes) or as a torch
float8 dtype, and rounds as the references do: torch's float8 casts, torchao's fp6 emulation
(``_f32_to_floatx_unpacked``) and compressed-tensors' ``cast_to_fp4``. A format of another type or
an unknown name is refused naming it."""

from __future__ import annotations

import pytest
import torch

import qstats

# (name, exponent bits, mantissa bits) of torchao's unpacked emulation
_FP6 = [("fp6_e2m3", 2, 3), ("fp6_e3m2", 3, 2)]
_FP8 = ["fp8_e4m3fn", "fp8_e5m2", "fp8_e4m3fnuz", "fp8_e5m2fnuz"]


def _values():
    """Random values over many binades, ties of the coarse grids, zeros, subnormals, saturation."""
    g = torch.Generator().manual_seed(0)
    spread = torch.randn(4096, generator=g) * torch.logspace(-12, 6, 4096)
    ties = torch.tensor([0.25, 0.75, 1.25, 2.5, 3.5, 5.0, 1.0625, 1.1875, -0.25, -5.0, 0.0, -0.0, 1e9, -1e9])
    return torch.cat([spread, ties])


@pytest.mark.parametrize("name", _FP8)
def test_fp8_names_and_dtypes_round_as_torch_casts(name):
    x = _values()
    dtype = getattr(torch, name.replace("fp8_", "float8_"))
    largest = float(torch.finfo(dtype).max)
    expected = x.clamp(-largest, largest).to(dtype).float()
    assert torch.equal(qstats.round_to_format(x, name), expected)
    assert torch.equal(qstats.round_to_format(x, dtype), expected)


@pytest.mark.parametrize("name, ebits, mbits", _FP6, ids=[n for n, _, _ in _FP6])
def test_fp6_names_round_as_torchao_emulation(name, ebits, mbits):
    custom_fp = pytest.importorskip("torchao.prototype.custom_fp_utils")
    x = _values()
    codes = custom_fp._f32_to_floatx_unpacked(x.clone(), ebits, mbits)
    expected = custom_fp._floatx_unpacked_to_f32(codes, ebits, mbits)
    ours = qstats.round_to_format(x, name)
    # torchao's decoder gives +0.0 for the code of -0.0: compare values, and signs off zero
    assert torch.equal(ours, expected.float())
    nonzero = ours != 0
    assert torch.equal(torch.signbit(ours[nonzero]), torch.signbit(expected[nonzero]))


def test_fp4_name_rounds_as_compressed_tensors_cast_to_fp4():
    fp4_utils = pytest.importorskip("compressed_tensors.quantization.utils.fp4_utils")
    x = _values()
    expected = fp4_utils.cast_to_fp4(x.clone())
    assert torch.equal(qstats.round_to_format(x, "fp4_e2m1"), expected)


def test_unknown_names_dtypes_and_types_are_refused_naming_them():
    x = torch.ones(3)
    with pytest.raises(ValueError, match="fp3_e1m1"):
        qstats.round_to_format(x, "fp3_e1m1")
    with pytest.raises(ValueError, match="torch.float32"):
        qstats.round_to_format(x, torch.float32)
    with pytest.raises(TypeError, match="got int"):
        qstats.round_to_format(x, 8)


def test_torch_fp4_dtype_rounds_as_torchao_and_compressed_tensors():
    """``torch.float4_e2m1fn_x2`` names fp4 as ``QuantSpec.dtype`` reads it (torchao's MX ``elem_dtype``);
    round_to_format refused it as no float element format."""
    fp4 = getattr(torch, "float4_e2m1fn_x2", None)
    if fp4 is None:
        pytest.skip("torch < 2.8 has no float4_e2m1fn_x2")
    fp4_utils = pytest.importorskip("compressed_tensors.quantization.utils.fp4_utils")
    kernels = pytest.importorskip("torchao.prototype.mx_formats.kernels")
    x = _values()
    ours = qstats.round_to_format(x, fp4)
    assert torch.equal(ours, fp4_utils.cast_to_fp4(x.clone()))
    assert torch.equal(ours, kernels.f4_unpacked_to_f32(kernels.f32_to_f4_unpacked(x.clone())))
    assert qstats.QuantSpec(dtype=fp4).dtype == "fp4_e2m1"
