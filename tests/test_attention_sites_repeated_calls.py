"""An attention module that calls its attention function twice in one call (DiffLlama's differential
attention: once with each half of the value, each repeated over the heads) is refused, naming it:
qstats would observe the key twice and each half of the value apart, where compressed-tensors' kv
cache quantizes the whole key and value once, at the cache update (llm-compressor's ``oneshot``
k_scale/v_scale then differ from qstats': 0.2% to 14% on a tiny DiffLlama)."""

from __future__ import annotations

import pytest
import torch

import qstats
from _shared import eager_attention_arguments

transformers = pytest.importorskip("transformers")
modeling = pytest.importorskip("transformers.models.diffllama.modeling_diffllama")

FP8 = dict(num_bits=8, type="float", symmetric=True, strategy="tensor", dynamic=False)


def _model():
    config = transformers.DiffLlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                          max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.DiffLlamaForCausalLM(config).eval()
    model.set_attn_implementation("eager")
    return model


def _batch():
    return torch.randint(1, 64, (1, 9), generator=torch.Generator().manual_seed(1))


def test_the_premise_two_attention_calls_with_halves_of_the_value():
    model = _model()
    seen = eager_attention_arguments(model, [_batch()], modeling)
    keys, values = seen["model.layers.0.self_attn", "k"], seen["model.layers.0.self_attn", "v"]
    assert len(keys) == 2 and torch.equal(keys[0], keys[1])
    assert not torch.equal(values[0], values[1])


@pytest.mark.parametrize("sites", [("k", "v"), ("q", "k", "v")])
def test_calibrating_its_q_k_v_is_refused_naming_the_module(sites):
    model = _model()
    recipe = qstats.Recipe([qstats.Rule("re:.*self_attn$", sites=sites, observer=qstats.minmax,
                                        spec=qstats.QuantSpec("int8"))])
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn' \(DiffLlamaAttention\) called its "
                                         r"attention function twice"):
        qstats.calibrate(model, [{"input_ids": _batch()}], recipe, progress=False)
    assert model.config._attn_implementation == "eager"


def test_a_kv_cache_scheme_is_refused_naming_the_module():
    pytest.importorskip("llmcompressor")
    from llmcompressor.modifiers.quantization import QuantizationModifier

    model = _model()
    modifier = QuantizationModifier(config_groups={}, kv_cache_scheme=FP8)
    plan = qstats.Recipe.from_compressed_tensors(modifier).resolve(model)
    with pytest.raises(ValueError, match=r"DiffLlamaAttention\) called its attention function twice"):
        qstats.calibrate(model, [{"input_ids": _batch()}], plan, progress=False)
