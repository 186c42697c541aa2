"""An llm-compressor recipe already parsed (``yaml.safe_load`` / ``json.load`` of a recipe file)
reads with `Recipe.from_compressed_tensors` as llm-compressor's ``Recipe.from_dict`` reads it,
and `Recipe.from_dict` names that reader."""

import copy
import json

import pytest

import qstats

pytest.importorskip("compressed_tensors")
llmcompressor_recipe = pytest.importorskip("llmcompressor.recipe")
yaml = pytest.importorskip("yaml")

RECIPES = {
    "scheme": """
quant_stage:
  quant_modifiers:
    QuantizationModifier:
      scheme: W8A8
      ignore: [lm_head, "re:.*mlp.gate$"]
""",
    "config_groups_kv_and_observers": """
quant_stage:
  quant_modifiers:
    QuantizationModifier:
      config_groups:
        group_0:
          targets: [Linear]
          weights: {num_bits: 4, type: int, symmetric: false, strategy: group, group_size: 32, observer: mse}
          input_activations: {num_bits: 8, type: int, symmetric: true, strategy: tensor, dynamic: false,
                              observer: minmax, observer_kwargs: {averaging_constant: 0.1}}
      ignore: [lm_head]
      kv_cache_scheme: {num_bits: 8, type: float, symmetric: true, strategy: tensor, dynamic: false}
""",
    "observer_overrides": """
quant_stage:
  quant_modifiers:
    QuantizationModifier:
      scheme: FP8
      ignore: [lm_head]
      observer: {weights: mse, input: memoryless_minmax}
""",
}


def _llm_compressor_config(data):
    """The QuantizationConfig llm-compressor resolves from the parsed recipe ``data``."""
    (modifier,) = llmcompressor_recipe.Recipe.from_dict(copy.deepcopy(data)).modifiers
    return modifier.resolve_quantization_config()


@pytest.mark.parametrize("name", sorted(RECIPES))
@pytest.mark.parametrize("parse", ["yaml", "json"])
def test_a_parsed_recipe_reads_as_llm_compressor_reads_it(name, parse):
    data = yaml.safe_load(RECIPES[name])
    if parse == "json":  # a recipe.json, loaded
        data = json.loads(json.dumps(data))
    given = copy.deepcopy(data)
    ours = qstats.Recipe.from_compressed_tensors(data)
    theirs = qstats.Recipe.from_compressed_tensors(_llm_compressor_config(data))
    assert ours.rules == theirs.rules and ours.ignore == theirs.ignore
    assert data == given  # not changed
    assert ours.rules == qstats.Recipe.from_compressed_tensors(RECIPES[name]).rules  # as its text reads


def test_a_parsed_recipe_without_stages_is_refused_saying_where_llm_compressor_reads_modifiers():
    data = {"QuantizationModifier": {"scheme": "W8A8"}}
    with pytest.raises(ValueError, match="_stage"):
        qstats.Recipe.from_compressed_tensors(data)


def test_from_dict_names_the_reader_of_a_parsed_llm_compressor_recipe():
    with pytest.raises(ValueError, match="llm-compressor recipe reads with Recipe.from_compressed_tensors"):
        qstats.Recipe.from_dict(yaml.safe_load(RECIPES["scheme"]))
