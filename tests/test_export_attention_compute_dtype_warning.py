"""q/k/v (attention) scales of a bfloat16 model calibrated with compressed-tensors specs computing in
float32: the export warns as it does for a Linear's (llm-compressor computes them in the model's dtype,
so its checkpoint differs); specs of the model's own dtype write llm-compressor's ``oneshot`` k/v scales,
quietly."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import qstats
from _shared import bit_equal, llm_compressor_oneshot, load_causal_lm

transformers = pytest.importorskip("transformers")
pytest.importorskip("llmcompressor")
from safetensors.torch import load_file  # noqa: E402

INT8 = dict(num_bits=8, type="int", symmetric=True, strategy="tensor", dynamic=False)
WARNING = "computing in another dtype than their module's"


def _modifier():
    from llmcompressor.modifiers.quantization import QuantizationModifier

    return QuantizationModifier(config_groups={}, kv_cache_scheme=INT8)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny random bfloat16 Llama on disk, its calibration samples and ``oneshot``'s kv-cache checkpoint."""
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=32, tie_word_embeddings=False)
    torch.manual_seed(0)
    path = str(tmp_path_factory.mktemp("bf16_llama"))
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    generator = torch.Generator().manual_seed(1)
    samples = [torch.randint(1, 64, (length,), generator=generator) for length in (12, 7)]
    theirs = str(tmp_path_factory.mktemp("theirs"))
    llm_compressor_oneshot(load_causal_lm(path), samples, _modifier(), theirs)
    return path, samples, load_file(os.path.join(theirs, "model.safetensors"))


@pytest.mark.parametrize("observed_dtype, warns", [(None, True), (torch.bfloat16, False)])
def test_float32_kv_scales_of_a_bfloat16_model_warn(saved, tmp_path, observed_dtype, warns):
    path, samples, theirs = saved
    model = load_causal_lm(path)
    model.set_attn_implementation("eager")  # as llm-compressor calibrates
    plan = qstats.Recipe.from_compressed_tensors(_modifier(), observed_dtype=observed_dtype).resolve(model)
    states = qstats.calibrate(model, [{"input_ids": s[None]} for s in samples], plan, progress=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qstats.export.compressed_tensors(model, qstats.compute_qparams_tree(states, plan), str(tmp_path), plan)
    messages = [str(c.message) for c in caught if WARNING in str(c.message)]
    assert bool(messages) == warns, messages
    if warns:
        assert "model.layers.0.self_attn/k" in messages[0] and "observed_dtype=" in messages[0]
    else:  # computed in the model's dtype: llm-compressor's k/v scales
        ours = load_file(str(tmp_path / "model.safetensors"))
        scales = [name for name in theirs if name.endswith(("k_scale", "v_scale"))]
        assert scales and all(bit_equal(ours[name], theirs[name]) for name in scales)
