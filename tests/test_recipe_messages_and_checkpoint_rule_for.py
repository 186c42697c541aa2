"""Recipe messages that name what the user wrote, and one reading of checkpoint-named ignores
across `Recipe.rule_for`, `Recipe.resolve` and `qstats.calibrate`, checked against
compressed-tensors' ``apply_quantization_config``."""

import copy
import logging
import re
import warnings

import pytest
import torch

import qstats

transformers = pytest.importorskip("transformers")
ct_quantization = pytest.importorskip("compressed_tensors.quantization")
ct_utils = pytest.importorskip("compressed_tensors.utils")

_WEIGHTS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
_GROUPS = {"group_0": {"targets": ["Linear"], "weights": _WEIGHTS}}


def _mixtral():
    config = transformers.MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, num_local_experts=3,
                                        num_experts_per_tok=2)
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(config).eval()


@pytest.mark.parametrize("name", ["recipe.json", "recipe.yaml", "config.json", "RECIPE.JSON", "recipe.md"])
def test_a_recipe_path_with_no_file_says_the_file_is_missing(tmp_path, name):
    """A path to no file is neither a checkpoint's config.json nor recipe text: the error names the
    missing file and what a path is read as. llm-compressor reads such a string as YAML text."""
    llmcompressor_recipe = pytest.importorskip("llmcompressor.recipe")
    path = tmp_path / "missing" / name
    with pytest.raises(ValueError, match="Could not parse recipe"):  # llm-compressor: no file, so recipe text
        llmcompressor_recipe.Recipe.create_instance(str(path))
    for given in (str(path), path):
        with pytest.raises(ValueError) as raised:
            qstats.Recipe.from_compressed_tensors(given)
        message = str(raised.value)
        assert repr(str(path)) in message and "no such file" in message and "llm-compressor recipe file" in message
        assert "is read as a dict" in message  # what to pass for a checkpoint's config.json


@pytest.mark.parametrize("entry", ["re:.*mlp.gatez", "re:(?i).*LAYERS.9", "model.layers.0.mlp.gatez"])
def test_an_unmatched_ignore_entry_is_named_as_written(entry, caplog):
    """compressed-tensors names an entry that matches nothing as it was written (its unmatched-target
    warning, ``match_named_modules(warn_on_fail=True)``); so does qstats' unmatched-ignore warning,
    not the regex it rewrites the entry into."""
    model = _mixtral()
    with caplog.at_level(logging.WARNING, logger="compressed_tensors.utils.match"):
        assert not list(ct_utils.match_named_modules(model, [entry], warn_on_fail=True))
    (logged,) = re.findall(r"Could not match `(.*)` in instance", caplog.text)
    assert logged == entry
    recipe = qstats.Recipe.from_compressed_tensors({"config_groups": _GROUPS, "ignore": ["lm_head", entry]})
    again = qstats.Recipe(recipe.rules, ignore=copy.deepcopy(recipe.ignore))  # a recipe built from its ignore list
    for each in (recipe, again):
        with pytest.warns(UserWarning, match="ignore entry") as caught:
            each.resolve(model)
        (message,) = [str(w.message) for w in caught if "ignore entry" in str(w.message)]
        assert f"the ignore entry {logged!r} matches no module" in message


def test_misspelt_config_keys_warn_naming_the_nearest_key():
    """compressed-tensors drops unknown top-level keys silently (``QuantizationConfig`` ignores extras):
    qstats reads the config as it does and warns, naming the key and the nearest valid one."""
    config = {"config_groups": _GROUPS, "ignores": ["lm_head"]}
    assert not ct_quantization.QuantizationConfig.model_validate(config).ignore  # "ignores" dropped
    with pytest.warns(UserWarning, match=r"key 'ignores' .* did you mean 'ignore'\?"):
        recipe = qstats.Recipe.from_compressed_tensors(config)
    assert recipe.ignore == ()  # as compressed-tensors reads it: nothing ignored
    with pytest.raises(ValueError):  # compressed-tensors refuses a config with no config_groups
        ct_quantization.QuantizationConfig.model_validate({"config_group": _GROUPS})
    with pytest.warns(UserWarning, match=r"key 'config_group' .* did you mean 'config_groups'\?"):
        with pytest.raises(ValueError, match="'config_groups' must be a mapping"):
            qstats.Recipe.from_compressed_tensors({"config_group": _GROUPS})
    checkpoint = {"config_groups": _GROUPS, "ignore": ["lm_head"], "format": "int-quantized",
                  "quant_method": "compressed-tensors", "quantization_status": "compressed", "version": "0.19",
                  "sparsity_config": {}, "transform_config": {}, "global_compression_ratio": None,
                  "kv_cache_scheme": None}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every key of a saved checkpoint's quantization_config is known
        qstats.Recipe.from_compressed_tensors(checkpoint)


def _saved_and_loaded(folder):
    """A Mixtral as ``from_pretrained`` loads it (renamed from its checkpoint names)."""
    _mixtral().save_pretrained(folder)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _compressed_tensors_quantized(model, ignore: list) -> tuple:
    """``(checkpoint-named config, {(path, site)} quantized)``: compressed-tensors'
    ``apply_quantization_config`` on the model linearized as llm-compressor linearizes it, its
    per-expert Linears mapped to the stacked sites they come from, and the config it saves
    (``QuantizationConfig.from_pretrained``: the ignore list under checkpoint names)."""
    from llmcompressor.modeling.moe.linearize import linearize_moe

    linearized = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        linearize_moe(linearized)
    config = ct_quantization.QuantizationConfig(config_groups=copy.deepcopy(_GROUPS), ignore=ignore)
    ct_quantization.apply_quantization_config(linearized, config, show_progress=False)
    quantized = set()
    for name, module in linearized.named_modules():
        if getattr(module, "quantization_scheme", None) is None:
            continue
        expert = re.fullmatch(r"(.*\.experts)\.\d+\.(gate|up|down)_proj", name)
        quantized.add((expert[1], "down_proj" if expert[2] == "down" else "gate_up_proj") if expert else (name, "weight"))
    saved = ct_quantization.QuantizationConfig.from_pretrained(linearized).model_dump()
    return {"config_groups": _GROUPS, "ignore": saved["ignore"]}, quantized


def test_checkpoint_named_ignores_read_alike_in_rule_for_resolve_and_calibrate(tmp_path):
    model = _saved_and_loaded(tmp_path / "float")
    config, quantized = _compressed_tensors_quantized(
        model, ["lm_head", "re:.*mlp.gate$", "re:model.layers.1.mlp.experts.*", "model.layers.0.self_attn.k_proj"])
    assert any("block_sparse_moe.experts" in name for name in config["ignore"])  # checkpoint names
    assert ("model.layers.0.mlp.experts", "gate_up_proj") in quantized
    assert ("model.layers.1.mlp.experts", "gate_up_proj") not in quantized
    recipe = qstats.Recipe.from_compressed_tensors(config)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every ignore entry names a module
        plan = recipe.resolve(model)
    resolved = {(path, site) for path, entry in plan.sites.items() for site in entry}
    assert resolved == quantized
    candidates = {(path, site) for path, module in model.named_modules()
                  for site in ("weight", "gate_up_proj", "down_proj") if site in dict(module.named_parameters(recurse=False))}
    by_rule_for = {(path, site) for path, site in candidates if recipe.rule_for(path, site, model=model) is not None}
    assert by_rule_for == quantized
    assert {key for key in candidates if recipe.rule_for(*key, model.get_submodule(key[0]), model) is not None} == quantized
    states = qstats.calibrate(model, [{"input_ids": torch.arange(1, 9)[None]}], recipe, progress=False, all_experts=True)
    assert {(path, site) for path, entry in states.items() for site in entry} == quantized


def test_rule_for_reads_a_rules_ignore_by_checkpoint_name_as_resolve_does(tmp_path):
    model = _saved_and_loaded(tmp_path / "float")
    recipe = qstats.Recipe([qstats.Rule("re:.*mlp.gate", sites=("weight",))],
                           ignore=["model.layers.0.block_sparse_moe.gate"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolved = set(recipe.sites(model))
    gates = {path for path, module in model.named_modules() if path.endswith("mlp.gate")}
    assert gates == {"model.layers.0.mlp.gate", "model.layers.1.mlp.gate"}
    assert resolved == {"model.layers.1.mlp.gate"}  # the checkpoint's block_sparse_moe.gate is mlp.gate
    assert {path for path in gates if recipe.rule_for(path, "weight", model=model) is not None} == resolved
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        recipe.rule_for("model.layers.0.mlp.gate", "weight", model="model")
