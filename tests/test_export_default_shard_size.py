"""`qstats.export.compressed_tensors` shards by default as llm-compressor's save does.

llm-compressor's ``save_pretrained`` (after ``oneshot``) splits a checkpoint into shards of at most
``"20GB"`` unless told otherwise (the Hugging Face Hub recommends no larger file and takes none
over 50GB). The export's default is the same size, read as huggingface_hub reads it: a model under
it is one ``model.safetensors`` with no index, as that save writes it; ``max_shard_size=None``
keeps one file whatever the size.
"""

from __future__ import annotations

import inspect
import os
import warnings

import pytest
import torch

import qstats
from _shared import llm_compressor_oneshot, load_causal_lm
from qstats.export.checkpoint import shard_bytes

transformers = pytest.importorskip("transformers")
pytest.importorskip("llmcompressor")
import transformers.modeling_utils  # noqa: E402
from huggingface_hub.serialization._base import parse_size_to_int  # noqa: E402

VOCAB = 64


def _saved_model(folder) -> str:
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return str(folder)


def _safetensors(folder) -> set:
    return {name for name in os.listdir(folder) if "safetensors" in name}


def test_the_default_shard_size_is_llm_compressors_save(tmp_path, monkeypatch):
    from llmcompressor.modifiers.quantization import QuantizationModifier

    base = _saved_model(tmp_path / "base")
    sizes = []
    split = transformers.modeling_utils.split_torch_state_dict_into_shards

    def recorded(state_dict, **options):  # what llm-compressor's save_pretrained asks huggingface_hub for
        sizes.append(options["max_shard_size"])
        return split(state_dict, **options)

    monkeypatch.setattr(transformers.modeling_utils, "split_torch_state_dict_into_shards", recorded)
    samples = [torch.randint(1, VOCAB, (8,), generator=torch.Generator().manual_seed(1))]
    modifier = QuantizationModifier(scheme="FP8_DYNAMIC", targets=["Linear"], ignore=["lm_head"])
    llm_compressor_oneshot(load_causal_lm(base), samples, modifier, tmp_path / "theirs")
    default = inspect.signature(qstats.export.compressed_tensors).parameters["max_shard_size"].default
    assert len(sizes) == 1 and shard_bytes(default) == parse_size_to_int(sizes[0])

    model = load_causal_lm(base)
    recipe = qstats.Recipe.from_scheme("FP8_DYNAMIC", ignore=["lm_head"])
    qparams = qstats.compute_qparams_tree(qstats.calibrate(model, [{"input_ids": samples[0][None]}], recipe,
                                                           progress=False), recipe, model)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qstats.export.compressed_tensors(model, qparams, str(tmp_path / "ours"), recipe)
        qstats.export.compressed_tensors(model, qparams, str(tmp_path / "one_file"), recipe, max_shard_size=None)
    assert _safetensors(tmp_path / "theirs") == {"model.safetensors"}
    assert _safetensors(tmp_path / "ours") == _safetensors(tmp_path / "one_file") == {"model.safetensors"}
