"""Recipes of several overlapping config groups, end to end: `Recipe.from_compressed_tensors` of an
llm-compressor ``QuantizationModifier(config_groups=..., ignore=...)`` (or of a YAML recipe holding one),
`calibrate`, `compute_qparams_tree` and `export.compressed_tensors` on a tiny random Llama, against
llm-compressor 0.14's ``oneshot`` with the same modifier: the same tensors bit for bit, the same
``ignore`` list and group schemes (our targets are the module paths each group quantizes, theirs the
recipe's targets: both select the same modules), and transformers loads ours and computes the logits
it computes from llm-compressor's checkpoint."""

from __future__ import annotations

import json
import os
import re
import warnings

import pytest
import torch

import qstats
from _shared import bit_equal, llm_compressor_oneshot, qwen3_moe_config

transformers = pytest.importorskip("transformers")
pytest.importorskip("llmcompressor")
from compressed_tensors.quantization import QuantizationScheme  # noqa: E402
from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES  # noqa: E402
from safetensors.torch import load_file  # noqa: E402


def _scheme(preset: str, targets: list) -> QuantizationScheme:
    return QuantizationScheme(targets=targets, **PRESET_SCHEMES[preset])


def _modifier(groups: dict, ignore: list, **options):
    from llmcompressor.modifiers.quantization import QuantizationModifier

    return QuantizationModifier(config_groups={name: _scheme(*group) for name, group in groups.items()}, ignore=ignore,
                                **options)


KV_FP8 = dict(num_bits=8, type="float", symmetric=True, strategy="tensor", dynamic=False)


YAML = """
quant_stage:
  quant_modifiers:
    QuantizationModifier:
      ignore: ["lm_head", "re:model.layers.0.self_attn.[qk]_proj"]
      config_groups:
        group_0:
          targets: ["Linear"]
          weights: {num_bits: 8, type: int, symmetric: true, strategy: channel}
          input_activations: {num_bits: 8, type: int, symmetric: false, strategy: tensor, dynamic: false}
        group_1:
          targets: ["re:.*mlp.(gate|up)_proj"]
          weights: {num_bits: 4, type: int, symmetric: false, strategy: group, group_size: 32}
"""

# case: (a modifier, built per run as llm-compressor's modifiers hold state, or YAML text;
#        {tensor: its dtype in both checkpoints}, showing which group took the module)
CASES = {
    "most-specific-wins": (lambda: _modifier(
        {"g0": ("W8A8", ["Linear"]), "g1": ("W4A16", ["re:.*down_proj"])}, ["lm_head"]),
        {"model.layers.1.mlp.down_proj.weight_packed": torch.int32, "model.layers.1.mlp.up_proj.weight": torch.int8}),
    "regex-group-then-linear": (lambda: _modifier(
        {"g0": ("FP8", ["re:.*self_attn.o_proj"]), "g1": ("W4A16", ["Linear"])}, ["lm_head"]),
        {"model.layers.0.self_attn.o_proj.input_scale": torch.float32,
         "model.layers.0.self_attn.o_proj.weight": torch.float8_e4m3fn,
         "model.layers.0.self_attn.v_proj.weight_packed": torch.int32}),
    "ignore-regex-prefix": (lambda: _modifier(
        {"g0": ("W8A8", ["Linear"]), "g1": ("W4A16", ["re:.*down_proj"])},
        ["lm_head", "re:model.layers.1"]),
        {"model.layers.1.mlp.down_proj.weight": torch.float32,
         "model.layers.0.mlp.down_proj.weight_packed": torch.int32}),
    "yaml": (lambda: YAML,
             {"model.layers.0.self_attn.q_proj.weight": torch.float32,
              "model.layers.0.self_attn.v_proj.input_zero_point": torch.int8,
              "model.layers.0.mlp.up_proj.weight_zero_point": torch.int32}),
    # an ignore regex that names the (unquantized) embeddings too: compressed-tensors lists only
    # modules of a quantized type
    "ignore-names-an-embedding": (lambda: _modifier(
        {"g0": ("W8A8", ["Linear"]), "g1": ("W4A16", ["re:.*down_proj"])}, ["re:model.(embed_tokens|layers.1.mlp)"]),
        {"model.embed_tokens.weight": torch.float32, "lm_head.weight_scale": torch.float32}),
    # k and v observed where compressed-tensors' kv cache quantizes them (after the rotary embedding)
    "kv-cache": (lambda: _modifier(
        {"g0": ("W4A16", ["Linear"]), "g1": ("FP8", ["re:.*mlp.*"])}, ["lm_head"], kv_cache_scheme=KV_FP8),
        {"model.layers.0.self_attn.v_scale": torch.float32, "model.layers.0.mlp.gate_proj.input_scale": torch.float32}),
}


@pytest.fixture(scope="module")
def float_llama(tmp_path_factory):
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    path = str(tmp_path_factory.mktemp("groups_llama"))
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def samples():
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(1, 64, (12,), generator=generator) for _ in range(3)]


def _load(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_pretrained(path).eval()


def _quantization_config(folder) -> dict:
    with open(os.path.join(folder, "config.json")) as file:
        return json.load(file)["quantization_config"]


def _selects(target: str, path: str) -> bool:
    return re.match(target[3:], path) is not None if target.startswith("re:") else target == path


@pytest.mark.parametrize("case", sorted(CASES))
def test_overlapping_groups_export_equals_llm_compressor_oneshot(float_llama, samples, tmp_path, case):
    theirs, ours = str(tmp_path / "llm_compressor"), str(tmp_path / "qstats")
    recipe, expected = CASES[case]
    llm_compressor_oneshot(_load(float_llama), samples, recipe(), theirs)
    model = _load(float_llama)
    model.set_attn_implementation("eager")  # as llm-compressor calibrates
    plan = qstats.Recipe.from_compressed_tensors(recipe()).resolve(model)
    states = qstats.calibrate(model, [{"input_ids": s[None]} for s in samples], plan, progress=False)
    qstats.export.compressed_tensors(model, qstats.compute_qparams_tree(states, plan), ours, plan)

    their_tensors = load_file(os.path.join(theirs, "model.safetensors"))
    our_tensors = load_file(os.path.join(ours, "model.safetensors"))
    assert sorted(our_tensors) == sorted(their_tensors)
    differing = [name for name in their_tensors if not bit_equal(our_tensors[name], their_tensors[name])]
    assert differing == []
    assert {name: their_tensors[name].dtype for name in expected} == expected

    our_config, their_config = _quantization_config(ours), _quantization_config(theirs)
    assert our_config["ignore"] == their_config["ignore"]
    our_groups, their_groups = our_config.pop("config_groups"), their_config.pop("config_groups")
    assert our_config == their_config
    assert sorted(our_groups) == sorted(their_groups)
    # llm-compressor numbers the groups in module order, as we do; the schemes agree but the targets
    quantized = {name.rsplit(".", 1)[0] for name in their_tensors if name.endswith(".weight_scale")}
    assert sorted(path for group in our_groups.values() for path in group["targets"]) == sorted(quantized)
    for name, their_group in their_groups.items():
        our_group = our_groups[name]
        our_targets, their_targets = our_group.pop("targets"), their_group.pop("targets")
        assert our_group == their_group, name
        # our targets are module paths; theirs select (most specific group wins) the same modules
        for path in our_targets:
            assert path in quantized
            assert any(_selects(target, path) or target == "Linear" for target in their_targets), (name, path)

    # transformers loads both checkpoints (compressed-tensors) and computes the same logits
    batch = torch.randint(1, 64, (2, 10), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        our_logits, their_logits = (_load(folder)(batch).logits for folder in (ours, theirs))
    assert our_logits.isfinite().all()
    if case != "kv-cache":
        assert bit_equal(our_logits, their_logits)


def _moe_export_and_oneshot(tmp_path, samples, ignore, recipe_of) -> tuple:
    """A tiny Qwen3-MoE calibrated W8A8 (``targets="Linear"``, ``ignore``) by llm-compressor's
    ``oneshot`` and by qstats with ``recipe_of(modifier)``, both exported: ``(ours, theirs)`` folders,
    after checking they hold the same tensors bit for bit and the same ``ignore`` list."""
    saved, theirs, ours = (str(tmp_path / name) for name in ("float", "llm_compressor", "qstats"))
    torch.manual_seed(0)
    config = qwen3_moe_config(hidden_size=32, moe_intermediate_size=32, head_dim=16)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(saved)
    from llmcompressor.modifiers.quantization import QuantizationModifier

    modifier = QuantizationModifier(targets="Linear", scheme="W8A8", ignore=ignore)
    llm_compressor_oneshot(_load(saved), samples[:1], modifier, theirs)
    model = _load(saved)
    model.set_attn_implementation("eager")
    plan = recipe_of(modifier).resolve(model)
    states = qstats.calibrate(model, [{"input_ids": samples[0][None]}], plan, progress=False, all_experts=True)
    qstats.export.compressed_tensors(model, qstats.compute_qparams_tree(states, plan), ours, plan)
    assert _quantization_config(ours)["ignore"] == _quantization_config(theirs)["ignore"]
    their_tensors = load_file(os.path.join(theirs, "model.safetensors"))
    our_tensors = load_file(os.path.join(ours, "model.safetensors"))
    assert sorted(our_tensors) == sorted(their_tensors)
    assert not [name for name in their_tensors if not bit_equal(our_tensors[name], their_tensors[name])]
    return ours, our_tensors


@pytest.mark.parametrize("ignore", [["lm_head"], ["lm_head", "re:.*mlp.experts.*"]])
def test_routers_the_ignore_list_does_not_name_are_listed_as_llm_compressor_lists_them(tmp_path, samples, ignore):
    """A Qwen3-MoE router (``Qwen3MoeTopKRouter``, a Linear to vLLM) that no group quantizes is in
    ``ignore`` even when the recipe's ``ignore`` does not name it, as in llm-compressor's checkpoint;
    unquantized stacked experts are listed as the per-expert Linears llm-compressor linearizes them into."""
    ours, _ = _moe_export_and_oneshot(
        tmp_path, samples, ignore,
        lambda modifier: qstats.Recipe.from_scheme("W8A8", ignore=ignore, experts="Qwen3MoeExperts"))
    assert "model.layers.0.mlp.gate" in _quantization_config(ours)["ignore"]


@pytest.mark.parametrize("ignore", [["lm_head"], ["lm_head", "re:.*experts.*down_proj"], ["re:model.layers.1.mlp"]])
def test_a_linear_recipe_quantizes_stacked_experts_as_llm_compressor_linearizes_them(tmp_path, samples, ignore):
    """``QuantizationModifier(targets="Linear")`` read as it is (no ``experts=``): llm-compressor
    linearizes Qwen3-MoE's stacked experts into per-expert Linears and quantizes those its targets
    and ignore select; qstats observes the stacked sites behind them. Same tensors bit for bit and
    the same ignore list as ``oneshot``'s checkpoint."""
    _, our_tensors = _moe_export_and_oneshot(tmp_path, samples, ignore, qstats.Recipe.from_compressed_tensors)
    assert "model.layers.0.mlp.experts.3.up_proj.weight_scale" in our_tensors


def test_a_float_lm_head_tied_to_the_embeddings_is_written_once_as_save_pretrained_does(tmp_path, samples):
    """A tied lm_head left unquantized: llm-compressor's checkpoint (``save_pretrained``) holds the
    embeddings only; qstats wrote a second copy under ``lm_head.weight`` (the vocabulary times the
    hidden size again). Now the same tensors, and transformers ties them back on load."""
    saved, theirs, ours = (str(tmp_path / name) for name in ("float", "llm_compressor", "qstats"))
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(saved)
    modifier = _modifier({"g0": ("W8A8", ["Linear"])}, ["lm_head"])
    llm_compressor_oneshot(_load(saved), samples, modifier, theirs)
    model = _load(saved)
    model.set_attn_implementation("eager")
    plan = qstats.Recipe.from_compressed_tensors(_modifier({"g0": ("W8A8", ["Linear"])}, ["lm_head"])).resolve(model)
    states = qstats.calibrate(model, [{"input_ids": s[None]} for s in samples], plan, progress=False)
    qstats.export.compressed_tensors(model, qstats.compute_qparams_tree(states, plan), ours, plan)
    their_tensors = load_file(os.path.join(theirs, "model.safetensors"))
    our_tensors = load_file(os.path.join(ours, "model.safetensors"))
    assert "lm_head.weight" not in their_tensors and sorted(our_tensors) == sorted(their_tensors)
    assert not [name for name in their_tensors if not bit_equal(our_tensors[name], their_tensors[name])]
    loaded = _load(ours)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
