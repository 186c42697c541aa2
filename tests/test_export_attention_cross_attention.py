"""k/v sites of a cross-attention module that hands its key and value to an ``EncoderDecoderCache``'s
``cross_attention_cache`` (T5Gemma): compressed-tensors' kv cache never quantizes them (its
``QuantizedKVCache`` passes ``cross_attention_cache`` through to the real cache, and fails without one),
so their k_scale/v_scale would be loaded and unused, and the loaded model computes other logits than
`qstats.fake_quantized`: the export refuses them, naming the module. Its self-attention modules, which
compressed-tensors quantizes, export."""

from __future__ import annotations

import json
import os

import pytest
import torch

import qstats
from _shared import compressed_tensors_applied, kv_quantized

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

FP8 = dict(num_bits=8, type="float", symmetric=True, strategy="tensor", dynamic=False)
SUB = dict(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
           num_key_value_heads=1, head_dim=16, max_position_embeddings=32)
BATCH = {"input_ids": torch.tensor([[5, 9, 3, 17, 8, 2]]), "decoder_input_ids": torch.tensor([[1, 4, 33, 7, 12]])}


def _model():
    torch.manual_seed(0)
    config = transformers.T5GemmaConfig(encoder=transformers.T5GemmaModuleConfig(**SUB),
                                        decoder=transformers.T5GemmaModuleConfig(**SUB), vocab_size=64)
    model = transformers.T5GemmaForConditionalGeneration(config).eval()
    model.set_attn_implementation("eager")
    return model


def test_cross_attention_k_v_are_refused_naming_the_module(tmp_path):
    model = _model()
    plan = qstats.Recipe.from_compressed_tensors({"config_groups": {}, "kv_cache_scheme": FP8}).resolve(model)
    states = qstats.calibrate(model, [BATCH], plan, progress=False)
    assert "model.decoder.layers.0.cross_attn" in states
    qparams = qstats.compute_qparams_tree(states, plan)
    with pytest.raises(ValueError, match=r"model.decoder.layers.0.cross_attn.*cross_attention_cache"):
        qstats.export.compressed_tensors(model, qparams, str(tmp_path / "ours"), plan)
    # the premise: the self-attention modules' k/v alone export, and compressed-tensors quantizes theirs,
    # never the cross-attention's
    rule = qstats.Rule("re:.*self_attn$", sites=("k", "v"), spec=qstats.QuantSpec.from_compressed_tensors(FP8))
    self_plan = qstats.Recipe([rule]).resolve(model)
    self_states = qstats.calibrate(model, [BATCH], self_plan, progress=False)
    with pytest.raises(ValueError, match=r"1 have no k/v qparams \(model.decoder.layers.0.cross_attn\)"):
        qstats.export.compressed_tensors(model, qstats.compute_qparams_tree(self_states, self_plan),
                                         str(tmp_path / "self"), self_plan)
    # compressed-tensors, given the kv-cache scheme, quantizes the self-attention k/v only
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig

    folder = str(tmp_path / "scheme")
    config = QuantizationConfig(config_groups={}, kv_cache_scheme=QuantizationArgs(**FP8))
    os.makedirs(folder)
    with open(os.path.join(folder, "config.json"), "w") as file:
        json.dump({"quantization_config": config.model_dump(mode="json")}, file)
    loaded = compressed_tensors_applied(model, folder)  # its forward with a cache, as generate runs it
    with kv_quantized(loaded) as quantized, torch.no_grad():
        loaded(**BATCH, use_cache=True)
    assert quantized == {("model.encoder.layers.0.self_attn", "k"), ("model.encoder.layers.0.self_attn", "v"),
                         ("model.decoder.layers.0.self_attn", "k"), ("model.decoder.layers.0.self_attn", "v")}
