"""Tied embeddings quantized alike (a recipe on ``Linear`` and ``Embedding``): llm-compressor 0.14's
save re-ties them (its ``_retie_embeddings``) and writes the input embeddings' tensors once with
``tie_word_embeddings`` true; the export writes the same checkpoint, in memory and layer by layer."""

import json
import os

import pytest
import torch
from _shared import bit_equal, checkpoint_tensors, llm_compressor_oneshot

import qstats

transformers = pytest.importorskip("transformers")
pytest.importorskip("llmcompressor")

TOKENS = 12


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    """A tiny random Llama whose lm_head is tied to its input embeddings, saved, and samples."""
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    path = str(tmp_path_factory.mktemp("tied_llama"))
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    generator = torch.Generator().manual_seed(1)
    return path, [torch.randint(1, 64, (TOKENS,), generator=generator) for _ in range(2)]


def _load(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path).eval()


def _config(folder):
    with open(os.path.join(folder, "config.json")) as file:
        return json.load(file)


def _llm_compressor(tied, scheme, out):
    from llmcompressor.modifiers.quantization import QuantizationModifier

    path, samples = tied
    modifier = QuantizationModifier(targets=["Linear", "Embedding"], scheme=scheme, ignore=[])
    llm_compressor_oneshot(_load(path), samples, modifier, out)


def _qstats(tied, scheme, out, layerwise=False):
    path, samples = tied
    recipe = qstats.Recipe.from_scheme(scheme, targets=["Linear", "Embedding"], ignore=[])
    model = _load(path)
    plan = recipe.resolve(model)
    batches = [{"input_ids": s[None]} for s in samples]
    qparams = qstats.compute_qparams_tree(qstats.calibrate(model, batches, plan, progress=False), plan)
    if not layerwise:
        return qstats.export.compressed_tensors(model, qparams, out, plan)
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(path)).eval()
    return qstats.export.compressed_tensors_layerwise(meta, path, qparams, out, recipe.resolve(meta), progress=False)


@pytest.mark.parametrize("scheme", ["W8A16", "W4A16"])
def test_embeddings_quantized_alike_are_written_once_and_tied_as_llm_compressor_writes_them(tied, tmp_path, scheme):
    """qstats wrote lm_head's packed codes and scales a second time and untied the config."""
    theirs, ours, streamed = (str(tmp_path / name) for name in ("llm_compressor", "qstats", "layerwise"))
    _llm_compressor(tied, scheme, theirs)
    _qstats(tied, scheme, ours)
    _qstats(tied, scheme, streamed, layerwise=True)
    their_tensors = checkpoint_tensors(theirs)
    assert not [name for name in their_tensors if name.startswith("lm_head.")]
    assert their_tensors["model.embed_tokens.weight_packed"].dtype == torch.int32
    for folder in (ours, streamed):
        our_tensors = checkpoint_tensors(folder)
        assert sorted(our_tensors) == sorted(their_tensors)
        assert not [name for name in their_tensors if not bit_equal(our_tensors[name], their_tensors[name])]
        assert _config(folder)["tie_word_embeddings"] is True is _config(theirs)["tie_word_embeddings"]


def test_embeddings_quantized_differently_stay_untied(tied, tmp_path):
    """lm_head quantized, the embeddings not (a recipe on ``Linear``): two tables, untied, as before
    and as llm-compressor writes them."""
    from llmcompressor.modifiers.quantization import QuantizationModifier

    theirs, ours = str(tmp_path / "llm_compressor"), str(tmp_path / "qstats")
    path, samples = tied
    llm_compressor_oneshot(_load(path), samples, QuantizationModifier(targets="Linear", scheme="W8A16", ignore=[]),
                           theirs)
    model = _load(path)
    plan = qstats.Recipe.from_scheme("W8A16", ignore=[]).resolve(model)
    qparams = qstats.compute_qparams_tree(
        qstats.calibrate(model, [{"input_ids": s[None]} for s in samples], plan, progress=False), plan)
    qstats.export.compressed_tensors(model, qparams, ours, plan)
    our_tensors, their_tensors = checkpoint_tensors(ours), checkpoint_tensors(theirs)
    assert "lm_head.weight_packed" in our_tensors and "model.embed_tokens.weight" in our_tensors
    assert sorted(our_tensors) == sorted(their_tensors)
    assert _config(ours)["tie_word_embeddings"] is False is _config(theirs)["tie_word_embeddings"]
    assert model.config.tie_word_embeddings is True  # the model itself is left alone
