"""`Recipe.from_compressed_tensors` of ``model.config.quantization_config`` of a model transformers
loaded from a compressed-tensors checkpoint: transformers holds there its ``CompressedTensorsConfig``
(not the ``config.json`` dict), which reads as that dict reads."""

import json
import os
import warnings

import pytest
import torch

import qstats

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")
from transformers.utils.quantization_config import CompressedTensorsConfig  # noqa: E402

FP8 = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": False}
W4 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}


def _rules(recipe) -> list:
    return [(rule.sites, rule.spec, rule.observer, rule.observer_kwargs, rule.qparams_kwargs, rule.dynamic)
            for rule in recipe.rules]


def _read_alike(config: dict) -> None:
    held = CompressedTensorsConfig.from_dict(dict(config))  # as from_pretrained builds it
    ours = qstats.Recipe.from_compressed_tensors(held)
    theirs = qstats.Recipe.from_compressed_tensors(config)
    assert _rules(ours) == _rules(theirs) and ours.ignore == theirs.ignore


@pytest.mark.parametrize("config", [
    {"config_groups": {"group_0": {"targets": ["Linear"], "weights": W4},
                       "group_1": {"targets": ["re:.*down_proj"], "weights": FP8, "input_activations": FP8}},
     "ignore": ["lm_head", "re:.*mlp.gate$"], "quant_method": "compressed-tensors", "format": "mixed-precision"},
    {"config_groups": {}, "kv_cache_scheme": FP8, "quant_method": "compressed-tensors"},  # kv cache only
    {"config_groups": {"W4A16": ["Linear"]}, "ignore": ["lm_head"], "quant_method": "compressed-tensors"},
])
def test_a_compressed_tensors_config_of_transformers_reads_as_its_dict(config):
    _read_alike(config)


def test_the_quantization_config_of_a_loaded_checkpoint_reads_as_its_config_json(tmp_path):
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    recipe = qstats.Recipe.from_scheme("FP8", ignore=["lm_head"], kv_cache_scheme=FP8)
    plan = recipe.resolve(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        states = qstats.calibrate(model, [torch.randint(1, 64, (1, 8))], plan, progress=False)
        qstats.export.compressed_tensors(model, qstats.compute_qparams_tree(states, plan), str(tmp_path), plan)
        loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path))
    held = loaded.config.quantization_config
    assert isinstance(held, CompressedTensorsConfig)
    with open(os.path.join(tmp_path, "config.json")) as file:
        written = json.load(file)["quantization_config"]
    ours, theirs = qstats.Recipe.from_compressed_tensors(held), qstats.Recipe.from_compressed_tensors(written)
    assert _rules(ours) == _rules(theirs) == _rules(recipe) and ours.ignore == theirs.ignore
