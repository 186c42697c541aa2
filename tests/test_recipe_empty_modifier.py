"""An llm-compressor modifier or config that quantizes nothing, read as a Recipe, against llm-compressor
0.14 itself: a modifier without any quantization field is refused as llm-compressor refuses it (before,
an empty Recipe, silently), and a config whose groups carry no args warns (compressed-tensors gives the
targeted modules a scheme without args, silently)."""

import copy
import warnings

import pytest
import torch

import qstats
from _shared import tiny_llama_config

pytest.importorskip("llmcompressor")
transformers = pytest.importorskip("transformers")
from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config  # noqa: E402
from llmcompressor.core import State  # noqa: E402
from llmcompressor.modifiers.gptq import GPTQModifier  # noqa: E402
from llmcompressor.modifiers.quantization import QuantizationModifier  # noqa: E402

KV = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}


@pytest.fixture(scope="module")
def llama():
    config = tiny_llama_config(vocab_size=64, intermediate_size=64, num_hidden_layers=1)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def _quantized_by_llm_compressor(model, modifier) -> list:
    """The modules compressed-tensors gives args to under ``modifier``'s resolved config."""
    model = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        apply_quantization_config(model, QuantizationConfig.model_validate(
            modifier.resolve_quantization_config().model_dump()), show_progress=False)
    return [path for path, module in model.named_modules()
            if any(getattr(getattr(module, "quantization_scheme", None), key, None) is not None
                   for key in ("weights", "input_activations", "output_activations"))]


def test_a_quantization_modifier_without_quantization_fields_is_refused_as_llm_compressor_refuses_it(llama):
    with pytest.raises(ValueError, match="requires that quantization fields be specified"):
        QuantizationModifier().on_initialize(State(model=copy.deepcopy(llama)))
    with pytest.raises(ValueError, match=r"QuantizationModifier specifies no quantization: give it scheme="):
        qstats.Recipe.from_compressed_tensors(QuantizationModifier())


def test_an_empty_modifier_in_a_yaml_recipe_is_refused():
    text = "quant_stage:\n  quant_modifiers:\n    QuantizationModifier: {}\n"
    with pytest.raises(ValueError, match="QuantizationModifier specifies no quantization"):
        qstats.Recipe.from_compressed_tensors(text)


def test_a_gptq_modifier_without_quantization_fields_is_refused_as_llm_compressor_refuses_it(llama):
    model = copy.deepcopy(llama)
    theirs = GPTQModifier()
    state = State(model=model)
    theirs.on_initialize(state)
    with pytest.raises(ValueError, match="unable to find any modules to quantize"):
        theirs.on_calibration_start(state, None)
    with pytest.raises(ValueError, match="GPTQModifier specifies no quantization"):
        qstats.Recipe.from_compressed_tensors(GPTQModifier())


def test_targets_without_a_scheme_warn_that_the_recipe_quantizes_nothing(llama):
    """llm-compressor takes ``targets``/``ignore`` without ``scheme``: a group without args, which
    quantizes nothing; the Recipe is as empty and says so."""
    modifier = QuantizationModifier(targets=["Linear"], ignore=["lm_head"])
    assert _quantized_by_llm_compressor(llama, modifier) == []
    with pytest.warns(UserWarning, match=r"no config group has weights.*\[\['Linear'\]\].*quantizes nothing"):
        recipe = qstats.Recipe.from_compressed_tensors(modifier)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert recipe.resolve(llama).sites == {}
    with pytest.warns(UserWarning, match="quantizes nothing"):
        qstats.Recipe.from_compressed_tensors({"config_groups": {"g": {"targets": ["Linear"]}}})
    with pytest.warns(UserWarning, match="Recipe.from_scheme: .*quantizes nothing"):
        qstats.Recipe.from_scheme("UNQUANTIZED")


def test_a_kv_cache_only_modifier_and_unquantized_groups_beside_others_do_not_warn(llama):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        kv_only = qstats.Recipe.from_compressed_tensors(QuantizationModifier(kv_cache_scheme=KV))
        mapping = QuantizationModifier(scheme={"W8A8": ["Linear"], "UNQUANTIZED": ["re:.*down_proj", "lm_head"]})
        mixed = qstats.Recipe.from_compressed_tensors(mapping)
        plan = mixed.resolve(llama)
    assert [rule.sites for rule in kv_only.rules] == [("k", "v")]
    assert sorted(plan.sites) == sorted(_quantized_by_llm_compressor(llama, mapping))
