"""`qstats.export.compressed_tensors` of a ``torch.compile``'d model writes the model it wraps.

Recipes resolve on the wrapped model (`qstats.calibrate` of a compiled model names its sites by
the model's own paths); the export writes that model too: the same tensor names, ``config.json``
and values as the export of the uncompiled model, which transformers loads with no missing or
unexpected key (the wrapper's names are ``_orig_mod.<name>``, its class ``OptimizedModule``).
"""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

import qstats

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402


def _config(folder) -> dict:
    with open(os.path.join(folder, "config.json")) as file:
        return json.load(file)


def test_the_export_of_a_compiled_model_is_the_export_of_the_model_it_wraps(tmp_path):
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    recipe = qstats.Recipe.from_scheme("W8A8", ignore=["lm_head"])
    batches = [{"input_ids": torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(1))}]
    qparams = qstats.compute_qparams_tree(qstats.calibrate(model, batches, recipe, progress=False), recipe, model)
    compiled, eager = str(tmp_path / "compiled"), str(tmp_path / "eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        written = qstats.export.compressed_tensors(torch.compile(model), qparams, compiled, recipe)
        assert written == qstats.export.compressed_tensors(model, qparams, eager, recipe)
    ours, expected = (load_file(os.path.join(folder, "model.safetensors")) for folder in (compiled, eager))
    assert ours.keys() == expected.keys()
    assert all(torch.equal(ours[name], expected[name]) for name in expected)
    assert _config(compiled) == _config(eager)
    assert _config(compiled)["architectures"] == ["LlamaForCausalLM"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, info = transformers.AutoModelForCausalLM.from_pretrained(compiled, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
