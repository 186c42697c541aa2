"""A float32 model (a bfloat16 checkpoint loaded with ``dtype=torch.float32``, as on a CPU) exported
from a recipe built with ``observed_dtype=torch.bfloat16``: llm-compressor 0.14's ``oneshot`` of the
same float32 model computes the qparams in float32, so the checkpoint differs from its, and the export
says so, as it does for a half-precision model calibrated with float32 specs. The recipe of the
model's own dtype writes ``oneshot``'s checkpoint, quietly."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import qstats
from _shared import bit_equal, llm_compressor_oneshot

transformers = pytest.importorskip("transformers")
pytest.importorskip("llmcompressor")
from safetensors.torch import load_file  # noqa: E402


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny random bfloat16 Llama saved to disk, loaded back in float32, and W8A8 checkpoints of it."""
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    path = str(tmp_path_factory.mktemp("bf16_llama"))
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    generator = torch.Generator().manual_seed(1)
    samples = [torch.randint(1, 64, (12,), generator=generator) for _ in range(2)]
    from llmcompressor.modifiers.quantization import QuantizationModifier

    theirs = str(tmp_path_factory.mktemp("theirs"))
    llm_compressor_oneshot(_load(path), samples, QuantizationModifier(targets="Linear", scheme="W8A8",
                                                                       ignore=["lm_head"]), theirs)
    return path, samples, load_file(os.path.join(theirs, "model.safetensors"))


def _load(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("observed_dtype, warns", [(torch.bfloat16, True), (torch.float32, False), (None, False)])
def test_float32_model_with_bfloat16_specs_warns_and_differs_from_oneshot(saved, tmp_path, observed_dtype, warns):
    path, samples, theirs = saved
    model = _load(path)
    model.set_attn_implementation("eager")  # as llm-compressor calibrates
    plan = qstats.Recipe.from_scheme("W8A8", ignore=["lm_head"], observed_dtype=observed_dtype).resolve(model)
    states = qstats.calibrate(model, [{"input_ids": s[None]} for s in samples], plan, progress=False)
    qparams = qstats.compute_qparams_tree(states, plan)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qstats.export.compressed_tensors(model, qparams, str(tmp_path / "ours"), plan)
    messages = [str(c.message) for c in caught if "observed_dtype" in str(c.message)]
    assert bool(messages) == warns, messages
    if warns:
        assert "model.layers.0.self_attn.q_proj/weight" in messages[0]
    ours = load_file(str(tmp_path / "ours" / "model.safetensors"))
    assert sorted(ours) == sorted(theirs)
    differing = [name for name in theirs if not bit_equal(ours[name], theirs[name])]
    assert bool(differing) == warns, differing
