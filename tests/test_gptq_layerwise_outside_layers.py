"""A quantized ``lm_head`` (outside the decoder layers) under `qstats.gptq_layerwise` and under
llm-compressor 0.14's sequential ``oneshot`` with a ``GPTQModifier`` that does not ignore it
(docs/gptq.md): both GPTQ it last, its Hessian from the last layer's outputs (its float weights,
its inputs from the GPTQ'd layers before it) through the final norm. llm-compressor unties a
tied ``lm_head`` and GPTQs it alone; `gptq_layerwise` refuses a tied one and gives the same codes
from the checkpoint saved untied."""

from __future__ import annotations

import pytest
import torch

import qstats
from _shared import llm_compressor_oneshot

transformers = pytest.importorskip("transformers")
pytest.importorskip("llmcompressor")
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

TOKENS = 16


def _llama(folder, tied: bool) -> str:
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=tied)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(str(folder))
    return str(folder)


def _samples() -> list:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(1, 64, (TOKENS,), generator=generator) for _ in range(4)]


def _batches(samples) -> list:
    return [{"input_ids": s[None], "attention_mask": torch.ones(1, TOKENS, dtype=torch.long)} for s in samples]


def _meta(path):
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(path)).eval()


def _codes(tensors, name):
    shape = tuple(tensors[f"{name}.weight_shape"].tolist())
    return unpack_from_int32(tensors[f"{name}.weight_packed"], 4, shape)


def _theirs(path, samples, out):
    from llmcompressor.modifiers.gptq import GPTQModifier

    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    llm_compressor_oneshot(model, samples, GPTQModifier(targets="Linear", scheme="W4A16", ignore=[]), out, "sequential")
    return load_file(f"{out}/model.safetensors")


@pytest.mark.parametrize("tied", [False, True])
def test_the_lm_head_is_gptqd_as_llm_compressor_sequential_oneshot_does(tmp_path, tied):
    """Every lm_head scale and code and every first-layer code equal llm-compressor's; the tied
    model's from its checkpoint saved untied (llm-compressor keeps its embeddings float)."""
    path, samples = _llama(tmp_path / "llama", tied), _samples()
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    embeddings, head = model.model.embed_tokens.weight.detach().clone(), model.lm_head.weight.detach().clone()
    theirs = _theirs(path, samples, str(tmp_path / "theirs"))
    assert torch.equal(theirs["model.embed_tokens.weight"], embeddings)
    if tied:
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(head.clone())
        model.save_pretrained(str(tmp_path / "untied"))
        path = str(tmp_path / "untied")

    recipe = qstats.Recipe.from_scheme("W4A16")
    meta = _meta(path)
    assert meta.lm_head.weight is not meta.model.embed_tokens.weight
    result = qstats.gptq_layerwise(meta, path, _batches(samples), recipe, progress=False)
    plan = recipe.resolve(meta)
    qparams = qstats.compute_qparams_tree(result.states, plan)
    spec = plan.site("lm_head", "weight").spec
    assert torch.equal(qparams["lm_head"]["weight"].scale, theirs["lm_head.weight_scale"])
    names = ["lm_head"] + [n[: -len(".weight_packed")] for n in theirs if n.startswith("model.layers.0.")
                           and n.endswith(".weight_packed")]  # fmt: skip
    assert len(names) == 8
    for name in names:
        weight = result.weights[f"{name}.weight"]
        ours = qstats.quantize(weight, qparams[name]["weight"], spec)
        assert torch.equal(qstats.dequantize(ours, qparams[name]["weight"], spec), weight), name  # on the grid
        assert torch.equal(ours.to(torch.int8), _codes(theirs, name)), name
    nearest = qstats.quantize(head, qparams["lm_head"]["weight"], spec).to(torch.int8)
    assert (_codes(theirs, "lm_head") != nearest).float().mean() > 0.05  # GPTQ, not round-to-nearest


def test_a_tied_lm_head_is_refused_naming_the_tie(tmp_path):
    path = _llama(tmp_path / "llama", tied=True)
    meta = _meta(path)
    assert meta.lm_head.weight is meta.model.embed_tokens.weight
    with pytest.raises(ValueError, match=r"lm_head.weight is tied to model.embed_tokens.weight.*untied"):
        qstats.gptq_layerwise(meta, path, _batches(_samples()), qstats.Recipe.from_scheme("W4A16"), progress=False)
    ignored = qstats.Recipe.from_scheme("W4A16", ignore=["lm_head"])
    result = qstats.gptq_layerwise(meta, path, _batches(_samples()), ignored, progress=False)
    assert len(result.weights) == 14 and "lm_head.weight" not in result.weights
