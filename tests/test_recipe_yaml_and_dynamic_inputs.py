"""Recipes as llm-compressor 0.14 writes and runs them: the ``recipe.yaml`` its ``oneshot`` saves
beside the checkpoint (compressed-tensors enums written as Python tags), and config groups with
dynamic per-tensor activations, against ``oneshot`` on a tiny random Llama."""

from __future__ import annotations

import json
import os
import warnings

import pytest
from _oneshot import calibrated_qparams, load_eager, saved_llama, token_samples
from _shared import bit_equal, llm_compressor_oneshot, load_causal_lm

import qstats

transformers = pytest.importorskip("transformers")
pytest.importorskip("llmcompressor")
yaml = pytest.importorskip("yaml")
from compressed_tensors.quantization import (QuantizationArgs, QuantizationScheme, QuantizationStrategy,  # noqa: E402
                                             QuantizationType)
from llmcompressor.modifiers.quantization import QuantizationModifier  # noqa: E402
from llmcompressor.recipe import Recipe as LLMCompressorRecipe  # noqa: E402
from safetensors.torch import load_file  # noqa: E402


def _enum_modifier():
    """A modifier whose args hold compressed-tensors enums, as llm-compressor's examples build them
    (``QuantizationArgs()``'s default ``type`` is one too)."""
    return QuantizationModifier(
        config_groups={
            "g0": QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
                num_bits=4, type=QuantizationType.INT, strategy=QuantizationStrategy.GROUP, group_size=32)),
            "g1": QuantizationScheme(
                targets=["re:.*down_proj"], weights=QuantizationArgs(num_bits=8, strategy="channel"),
                input_activations=QuantizationArgs(num_bits=8, strategy="tensor", symmetric=False)),
        },
        ignore=["lm_head", "re:.*layers.1.self_attn"],
        kv_cache_scheme=QuantizationArgs(num_bits=8, type=QuantizationType.FLOAT, strategy=QuantizationStrategy.TENSOR),
    )


def test_the_recipe_yaml_oneshot_writes_for_enum_args_reads_as_its_modifier(tmp_path):
    # what oneshot saves as recipe.yaml (save_pretrained -> update_and_save_recipe -> Recipe.yaml)
    text = LLMCompressorRecipe.create_instance([_enum_modifier()]).yaml()
    assert "!!python/object/apply:compressed_tensors.quantization.quant_args.QuantizationType" in text
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    with pytest.raises(yaml.constructor.ConstructorError):  # llm-compressor's own safe loader refuses it
        LLMCompressorRecipe.create_instance(str(path))
    with pytest.raises(ValueError, match="Could not parse recipe"):
        LLMCompressorRecipe.create_instance(text)
    expected = qstats.Recipe.from_compressed_tensors(_enum_modifier())
    for source in (text, str(path), path):
        recipe = qstats.Recipe.from_compressed_tensors(source)
        assert recipe.rules == expected.rules and recipe.ignore == expected.ignore
    (weights, *_), args = recipe.rules, _enum_modifier().config_groups["g0"].weights
    assert weights.spec == qstats.QuantSpec.from_compressed_tensors(args)


TAGGED = """
quant_stage:
  quant_modifiers:
    QuantizationModifier:
      ignore: [lm_head]
      config_groups:
        g0:
          targets: [Linear]
          weights: {num_bits: 8, type: !!python/object/apply:TAG, strategy: channel}
"""


@pytest.mark.parametrize("tag", ["os.system [echo]", "compressed_tensors.utils.match.match_name [a, b]",
                                 "compressed_tensors.no_such_module.QuantizationType [int]",
                                 "compressed_tensors.quantization.quant_args.QuantizationType [int]"])
def test_only_compressed_tensors_enum_tags_are_read(tag):
    text = TAGGED.replace("TAG", tag)
    # any other Python tag stays refused, as yaml's safe loader refuses it
    if not tag.startswith("compressed_tensors.quantization.quant_args.QuantizationType"):
        with pytest.raises(yaml.constructor.ConstructorError, match="could not determine a constructor"):
            qstats.Recipe.from_compressed_tensors(text)
        return
    (rule,) = qstats.Recipe.from_compressed_tensors(text).rules
    assert rule.spec == qstats.QuantSpec.from_compressed_tensors(QuantizationArgs(num_bits=8, strategy="channel"))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return saved_llama(tmp_path_factory, "oneshot_llama"), token_samples(3)


DYNAMIC_TENSOR = {"g": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                        "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": True}}}


def test_dynamic_per_tensor_inputs_read_without_a_warning_and_equal_oneshot(llama, tmp_path):
    """A config group with dynamic per-tensor inputs (vLLM's dynamic FP8): the Recipe declares the
    site dynamic, so reading it does not warn that the spec alone does not; the checkpoint equals
    oneshot's bit for bit (weights only: no input scales)."""
    path, samples = llama
    modifier = lambda: QuantizationModifier(config_groups=DYNAMIC_TENSOR, ignore=["lm_head"])  # noqa: E731
    theirs, ours = tmp_path / "llm_compressor", tmp_path / "qstats"
    llm_compressor_oneshot(load_causal_lm(path), samples, modifier(), theirs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        recipe = qstats.Recipe.from_compressed_tensors(modifier())
        kv = qstats.Recipe.from_scheme("W4A16", kv_cache_scheme={"num_bits": 8, "type": "float", "dynamic": True})
    assert [rule.dynamic for rule in recipe.rules] == [False, True] and kv.rules[-1].dynamic
    model = load_eager(path)
    plan = recipe.resolve(model)
    qstats.export.compressed_tensors(model, calibrated_qparams(model, samples, plan), str(ours), plan)
    their_tensors, our_tensors = (load_file(os.path.join(folder, "model.safetensors")) for folder in (theirs, ours))
    assert sorted(our_tensors) == sorted(their_tensors)
    assert all(bit_equal(our_tensors[name], their_tensors[name]) for name in their_tensors)
    with open(theirs / "config.json") as file:
        their_inputs = json.load(file)["quantization_config"]["config_groups"]["group_0"]["input_activations"]
    with open(ours / "config.json") as file:
        assert json.load(file)["quantization_config"]["config_groups"]["group_0"]["input_activations"] == their_inputs
