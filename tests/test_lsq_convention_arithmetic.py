"""`lsq_fake_quantize` computes its forward in the spec's convention, as `fake_quantize` does: a
learned float32 scale that an optimizer step moved off a bfloat16 grid is read in torchao's
``scale_precision`` (bfloat16), as torchao's range learning reads its bfloat16 scale parameter and
as `fake_quantize` with `lsq_qparams` (the export) reads it, so the trained forward is the exported one."""

import pytest
import torch

import qstats

pytest.importorskip("torchao")
from torchao.quantization.granularity import PerGroup  # noqa: E402
from torchao.quantization.qat.utils import _fake_quantize_per_channel_group  # noqa: E402
from torchao.quantization.quant_primitives import MappingType  # noqa: E402


@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_torchao_scale_precision_is_read_by_the_forward(scale_dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 64, generator=g) * 3
    spec = qstats.QuantSpec.from_torchao(torch.int4, mapping_type=MappingType.ASYMMETRIC, granularity=PerGroup(32),
                                         scale_dtype=scale_dtype)
    observer = qstats.minmax(spec)
    params = qstats.lsq_init(observer.update(observer.init(x), x), spec)
    # a float32 step off the grid of scale_dtype (as an optimizer moves float32 parameters)
    scale = (params.scale * (1 + 0.003 * torch.rand(params.scale.shape, generator=g))).requires_grad_(True)
    zero_point = params.zero_point.clone().requires_grad_(True)
    assert not torch.equal(scale.to(scale_dtype).float(), scale)
    ours = qstats.lsq_fake_quantize(x, qstats.LSQParams(scale, zero_point), spec)
    qmin, qmax = spec.qrange
    theirs = _fake_quantize_per_channel_group(x, scale.detach().to(scale_dtype), zero_point.detach().int(), qmin, qmax, 32)
    exported = qstats.fake_quantize(x, qstats.lsq_qparams(qstats.LSQParams(scale, zero_point), spec), spec)
    assert torch.equal(ours, theirs.float())
    assert torch.equal(ours, exported)
    ours.sum().backward()  # the scale still learns (nothing clips: no zero point gradient)
    assert scale.grad.abs().sum() > 0


def test_bfloat16_weights_of_a_compressed_tensors_spec_are_read_in_its_compute_dtype():
    """compressed-tensors fake-quantizes a bfloat16 weight in bfloat16 (its scale in the weight's dtype);
    the forward computed in float32 differed at hundreds of values (up to a step)."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle import fake_quantize as compressed_tensors_fake_quantize

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(8, 64, generator=g) * 3).bfloat16()
    args = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="tensor")
    spec = qstats.QuantSpec.from_compressed_tensors(args, observed_dtype=torch.bfloat16)
    observer = qstats.minmax(spec)
    params = qstats.lsq_init(observer.update(observer.init(x), x), spec)
    params = qstats.LSQParams(params.scale * 1.0037, params.zero_point)  # after a step
    ours = qstats.lsq_fake_quantize(x, params, spec)
    theirs = compressed_tensors_fake_quantize(x, params.scale.to(x.dtype).reshape(1),
                                              params.zero_point.to(torch.int8).reshape(1), args)
    assert ours.dtype == theirs.dtype == torch.bfloat16
    assert torch.equal(ours, theirs)
    assert torch.equal(ours, qstats.fake_quantize(x, qstats.lsq_qparams(params, spec), spec))
