"""Edges of `qstats.export.compressed_tensors` a migrating user meets: a model built in memory (or
converted to another dtype after loading) exported as transformers' own ``save_pretrained`` writes
it (``architectures``, ``dtype``, ``generation_config.json``), and an output path that is a file."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

import qstats

transformers = pytest.importorskip("transformers")


def _llama(**overrides):
    fields = dict(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False)
    config = transformers.LlamaConfig(**{**fields, **overrides})
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def _export(model, folder, dtype=None, **options):
    recipe = qstats.Recipe.from_scheme("W8A16", ignore=["lm_head"], observed_dtype=dtype)
    plan = recipe.resolve(model)
    states = qstats.calibrate(model, [{"input_ids": torch.randint(1, 64, (1, 8))}], plan, progress=False)
    qparams = qstats.compute_qparams_tree(states, plan)
    return qstats.export.compressed_tensors(model, qparams, str(folder), plan, **options)


def _json(folder, name):
    with open(os.path.join(folder, name)) as file:
        content = json.load(file)
    content.pop("transformers_version", None)
    return content


def test_a_model_built_in_memory_writes_the_config_and_generation_config_save_pretrained_writes(tmp_path):
    # a model built from its config (no config.json read) and cast to bfloat16: save_pretrained writes
    # "architectures" (vLLM picks the model's implementation by it and refuses a config without it) and
    # the parameters' "dtype", and generation_config.json (default sampling settings, stop tokens)
    model = _llama().to(torch.bfloat16)
    model.generation_config.eos_token_id = [2, 7]
    model.generation_config.temperature, model.generation_config.do_sample = 0.6, True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        written = _export(model, tmp_path / "ours", dtype=torch.bfloat16)
        model.save_pretrained(str(tmp_path / "float"))
    ours, reference = _json(tmp_path / "ours", "config.json"), _json(tmp_path / "float", "config.json")
    assert ours.pop("quantization_config") == written
    assert ours == reference
    assert reference["architectures"] == ["LlamaForCausalLM"] and reference["dtype"] == "bfloat16"
    assert _json(tmp_path / "ours", "generation_config.json") == _json(tmp_path / "float", "generation_config.json")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "ours"), dtype="auto")
    assert loaded.dtype == torch.bfloat16
    assert loaded.generation_config.eos_token_id == [2, 7] and loaded.generation_config.temperature == 0.6


def test_a_model_that_does_not_generate_writes_no_generation_config(tmp_path):
    model = transformers.LlamaModel(_llama().config).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _export(model, tmp_path / "ours")
        model.save_pretrained(str(tmp_path / "float"))
    assert sorted(os.listdir(tmp_path / "ours")) == ["config.json", "model.safetensors"]
    assert "generation_config.json" not in os.listdir(tmp_path / "float")
    ours = _json(tmp_path / "ours", "config.json")
    ours.pop("quantization_config")
    assert ours == _json(tmp_path / "float", "config.json")


def test_a_plain_module_gets_no_transformers_fields(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32)).eval()
    recipe = qstats.Recipe.from_scheme("W8A8")
    states = qstats.calibrate(model, [torch.randn(4, 32)], recipe, progress=False)
    written = qstats.export.compressed_tensors(model, qstats.compute_qparams_tree(states, recipe, model),
                                               str(tmp_path), recipe)
    assert _json(tmp_path, "config.json") == {"quantization_config": written}
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]


def test_an_output_path_that_is_a_file_is_refused_by_name(tmp_path):
    # it was a bare FileExistsError from os.makedirs; the file is left as it was
    target = tmp_path / "checkpoint"
    target.write_text("not a folder")
    with pytest.raises(ValueError, match="is a file"):
        _export(_llama(), target)
    assert target.read_text() == "not a folder"


def _tensors(folder) -> dict:
    from safetensors.torch import load_file

    tensors = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(folder, name)))
    return tensors


def _nbytes(tensors) -> int:
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors)


def test_max_shard_size_splits_the_checkpoint_as_save_pretrained_splits_it(tmp_path):
    from _shared import bit_equal

    model = _llama(num_hidden_layers=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        whole = _export(model, tmp_path / "whole")
        sharded = _export(model, tmp_path / "sharded", max_shard_size="100KB")
    assert sharded == whole
    ours, reference = _tensors(tmp_path / "sharded"), _tensors(tmp_path / "whole")
    assert sorted(ours) == sorted(reference) and all(bit_equal(ours[name], reference[name]) for name in ours)

    # shards of at most 100 kB (save_pretrained's units: powers of 1000; a larger tensor alone) named as
    # save_pretrained names them, and the index transformers follows
    index = _json(tmp_path / "sharded", "model.safetensors.index.json")
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)]
    assert len(files) > 1 and files == sorted(name for name in os.listdir(tmp_path / "sharded")
                                              if name.endswith(".safetensors"))
    assert sorted(index["weight_map"]) == sorted(ours)
    for file in files:
        shard = [ours[name] for name, where in index["weight_map"].items() if where == file]
        assert len(shard) == 1 or _nbytes(shard) <= 100_000
    assert index["metadata"]["total_size"] == _nbytes(ours.values())

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "sharded")).eval()
        whole_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "whole")).eval()
    batch = torch.randint(1, 64, (1, 8))
    with torch.no_grad():
        assert bit_equal(loaded(batch).logits, whole_model(batch).logits)


@pytest.mark.parametrize("size", [0, -5, "5 GiB", "GB", True, 1.5, "infGB", "1e400KB", "nanMB"])
def test_a_bad_max_shard_size_is_refused_before_anything_is_written(tmp_path, size):
    with pytest.raises(ValueError, match="max_shard_size"):
        _export(_llama(), tmp_path / "out", max_shard_size=size)
    assert not (tmp_path / "out").exists()


def test_a_model_on_the_meta_device_is_refused_by_name(tmp_path):
    # it was a bare RuntimeError from deep inside torch (Tensor.item() on meta tensors)
    model = _llama()
    recipe = qstats.Recipe.from_scheme("W8A16", ignore=["lm_head"])
    plan = recipe.resolve(model)
    states = qstats.calibrate(model, [{"input_ids": torch.randint(1, 64, (1, 8))}], plan, progress=False)
    qparams = qstats.compute_qparams_tree(states, plan)
    with pytest.raises(ValueError, match="meta device.*compressed_tensors_layerwise"):
        qstats.export.compressed_tensors(model.to("meta"), qparams, str(tmp_path / "out"), recipe)
    assert not (tmp_path / "out").exists()


def test_a_generation_config_transformers_refuses_to_save_is_left_out_with_a_warning(tmp_path):
    # save_pretrained refuses temperature without do_sample (strict validation): the export, whose tensors
    # are written by then, leaves that file out and says why instead of failing with a half-written folder
    model = _llama()
    model.generation_config.temperature, model.generation_config.do_sample = 0.6, False
    with pytest.raises(ValueError):
        model.generation_config.save_pretrained(str(tmp_path / "reference"))
    with pytest.warns(UserWarning, match="generation_config.json was not written.*temperature"):
        _export(model, tmp_path / "ours")
    assert sorted(os.listdir(tmp_path / "ours")) == ["config.json", "model.safetensors"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "ours")) is not None
