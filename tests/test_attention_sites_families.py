"""k_scale and v_scale equal llm-compressor's ``oneshot`` bit for bit on attention families whose
key and value take other paths to the attention function than Llama's: q/k norms over all heads
before the head split (OLMo2), per-head LayerNorm q/k norms (Cohere), logit softcapping and sliding
windows (Gemma 2), partial rotary embeddings with q/k LayerNorms (Phi), biased projections
(StarCoder2), interleaved sliding and full layers without rotary embedding (Cohere2), attention sinks
(GPT-OSS), linear-attention layers without a kv cache beside full attention (Qwen3-Next: k/v scales of
its full-attention layers only). Under eager attention, as ``oneshot`` calibrates."""

from __future__ import annotations

import os

import pytest
import torch

import qstats
from _shared import bit_equal, llm_compressor_oneshot, load_causal_lm

transformers = pytest.importorskip("transformers")
pytest.importorskip("llmcompressor")
from safetensors.torch import load_file  # noqa: E402

FP8 = dict(num_bits=8, type="float", symmetric=True, strategy="tensor", dynamic=False)
SMALL = dict(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=32)
TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
FAMILIES = {
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", TOKENS),
    "cohere": ("CohereConfig", "CohereForCausalLM", dict(TOKENS, use_qk_norm=True)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(head_dim=16, sliding_window=4, attn_logit_softcapping=5.0,
                                                          query_pre_attn_scalar=16)),
    "phi": ("PhiConfig", "PhiForCausalLM", dict(partial_rotary_factor=0.5, qk_layernorm=True)),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", dict(bos_token_id=0, eos_token_id=0)),
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", dict(TOKENS, head_dim=16, sliding_window=4,
                                                             layer_types=["sliding_attention", "full_attention"])),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(TOKENS, head_dim=16, sliding_window=4, num_local_experts=4,
                                                          num_experts_per_tok=2,
                                                          layer_types=["sliding_attention", "full_attention"])),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        TOKENS, head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, layer_types=["linear_attention", "full_attention"])),
}


def _base(path, family):
    config_name, model_name, extra = FAMILIES[family]
    if not hasattr(transformers, model_name):
        pytest.skip(f"transformers has no {model_name}")
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(getattr(transformers, config_name)(**SMALL, **extra))
    for name, parameter in model.named_parameters():  # norms (q/k norms too) and sinks that change the range
        if "norm" in name and parameter.ndim == 1:
            parameter.data = torch.rand(parameter.shape) * 3
        if name.endswith("sinks"):
            parameter.data = torch.randn(parameter.shape)
    model.save_pretrained(path)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_kv_scales_equal_llm_compressor_bit_for_bit(tmp_path, family, single_thread_quiet):
    # one thread: oneshot calibrates MoE families (GPT-OSS, Qwen3-Next) with their experts linearized, whose
    # sums multi-threaded matmuls may order otherwise than the fused experts' (Qwen3-Next's layer-1 k_scale then
    # differs in its last bit from oneshot's, and qstats' equals llm-compressor's observer over the model's keys)
    from llmcompressor.modifiers.quantization import QuantizationModifier

    base, theirs, ours = (str(tmp_path / name) for name in ("base", "theirs", "ours"))
    _base(base, family)
    generator = torch.Generator().manual_seed(1)
    samples = [torch.randint(3, 64, (length,), generator=generator) for length in (12, 7, 9)]
    llm_compressor_oneshot(load_causal_lm(base), samples, QuantizationModifier(config_groups={}, kv_cache_scheme=FP8),
                           theirs)
    model = load_causal_lm(base)
    model.set_attn_implementation("eager")
    modifier = QuantizationModifier(config_groups={}, kv_cache_scheme=FP8)
    plan = qstats.Recipe.from_compressed_tensors(modifier).resolve(model)
    states = qstats.calibrate(model, [{"input_ids": s[None]} for s in samples], plan, progress=False)
    qstats.export.compressed_tensors(model, qstats.compute_qparams_tree(states, plan), ours, plan)
    our_tensors = load_file(os.path.join(ours, "model.safetensors"))
    their_tensors = load_file(os.path.join(theirs, "model.safetensors"))
    kv = sorted(name for name in their_tensors if name.endswith(("k_scale", "v_scale")))
    layers = [index for index, kind in enumerate(getattr(model.config, "layer_types", None) or ["full_attention"] * 2)
              if kind != "linear_attention"]
    assert len(kv) == 2 * len(layers) and kv == sorted(name for name in our_tensors if name.endswith(("k_scale", "v_scale")))
    assert [name for name in kv if not bit_equal(our_tensors[name], their_tensors[name])] == []
