"""`compressed_tensors_layerwise` writes the ``config.json`` the in-memory export writes (whose tensors equal
``oneshot``'s, tests/test_export_roundtrip.py), byte for byte, also where a config group targets modules
outside the decoder layers: the group's targets listed the layers' modules first and the embeddings after
them (the order the parts are written), where the in-memory export lists them in the model's order."""

from __future__ import annotations

import os

import pytest
import torch

import qstats
from _shared import bit_equal, checkpoint_tensors

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402


def test_a_group_targeting_the_embeddings_is_written_as_in_memory(tmp_path):
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(str(tmp_path / "float"))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "float")).eval()
    spec = qstats.QuantSpec.from_compressed_tensors(QuantizationArgs(num_bits=8, type="int", symmetric=True,
                                                                     strategy="channel"))
    recipe = qstats.Recipe([qstats.Rule(("Linear", "Embedding"), sites=("weight",), spec=spec)], ignore=["lm_head"])
    plan = recipe.resolve(model)
    batch = {"input_ids": torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(1))}
    qparams = qstats.compute_qparams_tree(qstats.calibrate(model, [batch], plan, progress=False), plan)
    qstats.export.compressed_tensors(model, qparams, str(tmp_path / "in_memory"), plan)
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config).eval()
    qstats.export.compressed_tensors_layerwise(meta, str(tmp_path / "float"), qparams, str(tmp_path / "layerwise"),
                                               recipe, progress=False)
    in_memory, layerwise = (checkpoint_tensors(str(tmp_path / name)) for name in ("in_memory", "layerwise"))
    assert sorted(in_memory) == sorted(layerwise)
    assert all(bit_equal(in_memory[name], layerwise[name]) for name in in_memory)
    with open(os.path.join(tmp_path, "in_memory", "config.json"), "rb") as file:
        expected = file.read()
    assert b'"model.embed_tokens"' in expected  # a group of explicit targets, the embeddings among them
    with open(os.path.join(tmp_path, "layerwise", "config.json"), "rb") as file:
        assert file.read() == expected
