"""k/v sites of BART's and Whisper's attention, one class for the encoder's self-attention and the decoder's
self- and cross-attention (``encoder_attn``): compressed-tensors 0.19 replaces the cache its forward is
handed by its ``QuantizedKVCache``, which fails their ``isinstance(past_key_values, EncoderDecoderCache)``
check, so every call, cross-attention too, hands its key and value to the wrapper's ``update``, which
quantizes them. The export writes k_scale/v_scale of all three modules, the modules compressed-tensors
quantizes (its ``forward_quantize`` calls recorded), and the loaded checkpoint computes the logits of
`qstats.fake_quantized`. (T5Gemma's cross-attention takes ``cross_attention_cache`` from any cache it is
handed: refused, test_export_attention_cross_attention.py.)

Their stock configs give compressed-tensors no ``num_key_value_heads`` (it cannot apply a kv-cache
scheme, and `Recipe.resolve` refuses one); these tiny configs set it. compressed-tensors runs them without
a cache only: given an ``EncoderDecoderCache``, its wrapper's ``update`` calls the real cache's, which has
none (AttributeError)."""

from __future__ import annotations

import os

import pytest
import torch

import qstats
from _shared import compressed_tensors_applied, kv_quantized

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")
from safetensors.torch import load_file  # noqa: E402

INT8 = dict(num_bits=8, type="int", symmetric=True, strategy="tensor", dynamic=False)
SIZES = dict(vocab_size=64, decoder_start_token_id=1, pad_token_id=0, bos_token_id=1, eos_token_id=2, d_model=32,
             encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
             encoder_ffn_dim=32, decoder_ffn_dim=32)
ATTENTION = {"model.encoder.layers.0.self_attn", "model.decoder.layers.0.self_attn",
             "model.decoder.layers.0.encoder_attn"}


def _model(family: str):
    torch.manual_seed(0)
    if family == "bart":
        config = transformers.BartConfig(max_position_embeddings=64, **SIZES)
        model = transformers.BartForConditionalGeneration(config)
    else:
        config = transformers.WhisperConfig(num_mel_bins=8, max_source_positions=8, max_target_positions=32, **SIZES)
        model = transformers.WhisperForConditionalGeneration(config)
    model.config.num_attention_heads, model.config.num_key_value_heads, model.config.head_dim = 2, 2, 16
    model.set_attn_implementation("eager")
    return model.eval()


def _batch(family: str, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    encoder = ({"input_ids": torch.randint(3, 64, (2, 7), generator=generator)} if family == "bart"
               else {"input_features": torch.randn(2, 8, 16, generator=generator)})
    return {**encoder, "decoder_input_ids": torch.randint(3, 64, (2, 5), generator=generator)}


def _loaded(model, folder: str):
    """A copy of ``model`` with the checkpoint's ``quantization_config`` applied by compressed-tensors and its
    tensors loaded."""
    loaded = compressed_tensors_applied(model, folder)
    missing, unexpected = loaded.load_state_dict(load_file(os.path.join(folder, "model.safetensors")), strict=False)
    assert unexpected == [] and not [name for name in missing if name.endswith(("k_scale", "v_scale"))]
    return loaded


@pytest.mark.parametrize("family", ["bart", "whisper"])
def test_self_and_cross_attention_kv_export_as_compressed_tensors_quantizes_them(family, tmp_path, single_thread_quiet):
    model = _model(family)
    plan = qstats.Recipe.from_compressed_tensors({"config_groups": {}, "kv_cache_scheme": INT8}).resolve(model)
    states = qstats.calibrate(model, [_batch(family, 0)], plan, progress=False)
    qparams = qstats.compute_qparams_tree(states, plan)
    folder = str(tmp_path)
    qstats.export.compressed_tensors(model, qparams, folder, plan)
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    assert {name.rsplit(".", 1)[0] for name in tensors if name.endswith(("k_scale", "v_scale"))} == ATTENTION
    loaded = _loaded(model, folder)
    batch = _batch(family, 1)
    with kv_quantized(loaded) as quantized, torch.no_grad():
        theirs = loaded(**batch, use_cache=False).logits
        assert quantized == {(path, site) for path in ATTENTION for site in ("k", "v")}
        with pytest.raises(AttributeError):  # compressed-tensors' wrapper cannot update an EncoderDecoderCache
            loaded(**batch, past_key_values=transformers.EncoderDecoderCache(
                transformers.DynamicCache(), transformers.DynamicCache()), use_cache=True)
    with torch.no_grad():
        with qstats.fake_quantized(model, qparams, plan):
            ours = model(**batch, use_cache=False).logits
        float_logits = model(**batch, use_cache=False).logits
    assert (theirs - float_logits).abs().max() > 1e-5  # the quantization shows in the logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)  # Whisper: 7e-8 apart (float rounding), BART: 0
