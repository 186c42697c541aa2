"""from_torchao(nvfp4=True, per_tensor_scale=...) against torchao's ``NVFP4Tensor.to_nvfp4``.

torchao's ``per_tensor_scale`` is a tensor (a calibrated global scale); from_torchao's is a flag. A
tensor or number is refused (its truth value would ignore its value, a zero tensor meaning block
scales only), and the route the error names, ``compute_qparams(...,
global_scale=tensor)``, reproduces torchao with that tensor bit for bit.
"""

import warnings

import pytest
import torch

import qstats

warnings.filterwarnings("ignore")

nvfp4 = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
NVFP4Tensor, nvfp4_quantize, per_tensor_amax_to_scale = (
    nvfp4.NVFP4Tensor, nvfp4.nvfp4_quantize, nvfp4.per_tensor_amax_to_scale)


def _state(spec, x):
    obs = qstats.minmax(spec)
    return obs.update(obs.init(x), x)


def _bits(t):
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize(
    "value", (torch.tensor(0.01), torch.tensor(0.0), torch.tensor([0.5]), 0.5, 1, "yes"), ids=repr)
def test_a_scale_value_is_refused_naming_the_argument(value):
    with pytest.raises(ValueError, match="per_tensor_scale must be True.*compute_qparams"):
        qstats.QuantSpec.from_torchao(nvfp4=True, per_tensor_scale=value)


@pytest.mark.parametrize("input_dtype", (torch.float32, torch.bfloat16), ids=str)
def test_a_calibrated_global_scale_given_to_compute_qparams_equals_to_nvfp4(input_dtype):
    """The global scale of other (calibration) data, not of ``x``: torchao's codes and values."""
    x = (torch.randn(8, 64, generator=torch.Generator().manual_seed(3)) * 2).to(input_dtype)
    calibrated = per_tensor_amax_to_scale(torch.tensor(3.0))
    spec = qstats.QuantSpec.from_torchao(nvfp4=True, per_tensor_scale=True)
    qp = qstats.compute_qparams(_state(spec, x), spec, global_scale=calibrated)
    block_scales, _ = nvfp4_quantize(x, 16, calibrated)
    assert torch.equal(qp.global_scale, calibrated)
    assert torch.equal(qp.scale, block_scales.float())
    reference = NVFP4Tensor.to_nvfp4(x, per_tensor_scale=calibrated).dequantize(input_dtype)
    ours = qstats.fake_quantize(x, qp, spec)
    assert ours.dtype == input_dtype and torch.equal(_bits(ours.float()), _bits(reference.float()))


@pytest.mark.parametrize("flag", (False, None), ids=repr)
def test_false_and_none_give_block_scales_only(flag):
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(4)) * 5
    spec = qstats.QuantSpec.from_torchao(nvfp4=True, per_tensor_scale=flag)
    qp = qstats.compute_qparams(_state(spec, x), spec)
    block_scales, _ = nvfp4_quantize(x, 16, None)
    assert torch.equal(qp.scale, block_scales.float())
    reference = NVFP4Tensor.to_nvfp4(x, per_tensor_scale=None).dequantize(torch.float32)
    assert torch.equal(_bits(qstats.fake_quantize(x, qp, spec)), _bits(reference))
