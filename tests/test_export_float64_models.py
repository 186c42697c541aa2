"""The export of a float64 model: llm-compressor 0.14's ``oneshot`` computes its qparams in float64,
qstats' compressed-tensors specs in float32 at most, so the two checkpoints differ; the export says
so with a warning, and its own tensors stay self-consistent (codes quantized with the scales written)."""

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

VOCAB = 64


def _llama(path, dtype):
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).to(dtype).save_pretrained(path)


def _export(base, samples, out):
    """qstats' W8A8 export of the checkpoint ``base``: ``(model, plan, qparams, export warnings)``."""
    model = load_causal_lm(base)
    model.set_attn_implementation("eager")  # as llm-compressor calibrates
    plan = qstats.Recipe.from_scheme("W8A8", ignore=["lm_head"]).resolve(model)
    states = qstats.calibrate(model, [{"input_ids": s[None]} for s in samples], plan, progress=False)
    qparams = qstats.compute_qparams_tree(states, plan)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qstats.export.compressed_tensors(model, qparams, out, plan)
    return model, plan, qparams, [str(warning.message) for warning in caught]


def test_a_float64_export_warns_that_llm_compressor_computes_in_float64(tmp_path):
    from llmcompressor.modifiers.quantization import QuantizationModifier

    generator = torch.Generator().manual_seed(1)
    samples = [torch.randint(1, VOCAB, (12,), generator=generator) for _ in range(2)]
    base, theirs, ours = (str(tmp_path / name) for name in ("base", "theirs", "ours"))
    _llama(base, torch.float64)
    llm_compressor_oneshot(load_causal_lm(base), samples, QuantizationModifier(targets="Linear", scheme="W8A8",
                                                                      ignore=["lm_head"]), theirs)
    model, plan, qparams, messages = _export(base, samples, ours)
    assert [message for message in messages if "float64 model" in message]

    # the reason: oneshot's float64 scales and codes differ from ours, computed in float32
    our_tensors = load_file(os.path.join(ours, "model.safetensors"))
    their_tensors = load_file(os.path.join(theirs, "model.safetensors"))
    assert sorted(our_tensors) == sorted(their_tensors)
    differing = [name for name in their_tensors if not bit_equal(our_tensors[name], their_tensors[name])]
    assert any(name.endswith(".weight_scale") for name in differing)
    # ours is self-consistent: every code is the weight quantized with the float64 scale written
    specs = plan.specs(qparams)
    for path, sites in qparams.items():
        scale = our_tensors[f"{path}.weight_scale"]
        assert scale.dtype == torch.float64
        qp = sites["weight"]._replace(scale=scale.reshape(-1).float())
        codes = qstats.quantize(model.get_submodule(path).weight.detach(), qp, specs[path]["weight"])
        assert torch.equal(our_tensors[f"{path}.weight"], codes.to(torch.int8)), path


def test_a_float32_export_does_not_warn_about_float64(tmp_path):
    generator = torch.Generator().manual_seed(1)
    samples = [torch.randint(1, VOCAB, (12,), generator=generator) for _ in range(2)]
    base = str(tmp_path / "base")
    _llama(base, torch.float32)
    _, _, _, messages = _export(base, samples, str(tmp_path / "ours"))
    assert not [message for message in messages if "float64" in message]
