"""A GPTQ'd checkpoint's ``actorder`` read by `Recipe.from_compressed_tensors`: GPTQ's column order,
which a Recipe (observers and specs) does not hold, so calibrating with it rounds to nearest. It was
dropped without a word, where the GPTQModifier path warns of its algorithm options."""

import warnings

import pytest

import qstats

pytest.importorskip("compressed_tensors")
pytest.importorskip("llmcompressor")


def _caught(config):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        recipe = qstats.Recipe.from_compressed_tensors(config)
    return recipe, [str(w.message) for w in caught]


def _written(modifier):
    """The config groups a checkpoint of ``modifier`` holds, as JSON (its resolved config's dump)."""
    return modifier.resolve_quantization_config().model_dump(mode="json")


def test_gptq_checkpoint_config_warns_of_its_actorder():
    from llmcompressor.modifiers.quantization import GPTQModifier

    config = _written(GPTQModifier(targets="Linear", scheme="W4A16", ignore=["lm_head"]))
    assert config["config_groups"]["group_0"]["weights"]["actorder"] == "static"  # GPTQModifier's default
    recipe, messages = _caught(config)
    assert [m for m in messages if "actorder ['static']" in m and "gptq_layerwise" in m] == messages
    assert len(messages) == 1
    assert recipe == qstats.Recipe.from_compressed_tensors(_written(
        GPTQModifier(targets="Linear", scheme="W4A16", ignore=["lm_head"], actorder=None)))  # same specs


def test_no_order_no_warning_and_modifier_warns_once():
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

    _, messages = _caught(_written(QuantizationModifier(targets="Linear", scheme="W4A16")))
    assert messages == []
    _, messages = _caught(GPTQModifier(targets="Linear", scheme="W4A16"))
    assert len(messages) == 1 and "algorithm options" in messages[0]  # not a second one for its actorder
