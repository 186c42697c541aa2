"""`qstats.export.compressed_tensors_layerwise` refused after some shards are written leaves the file
system as `qstats.export.compressed_tensors` leaves it on a refusal: a folder it created is removed, a
folder that existed before is kept with its files."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import qstats

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=32, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    path = str(tmp_path_factory.mktemp("refusal_llama"))
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def _meta(path):
    config = transformers.AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config).eval()


def _export_refused_after_writing(checkpoint, out):
    """A weights= name the model lacks: refused once every layer's shard is written."""
    model = _meta(checkpoint)
    plan = qstats.Recipe.from_scheme("W8A8", ignore=["lm_head"]).resolve(model)
    with warnings.catch_warnings(), pytest.raises(ValueError, match="name no tensor"):
        warnings.simplefilter("ignore", qstats.UncalibratedWarning)  # no qparams: written unquantized
        qstats.export.compressed_tensors_layerwise(model, checkpoint, {}, str(out), plan, progress=False,
                                                   weights={"model.no_such.weight": torch.zeros(2)})


def test_a_refused_export_leaves_no_folder_it_created(llama, tmp_path):
    out = tmp_path / "new" / "out"
    os.makedirs(out.parent)
    _export_refused_after_writing(llama, out)
    assert not out.exists() and out.parent.is_dir()


def test_a_refused_export_keeps_a_folder_that_existed(llama, tmp_path):
    empty, kept = tmp_path / "empty", tmp_path / "kept"
    os.makedirs(empty)
    os.makedirs(kept)
    (kept / "README.md").write_text("mine")
    for out in (empty, kept):
        _export_refused_after_writing(llama, out)
    assert empty.is_dir() and os.listdir(empty) == []
    assert os.listdir(kept) == ["README.md"] and (kept / "README.md").read_text() == "mine"


def test_a_refusal_before_writing_creates_no_folder_in_memory_or_layer_by_layer(llama, tmp_path):
    """The same bad max_shard_size, refused by both exports before they write."""
    loaded = transformers.AutoModelForCausalLM.from_pretrained(llama)
    recipe = qstats.Recipe.from_scheme("W8A8", ignore=["lm_head"])
    whole, streamed = tmp_path / "whole", tmp_path / "streamed"
    with pytest.raises(ValueError, match="max_shard_size"):
        qstats.export.compressed_tensors(loaded, {}, str(whole), recipe.resolve(loaded), max_shard_size="5XB")
    model = _meta(llama)
    with pytest.raises(ValueError, match="max_shard_size"):
        qstats.export.compressed_tensors_layerwise(model, llama, {}, str(streamed), recipe.resolve(model),
                                                   max_shard_size="5XB", progress=False)
    assert not whole.exists() and not streamed.exists()
