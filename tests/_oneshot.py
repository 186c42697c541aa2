"""Tiny random-weight models saved to disk (llm-compressor's ``oneshot`` reads its model from a folder),
token-id samples for them, llm-compressor 0.14's ``oneshot`` of a recipe over a Llama (its logits and
the tensors it saves) and qstats' calibration of the same model (its qparams and fake-quantized
logits). Shared by the tests that compare a recipe's scales and logits with oneshot's."""

from __future__ import annotations

import os
import warnings

import torch
from _shared import llm_compressor_oneshot, load_causal_lm

import qstats

LLAMA_FIELDS = dict(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False)  # fmt: skip


def random_llama(**overrides):
    """A ``LlamaForCausalLM`` of ``LLAMA_FIELDS`` (``overrides`` replace fields) with random weights
    drawn after ``torch.manual_seed(0)``."""
    import transformers

    config = transformers.LlamaConfig(**LLAMA_FIELDS | overrides)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def saved_random_model(tmp_path_factory, name: str, model_class, config) -> str:
    """``model_class(config)`` with random weights drawn after ``torch.manual_seed(0)``, saved to a new
    temporary folder named after ``name``; the folder as a str."""
    torch.manual_seed(0)
    path = str(tmp_path_factory.mktemp(name))
    model_class(config).save_pretrained(path)
    return path


def saved_llama(tmp_path_factory, name: str, **overrides) -> str:
    """`random_llama` saved to a new temporary folder named after ``name``; the folder as a str."""
    path = str(tmp_path_factory.mktemp(name))
    random_llama(**overrides).save_pretrained(path)
    return path


def token_samples(count: int, length: int = 12, seed: int = 1) -> list:
    """``count`` sequences of ``length`` token ids in [1, 64) from a generator seeded with ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 64, (length,), generator=generator) for _ in range(count)]


def load_eager(path):
    """`load_causal_lm` of ``path`` with transformers' eager attention."""
    model = load_causal_lm(path)
    model.set_attn_implementation("eager")
    return model


def oneshot_logits_and_tensors(path, samples, recipe, out) -> tuple:
    """``oneshot`` of the model saved at ``path`` (eager attention) with ``recipe`` over ``samples``:
    its logits on the first sample, then the tensors of the checkpoint it saves compressed to ``out``."""
    from safetensors.torch import load_file

    model = llm_compressor_oneshot(load_eager(path), samples, recipe)
    with torch.no_grad():
        logits = model(samples[0][None]).logits
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(str(out), save_compressed=True)
    return logits, load_file(os.path.join(out, "model.safetensors"))


def calibrated_qparams(model, samples, plan) -> dict:
    """``qstats.compute_qparams_tree`` of ``qstats.calibrate`` of ``model`` with ``plan`` over
    ``samples``, one a batch."""
    states = qstats.calibrate(model, [{"input_ids": s[None]} for s in samples], plan, progress=False)
    return qstats.compute_qparams_tree(states, plan)


def qparams_and_fake_quantized_logits(model, samples, plan) -> tuple:
    """`calibrated_qparams` and ``model``'s logits on the first sample under ``qstats.fake_quantized``."""
    qparams = calibrated_qparams(model, samples, plan)
    with torch.no_grad(), qstats.fake_quantized(model, qparams, plan):
        logits = model(samples[0][None]).logits
    return qparams, logits

