"""A mapping of preset names to their targets with a misspelt preset among them is refused as
llm-compressor's ``QuantizationModifier(scheme=...)`` refuses it, naming the unknown name (not every
key as an extra ``QuantizationScheme`` field)."""

import pytest

import qstats

pytest.importorskip("compressed_tensors")

MAPPING = {"W4A16": ["Linear"], "W4A17": ["re:.*down_proj"]}


def test_llm_compressor_refuses_the_mapping():
    pytest.importorskip("llmcompressor")
    from llmcompressor.modifiers.quantization import QuantizationModifier

    with pytest.raises(ValueError, match="preset scheme"):
        QuantizationModifier(scheme=dict(MAPPING))


@pytest.mark.parametrize("build", [lambda: qstats.Recipe.from_scheme(dict(MAPPING)),
                                   lambda: qstats.Recipe.from_dict({"scheme": dict(MAPPING)})])
def test_the_unknown_preset_is_named(build):
    with pytest.raises(ValueError, match=r"unknown compressed-tensors scheme\(s\) \['W4A17'\].*presets: .*W4A16"):
        build()


def test_a_mapping_of_known_presets_in_any_case_still_reads():
    recipe = qstats.Recipe.from_scheme({"w4a16": ["Linear"], "W8A16": ["re:.*down_proj"]})
    assert [rule.targets for rule in recipe.rules] == [("Linear",), ("re:.*down_proj",)]
