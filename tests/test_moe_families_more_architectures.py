"""More mixture-of-experts families of the installed transformers than test_moe_families covers, each a
tiny random model (2 layers, both sparse: a family whose first layers are dense by default is given
sparse ones), its fused experts (transformers' `use_experts_implementation`) calibrated and exported:

- against an independent reference (test_moe_families' helpers): each expert's routed (or, with
  ``all_experts``, every) row recomputed in plain torch from the experts' recorded calls, and plain
  amin/amax over each weight slice, in every experts implementation that runs on CPU;
- against llm-compressor 0.14's ``oneshot`` of ``QuantizationModifier(scheme="NVFP4")`` (which linearizes
  the experts, every token through every expert): the same tensor names and config, the first layer's
  tensors bit for bit, the second layer's static input global scales within a few float32 ulps (the
  linearized experts' sums differ from the stacked experts' in the last bits: docs/differences.md,
  "Linearized experts' sums")."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
from _shared import bit_equal, llm_compressor_oneshot, word_tokenizer

import qstats

transformers = pytest.importorskip("transformers")
import test_moe_families as families  # noqa: E402

# families with fused experts that test_moe_families and test_export_moe_linearized leave out
MORE = ("afmoe", "axk1", "cohere2_moe", "deepseek_v32", "dots1", "exaone_moe", "flex_olmo", "glm4_moe_lite",
        "glm_moe_dsa", "granitemoe_swa", "granitemoeshared", "hy_v3", "hy_v4", "kimi_linear", "lfm2_moe", "mellum",
        "mimo_v2_flash", "minimax_m2", "qwen3_5_moe_text", "qwen3_next", "solar_open", "zaya")
RTOL = 2e-6  # a few float32 ulps


def _model(family):
    """The family's tiny model with both layers sparse (first dense layers turned off)."""
    try:
        config = transformers.AutoConfig.for_model(family)
    except (ValueError, KeyError):
        pytest.skip(f"{family} is not in transformers {transformers.__version__}")
    fields = config.to_dict()
    chosen = {name: value for name, value in families.FIELDS.items() if name in fields}
    chosen.update({name: 0 for name in ("first_k_dense_replace", "num_dense_layers") if name in fields})
    if isinstance(fields.get("mlp_layer_types"), list):
        chosen["mlp_layer_types"] = ["sparse"] * 2
    if isinstance(fields.get("layer_types"), list) or "layer_types" in fields:
        kinds = fields.get("layer_types") or ["full_attention"]
        chosen["layer_types"] = ([kind for kind in kinds if "full" in kind] or kinds)[:1] * 2
    if family == "zaya":  # one expert per token only
        chosen["num_experts_per_tok"] = 1
    if "n_shared_experts" in fields:
        chosen["n_shared_experts"] = 1
    if "qk_rope_head_dim" in fields:  # multi-head latent attention: head_dim is the rope dimension, and
        chosen["head_dim"] = 8  # eager attention needs as many kv heads as heads
        chosen["num_key_value_heads"] = chosen["num_attention_heads"]
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(type(config)(**{**fields, **chosen})).eval()
    stacked = families._stacked(model)
    assert len(stacked) == 2 and all(m.down_proj.shape[0] == families.E for m in stacked.values()), family
    return model


@pytest.mark.parametrize("family", MORE)
def test_stacked_experts_of_more_families_match_per_expert_reference(family, single_thread_quiet):
    model = _model(family)
    modules = families._stacked(model)
    first = next(iter(modules.values()))
    stacked = [name for name, p in first.named_parameters(recurse=False) if p.ndim == 3]
    up = "gate_up_proj" if "gate_up_proj" in stacked else "up_proj"
    target = type(first).__name__
    recipe = qstats.Recipe([
        qstats.Rule(target, sites=tuple(stacked), observer=qstats.minmax, spec=families.WEIGHTS),
        qstats.Rule(target, sites=("input", "down_proj.input"), observer=qstats.minmax, spec=families.INPUTS),
    ])
    batches = families._batches()
    for implementation in families.IMPLEMENTATIONS:
        model.set_experts_implementation(implementation)
        calls = families._recorded_calls(model, modules, batches)
        for all_experts in (False, True):
            states = qstats.calibrate(model, batches, recipe, progress=False, all_experts=all_experts)
            for path, module in modules.items():
                for name in stacked:
                    param = families._per_expert_linear_weights(module, name)
                    assert torch.equal(states[path][name].min_val, param.amin(dim=-1))
                    assert torch.equal(states[path][name].max_val, param.amax(dim=-1))
                check = implementation == "eager" and not all_experts and path == next(iter(modules))
                inputs, intermediates = families._reference(module, calls[path], up, all_experts, check)
                where = (family, implementation, all_experts, path)
                families._assert_site(states[path]["input"], inputs, where + ("input",))
                families._assert_site(states[path]["down_proj.input"], intermediates, where + ("down_proj.input",))


def _quantization_config(folder):
    with open(os.path.join(folder, "config.json")) as file:
        config = json.load(file)["quantization_config"]
    config["ignore"] = sorted(config["ignore"])
    config.pop("config_groups")  # ours targets the unpacked experts by regex, theirs "Linear"
    return config


@pytest.mark.parametrize("family", MORE)
def test_nvfp4_export_of_more_families_equals_llm_compressor_oneshot(family, tmp_path, single_thread_quiet):
    pytest.importorskip("llmcompressor")
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from safetensors.torch import load_file

    saved, theirs, ours = (str(tmp_path / name) for name in ("float", "llm_compressor", "qstats"))
    _model(family).save_pretrained(saved)
    ignore = ["lm_head", r"re:.*(mlp|block_sparse_moe|feed_forward)\.(gate|router)$", "re:.*router.*"]
    generator = torch.Generator().manual_seed(1)
    samples = [torch.randint(1, 128, (12,), generator=generator) for _ in range(3)]

    def load():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return transformers.AutoModelForCausalLM.from_pretrained(saved).eval()

    llm_compressor_oneshot(load(), samples, QuantizationModifier(targets="Linear", scheme="NVFP4", ignore=ignore),
                           theirs, tokenizer=word_tokenizer(128))
    model = load()
    model.set_attn_implementation("eager")  # as llm-compressor calibrates
    experts = type(next(iter(families._stacked(model).values()))).__name__
    plan = qstats.Recipe.from_scheme("NVFP4", ignore=ignore, experts=experts).resolve(model)
    states = qstats.calibrate(model, [{"input_ids": s[None]} for s in samples], plan, progress=False, all_experts=True)
    qstats.export.compressed_tensors(model, qstats.compute_qparams_tree(states, plan), ours, plan)
    our_tensors = load_file(os.path.join(ours, "model.safetensors"))
    their_tensors = load_file(os.path.join(theirs, "model.safetensors"))
    assert sorted(our_tensors) == sorted(their_tensors)
    assert any(".experts.7.down_proj.weight_packed" in name for name in their_tensors)
    assert _quantization_config(ours) == _quantization_config(theirs)
    for name, theirs_tensor in their_tensors.items():
        if bit_equal(our_tensors[name], theirs_tensor):
            continue
        assert ".layers.0." not in name and name.endswith("input_global_scale"), name
        torch.testing.assert_close(our_tensors[name], theirs_tensor, rtol=RTOL, atol=0, msg=name)
