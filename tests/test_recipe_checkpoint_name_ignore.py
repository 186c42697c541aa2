"""A compressed-tensors ``ignore`` list under checkpoint names (as llm-compressor writes it for a
model transformers renames on load: Mixtral's ``block_sparse_moe`` is the model's ``mlp``) leaves
out exactly the modules whose saved tensors it names."""

import json
import os
import re
import warnings

import pytest
import torch

import qstats

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")
ct_utils = pytest.importorskip("compressed_tensors.utils")

_WEIGHTS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}


def _mixtral():
    config = transformers.MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, num_local_experts=3,
                                        num_experts_per_tok=2)
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(config)


def _candidates(model) -> list:
    """The modules a ``Linear`` config group quantizes: Linears and stacked experts (which
    llm-compressor quantizes as per-expert Linears)."""
    return [path for path, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) or type(module).__name__ == "MixtralExperts"]


def _ignored_by_saved_names(model, ignore: list, tmp_path) -> set:
    """The candidate modules whose tensors, as ``save_pretrained`` writes them, all lie under a
    module name compressed-tensors' ``match_name`` matches to ``ignore``: each candidate's
    parameters are filled with its own index, so the saved tensors say which module they came from."""
    candidates = _candidates(model)
    with torch.no_grad():
        for path, module in model.named_modules():
            for parameter in module.parameters(recurse=False):
                parameter.fill_(candidates.index(path) + 1 if path in candidates else -1)
    model.save_pretrained(tmp_path)
    saved = safetensors_torch.load_file(str(tmp_path / "model.safetensors"))
    hit: dict = {}
    for key, tensor in saved.items():
        name = key.rsplit(".", 1)[0]  # the saved module name of a ".weight" / ".bias" key
        tags = set(tensor.unique().tolist())
        assert len(tags) == 1, key
        tag = int(tags.pop())
        if tag > 0:
            ignored = any(ct_utils.match_name(name, target) for target in ignore)
            hit.setdefault(candidates[tag - 1], set()).add(ignored)
    assert set(hit) == set(candidates)
    assert all(len(flags) == 1 for flags in hit.values()), hit  # each module ignored whole or not at all
    return {path for path, flags in hit.items() if flags == {True}}


@pytest.mark.parametrize("ignore", [
    ["lm_head", "re:.*block_sparse_moe.gate", "re:model.layers.1.block_sparse_moe.experts.*"],
    ["lm_head", "model.layers.0.block_sparse_moe.gate", "model.layers.1.block_sparse_moe.gate",
     "re:model.layers.0.block_sparse_moe.experts"],
])
def test_checkpoint_name_ignore_leaves_out_the_saved_modules_it_names(ignore, tmp_path):
    model = _mixtral()
    expected_ignored = _ignored_by_saved_names(model, ignore, tmp_path)
    assert expected_ignored and any("experts" in path for path in expected_ignored)
    config = {"config_groups": {"group_0": {"targets": ["Linear"], "weights": _WEIGHTS}}, "ignore": ignore}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every entry names a module, so none warns
        sites = qstats.Recipe.from_compressed_tensors(config).sites(model)
    assert set(sites) == set(_candidates(model)) - expected_ignored


def test_ignore_matching_neither_path_nor_checkpoint_name_warns():
    model = _mixtral()
    config = {"config_groups": {"group_0": {"targets": ["Linear"], "weights": _WEIGHTS}},
              "ignore": ["model.layers.0.block_sparse_moe.gates"]}
    with pytest.warns(UserWarning, match="block_sparse_moe.gates"):
        sites = qstats.Recipe.from_compressed_tensors(config).sites(model)
    assert set(sites) == set(_candidates(model))



def _quantized_by_llm_compressor(folder) -> set:
    """``{(model path, site)}`` llm-compressor's compressed checkpoint in ``folder`` quantized: its
    ``weight_packed`` tensors, their checkpoint module names mapped to Mixtral's model paths by hand
    (``block_sparse_moe.experts.<e>.{gate,up,down}_proj`` are the stacked ``mlp.experts``'
    ``gate_up_proj`` / ``down_proj``; ``block_sparse_moe.gate`` is ``mlp.gate``)."""
    out = set()
    for key in safetensors_torch.load_file(os.path.join(folder, "model.safetensors")):
        if not key.endswith(".weight_packed"):
            continue
        name = key.removesuffix(".weight_packed")
        expert = re.fullmatch(r"(.*)\.block_sparse_moe\.experts\.\d+\.(gate|up|down)_proj", name)
        if expert:
            out.add((f"{expert[1]}.mlp.experts", "down_proj" if expert[2] == "down" else "gate_up_proj"))
        else:
            out.add((name.replace(".block_sparse_moe.gate", ".mlp.gate"), "weight"))
    return out


def test_llm_compressor_config_of_mixtral_quantizes_what_llm_compressor_quantized(tmp_path):
    from _shared import llm_compressor_oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from test_export_moe_linearized import _saved

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _saved("mixtral", str(tmp_path / "float"))
        model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "float"), dtype=torch.float32)
    generator = torch.Generator().manual_seed(1)
    samples = [torch.randint(1, 128, (12,), generator=generator) for _ in range(2)]
    group = {"targets": ["Linear"], "weights": _WEIGHTS}  # in-memory names: llm-compressor writes checkpoint ones
    modifier = QuantizationModifier(config_groups={"group_0": group}, ignore=[
        "lm_head", "re:.*mlp.gate$", "re:model.layers.1.mlp.experts.*", "re:.*layers.0.*down_proj"])
    llm_compressor_oneshot(model, samples, modifier, tmp_path / "quantized")
    with open(tmp_path / "quantized" / "config.json") as file:
        config = json.load(file)["quantization_config"]
    assert any("block_sparse_moe.experts" in name for name in config["ignore"])  # checkpoint names
    expected = _quantized_by_llm_compressor(tmp_path / "quantized")
    assert ("model.layers.0.mlp.experts", "gate_up_proj") in expected

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "float"), dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every ignore entry names a module
        sites = qstats.Recipe.from_compressed_tensors(config).sites(model)
    assert {(path, site) for path, entry in sites.items() for site in entry} == expected
