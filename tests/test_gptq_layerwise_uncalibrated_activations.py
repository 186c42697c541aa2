"""`qstats.gptq_layerwise` with a recipe whose activation sites include routed experts that receive
no token: their states are uncalibrated (under the default ``on_uncalibrated="raise"``), as
`calibrate_layerwise` returns them, and GPTQ, which needs the weights' qparams alone, GPTQs every
weight as without those activation sites."""

from __future__ import annotations

import pytest
import torch

import qstats

transformers = pytest.importorskip("transformers")

W4 = qstats.QuantSpec(dtype="int4", granularity=qstats.PerGroup(16))
A8 = qstats.QuantSpec(dtype="int8", mapping="asymmetric")  # on_uncalibrated="raise", the default


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    config = transformers.Qwen3MoeConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=16, num_experts_per_tok=1)
    torch.manual_seed(0)
    path = str(tmp_path_factory.mktemp("routed_moe"))
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path, config


def _meta(config):
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config).eval()


def _weight_rules():
    return [qstats.Rule("Linear", sites=("weight",), spec=W4),
            qstats.Rule("Qwen3MoeExperts", sites=("gate_up_proj", "down_proj"), spec=W4)]


def test_experts_without_tokens_in_activation_sites_do_not_stop_gptq(checkpoint, single_thread_quiet):
    path, config = checkpoint
    activations = qstats.Rule(("Linear", "Qwen3MoeExperts"), sites=("input", "down_proj.input"), spec=A8)
    recipe = qstats.Recipe([activations, *_weight_rules()])
    batches = [{"input_ids": torch.randint(0, 96, (1, 3), generator=torch.Generator().manual_seed(2))}]

    states = qstats.calibrate_layerwise(_meta(config), path, batches, recipe, progress=False)
    unrouted = ~torch.isfinite(states["model.layers.0.mlp.experts"]["input"].min_val)
    assert unrouted.any()  # 3 tokens, 16 experts, one each: most experts see none
    with pytest.raises(ValueError, match="uncalibrated"):
        qstats.compute_qparams_tree(states, recipe, _meta(config))

    result = qstats.gptq_layerwise(_meta(config), path, batches, recipe, progress=False)
    weights_only = qstats.gptq_layerwise(_meta(config), path, batches, qstats.Recipe(_weight_rules()), progress=False)
    assert sorted(result.weights) == sorted(weights_only.weights)
    assert all(torch.equal(result.weights[name], weights_only.weights[name]) for name in weights_only.weights)
    assert set(result.states) == set(states)
    first = [p for p in states if p.startswith("model.layers.0.")]  # later layers see GPTQ'd inputs
    assert all(torch.equal(a, b) for p in first for s in states[p] for a, b in zip(result.states[p][s], states[p][s]))
