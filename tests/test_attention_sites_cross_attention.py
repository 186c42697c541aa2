"""The batch's observation weight (the text's padding mask, ``[batch, tokens]``) describes the tokens
of an attention call's query; in a cross-attention call the key and value come from other tokens (the
image's in Mllama, the encoder's in BART), which it does not describe, even where their
count equals the text's. Their k/v sites observe every key and value the layer computes from those
states, as llm-compressor 0.14's kv-cache observers see them; the query and self-attention k/v keep
the mask. Reference: the extremes of the query, key and value the modeling file's eager attention
receives (recorded by wrapping it), the padded tokens' rows left out of the query and self-attention."""

from __future__ import annotations

import contextlib

import pytest
import torch

import qstats

transformers = pytest.importorskip("transformers")
from transformers.models.mllama import modeling_mllama  # noqa: E402

TOKENS = 6


def _mllama():
    torch.manual_seed(0)
    config = transformers.MllamaTextConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                           num_attention_heads=2, num_key_value_heads=1, cross_attention_layers=[1],
                                           max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = transformers.MllamaForCausalLM(config).eval()
    model.set_attn_implementation("eager")
    return model


def _batch():
    generator = torch.Generator().manual_seed(1)
    mask = torch.ones(2, TOKENS, dtype=torch.long)
    mask[0, :4] = 0  # left padding
    vision = torch.randn(2, TOKENS, 32, generator=generator) * 3  # as many image tokens as text tokens
    vision[0, :4] *= 4  # the image tokens at the text's padding hold the largest keys and values
    return {"input_ids": torch.randint(3, 64, (2, TOKENS), generator=generator), "attention_mask": mask,
            "cross_attention_states": vision}


def _eager_arguments(model, batch, modeling=modeling_mllama) -> dict:
    """``{(path, site): tensor}`` the modeling file's eager attention receives in one forward."""
    original, seen = modeling.eager_attention_forward, {}
    paths = {id(module): path for path, module in model.named_modules()}

    def recording(module, query, key, value, *args, **kwargs):
        for site, x in zip("qkv", (query, key, value)):
            seen[paths[id(module)], site] = x.detach()
        return original(module, query, key, value, *args, **kwargs)

    modeling.eager_attention_forward = recording
    try:
        with torch.no_grad():
            model(**batch)
    finally:
        modeling.eager_attention_forward = original
    return seen


def _extremes(x: torch.Tensor, mask=None, heads: bool = False):
    """min/max of ``[batch, heads, tokens, head_dim]`` over the tokens ``mask`` keeps (all without one),
    per head with ``heads``."""
    keep = torch.ones(x.shape[0], x.shape[2], dtype=torch.bool) if mask is None else mask.bool()
    rows = x.transpose(1, 2)[keep]  # [kept tokens, heads, head_dim]
    if heads:
        return rows.amin(dim=(0, 2)), rows.amax(dim=(0, 2))
    return rows.amin(), rows.amax()


@pytest.mark.parametrize("granularity", ["tensor", "head"])
def test_mllama_cross_attention_kv_ignore_the_text_padding_mask(granularity):
    model, batch = _mllama(), _batch()
    spec = qstats.QuantSpec("int8", granularity=qstats.PerHead(1)) if granularity == "head" else qstats.QuantSpec("int8")
    recipe = qstats.Recipe([qstats.Rule(("MllamaTextSelfAttention", "MllamaTextCrossAttention"), sites=("q", "k", "v"),
                                        observer=qstats.minmax, spec=spec)])
    states = qstats.calibrate(model, [batch], recipe, observation_weight=lambda b: b["attention_mask"], progress=False)

    seen = _eager_arguments(model, batch)
    heads = granularity == "head"
    cross, self_attention = "model.layers.1.cross_attn", "model.layers.0.self_attn"
    expected = {(cross, "q"): batch["attention_mask"], (cross, "k"): None, (cross, "v"): None,
                **{(self_attention, site): batch["attention_mask"] for site in "qkv"}}
    for (path, site), mask in expected.items():
        low, high = _extremes(seen[path, site], mask, heads)
        state = states[path][site]
        assert torch.equal(state.min_val.reshape(low.shape), low), (path, site)
        assert torch.equal(state.max_val.reshape(high.shape), high), (path, site)
    # the check can fail: the padding's image tokens hold the cross-attention's extremes
    k, v = seen[cross, "k"], seen[cross, "v"]
    assert _extremes(v, batch["attention_mask"])[1].amax() < _extremes(v)[1].amax()
    assert _extremes(k, batch["attention_mask"])[1].amax() < _extremes(k)[1].amax()


def test_bart_decoder_cross_attention_kv_ignore_the_decoder_padding_mask():
    """BART's decoder calls one attention class for self- and cross-attention, the latter handed
    ``key_value_states`` (the encoder's output, as many tokens as the decoder's here)."""
    from transformers.models.bart import modeling_bart

    torch.manual_seed(0)
    config = transformers.BartConfig(vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1,
                                     encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                                     decoder_ffn_dim=32, max_position_embeddings=64)
    model = transformers.BartForConditionalGeneration(config).eval()
    model.set_attn_implementation("eager")
    generator = torch.Generator().manual_seed(1)
    mask = torch.ones(2, TOKENS, dtype=torch.long)
    mask[1, 3:] = 0  # the decoder's right padding
    batch = {"input_ids": torch.randint(3, 64, (2, TOKENS), generator=generator),
             "decoder_input_ids": torch.randint(3, 64, (2, TOKENS), generator=generator), "decoder_attention_mask": mask}
    recipe = qstats.Recipe([qstats.Rule("re:model[.]decoder.*(self_attn|encoder_attn)$", sites=("q", "k", "v"),
                                        observer=qstats.minmax, spec=qstats.QuantSpec("int8"))])
    states = qstats.calibrate(model, [batch], recipe, observation_weight=lambda b: b["decoder_attention_mask"],
                              progress=False)

    seen = _eager_arguments(model, batch, modeling_bart)
    cross, self_attention = "model.decoder.layers.0.encoder_attn", "model.decoder.layers.0.self_attn"
    expected = {(cross, "q"): mask, (cross, "k"): None, (cross, "v"): None,
                **{(self_attention, site): mask for site in "qkv"}}
    for (path, site), kept in expected.items():
        low, high = _extremes(seen[path, site], kept)
        assert torch.equal(states[path][site].min_val, low), (path, site)
        assert torch.equal(states[path][site].max_val, high), (path, site)
    k, v = seen[cross, "k"], seen[cross, "v"]  # the check can fail: the padding's encoder tokens matter
    assert not (torch.equal(_extremes(k, mask)[0], _extremes(k)[0]) and torch.equal(_extremes(k, mask)[1], _extremes(k)[1])
                and torch.equal(_extremes(v, mask)[0], _extremes(v)[0]) and torch.equal(_extremes(v, mask)[1], _extremes(v)[1]))


def test_mllama_decode_steps_observe_the_cross_attention_kv_once(monkeypatch):
    """With a cache, Mllama's cross-attention hands the image's key and value to the cache's ``update``
    at the prompt and reads them back from the cache at each decode step: its k/v sites observe them once,
    where they are handed over, as llm-compressor's static observer (``minmax``, a moving average) fed the
    keys and values each call hands ``DynamicCache.update`` (recorded by wrapping it, not by qstats)."""
    pytest.importorskip("llmcompressor")
    from compressed_tensors.quantization import QuantizationArgs
    from llmcompressor.observers import Observer

    model, batch = _mllama(), _batch()

    def decode(steps=3):
        cache = transformers.DynamicCache(config=model.config)
        with torch.no_grad():
            out = model(**batch, past_key_values=cache, use_cache=True)
            mask = batch["attention_mask"]
            for _ in range(steps):
                mask = torch.cat([mask, mask.new_ones(2, 1)], dim=1)
                out = model(input_ids=out.logits[:, -1:].argmax(-1), attention_mask=mask, past_key_values=cache,
                            use_cache=True)

    handed: dict = {}
    update = transformers.DynamicCache.update

    def recording(cache, key, value, layer_idx, *args, **kwargs):
        handed.setdefault(layer_idx, []).append((key.clone(), value.clone()))
        return update(cache, key, value, layer_idx, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(transformers.DynamicCache, "update", recording)
        decode()
    assert [len(handed[layer]) for layer in (0, 1)] == [4, 1]  # the image's key and value once

    args = dict(num_bits=8, type="int", symmetric=True, strategy="tensor", dynamic=False)
    recipe = qstats.Recipe([qstats.Rule(("MllamaTextSelfAttention", "MllamaTextCrossAttention"), sites=("k", "v"),
                                        observer=qstats.moving_average_minmax,
                                        spec=qstats.QuantSpec.from_compressed_tensors(QuantizationArgs(**args)))])
    plan = recipe.resolve(model)
    with qstats.observing(model, plan) as session:
        decode()
    qparams = qstats.compute_qparams_tree(session.states, plan)
    for layer, path in enumerate(("model.layers.0.self_attn", "model.layers.1.cross_attn")):
        for index, site in enumerate("kv"):
            observer = Observer.load_from_registry("minmax", base_name=site, args=QuantizationArgs(**args))
            for call in handed[layer]:
                observer(call[index])
            assert torch.equal(qparams[path][site].scale.reshape(-1), observer.get_qparams()["scale"].reshape(-1)), \
                (path, site)
            assert int(session.states[path][site].batches) == len(handed[layer]), (path, site)


def test_gpt2_cross_attention_kv_at_the_cross_attention_cache_update(monkeypatch):
    """GPT-2's attention compares the name of its implementation, so qstats reads its k/v at the cache
    update (`qstats._attention._cache_hooks`); with ``add_cross_attention`` its modules update an
    ``EncoderDecoderCache``'s self- and cross-attention caches, and at decode steps its cross-attention
    reads the encoder's key and value back from the cache. Its k/v sites equal the extremes of the keys
    and values handed to ``DynamicCache.update`` (recorded by wrapping it), the text's padding left out
    of the self-attention's only, the cross-attention's counted once."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=32,
                                     add_cross_attention=True, bos_token_id=1, eos_token_id=2)
    model = transformers.GPT2LMHeadModel(config).eval()
    model.set_attn_implementation("eager")
    batch = _batch()
    batch["encoder_hidden_states"] = batch.pop("cross_attention_states")

    def decode(prompt_weighted=contextlib.nullcontext, steps=2):
        with torch.no_grad():
            with prompt_weighted():
                out = model(**batch, use_cache=True)
            mask = batch["attention_mask"]
            for _ in range(steps):
                mask = torch.cat([mask, mask.new_ones(2, 1)], dim=1)
                out = model(input_ids=out.logits[:, -1:].argmax(-1), attention_mask=mask, use_cache=True,
                            encoder_hidden_states=batch["encoder_hidden_states"], past_key_values=out.past_key_values)

    handed: list = []
    update = transformers.DynamicCache.update

    def recording(cache, key, value, *args, **kwargs):
        handed.append((id(cache), key.clone(), value.clone()))
        return update(cache, key, value, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(transformers.DynamicCache, "update", recording)
        decode()
    caches = list(dict.fromkeys(cache for cache, _, _ in handed))  # the self-attention's first
    assert [sum(cache == each for each, _, _ in handed) for cache in caches] == [3, 1]

    recipe = qstats.Recipe([qstats.Rule("GPT2Attention", sites=("k", "v"), observer=qstats.minmax,
                                        spec=qstats.QuantSpec("int8"))])
    with qstats.observing(model, recipe) as session:
        decode(lambda: session.weighted(batch["attention_mask"]))  # the prompt's padding left out
    states = session.states
    prompt = batch["attention_mask"].bool()
    for path, cache in (("transformer.h.0.attn", caches[0]), ("transformer.h.0.crossattention", caches[1])):
        for index, site in enumerate("kv"):
            rows = [call[1 + index].transpose(1, 2).flatten(2) for call in handed if call[0] == cache]
            kept = rows[0][prompt] if "cross" not in path else rows[0].flatten(0, 1)  # the prompt's
            seen = torch.cat([kept] + [x.flatten(0, 1) for x in rows[1:]])
            assert torch.equal(states[path][site].min_val, seen.amin()), (path, site)
            assert torch.equal(states[path][site].max_val, seen.amax()), (path, site)
            assert int(states[path][site].count) == seen.numel(), (path, site)


def _sqnr_db(x: torch.Tensor, qparams, spec, mask=None) -> float:
    """SQNR of ``x`` ``[batch, heads, tokens, head_dim]`` under per-tensor ``qparams``, by torch's own
    fake quantization, over the tokens ``mask`` keeps (all without one)."""
    keep = torch.ones(x.shape[0], x.shape[2], dtype=torch.bool) if mask is None else mask.bool()
    rows = x.transpose(1, 2)[keep].double()
    fake = torch.fake_quantize_per_tensor_affine(rows.float(), float(qparams.scale), int(qparams.zero_point),
                                                 spec.qmin, spec.qmax).double()
    return float(10 * torch.log10(rows.square().sum() / (rows - fake).square().sum()))


def test_report_measures_cross_attention_kv_over_every_image_token():
    """`report` leaves the batch's padding out of what it measures as `calibrate` leaves it out of what
    it observes: of the query and self-attention's k/v, not of the cross-attention's key and value."""
    model, batch = _mllama(), _batch()
    spec = qstats.QuantSpec("int8")
    recipe = qstats.Recipe([qstats.Rule(("MllamaTextSelfAttention", "MllamaTextCrossAttention"), sites=("q", "k", "v"),
                                        observer=qstats.minmax, spec=spec)])
    weight = lambda b: b["attention_mask"]  # noqa: E731
    states = qstats.calibrate(model, [batch], recipe, observation_weight=weight, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe.resolve(model))
    rows = {(row.module, row.site): row for row in qstats.report(states, qparams, model, recipe, [batch],
                                                                 observation_weight=weight).rows}
    seen = _eager_arguments(model, batch)
    cross, self_attention = "model.layers.1.cross_attn", "model.layers.0.self_attn"
    mask = batch["attention_mask"]
    for path, site, kept in [(cross, "k", None), (cross, "v", None), (cross, "q", mask), (self_attention, "k", mask)]:
        expected = _sqnr_db(seen[path, site], qparams[path][site], spec, kept)
        assert rows[path, site].sqnr_db == pytest.approx(expected, abs=1e-3), (path, site)
    # the check can fail: measured without the padding's image tokens, the cross-attention's v reads otherwise
    v = seen[cross, "v"]
    assert abs(_sqnr_db(v, qparams[cross]["v"], spec, mask) - _sqnr_db(v, qparams[cross]["v"], spec)) > 0.1
