"""Re-export into a folder that already holds a ``config.json`` (an earlier export whose shards were
removed, as the refusal of a folder holding safetensors files asks): transformers' ``save_pretrained``
and llm-compressor's save write the whole file anew, so nothing of the earlier model's config is left
for a loader to read; a model without a config (a plain ``nn.Module``) still extends the file it finds."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

import qstats
from _shared import load_causal_lm

transformers = pytest.importorskip("transformers")


def _llama(**overrides) -> "transformers.LlamaForCausalLM":
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                                      **overrides)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def _export(model, folder) -> None:
    plan = qstats.Recipe.from_scheme("W8A8", ignore=["lm_head"]).resolve(model)
    batches = [{"input_ids": torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))}]
    qparams = qstats.compute_qparams_tree(qstats.calibrate(model, batches, plan, progress=False), plan)
    qstats.export.compressed_tensors(model, qparams, folder, plan)


def _read(folder) -> dict:
    with open(os.path.join(folder, "config.json")) as file:
        return json.load(file)


def test_a_reexport_writes_the_models_config_not_the_earlier_ones(tmp_path):
    # the model read from a config.json without attention_bias / mlp_bias (as Llama 2's files are: their
    # defaults, false), exported into a folder whose earlier export had biases
    base, out, reference = (str(tmp_path / name) for name in ("base", "out", "reference"))
    _llama().save_pretrained(base)
    config = _read(base)
    del config["attention_bias"], config["mlp_bias"]
    with open(os.path.join(base, "config.json"), "w") as file:
        json.dump(config, file)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _export(_llama(attention_bias=True, mlp_bias=True, rms_norm_eps=1e-2), out)
    os.remove(os.path.join(out, "model.safetensors"))  # the shards go, as the refusal of the folder asks
    model = load_causal_lm(base)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _export(model, out)
        model.save_pretrained(reference)  # transformers writes config.json anew
    assert "quantization_config" in _read(out)
    # the config transformers reads from the export is the one it reads from its own save of the model
    ours, saved = (transformers.AutoConfig.from_pretrained(folder).to_dict() for folder in (out, reference))
    ours.pop("quantization_config")
    assert {key: (value, saved.get(key)) for key, value in ours.items() if saved.get(key) != value
            and key not in ("_name_or_path", "transformers_version")} == {}
    assert (ours["attention_bias"], ours["mlp_bias"], ours["rms_norm_eps"]) == (False, False, 1e-6)
