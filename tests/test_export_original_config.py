"""The ``config.json`` of `qstats.export.compressed_tensors`, against llm-compressor 0.14's save.

transformers 5 serialises a config read from an older ``config.json`` under new field names: a
Llama 3 config's ``rope_theta`` and ``rope_scaling`` become ``rope_parameters``, which readers on
older transformers (vLLM deployments) do not know, so they would run the default rope base and no
scaling. llm-compressor's save writes the model's original ``config.json`` instead (its
``resave_config``), with the text config's ``tie_word_embeddings`` and dtype set to the model's. The
export writes the same file, in memory and layer by layer; a config changed after it was read (here
fewer layers) is written as transformers serialises it, so it still describes the checkpoint. Both
copy the ``*.py`` files of the model's folder (a remote-code model's code, which
``trust_remote_code`` loading reads beside the checkpoint).
"""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

import qstats
from _shared import llm_compressor_oneshot, load_causal_lm

transformers = pytest.importorskip("transformers")
pytest.importorskip("llmcompressor")

VOCAB = 64
# a config.json as transformers 4 wrote Llama 3's (rope_theta, rope_scaling, torch_dtype)
ORIGINAL = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": VOCAB,
            "max_position_embeddings": 16384, "rope_theta": 500000.0, "tie_word_embeddings": False,
            "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192, "rope_type": "llama3"},
            "torch_dtype": "bfloat16", "transformers_version": "4.43.0"}  # fmt: skip


def _config(folder) -> dict:
    with open(os.path.join(folder, "config.json")) as file:
        return json.load(file)


def _base(folder) -> str:
    """Random weights saved by transformers, beside the original config.json."""
    os.makedirs(folder)
    with open(os.path.join(folder, "config.json"), "w") as file:
        json.dump(ORIGINAL, file)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.LlamaForCausalLM(transformers.AutoConfig.from_pretrained(folder))
        model.to(torch.bfloat16).save_pretrained(os.path.join(folder, "weights"))
    os.replace(os.path.join(folder, "weights", "model.safetensors"), os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "configuration_custom.py"), "w") as file:  # as a remote-code model ships
        file.write("CUSTOM = True\n")
    return str(folder)


def _python_files(folder) -> set:
    return {name for name in os.listdir(folder) if name.endswith(".py")}


def _qparams(model, recipe, samples):
    states = qstats.calibrate(model, [{"input_ids": sample[None]} for sample in samples], recipe, progress=False)
    return qstats.compute_qparams_tree(states, recipe, model)


def test_the_config_is_the_original_one_as_llm_compressor_writes_it(tmp_path):
    from llmcompressor.modifiers.quantization import QuantizationModifier

    base = _base(tmp_path / "base")
    samples = [torch.randint(1, VOCAB, (8,), generator=torch.Generator().manual_seed(1))]
    modifier = QuantizationModifier(scheme="FP8_DYNAMIC", targets=["Linear"], ignore=["lm_head"])
    llm_compressor_oneshot(load_causal_lm(base), samples, modifier, tmp_path / "theirs")
    theirs = _config(tmp_path / "theirs")
    assert theirs["rope_theta"] == 500000.0 and "rope_parameters" not in theirs

    model = load_causal_lm(base)
    recipe = qstats.Recipe.from_scheme("FP8_DYNAMIC", ignore=["lm_head"], observed_dtype=torch.bfloat16)
    qparams = _qparams(model, recipe, samples)
    qstats.export.compressed_tensors(model, qparams, str(tmp_path / "ours"), recipe)
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(base),
                                                             dtype=torch.bfloat16)  # fmt: skip
    qstats.export.compressed_tensors_layerwise(meta, base, qparams, str(tmp_path / "layerwise"), recipe, progress=False)
    assert _python_files(tmp_path / "theirs") == {"configuration_custom.py"}
    for folder in ("ours", "layerwise"):
        assert _config(tmp_path / folder) == theirs, folder
        assert _python_files(tmp_path / folder) == _python_files(tmp_path / "theirs"), folder


def test_a_config_changed_after_it_was_read_is_written_as_transformers_serialises_it(tmp_path):
    base = _base(tmp_path / "base")
    config = transformers.AutoConfig.from_pretrained(base, num_hidden_layers=1)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    recipe = qstats.Recipe.from_scheme("FP8_DYNAMIC", ignore=["lm_head"])
    samples = [torch.randint(1, VOCAB, (8,), generator=torch.Generator().manual_seed(1))]
    qstats.export.compressed_tensors(model, _qparams(model, recipe, samples), str(tmp_path / "ours"), recipe)
    written = _config(tmp_path / "ours")
    assert written["num_hidden_layers"] == 1 and "rope_parameters" in written
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "ours"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
