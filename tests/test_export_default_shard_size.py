"""`qstats.export.compressed_tensors` shards by default as ``save_pretrained`` does.

transformers' ``save_pretrained`` (and so llm-compressor's ``oneshot`` save) splits a checkpoint
into shards of at most ``"50GB"`` unless told otherwise: the Hugging Face Hub takes no larger file.
The export's default is the same size, read as huggingface_hub reads it: a model under it is one
``model.safetensors`` with no index, as ``save_pretrained`` writes it; ``max_shard_size=None`` keeps
one file whatever the size.
"""

from __future__ import annotations

import inspect
import os
import warnings

import pytest
import torch

import qstats
from qstats.export.checkpoint import shard_bytes

transformers = pytest.importorskip("transformers")
from huggingface_hub.serialization._base import parse_size_to_int  # noqa: E402


def test_the_default_shard_size_is_save_pretrained_s():
    theirs = inspect.signature(transformers.PreTrainedModel.save_pretrained).parameters["max_shard_size"].default
    ours = inspect.signature(qstats.export.compressed_tensors).parameters["max_shard_size"].default
    assert ours == theirs
    assert shard_bytes(ours) == parse_size_to_int(theirs)


def test_a_model_under_the_default_writes_the_files_save_pretrained_writes(tmp_path):
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    recipe = qstats.Recipe.from_scheme("FP8_DYNAMIC", ignore=["lm_head"])
    batches = [{"input_ids": torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(1))}]
    qparams = qstats.compute_qparams_tree(qstats.calibrate(model, batches, recipe, progress=False), recipe, model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qstats.export.compressed_tensors(model, qparams, str(tmp_path / "ours"), recipe)
        qstats.export.compressed_tensors(model, qparams, str(tmp_path / "one_file"), recipe, max_shard_size=None)
        model.save_pretrained(str(tmp_path / "theirs"))
    weights = {name for name in os.listdir(tmp_path / "theirs") if "safetensors" in name}
    assert weights == {"model.safetensors"}
    assert {name for name in os.listdir(tmp_path / "ours") if "safetensors" in name} == weights
    assert {name for name in os.listdir(tmp_path / "one_file") if "safetensors" in name} == weights
