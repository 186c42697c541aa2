"""The shard index (``model.safetensors.index.json``) of a sharded export holds the ``metadata`` that
transformers 5's ``save_pretrained`` writes into it (``total_parameters``: its ``num_parameters`` of the
model saved; ``total_size``: the tensors' bytes), compared with llm-compressor's ``oneshot`` save of the
same model and scheme (whose compressed model's parameters are the checkpoint's tensors, packed int4
codes counted as the int32 elements written) and with ``save_pretrained`` of the float model."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

import qstats
from _shared import llm_compressor_oneshot

transformers = pytest.importorskip("transformers")
pytest.importorskip("llmcompressor")

SHARD = "40KB"


def _index(folder) -> dict:
    with open(os.path.join(folder, "model.safetensors.index.json")) as file:
        return json.load(file)


def _saved(folder) -> str:
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(str(folder))
    return str(folder)


@pytest.mark.parametrize("scheme", ["W4A16", "W8A8"])
def test_the_index_metadata_is_oneshots_save(tmp_path, scheme, single_thread_quiet):
    from llmcompressor.modifiers.quantization import QuantizationModifier

    source = _saved(tmp_path / "source")
    samples = [torch.randint(0, 64, (8,), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    reference = transformers.AutoModelForCausalLM.from_pretrained(source).eval()
    llm_compressor_oneshot(reference, samples, QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"]))
    reference.save_pretrained(str(tmp_path / "oneshot"), save_compressed=True, max_shard_size=SHARD)

    model = transformers.AutoModelForCausalLM.from_pretrained(source).eval()
    recipe = qstats.Recipe.from_scheme(scheme, ignore=["lm_head"], observed_dtype=torch.float32)
    batches = [{"input_ids": sample[None]} for sample in samples]
    qparams = qstats.compute_qparams_tree(qstats.calibrate(model, batches, recipe, progress=False), recipe, model)
    qstats.export.compressed_tensors(model, qparams, str(tmp_path / "ours"), recipe, max_shard_size=SHARD)

    ours, theirs = _index(tmp_path / "ours"), _index(tmp_path / "oneshot")
    assert len(set(theirs["weight_map"].values())) > 1  # sharded
    assert ours["metadata"] == theirs["metadata"]
    assert set(theirs["metadata"]) == {"total_parameters", "total_size"}


def test_the_index_metadata_of_a_float_export_is_save_pretrained(tmp_path):
    """A recipe that quantizes nothing writes the float model: its index is ``save_pretrained``'s."""
    model = transformers.AutoModelForCausalLM.from_pretrained(_saved(tmp_path / "source")).eval()
    model.save_pretrained(str(tmp_path / "saved"), max_shard_size=SHARD)
    recipe = qstats.Recipe.from_scheme("W8A8", targets=["Conv1d"])  # no such module
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qstats.export.compressed_tensors(model, {}, str(tmp_path / "ours"), recipe, max_shard_size=SHARD)
    ours, theirs = _index(tmp_path / "ours"), _index(tmp_path / "saved")
    assert ours["metadata"] == theirs["metadata"] and ours["metadata"]["total_parameters"] == model.num_parameters()
    assert ours["weight_map"].keys() == theirs["weight_map"].keys()


class _Shared(torch.nn.Module):
    """A module under two paths (``self.b = self.a``: written under both, one parameter set) and a
    BatchNorm's persistent buffers (written, no parameters)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(32, 32)
        self.b = self.a
        self.norm = torch.nn.BatchNorm1d(32)
        self.c = torch.nn.Linear(32, 16)

    def forward(self, x):
        return self.c(self.norm(self.b(self.a(x))))


def test_total_parameters_is_the_compressed_models_parameter_count(tmp_path):
    """The reference: compressed-tensors' ``compress_model`` of the model with our scales, whose
    parameters (each once, as ``num_parameters`` counts them) are what ``oneshot``'s save counts."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, apply_quantization_config

    torch.manual_seed(0)
    model = _Shared().eval()
    spec = qstats.QuantSpec.from_compressed_tensors(
        QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=16))
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("weight",), spec=spec)])
    qparams = qstats.compute_qparams_tree(qstats.calibrate(model, [], recipe, progress=False), recipe, model)
    written = qstats.export.compressed_tensors(model, qparams, str(tmp_path), recipe, max_shard_size=600)
    reference = _Shared().eval()
    reference.load_state_dict(model.state_dict())
    config = QuantizationConfig.model_validate(written)
    apply_quantization_config(reference, config)
    ModelCompressor(quantization_config=config).compress_model(reference)
    index = _index(tmp_path)
    assert len(set(index["weight_map"].values())) > 1
    assert sorted(index["weight_map"]) == sorted(reference.state_dict())
    assert index["metadata"]["total_parameters"] == sum(p.numel() for p in reference.parameters())
