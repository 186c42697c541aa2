"""A quantized ``lm_head`` (outside the decoder layers) under `qstats.gptq_layerwise` and under
llm-compressor 0.14's sequential ``oneshot`` with a ``GPTQModifier`` that does not ignore it
(docs/gptq.md): llm-compressor GPTQs it in its last subgraph; qstats rounds it to nearest and
names it in a warning."""

from __future__ import annotations

import warnings

import pytest
import torch

import qstats
from _shared import llm_compressor_oneshot

transformers = pytest.importorskip("transformers")
pytest.importorskip("llmcompressor")
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

TOKENS = 16


def test_llm_compressor_gptqs_the_lm_head_and_gptq_layerwise_rounds_it(tmp_path):
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    path = str(tmp_path / "llama")
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    generator = torch.Generator().manual_seed(1)
    samples = [torch.randint(1, 64, (TOKENS,), generator=generator) for _ in range(4)]
    from llmcompressor.modifiers.gptq import GPTQModifier

    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    head = model.lm_head.weight.detach().clone()
    llm_compressor_oneshot(model, samples, GPTQModifier(targets="Linear", scheme="W4A16", ignore=[]),
                           str(tmp_path / "theirs"), "sequential")
    theirs = load_file(str(tmp_path / "theirs" / "model.safetensors"))
    recipe = qstats.Recipe.from_scheme("W4A16")
    spec = recipe.rules[0].spec
    observer = qstats.minmax(spec)
    nearest = qstats.quantize(head, qstats.compute_qparams(observer.update(observer.init(head), head), spec), spec)
    shape = tuple(theirs["lm_head.weight_shape"].tolist())
    gptq_codes = unpack_from_int32(theirs["lm_head.weight_packed"], 4, shape)
    assert (gptq_codes != nearest).float().mean() > 0.05  # llm-compressor's lm_head is GPTQ'd

    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config).eval()
    batches = [{"input_ids": s[None], "attention_mask": torch.ones(1, TOKENS, dtype=torch.long)} for s in samples]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = qstats.gptq_layerwise(meta, path, batches, recipe, progress=False)
    named = [str(w.message) for w in caught if issubclass(w.category, qstats.UncalibratedWarning)]
    assert any("lm_head.weight" in message and "llm-compressor's oneshot GPTQs them" in message for message in named)
    assert "lm_head.weight" not in result.weights  # the export rounds it to nearest
