"""Gemma 4's KV-shared layers attend over the key and value an earlier layer handed its cache update,
which compressed-tensors' kv cache quantizes there: with a cache, `qstats.fake_quantized` quantizes the
k/v sites at that update too, so the shared layers see the quantized key and value, and its logits equal
those of the model under compressed-tensors' kv-cache scheme with the exported scales."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

import qstats

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")
if not hasattr(transformers, "Gemma4TextConfig"):
    pytest.skip("transformers without Gemma 4", allow_module_level=True)

INT8 = dict(num_bits=8, type="int", symmetric=True, strategy="tensor", dynamic=False)


def _model():
    config = transformers.Gemma4TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, global_head_dim=16, max_position_embeddings=64, num_kv_shared_layers=2,
        layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=8, hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=64)
    torch.manual_seed(0)
    model = transformers.Gemma4ForCausalLM(config).eval()
    model.set_attn_implementation("eager")
    return model


def test_kv_shared_layers_see_the_key_and_value_quantized_at_the_cache_update(tmp_path):
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from safetensors.torch import load_file

    model = _model()
    assert [layer.self_attn.is_kv_shared_layer for layer in model.model.layers] == [False, False, True, True]
    plan = qstats.Recipe.from_compressed_tensors({"config_groups": {}, "kv_cache_scheme": INT8}).resolve(model)
    ids = torch.randint(1, 64, (1, 10), generator=torch.Generator().manual_seed(1))
    qparams = qstats.compute_qparams_tree(qstats.calibrate(model, [ids], plan, progress=False), plan)
    qstats.export.compressed_tensors(model, qparams, str(tmp_path), plan)
    with open(os.path.join(tmp_path, "config.json")) as file:
        config = QuantizationConfig.model_validate(json.load(file)["quantization_config"])
    theirs = copy.deepcopy(model)
    apply_quantization_config(theirs, config)
    scales = {name: t for name, t in load_file(os.path.join(tmp_path, "model.safetensors")).items()
              if name.endswith("_scale")}
    assert not theirs.load_state_dict(scales, strict=False).unexpected_keys
    with torch.no_grad():
        float_logits = model(ids, use_cache=True).logits
        with qstats.fake_quantized(model, qparams, plan):
            ours = model(ids, use_cache=True).logits
        reference = theirs(ids, use_cache=True).logits
    assert not torch.equal(ours, float_logits)
    assert torch.equal(ours, reference), (ours - reference).abs().max()
