"""Decode steps of encoder-decoder models (BART, Whisper, T5, T5Gemma) given an ``EncoderDecoderCache``, as
``generate`` runs them: their attention modules hand the new key and value to its
``self_attention_cache`` (each step) and ``cross_attention_cache`` (the encoder's, once) and read the
cross-attention's back at later steps. The k/v sites observe each key and value once, where they are
handed to the cache, as for a decoder-only model's cache (`test_attention_sites_decode_steps.py`), not
the whole cache at every step. k_scale and v_scale equal llm-compressor's static observer (``minmax``, a
moving average) fed the keys and values each call hands the caches' ``update``, recorded by a wrapper
of ``DynamicCache.update`` (not by qstats)."""

from __future__ import annotations

import pytest
import torch

import qstats

transformers = pytest.importorskip("transformers")
pytest.importorskip("llmcompressor")
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402

INT8 = dict(num_bits=8, type="int", symmetric=True, strategy="tensor", dynamic=False)
SIZES = dict(vocab_size=64, decoder_start_token_id=1, pad_token_id=0, bos_token_id=1, eos_token_id=2)
T5GEMMA = dict(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
               num_key_value_heads=1, head_dim=16, max_position_embeddings=32)
# family: (model, its encoder's inputs, decoder self-attention path, decoder cross-attention path)
FAMILIES = {
    "bart": (lambda: transformers.BartForConditionalGeneration(transformers.BartConfig(
        d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=64, **SIZES)),
        lambda generator: {"input_ids": torch.randint(3, 64, (2, 7), generator=generator)},
        "model.decoder.layers.0.self_attn", "model.decoder.layers.0.encoder_attn"),
    "whisper": (lambda: transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(
        d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=32, decoder_ffn_dim=32, num_mel_bins=8, max_source_positions=8, max_target_positions=32,
        **SIZES)),
        lambda generator: {"input_features": torch.randn(2, 8, 16, generator=generator)},
        "model.decoder.layers.0.self_attn", "model.decoder.layers.0.encoder_attn"),
    "t5": (lambda: transformers.T5ForConditionalGeneration(transformers.T5Config(
        d_model=32, d_kv=16, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=2, **SIZES)),
        lambda generator: {"input_ids": torch.randint(3, 64, (2, 7), generator=generator)},
        "decoder.block.0.layer.0.SelfAttention", "decoder.block.0.layer.1.EncDecAttention"),
    "t5gemma": (lambda: transformers.T5GemmaForConditionalGeneration(transformers.T5GemmaConfig(
        encoder=transformers.T5GemmaModuleConfig(**T5GEMMA), decoder=transformers.T5GemmaModuleConfig(**T5GEMMA),
        **SIZES)),
        lambda generator: {"input_ids": torch.randint(3, 64, (2, 7), generator=generator)},
        "model.decoder.layers.0.self_attn", "model.decoder.layers.0.cross_attn"),
}


def _decode(model, inputs, caches, steps=3):
    """The decoder over a prompt, then ``steps`` greedy steps, given the encoder's output and an
    ``EncoderDecoderCache`` of ``caches`` (self-attention, cross-attention)."""
    cache = transformers.EncoderDecoderCache(*caches)
    prompt = torch.randint(3, 64, (2, 4), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        encoded = model.get_encoder()(**inputs)
        out = model(encoder_outputs=encoded, decoder_input_ids=prompt, past_key_values=cache, use_cache=True)
        for _ in range(steps):
            token = out.logits[:, -1:].argmax(-1)
            out = model(encoder_outputs=encoded, decoder_input_ids=token, past_key_values=cache, use_cache=True)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_encoder_decoder_cache_decode_steps_observe_each_handed_key_and_value_once(monkeypatch, family):
    from llmcompressor.observers import Observer

    make, encoder_inputs, self_attention, cross_attention = FAMILIES[family]
    torch.manual_seed(0)
    model = make().eval()
    model.set_attn_implementation("eager")
    inputs = encoder_inputs(torch.Generator().manual_seed(1))
    caches = (transformers.DynamicCache(), transformers.DynamicCache())
    handed = {id(cache): [] for cache in caches}
    update = transformers.DynamicCache.update

    def recording(cache, key, value, *args, **kwargs):
        handed[id(cache)].append((key.clone(), value.clone()))
        return update(cache, key, value, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(transformers.DynamicCache, "update", recording)
        _decode(model, inputs, caches)
    assert [len(calls) for calls in handed.values()] == [4, 1]  # each step's own; the encoder's once

    spec = qstats.QuantSpec.from_compressed_tensors(QuantizationArgs(**INT8))
    recipe = qstats.Recipe([qstats.Rule((self_attention, cross_attention), sites=("k", "v"),
                                        observer=qstats.moving_average_minmax, spec=spec)])
    plan = recipe.resolve(model)
    with qstats.observing(model, plan) as session:
        _decode(model, inputs, (transformers.DynamicCache(), transformers.DynamicCache()))
    qparams = qstats.compute_qparams_tree(session.states, plan)
    for path, calls in zip((self_attention, cross_attention), handed.values()):
        for index, site in enumerate("kv"):
            observer = Observer.load_from_registry("minmax", base_name=site, args=QuantizationArgs(**INT8))
            for call in calls:
                observer(call[index])
            assert torch.equal(qparams[path][site].scale.reshape(-1), observer.get_qparams()["scale"].reshape(-1)), \
                (path, site)
            assert int(session.states[path][site].batches) == len(calls), (path, site)
