"""A target or ignore entry written as a regular expression without the ``re:`` prefix
(``".*q_proj"``, ``".*down_proj$"``): compressed-tensors reads it as a module path or class name, so it
matches nothing, silently (its "Could not match" names the target only). A Recipe selects what
compressed-tensors' ``apply_quantization_config`` selects, and its warnings now say what was meant
(before: that the entry matches nothing, without the hint)."""

import copy
import warnings

import pytest
import torch

import qstats
from _shared import tiny_llama_config

pytest.importorskip("compressed_tensors")
transformers = pytest.importorskip("transformers")
from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config  # noqa: E402

W8 = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}


@pytest.fixture(scope="module")
def llama():
    config = tiny_llama_config(vocab_size=64, intermediate_size=64, num_hidden_layers=1)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def _config(targets, ignore=()) -> dict:
    return {"config_groups": {"g": {"targets": list(targets), "weights": W8}}, "ignore": list(ignore)}


def _theirs(model, config) -> list:
    model = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        apply_quantization_config(model, QuantizationConfig.model_validate(config), show_progress=False)
    return sorted(path for path, module in model.named_modules() if hasattr(module, "quantization_scheme"))


def _ours(model, config) -> tuple:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = qstats.Recipe.from_compressed_tensors(config).resolve(model)
    return sorted(plan.sites), [str(w.message) for w in caught]


def test_a_target_regex_without_re_selects_nothing_and_the_warning_names_the_prefix(llama):
    config = _config([".*q_proj"])
    assert _theirs(llama, config) == []
    assert _theirs(llama, _config(["re:.*q_proj"])) == ["model.layers.0.self_attn.q_proj"]
    paths, messages = _ours(llama, config)
    assert paths == []
    assert any("selects no site" in m and "did you mean 're:.*q_proj'?" in m for m in messages), messages


def test_an_ignore_regex_without_re_ignores_nothing_and_the_warning_names_the_prefix(llama):
    config = _config(["Linear"], ignore=["lm_head", ".*down_proj$"])
    theirs = _theirs(llama, config)
    assert "model.layers.0.mlp.down_proj" in theirs
    assert "model.layers.0.mlp.down_proj" not in _theirs(llama, _config(["Linear"], ["lm_head", "re:.*down_proj$"]))
    paths, messages = _ours(llama, config)
    assert paths == theirs
    assert any("ignore entry '.*down_proj$' matches no module" in m and "did you mean 're:.*down_proj$'?" in m
               for m in messages), messages


def test_paths_and_class_names_get_no_hint(llama):
    _, messages = _ours(llama, _config(["Linaer"], ignore=["model.layers.0.mlp.down_projj"]))
    assert len(messages) == 2 and not any("did you mean" in m for m in messages), messages
