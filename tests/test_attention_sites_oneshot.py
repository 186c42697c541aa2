"""The q/k/v sites of transformers attention modules are the query, key and value after the rotary
embedding and q/k norms (the attention function's arguments): k_scale, v_scale and q_scale equal
llm-compressor's ``oneshot`` bit for bit on a Llama and on a Qwen3 (q/k norms), and
`qstats.fake_quantized` computes the logits of the exported checkpoint loaded back."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

import qstats
from _shared import assert_fake_quantized_logits_equal, bit_equal, eager_attention_arguments, llm_compressor_oneshot, load_causal_lm

transformers = pytest.importorskip("transformers")
pytest.importorskip("llmcompressor")
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

FP8 = dict(num_bits=8, type="float", symmetric=True, strategy="tensor", dynamic=False)
INT8 = dict(num_bits=8, type="int", symmetric=True, strategy="tensor", dynamic=False)
SMALL = dict(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=32, tie_word_embeddings=False)
MODELS = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
          "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {})}
# more attention modules, checked against the loaded checkpoint: q/k norms (Qwen3-MoE, Gemma 3, whose
# norms scale by 1 + weight), sliding windows (Mistral, Gemma 3)
LOADED_MODELS = {**MODELS,
                 "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                               dict(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)),
                 "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(sliding_window=4)),
                 "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM,
                            dict(sliding_window=4, query_pre_attn_scalar=16))}


def _base(path, family):
    make_config, make_model, extra = LOADED_MODELS[family]
    torch.manual_seed(0)
    model = make_model(make_config(**SMALL, **extra))
    for layer in model.model.layers:  # q/k norms that change the range (their weights start at one or zero)
        for norm in (getattr(layer.self_attn, "q_norm", None), getattr(layer.self_attn, "k_norm", None)):
            if norm is not None:
                norm.weight.data = torch.rand(norm.weight.shape) * 3
    model.save_pretrained(path)


def _samples():
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(1, 64, (length,), generator=generator) for length in (12, 7, 9)]


def _modifier(args, query: bool):
    from llmcompressor.modifiers.quantization import QuantizationModifier

    if query:  # an attention group: q, k and v under its input args
        return QuantizationModifier(config_groups={"attention": {"targets": ["re:.*self_attn$"],
                                                                 "input_activations": args}})
    return QuantizationModifier(config_groups={}, kv_cache_scheme=args)


def _calibrated(base, modifier, samples, attention="eager"):
    model = load_causal_lm(base)
    model.set_attn_implementation(attention)
    plan = qstats.Recipe.from_compressed_tensors(modifier).resolve(model)
    states = qstats.calibrate(model, [{"input_ids": s[None]} for s in samples], plan, progress=False)
    return model, plan, states


CASES = {"fp8-kv-cache": (FP8, False), "int8-kv-cache": (INT8, False), "fp8-attention-group": (FP8, True),
         "int8-attention-group": (INT8, True)}


@pytest.mark.parametrize("family", sorted(MODELS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_kv_and_q_scales_equal_llm_compressor_bit_for_bit(tmp_path, family, case):
    """k_scale and v_scale equal ``oneshot``'s; every other tensor too but q_scale, which llm-compressor
    0.14's oneshot leaves uninitialised (its calibration forces eager attention, so compressed-tensors'
    hooked attention never hands it the query): q_scale equals llm-compressor's own observer of the
    args fed, batch by batch, the queries eager attention receives."""
    from llmcompressor.observers import Observer

    args, query = CASES[case]
    base, theirs, ours = (str(tmp_path / name) for name in ("base", "theirs", "ours"))
    _base(base, family)
    samples = _samples()
    llm_compressor_oneshot(load_causal_lm(base), samples, _modifier(args, query), theirs)
    model, plan, states = _calibrated(base, _modifier(args, query), samples)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning: no rotary embedding after the observed q/k
        qstats.export.compressed_tensors(model, qstats.compute_qparams_tree(states, plan), ours, plan)
    our_tensors = load_file(os.path.join(ours, "model.safetensors"))
    their_tensors = load_file(os.path.join(theirs, "model.safetensors"))
    # oneshot also saves zero q/k/v zero points of symmetric args, which a loaded checkpoint does not need
    zero_points = [name for name in their_tensors if name.endswith(("q_zero_point", "k_zero_point", "v_zero_point"))]
    assert all(not their_tensors.pop(name).any() for name in zero_points)
    assert sorted(our_tensors) == sorted(their_tensors)
    kv = [name for name in their_tensors if name.endswith(("k_scale", "v_scale"))]
    assert len(kv) == 4 and all(bit_equal(our_tensors[name], their_tensors[name]) for name in kv)
    differing = [name for name in their_tensors if not bit_equal(our_tensors[name], their_tensors[name])]
    assert differing == [name for name in their_tensors if name.endswith("q_scale")]
    if not query:
        return
    seen = eager_attention_arguments(model, [s[None] for s in samples])
    for (path, site), xs in seen.items():
        if site != "q":
            continue
        # llm-compressor's observer for static activations without one named: "minmax" (a moving average)
        observer = Observer.load_from_registry("minmax", base_name="q", args=QuantizationArgs(**args))
        for x in xs:
            observer(x)
        reference = observer.get_qparams()["scale"]
        assert bit_equal(our_tensors[f"{path}.q_scale"], reference.reshape(1)), path


@pytest.mark.parametrize("family", sorted(MODELS))
def test_observed_q_k_v_are_the_eager_attention_arguments(family, tmp_path):
    """The states' extremes are those of the tensors eager attention receives, recorded by a
    wrapper of the modeling file's function (not by qstats), and not those of the projections."""
    base = str(tmp_path / "base")
    _base(base, family)
    static = {**FP8, "observer": "static_minmax"}
    samples = _samples()
    model, plan, states = _calibrated(base, _modifier(static, True), samples)
    assert model.config._attn_implementation == "eager"  # the user's setting, back
    seen = eager_attention_arguments(model, [s[None] for s in samples])
    assert len(seen) == 3 * len(model.model.layers)
    for (path, site), xs in seen.items():
        state = states[path][site]
        assert torch.equal(state.min_val, torch.stack([x.amin() for x in xs]).amin()), (path, site)
        assert torch.equal(state.max_val, torch.stack([x.amax() for x in xs]).amax()), (path, site)
    projection = model.model.layers[0].self_attn.k_proj(model.model.embed_tokens(samples[0][None]))
    assert not torch.equal(states["model.layers.0.self_attn"]["k"].max_val, projection.amax())


def _loaded_back(base: str, ours: str, family: str):
    """The checkpoint ``ours`` loaded by transformers (under sdpa); for Qwen3-MoE, whose attention-only
    checkpoint transformers 5 loads without its experts (their per-expert tensors are not stacked back:
    UNEXPECTED / MISSING keys) or not at all (a kv-cache-only one: IndexError in its get_experts_scheme),
    the float model with compressed-tensors' quantization config applied and the checkpoint's scales."""
    if family != "qwen3_moe":
        return load_causal_lm(ours, attn_implementation="sdpa")
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config

    with open(os.path.join(ours, "config.json")) as file:
        config = QuantizationConfig.model_validate(json.load(file)["quantization_config"])
    model = load_causal_lm(base, attn_implementation="sdpa")
    apply_quantization_config(model, config)
    tensors = load_file(os.path.join(ours, "model.safetensors"))
    scales = {name: tensor for name, tensor in tensors.items() if name.endswith("_scale")}
    missing, unexpected = model.load_state_dict(scales, strict=False)
    assert not unexpected and not [name for name in missing if name.endswith("_scale")]
    return model


@pytest.mark.parametrize("family", sorted(LOADED_MODELS))
@pytest.mark.parametrize("case", ["fp8-kv-cache", "fp8-attention-group"])
def test_fake_quantized_logits_equal_the_checkpoint_loaded_back(tmp_path, family, case):
    """compressed-tensors' hooked attention quantizes the loaded checkpoint's q/k/v; qstats'
    fake-quantized model computes the same logits (both under sdpa), on attention modules with q/k
    norms (Qwen3, Qwen3-MoE, Gemma 3) and sliding windows (Mistral, Gemma 3) too."""
    args, query = CASES[case]
    base, ours = str(tmp_path / "base"), str(tmp_path / "ours")
    _base(base, family)
    samples = _samples()
    model, plan, states = _calibrated(base, _modifier(args, query), samples, attention="sdpa")
    qparams = qstats.compute_qparams_tree(states, plan)
    qstats.export.compressed_tensors(model, qparams, ours, plan)
    loaded = _loaded_back(base, ours, family)
    # compressed-tensors' kv cache (k, v) and hooked attention (q) quantize the loaded model
    assert all(hasattr(layer.self_attn, "kv_cache") for layer in loaded.model.layers)
    assert (loaded.config._attn_implementation == "ct_hooked_attention") == query
    assert_fake_quantized_logits_equal(model, qparams, plan, loaded, samples[0][None])
    assert model.config._attn_implementation == "sdpa"
