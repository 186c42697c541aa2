"""q/k/v sites of transformers attention modules without q_proj/k_proj/v_proj children: Phi-3's fused
qkv_proj. Their k_scale/v_scale equal llm-compressor's ``oneshot`` bit for bit, `qstats.fake_quantized`
computes the logits of the exported checkpoint loaded back, and `qstats.report` measures them.
DeepSeek-V3's multi-head latent attention (kv_b_proj) caches its latent, which compressed-tensors'
kv cache quantizes: refused, naming it."""

from __future__ import annotations

import math
import os
import warnings

import pytest
import torch

import qstats
from _shared import assert_fake_quantized_logits_equal, bit_equal, eager_attention_arguments, llm_compressor_oneshot, load_causal_lm

transformers = pytest.importorskip("transformers")
pytest.importorskip("llmcompressor")
from safetensors.torch import load_file  # noqa: E402

FP8 = dict(num_bits=8, type="float", symmetric=True, strategy="tensor", dynamic=False)
SMALL = dict(vocab_size=64, hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False, pad_token_id=0,
             bos_token_id=1, eos_token_id=2)
FAMILIES = {"phi3": dict()}  # a fused qkv_proj
OTHER_FAMILIES = {
    # multi-head latent attention: q_a_proj/q_b_proj, kv_a_proj_with_mqa/kv_b_proj (a key and value
    # per query head); dense MLPs only
    "deepseek_v3": dict(num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                        first_k_dense_replace=2, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
                        n_group=2, topk_group=1),
}


def _base(path, family):
    config = transformers.AutoConfig.for_model(family, **{**SMALL, **{**FAMILIES, **OTHER_FAMILIES}[family]})
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.AutoModelForCausalLM.from_config(config).eval().save_pretrained(path)


def _samples():
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(3, 64, (length,), generator=generator) for length in (12, 7, 9)]


def _modifier(case: str):
    from llmcompressor.modifiers.quantization import QuantizationModifier

    if case == "fp8-attention-group":  # q, k and v under the group's input args
        return QuantizationModifier(config_groups={"attention": {"targets": ["re:.*self_attn$"],
                                                                 "input_activations": FP8}})
    if case == "w8a16-fp8-kv-cache":  # weights too, the fused qkv_proj's among them
        return QuantizationModifier(scheme="W8A16", targets=["Linear"], ignore=["lm_head"], kv_cache_scheme=FP8)
    return QuantizationModifier(config_groups={}, kv_cache_scheme=FP8)


def _calibrated(base, case, samples, attention="eager"):
    model = load_causal_lm(base)
    model.set_attn_implementation(attention)
    plan = qstats.Recipe.from_compressed_tensors(_modifier(case)).resolve(model)
    states = qstats.calibrate(model, [{"input_ids": s[None]} for s in samples], plan, progress=False)
    return model, plan, states


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("case", ["fp8-kv-cache", "w8a16-fp8-kv-cache"])
def test_kv_scales_equal_llm_compressor_bit_for_bit(tmp_path, family, case):
    """Every tensor of the exported checkpoint equals ``oneshot``'s, k_scale and v_scale of every
    attention module among them (before: a ValueError at resolve naming the missing k_proj/v_proj)."""
    base, theirs, ours = (str(tmp_path / name) for name in ("base", "theirs", "ours"))
    _base(base, family)
    samples = _samples()
    llm_compressor_oneshot(load_causal_lm(base), samples, _modifier(case), theirs)
    model, plan, states = _calibrated(base, case, samples)
    qstats.export.compressed_tensors(model, qstats.compute_qparams_tree(states, plan), ours, plan)
    our_tensors = load_file(os.path.join(ours, "model.safetensors"))
    their_tensors = load_file(os.path.join(theirs, "model.safetensors"))
    # oneshot also saves zero k/v zero points of symmetric args, which a loaded checkpoint does not need
    zero_points = [name for name in their_tensors if name.endswith(("k_zero_point", "v_zero_point"))]
    assert all(not their_tensors.pop(name).any() for name in zero_points)
    assert sorted(our_tensors) == sorted(their_tensors)
    kv = [name for name in their_tensors if name.endswith(("k_scale", "v_scale"))]
    assert len(kv) == 4
    assert [name for name in their_tensors if not bit_equal(our_tensors[name], their_tensors[name])] == []


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("case", ["fp8-kv-cache", "fp8-attention-group"])
def test_fake_quantized_logits_equal_the_checkpoint_loaded_back(tmp_path, family, case):
    """compressed-tensors' kv cache (k, v) and hooked attention (q) quantize the loaded checkpoint;
    qstats' fake-quantized model computes the same logits (both under sdpa)."""
    base, ours = str(tmp_path / "base"), str(tmp_path / "ours")
    _base(base, family)
    samples = _samples()
    model, plan, states = _calibrated(base, case, samples, attention="sdpa")
    qparams = qstats.compute_qparams_tree(states, plan)
    qstats.export.compressed_tensors(model, qparams, ours, plan)
    loaded = load_causal_lm(ours, attn_implementation="sdpa")
    assert all(hasattr(layer.self_attn, "kv_cache") for layer in loaded.model.layers)
    assert (loaded.config._attn_implementation == "ct_hooked_attention") == (case == "fp8-attention-group")
    assert_fake_quantized_logits_equal(model, qparams, plan, loaded, samples[0][None])


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_report_sqnr_of_q_k_v_is_compressed_tensors_fake_quantization_error(tmp_path, family):
    """`report`'s SQNR of each q/k/v site is that of compressed-tensors' ``fake_quantize`` (the
    calibrated scale) on the tensors eager attention receives, recorded by a wrapper (not qstats)."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize

    base = str(tmp_path / "base")
    _base(base, family)
    samples = _samples()
    model, plan, states = _calibrated(base, "fp8-attention-group", samples)
    qparams = qstats.compute_qparams_tree(states, plan)
    batches = [s[None] for s in samples]
    rows = {(row.module, row.site): row for row in qstats.report(states, qparams, model, plan, batches).rows
            if row.site in ("q", "k", "v")}
    seen = eager_attention_arguments(model, batches)
    assert sorted(seen) == sorted(rows) and len(rows) == 6
    for (path, site), xs in seen.items():
        scale = qparams[path][site].scale
        signal = noise = 0.0
        for x in xs:
            fq = fake_quantize(x, scale, torch.zeros_like(scale), QuantizationArgs(**FP8))
            signal += float(x.double().pow(2).sum())
            noise += float((x - fq).double().pow(2).sum())
        assert rows[path, site].sqnr_db == pytest.approx(10 * math.log10(signal / noise), rel=1e-4), (path, site)


def test_kv_sites_are_those_of_the_modules_compressed_tensors_caches(tmp_path):
    """A rule for k/v on every module selects exactly the attention modules compressed-tensors'
    ``is_cached_attention_module`` gives a kv cache, not the model, decoder layers or MLPs holding
    a config."""
    from compressed_tensors.quantization.lifecycle.initialize import is_cached_attention_module

    base = str(tmp_path / "base")
    _base(base, "phi3")
    model = load_causal_lm(base)
    spec = qstats.QuantSpec.from_compressed_tensors(FP8)
    plan = qstats.Recipe([qstats.Rule("re:.*", sites=("k", "v"), spec=spec)]).resolve(model)
    cached = [path for path, module in model.named_modules() if is_cached_attention_module(module)]
    assert len(cached) == 2 and sorted(plan.sites) == sorted(cached)


@pytest.mark.parametrize("case", ["fp8-kv-cache", "fp8-attention-group"])
def test_kv_of_latent_attention_is_refused_naming_it(tmp_path, case):
    """DeepSeek-V3 (transformers 5) hands its cache the compressed latent and the rotary key, which
    compressed-tensors' kv cache quantizes (oneshot's k_scale/v_scale are theirs), not the key and
    value its attention function receives: refused at resolve, and at export for a plain rule."""
    base = str(tmp_path / "base")
    _base(base, "deepseek_v3")
    model = load_causal_lm(base)
    recipe = qstats.Recipe.from_compressed_tensors(_modifier(case))
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn' \(DeepseekV3Attention\).*multi-head latent "
                                         r"attention .*compressed latent"):
        recipe.resolve(model)
    rule = qstats.Rule("re:.*self_attn$", sites=("k", "v"), spec=qstats.QuantSpec.from_compressed_tensors(FP8))
    plan = qstats.Recipe([rule]).resolve(model)
    states = qstats.calibrate(model, [s[None] for s in _samples()], plan, progress=False)
    with pytest.raises(ValueError, match=r"k/v sites of a DeepseekV3Attention: it is multi-head latent attention"):
        qstats.export.compressed_tensors(model, qstats.compute_qparams_tree(states, plan), str(tmp_path / "ours"),
                                         plan)


def test_layer_by_layer_q_k_v_states_equal_the_full_model(tmp_path):
    """Phi-3's q/k/v calibrated layer by layer (`qstats.calibrate_layerwise`, on a meta model) equal
    a full-model `qstats.calibrate` bit for bit; each state counts every element of the attention
    function's query (heads * head_dim per token) and key/value (kv heads * head_dim)."""
    from _shared import assert_site_states_equal

    base = str(tmp_path / "base")
    _base(base, "phi3")
    config = transformers.AutoConfig.from_pretrained(base)
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config).eval()
    recipe = qstats.Recipe.from_compressed_tensors(
        {"config_groups": {"attention": {"targets": ["re:.*self_attn$"], "input_activations": FP8}},
         "kv_cache_scheme": FP8})
    batches = [{"input_ids": s[None]} for s in _samples()]
    want = qstats.calibrate(load_causal_lm(base), batches, recipe, progress=False)
    got = qstats.calibrate_layerwise(meta, base, batches, recipe, progress=False)
    assert_site_states_equal(got, want)
    tokens, head_dim = sum(s.numel() for s in _samples()), SMALL["hidden_size"] // SMALL["num_attention_heads"]
    for layer in range(2):
        entry = want[f"model.layers.{layer}.self_attn"]
        assert int(entry["q"].count) == tokens * SMALL["num_attention_heads"] * head_dim
        assert int(entry["k"].count) == int(entry["v"].count) == tokens * SMALL["num_key_value_heads"] * head_dim
