"""`QuantSpec.from_torchao` takes ``is_swizzled_scales`` of ``to_mx`` and ``NVFP4Tensor.to_nvfp4``: it
lays the same scales out for a kernel, so the spec (and its codes) are those without it; it used to be
refused as an unexpected argument."""

import warnings

import pytest
import torch

import qstats

warnings.filterwarnings("ignore")


def _observe(spec, x):
    obs = qstats.minmax(spec)
    return qstats.compute_qparams(obs.update(obs.init(x), x), spec)


@pytest.mark.parametrize("elem_dtype", (torch.float8_e4m3fn, "fp6_e2m3"), ids=str)
def test_mx_swizzled_scales_quantize_as_torchao(elem_dtype):
    from torchao.prototype.mx_formats.mx_tensor import ScaleCalculationMode, to_mx

    x = torch.randn(128, 64, generator=torch.Generator().manual_seed(0))
    spec = qstats.QuantSpec.from_torchao(elem_dtype=elem_dtype, scaling_mode="FLOOR", is_swizzled_scales=True)
    assert spec == qstats.QuantSpec.from_torchao(elem_dtype=elem_dtype, scaling_mode="FLOOR")
    _, data = to_mx(x, elem_dtype, 32, ScaleCalculationMode.FLOOR, is_swizzled_scales=True)
    codes = qstats.quantize(x, _observe(spec, x), spec)
    assert torch.equal(codes.view(torch.uint8), data.view(torch.uint8))


def test_nvfp4_swizzled_scales_give_the_spec_without_them():
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

    x = torch.randn(128, 64, generator=torch.Generator().manual_seed(1))
    spec = qstats.QuantSpec.from_torchao(nvfp4=True, is_swizzled_scales=True)
    assert spec == qstats.QuantSpec.from_torchao(nvfp4=True)
    reference = NVFP4Tensor.to_nvfp4(x, per_tensor_scale=per_tensor_amax_to_scale(x.abs().amax()), is_swizzled_scales=True)
    assert torch.equal(qstats.fake_quantize(x, _observe(spec, x), spec), reference.dequantize(torch.float32))


def test_is_swizzled_scales_must_be_a_bool():
    with pytest.raises(ValueError, match="is_swizzled_scales"):
        qstats.QuantSpec.from_torchao(nvfp4=True, is_swizzled_scales="yes")
