"""torchao's 8da4w QAT (``QATConfig(Int8DynamicActivationIntxWeightConfig(torch.int4, PerGroup(32)))``):
prepare, train, convert; qstats' QAT model with ``from_torchao`` specs (``input_dtype=`` the model's
dtype) equals its fake-quantized and its converted forwards bit for bit (docs/qat.md)."""

import copy
import warnings

import pytest
import torch
from torch import nn

import qstats

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, quantize_
    from torchao.quantization.granularity import PerAxis, PerGroup, PerToken
    from torchao.quantization.qat import QATConfig
    from torchao.quantization.quant_primitives import MappingType


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("granularity", [PerGroup(32), PerAxis(0)], ids=["group32", "per_channel"])
def test_prepare_train_convert_equals_torchaos(granularity, dtype):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16)).to(dtype)
    reference = copy.deepcopy(model)
    base = Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=granularity)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_(reference, QATConfig(base, step="prepare"))
    tokens = qstats.QuantSpec.from_torchao(torch.int8, mapping_type=MappingType.ASYMMETRIC, granularity=PerToken(),
                                           input_dtype=dtype)
    weights = qstats.QuantSpec.from_torchao(torch.int4, mapping_type=MappingType.SYMMETRIC, granularity=granularity,
                                            input_dtype=dtype)
    qat = qstats.qat.prepare(model, qstats.memoryless_minmax(weights), qstats.memoryless_minmax(tokens))
    state = qat.init(torch.zeros(1, 64, dtype=dtype))
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    for shape in [(4, 3), (2,), (5, 1)]:
        x = (torch.randn(*shape, 64, generator=g) * 3).to(dtype)
        params = {name: p.detach().clone() for name, p in reference.named_parameters()}
        optimizer.zero_grad()
        expected = reference(x)
        expected.float().square().mean().backward()
        out, state = qat.apply(params, state, x)
        assert torch.equal(out, expected.detach())
        optimizer.step()
    params = {name: p.detach().clone() for name, p in reference.named_parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_(reference, QATConfig(base, step="convert"))
    x = (torch.randn(3, 5, 64, generator=g) * 3).to(dtype)
    with torch.no_grad():
        out, _ = qat.apply(params, state, x)
        assert torch.equal(out, reference(x))
