"""llm-compressor recipe files and texts read by `Recipe.from_compressed_tensors`, against
llm-compressor's own ``Recipe.create_instance``: a JSON recipe file reads as the modifier
llm-compressor reads from it, and a text in which llm-compressor finds no modifier says where it
looks for them."""

import json
import warnings

import pytest

import qstats

pytest.importorskip("llmcompressor")
from llmcompressor.recipe import Recipe as LLMCompressorRecipe  # noqa: E402

RECIPE = {"quant_stage": {"quant_modifiers": {"QuantizationModifier": {
    "ignore": ["lm_head"],
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 32},
        "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "tensor",
                              "dynamic": False, "observer": "mse"},
    }},
}}}}


def _rules_of_llm_compressors_reading(path):
    (modifier,) = LLMCompressorRecipe.create_instance(path).modifiers
    recipe = qstats.Recipe.from_compressed_tensors(modifier.resolve_quantization_config())
    return recipe.rules, recipe.ignore


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_a_recipe_file_reads_as_the_modifier_llm_compressor_reads_from_it(tmp_path, suffix):
    """llm-compressor reads ``.json`` recipe files as it reads YAML ones; the JSON file was refused
    as a checkpoint's config.json."""
    path = tmp_path / f"recipe{suffix}"
    path.write_text(json.dumps(RECIPE))  # JSON is YAML too
    recipe = qstats.Recipe.from_compressed_tensors(str(path))
    rules, ignore = _rules_of_llm_compressors_reading(str(path))
    assert recipe.rules == rules and recipe.ignore == ignore == ("lm_head",)
    assert [rule.sites for rule in recipe.rules] == [("weight",), ("input",)]


@pytest.mark.parametrize("data", [{"quantization_config": {"config_groups": {}}, "architectures": ["X"]},
                                  {"config_groups": {"group_0": {"targets": ["Linear"]}}},
                                  {"architectures": ["LlamaForCausalLM"], "hidden_size": 64}])
def test_a_json_file_of_a_checkpoint_config_still_says_to_pass_the_dict(tmp_path, data):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"a config.json is read as a dict"):
        qstats.Recipe.from_compressed_tensors(str(path))


def test_a_recipe_text_without_stages_names_where_llm_compressor_reads_modifiers():
    """A modifier at the top level is read by llm-compressor as no modifier at all (its
    ``from_dict`` looks under ``*_stage`` / ``*_modifiers`` keys only); the error says so."""
    text = "QuantizationModifier:\n  targets: [Linear]\n  scheme: FP8_DYNAMIC\n"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert LLMCompressorRecipe.create_instance(text).modifiers == []
    with pytest.raises(ValueError, match=r"no quantization modifier: llm-compressor reads modifiers only under "
                                         r"'<name>_stage:' and then '<group>_modifiers:'"):
        qstats.Recipe.from_compressed_tensors(text)
