"""`qstats.gptq_layerwise` with routed experts (``all_experts=False``) against llm-compressor 0.14's
``oneshot`` with ``moe_calibrate_all_experts=False``: its linearized experts call every expert once a
forward, on the tokens routed to it, none included (``LinearExperts2D.forward``), and its
``accumulate_hessian`` counts each such 2-D call as one sample. An expert routed a token in some
batches only is divided by the number of batches, not of the batches that routed it a token: with
dead input columns (features a norm zeroes) the codes depend on that count (docs/gptq.md)."""

from __future__ import annotations

import warnings

import pytest
import torch

import qstats
from _oneshot import token_samples
from _packed import packed_codes
from _shared import llm_compressor_oneshot, qwen3_moe_config

transformers = pytest.importorskip("transformers")
llmc_helpers = pytest.importorskip("llmcompressor.modifiers.gptq.helpers")
from safetensors.torch import load_file  # noqa: E402

IN = 16


def test_each_expert_counts_every_call_as_accumulate_hessian_does():
    """The stacked Hessian observer of `gptq_layerwise` against `accumulate_hessian` called as
    llm-compressor's routed experts call it: once a batch per expert, on its routed rows."""
    from qstats.layerwise_gptq import _gptq_inputs

    gen = torch.Generator().manual_seed(0)
    batches = [torch.randn(6, IN, generator=gen) for _ in range(3)]
    routes = [torch.tensor([[1.0] * 6, [1.0, 0, 0, 0, 0, 0], [0.0] * 6]),
              torch.tensor([[0.0, 1, 1, 0, 0, 0], [0.0] * 6, [0.0] * 6]),
              torch.tensor([[1.0] * 6, [0.0] * 6, [0.0] * 6])]  # expert 1: a token in one batch of three
    stacked = qstats.stacked_observer(_gptq_inputs(), 3)
    state = stacked.init(batches[0].expand(3, -1, -1))
    layer = torch.nn.Linear(IN, 8, bias=False)
    hessians = [llmc_helpers.make_empty_hessian(layer) for _ in range(3)]
    samples = [torch.zeros(()) for _ in range(3)]
    for x, route in zip(batches, routes):
        state = stacked.update(state, x.expand(3, -1, -1), route)
        for expert in range(3):
            routed = x[route[expert].bool()]  # [tokens, in], empty where no token was routed
            hessians[expert], samples[expert] = llmc_helpers.accumulate_hessian(routed, layer, hessians[expert],
                                                                                samples[expert])
    assert [int(s) for s in samples] == [3, 3, 3]
    assert state.samples.tolist() == [3, 3, 3] and state.count.tolist() == [14, 1, 0]
    for expert in range(3):
        assert torch.equal(state.total[expert], hessians[expert])  # its sum, bit for bit


def test_routed_experts_with_dead_columns_equal_llm_compressor_routed_oneshot(tmp_path, single_thread_quiet):
    """A one-layer Qwen3-MoE whose post-attention norm zeroes 8 features (dead columns in every
    expert's gate_up_proj Hessian, small inputs elsewhere), 8 experts, top-1, 2 batches of 6 tokens:
    the experts routed a token have llm-compressor's codes (every code measured; before, 98.9%: those
    routed a token in one batch of the two were divided by one sample, not two)."""
    config = qwen3_moe_config(hidden_size=64, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=1,
                              head_dim=16, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        model.model.layers[0].post_attention_layernorm.weight.mul_(0.05)  # small inputs: the dead columns' 1 weighs
        model.model.layers[0].post_attention_layernorm.weight[:8] = 0
    path = str(tmp_path / "model")
    model.save_pretrained(path)
    samples = token_samples(2, 6)
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}
    ignore = ["lm_head", "re:.*mlp.gate$"]
    from llmcompressor.modifiers.gptq import GPTQModifier

    modifier = GPTQModifier(config_groups={"group_0": {"targets": ["Linear"], "weights": weights}}, ignore=ignore)
    theirs_model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    llm_compressor_oneshot(theirs_model, samples, modifier, tmp_path / "theirs", "basic",
                           moe_calibrate_all_experts=False)
    theirs = load_file(str(tmp_path / "theirs" / "model.safetensors"))

    recipe = qstats.Recipe.from_scheme({"targets": ["Linear"], "weights": weights}, ignore=ignore,
                                       experts="Qwen3MoeExperts")
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config).eval()
    batches = [{"input_ids": s[None], "attention_mask": torch.ones(1, 6, dtype=torch.long)} for s in samples]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the experts without a token: rounded to nearest
        result = qstats.gptq_layerwise(meta, path, batches, recipe, progress=False)
    ours_model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    ours_model.load_state_dict(result.weights, strict=False)
    plan = recipe.resolve(ours_model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qstats.export.compressed_tensors(ours_model, qstats.compute_qparams_tree(result.states, plan),
                                         str(tmp_path / "ours"), plan)
    ours = load_file(str(tmp_path / "ours" / "model.safetensors"))
    gate_up = result.states["model.layers.0.mlp.experts"]
    routed = [expert for expert in range(8) if not bool((packed_codes(theirs, f"model.layers.0.mlp.experts.{expert}"
                                                                      ".gate_proj") == 0).all())]
    assert 3 <= len(routed) < 8 and gate_up  # some experts were routed no token (llm-compressor: zeros)
    same = total = 0
    for expert in routed:
        for projection in ("gate_proj", "up_proj", "down_proj"):
            name = f"model.layers.0.mlp.experts.{expert}.{projection}"
            equal = packed_codes(ours, name) == packed_codes(theirs, name)
            same, total = same + int(equal.sum()), total + equal.numel()
    # every code equal here; a code the Hessians' float rounding flips carries along its row (64 codes)
    assert same / total >= 0.998, same / total
