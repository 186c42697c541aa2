"""`qstats.calibrate_layerwise` against llm-compressor 0.14's ``oneshot(..., pipeline="sequential")`` with
``QuantizationModifier(targets="Linear", scheme="FP8", ignore=["lm_head"])`` (static input scales) on
tiny Llama and Mistral checkpoints, under eager attention, checkpoints compared tensor by tensor.

Given all-ones attention masks, the sequential pipeline calls Llama's layers with their causal mask
(qstats' default float propagation on the same batches is its checkpoint bit for bit) and
Mistral's without it: there qstats equals it given an additive 4-D mask of zeros (attention both
ways), and the first ``o_proj`` input scale of the causal model is another (docs/layerwise.md).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import qstats
from _shared import bit_equal, checkpoint_tensors, llm_compressor_oneshot

transformers = pytest.importorskip("transformers")
pytest.importorskip("llmcompressor")

TOKENS = 12


def _samples():
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(1, 128, (TOKENS,), generator=generator) for _ in range(2)]


def _modifier():
    from llmcompressor.modifiers.quantization import QuantizationModifier

    return QuantizationModifier(targets="Linear", scheme="FP8", ignore=["lm_head"])


@pytest.fixture(scope="module", params=["llama", "mistral"])
def oneshot(request, tmp_path_factory):
    """``(family, float checkpoint, oneshot's sequential checkpoint tensors)``."""
    family = request.param
    shape = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64)
    config = transformers.LlamaConfig(**shape) if family == "llama" else transformers.MistralConfig(**shape)
    root = tmp_path_factory.mktemp(family)
    saved, theirs = str(root / "float"), str(root / "theirs")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.manual_seed(0)
            transformers.AutoModelForCausalLM.from_config(config).save_pretrained(saved, max_shard_size="20KB")
            model = transformers.AutoModelForCausalLM.from_pretrained(saved).eval()
            llm_compressor_oneshot(model, _samples(), _modifier(), out=theirs, pipeline="sequential")
    finally:
        torch.set_num_threads(threads)
    return family, saved, checkpoint_tensors(theirs)


def _ours(saved: str, out: str, both_ways: bool) -> dict:
    config = transformers.AutoConfig.from_pretrained(saved)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.set_attn_implementation("eager")
    plan = qstats.Recipe.from_compressed_tensors(_modifier()).resolve(model)
    masks = [torch.zeros(1, 1, TOKENS, TOKENS) if both_ways else torch.ones(1, TOKENS, dtype=torch.long)
             for _ in _samples()]  # fmt: skip
    batches = [{"input_ids": sample[None], "attention_mask": mask} for sample, mask in zip(_samples(), masks)]
    states = qstats.calibrate_layerwise(model, saved, batches, plan, progress=False)
    qstats.export.compressed_tensors_layerwise(model, saved, qstats.compute_qparams_tree(states, plan), out, plan,
                                               progress=False)  # fmt: skip
    return checkpoint_tensors(out)


def test_sequential_pipeline_keeps_llamas_causal_mask_and_drops_mistrals(oneshot, tmp_path):
    family, saved, theirs = oneshot
    causal = _ours(saved, str(tmp_path / "causal"), both_ways=False)
    both_ways = _ours(saved, str(tmp_path / "both_ways"), both_ways=True)
    assert sorted(causal) == sorted(theirs) == sorted(both_ways)
    same = both_ways if family == "mistral" else causal
    assert not [name for name in theirs if not bit_equal(same[name], theirs[name])]
    other = causal if family == "mistral" else both_ways
    name = "model.layers.0.self_attn.o_proj.input_scale"
    assert not bit_equal(other[name], theirs[name])
