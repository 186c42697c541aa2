"""Recipes a user migrating from llm-compressor 0.14 / compressed-tensors 0.19 may write that those
libraries refuse or cannot run: `Recipe.from_compressed_tensors` refuses them too, naming the problem,
where it read them as another scheme (all Linears for a config group without targets, static weights for
dynamic ones)."""

import copy
import re
import warnings

import pytest
import torch
from _oneshot import load_eager, random_llama, token_samples
from _shared import llm_compressor_oneshot

import qstats

quantization = pytest.importorskip("compressed_tensors.quantization")
from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config  # noqa: E402
from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES  # noqa: E402

W8 = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}


@pytest.mark.parametrize("group", [{"weights": W8}, {"targets": None, "weights": W8}])
def test_a_config_group_without_targets_is_refused_as_compressed_tensors_refuses_it(group):
    config = {"config_groups": {"group_0": group}, "ignore": ["lm_head"]}
    with pytest.raises(ValueError, match="targets"):  # pydantic's ValidationError: "Field required"
        QuantizationConfig.model_validate(config)
    with pytest.raises(ValueError, match=r"config_groups\['group_0'\] has no 'targets'"):
        qstats.Recipe.from_compressed_tensors(config)


@pytest.mark.parametrize("weights", [{**W8, "strategy": "tensor", "dynamic": True},
                                     {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True},
                                     {**PRESET_SCHEMES["NVFP4"]["weights"].model_dump(), "dynamic": "local"}])
def test_dynamic_weights_are_refused_where_llm_compressor_cannot_save_them(tmp_path, weights):
    """compressed-tensors keeps no weight_scale for dynamic weights (scales at each forward) and oneshot fails
    compressing the model; the Recipe calibrated them as static weights and exported them as such."""
    pytest.importorskip("llmcompressor")
    from llmcompressor.modifiers.quantization import QuantizationModifier

    config = {"config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}, "ignore": ["lm_head"]}
    linear = torch.nn.Sequential(torch.nn.Linear(32, 32))
    apply_quantization_config(linear, QuantizationConfig.model_validate(config), show_progress=False)
    assert not hasattr(linear[0], "weight_scale")
    path = str(tmp_path / "llama")
    random_llama(hidden_size=64, intermediate_size=128).save_pretrained(path)
    with pytest.raises((TypeError, KeyError)):  # 'Tensor' / 'NoneType', 'weight_scale'
        llm_compressor_oneshot(load_eager(path), token_samples(1), QuantizationModifier(**config), tmp_path / "out")
    for read in (lambda: qstats.Recipe.from_compressed_tensors(config), lambda: qstats.Recipe.from_scheme(
            {"weights": weights})):
        with pytest.raises(ValueError, match=r"the weights args: dynamic weights are not supported.*dynamic=False"):
            read()


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3)
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(self.conv(x).mean((-1, -2)))


@pytest.mark.parametrize("target, named", [("Conv2d", r"'0\.conv' \(Conv2d\)"), ("_Block", r"'0' \(_Block\)"),
                                           ("re:0$", r"'0' \(_Block\)")])
def test_targets_matching_only_modules_compressed_tensors_leaves_alone_say_why(target, named):
    """compressed-tensors matches a convolution, or the parent of the Linears, and quantizes nothing there:
    the Recipe's warning names that module and says so, where it said no module it matches had a weight."""
    model = torch.nn.Sequential(_Block())
    config = {"config_groups": {"group_0": {"targets": [target], "weights": W8}}}
    apply_quantization_config(model, QuantizationConfig.model_validate(config), show_progress=False)
    assert not any(hasattr(module, "quantization_scheme") for module in model.modules())
    with pytest.warns(UserWarning, match=named + r", which compressed-tensors does not quantize.*a qstats Rule"):
        plan = qstats.Recipe.from_compressed_tensors(config).resolve(torch.nn.Sequential(_Block()))
    assert not plan.sites


@pytest.mark.parametrize("entry, instead", [("0", r"'re:0\\\.\.\*'"), ("_Block", "a 're:' regex"), ("re:0$", "a 're:' regex")])
def test_an_ignore_entry_naming_the_parent_of_quantized_modules_warns(entry, instead):
    """compressed-tensors' ignore matches the module itself: ignoring the parent of a Linear leaves the Linear
    quantized, silently; the Recipe quantizes it too and warns, naming the entry, the child and what to write."""
    model = torch.nn.Sequential(_Block())
    config = {"config_groups": {"group_0": {"targets": ["Linear"], "weights": W8}}, "ignore": [entry]}
    apply_quantization_config(model, QuantizationConfig.model_validate(config), show_progress=False)
    assert [path for path, module in model.named_modules() if hasattr(module, "quantization_scheme")] == ["0.proj"]
    with pytest.warns(UserWarning, match=rf"ignore entry '{re.escape(entry)}' matches '0' \(_Block\).*not the "
                                         rf"modules below it \('0\.proj', \.\.\.\).*use {instead}"):
        plan = qstats.Recipe.from_compressed_tensors(config).resolve(torch.nn.Sequential(_Block()))
    assert list(plan.sites) == ["0.proj"]


def test_a_modifier_that_does_not_quantize_is_refused_naming_it_alone_as_in_a_list():
    """llm-compressor reads a SmoothQuantModifier (or QuIP's) as a recipe of that modifier, which configures no
    quantization; the Recipe read it as a quantization config: a warning for each of its fields, then
    "'config_groups' must be a mapping"."""
    pytest.importorskip("llmcompressor")
    from llmcompressor.modifiers.smoothquant import SmoothQuantModifier
    from llmcompressor.modifiers.transform import QuIPModifier
    from llmcompressor.recipe import Recipe as LLMCompressorRecipe

    for modifier in (SmoothQuantModifier(smoothing_strength=0.8), QuIPModifier()):
        (read,) = LLMCompressorRecipe.create_instance(modifier).modifiers
        assert not hasattr(read, "resolve_quantization_config")
        for given in (modifier, [modifier]):
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # no warning per field of the modifier
                with pytest.raises(ValueError, match=rf"it holds \['{type(modifier).__name__}'\] .*modifiers that "
                                                     "change the model"):
                    qstats.Recipe.from_compressed_tensors(given)


@pytest.mark.parametrize("ignore, fused, shard", [("model.layers.0.self_attn.qkv_proj", "qkv_proj", "self_attn.q_proj"),
                                                  ("re:.*mlp.gate_up_proj", "gate_up_proj", "mlp.gate_proj")])
def test_an_ignore_entry_naming_vllms_fused_module_names_the_models_own(ignore, fused, shard):
    """An ignore list written for vLLM's fused modules names nothing in a transformers model, which holds their
    shards: compressed-tensors quantizes them (it matches the model's names); the Recipe too, and its warning
    names the shards to write."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    quantization_config = {"config_groups": {"group_0": {"targets": ["Linear"], "weights": W8}}, "ignore": [ignore]}
    applied = copy.deepcopy(model)
    apply_quantization_config(applied, QuantizationConfig.model_validate(quantization_config), show_progress=False)
    assert hasattr(applied.get_submodule(f"model.layers.0.{shard}"), "quantization_scheme")
    with pytest.warns(UserWarning, match=rf"names vLLM's fused '{fused}'.*'model\.layers\.0\.{re.escape(shard)}'"):
        plan = qstats.Recipe.from_compressed_tensors(quantization_config).resolve(model)
    assert "weight" in plan.sites[f"model.layers.0.{shard}"]


@pytest.mark.parametrize("name", ["W4A16", "fp8", "FP8_DYNAMIC"])
def test_a_rule_spec_naming_a_compressed_tensors_preset_scheme_says_how_to_read_it(name):
    """A compressed-tensors preset is a whole scheme (weights and input args), not one tensor's spec: the refusal
    names the scheme form that reads it, where it listed qstats' spec presets alone."""
    from compressed_tensors.quantization.quant_scheme import is_preset_scheme, preset_name_to_scheme

    assert is_preset_scheme(name) and preset_name_to_scheme(name, ["Linear"]).weights is not None
    data = {"rules": [{"targets": "Linear", "sites": ["weight"], "spec": {"preset": name}}]}
    with pytest.raises(ValueError, match=rf"'{name}' is a compressed-tensors preset scheme.*\{{'scheme': '{name}'"):
        qstats.Recipe.from_dict(data)
