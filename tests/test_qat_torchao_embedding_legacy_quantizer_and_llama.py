"""torchao QAT flows no other test ran against qstats (docs/qat.md):

- embedding QAT (``QATConfig(weight_config=IntxFakeQuantizeConfig(torch.int4, group_size=32))`` on ``nn.Embedding``,
  its ``FakeQuantizedEmbedding``; the config's scale precision is float32 whatever the model's dtype);
- the legacy ``Int8DynActInt4WeightQATQuantizer`` (prepare, train, convert; its activation scales are float32
  whatever ``precision``);
- a transformers Llama, which torch.fx cannot trace (`prepare` refuses it), trained as torchao's 8da4w QAT with
  `qstats.fake_quantized`: weight ranges observed from each step's weights, per-token inputs dynamic.

Forwards are bit for bit; gradients within the rounding of torchao's straight-through backward (differences.md).
"""

import copy
import warnings

import pytest
import torch
from torch import nn

import qstats

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, quantize_
    from torchao.quantization.granularity import PerGroup, PerToken
    from torchao.quantization.qat import Int8DynActInt4WeightQATQuantizer, IntxFakeQuantizeConfig, QATConfig
    from torchao.quantization.quant_primitives import MappingType



def _assert_gradients_close(ours, theirs, dtype, name=""):
    """float32: to float32 rounding; bf16: within two bf16 ulps of the largest gradient (torchao's backward is within
    an ulp of the upstream gradient, which bf16 matmuls then sum over tokens: near-zero sums can differ wholly)."""
    if dtype == torch.float32:
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7, msg=name)
    else:
        assert (ours.float() - theirs.float()).abs().max() <= 2 ** -6 * theirs.float().abs().max(), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_embedding_qat_equals_torchaos_fake_quantized_embedding(dtype):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 64)).to(dtype)
    reference = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_(reference, QATConfig(weight_config=IntxFakeQuantizeConfig(torch.int4, group_size=32), step="prepare"),
                  filter_fn=lambda module, name: isinstance(module, nn.Embedding))
    assert type(reference[0]).__name__ == "FakeQuantizedEmbedding"
    spec = qstats.QuantSpec.from_torchao(torch.int4, mapping_type=MappingType.SYMMETRIC, granularity=PerGroup(32),
                                         input_dtype=dtype, scale_dtype=torch.float32)
    qat = qstats.qat.prepare(model, qstats.memoryless_minmax(spec), None, layers=nn.Embedding)
    ids = torch.randint(0, 50, (4, 7), generator=torch.Generator().manual_seed(1))
    state = qat.init(ids)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    for _ in range(3):
        params = {name: p.detach().clone().requires_grad_(True) for name, p in reference.named_parameters()}
        optimizer.zero_grad()
        expected = reference(ids)
        expected.float().square().mean().backward()
        out, state = qat.apply(params, state, ids)
        out.float().square().mean().backward()
        assert torch.equal(out, expected.detach())
        _assert_gradients_close(params["0.weight"].grad, reference[0].weight.grad, dtype)
        optimizer.step()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_legacy_8da4w_quantizer_prepare_train_convert_equals_qstats(dtype):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 16)).to(dtype)
    quantizer = Int8DynActInt4WeightQATQuantizer(groupsize=32, precision=dtype, scales_precision=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = quantizer.prepare(copy.deepcopy(model))
    tokens = qstats.QuantSpec.from_torchao(torch.int8, mapping_type=MappingType.ASYMMETRIC, granularity=PerToken(),
                                           input_dtype=dtype, scale_dtype=torch.float32)
    weights = qstats.QuantSpec.from_torchao(torch.int4, mapping_type=MappingType.SYMMETRIC, granularity=PerGroup(32),
                                            input_dtype=dtype)
    qat = qstats.qat.prepare(model, qstats.memoryless_minmax(weights), qstats.memoryless_minmax(tokens))
    state = qat.init(torch.zeros(1, 128, dtype=dtype))
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        x = (torch.randn(4, 3, 128, generator=g) * 3).to(dtype)
        params = {name: p.detach().clone().requires_grad_(True) for name, p in reference.named_parameters()}
        optimizer.zero_grad()
        expected = reference(x)
        expected.float().square().mean().backward()
        out, state = qat.apply(params, state, x)
        out.float().square().mean().backward()
        assert torch.equal(out, expected.detach())
        for name, p in reference.named_parameters():
            _assert_gradients_close(params[name].grad, p.grad, dtype, name)
        optimizer.step()
    params = {name: p.detach().clone() for name, p in reference.named_parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        converted = quantizer.convert(reference)
    x = (torch.randn(3, 128, generator=g) * 3).to(dtype)
    with torch.no_grad():
        assert torch.equal(qat.apply(params, state, x)[0], converted(x))


def test_a_transformers_llama_trains_as_torchaos_8da4w_qat_with_fake_quantized():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    reference = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_(reference, QATConfig(Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4,
                                                                             weight_granularity=PerGroup(32)),
                                       step="prepare"))
    with pytest.raises(TypeError, match="torch.fx cannot trace LlamaForCausalLM.forward"):
        qstats.qat.prepare(model, qstats.memoryless_minmax(qstats.QuantSpec("int4")))
    weights = qstats.QuantSpec.from_torchao(torch.int4, mapping_type=MappingType.SYMMETRIC, granularity=PerGroup(32))
    tokens = qstats.QuantSpec.from_torchao(torch.int8, mapping_type=MappingType.ASYMMETRIC, granularity=PerToken())
    weight_recipe = qstats.Recipe([qstats.Rule("Linear", sites=("weight",), spec=weights)])
    recipe = qstats.Recipe([*weight_recipe.rules, qstats.Rule("Linear", sites=("input",), spec=tokens, dynamic=True)])
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        with torch.no_grad():  # the same weights at every step: a last-bit gradient difference would flip int4 codes
            for p, q in zip(model.parameters(), reference.parameters()):
                p.copy_(q)
        ids = torch.randint(0, 64, (2, 8), generator=g)
        weight_qparams = qstats.compute_qparams_tree(qstats.calibrate(model, [], weight_recipe, progress=False),
                                                     weight_recipe, model)  # each step's weights, as torchao's
        qparams = {path: {**sites, "input": None} for path, sites in weight_qparams.items()}
        with qstats.fake_quantized(model, qparams, recipe):
            out = model(ids, labels=ids)
            out.loss.backward()
        expected = reference(ids, labels=ids)
        expected.loss.backward()
        assert torch.equal(out.logits, expected.logits)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)
        for m in (model, reference):
            with torch.no_grad():
                for p in m.parameters():
                    p -= 0.5 * p.grad
            m.zero_grad()
