"""A quantized ``lm_head`` (outside the decoder layers) under `qstats.gptq_layerwise` and under
llm-compressor 0.14's sequential ``oneshot`` with a ``GPTQModifier`` that does not ignore it
(docs/gptq.md): both GPTQ it last, its Hessian from the last layer's outputs (its float weights,
its inputs from the GPTQ'd layers before it) through the final norm. llm-compressor unties a
tied ``lm_head``, GPTQs it alone and saves the embeddings float with ``tie_word_embeddings`` false;
so do `gptq_layerwise` and the exports of its weights."""

from __future__ import annotations

import json
import os

import pytest
import torch

import qstats
from _packed import packed_codes
from _shared import llm_compressor_oneshot

transformers = pytest.importorskip("transformers")
pytest.importorskip("llmcompressor")
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
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(path)).eval()
    # llm-compressor calibrates under eager attention; under sdpa the codes past the first layer equal its own
    # only on some thread counts (2 threads here; one thread: 24 of 32768 codes of the last down_proj differ)
    model.set_attn_implementation("eager")
    return model


def _theirs(path, samples, out, ignore=()):
    from llmcompressor.modifiers.gptq import GPTQModifier

    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    recipe = GPTQModifier(targets="Linear", scheme="W4A16", ignore=list(ignore))
    llm_compressor_oneshot(model, samples, recipe, out, "sequential")
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
        assert torch.equal(ours.to(torch.int8), packed_codes(theirs, name)), name
    nearest = qstats.quantize(head, qparams["lm_head"]["weight"], spec).to(torch.int8)
    assert (packed_codes(theirs, "lm_head") != nearest).float().mean() > 0.05  # GPTQ, not round-to-nearest


def _saved(folder) -> tuple:
    """``({name: tensor}, config)`` of a saved checkpoint, its shards merged."""
    tensors: dict = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(folder, name)))
    with open(os.path.join(folder, "config.json")) as file:
        return tensors, json.load(file)


def _assert_same_checkpoint(ours: str, theirs: str) -> None:
    (mine, my_config), (reference, config) = _saved(ours), _saved(theirs)
    assert sorted(mine) == sorted(reference)
    assert not [name for name in reference if mine[name].dtype != reference[name].dtype
                or not torch.equal(mine[name], reference[name])]  # fmt: skip
    assert my_config == config


@pytest.mark.parametrize("export", ["layerwise", "layerwise from weights_dir", "in memory"])
def test_a_tied_lm_head_is_gptqd_alone_and_saved_untied_as_llm_compressor_sequential_oneshot(tmp_path, export):
    """The tied model's checkpoint equals llm-compressor's bit for bit (tensors and config): the GPTQ'd
    lm_head under its own name, the embeddings float, ``tie_word_embeddings`` false; exported layer by
    layer from the meta model (the weights a dict or a folder), or in memory from the loaded model given
    the weights with ``assign=True`` (the lm_head's parameter replaced alone). The GPTQ'd lm_head was
    refused, naming the tie."""
    path, samples = _llama(tmp_path / "llama", tied=True), _samples()
    _theirs(path, samples, str(tmp_path / "theirs"))
    recipe = qstats.Recipe.from_scheme("W4A16")
    meta = _meta(path)
    assert meta.lm_head.weight is meta.model.embed_tokens.weight
    folder = str(tmp_path / "gptq") if export == "layerwise from weights_dir" else None
    result = qstats.gptq_layerwise(meta, path, _batches(samples), recipe, progress=False, weights_dir=folder)
    assert meta.lm_head.weight is meta.model.embed_tokens.weight and meta.lm_head.weight.device.type == "meta"
    if folder is None:
        names = set(result.weights)
    else:
        with open(os.path.join(folder, "model.safetensors.index.json")) as file:
            names = set(json.load(file)["weight_map"])
    assert len(names) == 15 and "lm_head.weight" in names and "model.embed_tokens.weight" not in names
    ours = str(tmp_path / "ours")
    if export.startswith("layerwise"):
        plan = recipe.resolve(meta)
        qparams = qstats.compute_qparams_tree(result.states, plan)
        qstats.export.compressed_tensors_layerwise(meta, path, qparams, ours, plan, weights=result.weights,
                                                   progress=False, actorder="static")  # fmt: skip
        assert meta.lm_head.weight is meta.model.embed_tokens.weight  # tied again, on meta
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
        model.load_state_dict(result.weights, strict=False, assign=True)
        assert model.lm_head.weight is not model.model.embed_tokens.weight
        plan = recipe.resolve(model)
        qstats.export.compressed_tensors(model, qstats.compute_qparams_tree(result.states, plan), ours, plan,
                                         actorder="static")  # fmt: skip
    _assert_same_checkpoint(ours, str(tmp_path / "theirs"))
    assert _saved(ours)[1]["tie_word_embeddings"] is False


def test_a_tied_lm_head_ignored_stays_tied_as_llm_compressor_saves_it(tmp_path):
    """With ``lm_head`` ignored, the float head tied to the embeddings is written once and the config
    stays tied, as llm-compressor's checkpoint (bit for bit)."""
    path, samples = _llama(tmp_path / "llama", tied=True), _samples()
    _theirs(path, samples, str(tmp_path / "theirs"), ignore=["lm_head"])
    recipe = qstats.Recipe.from_scheme("W4A16", ignore=["lm_head"])
    meta = _meta(path)
    result = qstats.gptq_layerwise(meta, path, _batches(samples), recipe, progress=False)
    assert len(result.weights) == 14 and "lm_head.weight" not in result.weights
    plan = recipe.resolve(meta)
    ours = str(tmp_path / "ours")
    qstats.export.compressed_tensors_layerwise(meta, path, qstats.compute_qparams_tree(result.states, plan), ours,
                                               plan, weights=result.weights, progress=False, actorder="static")
    _assert_same_checkpoint(ours, str(tmp_path / "theirs"))
    assert _saved(ours)[1]["tie_word_embeddings"] is True and "lm_head.weight" not in _saved(ours)[0]


def test_a_weight_tied_to_another_than_the_input_embeddings_is_refused_naming_the_tie(tmp_path):
    """llm-compressor unties an lm_head from the input embeddings only; a Linear tied to another
    Linear would be GPTQ'd under one name and float under the other."""
    path = _llama(tmp_path / "llama", tied=False)
    meta = _meta(path)
    meta.extra_head = torch.nn.Linear(128, 64, bias=False, device="meta")
    meta.extra_head.weight = meta.lm_head.weight
    with pytest.raises(ValueError, match=r"lm_head.weight is tied to extra_head.weight.*does not untie"):
        qstats.gptq_layerwise(meta, path, _batches(_samples()), qstats.Recipe.from_scheme("W4A16"), progress=False)
