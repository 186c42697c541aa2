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


def test_range_learning_is_lsq_without_gradient_scaling():
    """torchao's weight range learning (``is_dynamic=False, range_learning=True``): its initial scales are
    `learnable_ranges`', its fake-quantized and converted forwards with the learned scales are qstats'
    with ``grad_scale=None``, and the scale gradients agree to float32 rounding."""
    from torchao.quantization.qat import IntxFakeQuantizeConfig, initialize_fake_quantizers

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16))
    reference = copy.deepcopy(model)
    activation = IntxFakeQuantizeConfig(torch.int8, "per_token", is_symmetric=False, scale_precision=None)
    weight = IntxFakeQuantizeConfig(torch.int4, group_size=32, is_dynamic=False, range_learning=True,
                                    scale_precision=None)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_(reference, QATConfig(activation_config=activation, weight_config=weight, step="prepare"))
        initialize_fake_quantizers(reference, (x,))
    tokens = qstats.QuantSpec.from_torchao(torch.int8, mapping_type=MappingType.ASYMMETRIC, granularity=PerToken())
    weights = qstats.QuantSpec.from_torchao(torch.int4, mapping_type=MappingType.SYMMETRIC, granularity=PerGroup(32))
    qat = qstats.qat.prepare(model, qstats.memoryless_minmax(weights), qstats.memoryless_minmax(tokens), grad_scale=None)
    _, state = qat.apply(qat.params(), qat.init(x), x, phase=qstats.QATPhase(fake_quantize=False))
    ranges = qat.learnable_ranges(state, weights=True, activations=False)
    scales = {key: reference.get_submodule(key).weight_fake_quantizer.scale for key in ("0", "2")}
    assert all(torch.equal(ranges["weights"][key].scale, scales[key].detach()) for key in scales)

    def loss_fn(params, ranges, x):
        out, _ = qat.apply(params, state, x, phase=qstats.QATPhase(observe=False), ranges=ranges)
        return out.square().mean()

    optimizer = torch.optim.SGD(reference.parameters(), lr=0.01)  # scales stay positive (docs/differences.md)
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        x = torch.randn(4, 64, generator=g)
        params = {name: p.detach().clone() for name, p in reference.named_parameters() if "fake_quantizer" not in name}
        ranges = {"weights": {key: qstats.LSQParams(s.detach().clone(), torch.zeros_like(s.detach())) for key, s in
                              scales.items()}}
        optimizer.zero_grad()
        loss = reference(x).square().mean()
        loss.backward()
        assert torch.equal(loss_fn(params, ranges, x), loss.detach())
        grads = torch.func.grad(loss_fn, argnums=1)(params, ranges, x)
        for key, scale in scales.items():
            torch.testing.assert_close(grads["weights"][key].scale, scale.grad, rtol=1e-4, atol=1e-7)
        optimizer.step()
    params = {name: p.detach().clone() for name, p in reference.named_parameters() if "fake_quantizer" not in name}
    ranges = {"weights": {key: qstats.LSQParams(s.detach().clone(), torch.zeros_like(s.detach())) for key, s in
                          scales.items()}}
    assert all(bool((s > 0).all()) for s in scales.values())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_(reference, QATConfig(Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4,
                                                                            weight_granularity=PerGroup(32)),
                                       step="convert"))
    x = torch.randn(3, 64, generator=g)
    with torch.no_grad():
        assert torch.equal(qat.apply(params, state, x, phase=qstats.QATPhase(observe=False), ranges=ranges)[0],
                           reference(x))
