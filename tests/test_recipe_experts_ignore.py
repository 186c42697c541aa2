"""``Recipe.from_scheme(..., experts=...)`` honours the ``ignore`` list on the per-expert Linears
llm-compressor linearizes the stacked experts into (``re:.*experts.*down_proj``): it quantized every
expert's down_proj, which ``oneshot`` leaves in full precision."""

import os

import pytest
import torch
from _oneshot import saved_random_model, token_samples
from _shared import bit_equal, llm_compressor_oneshot, load_causal_lm, qwen3_moe_config

import qstats

transformers = pytest.importorskip("transformers")
pytest.importorskip("llmcompressor")
from safetensors.torch import load_file  # noqa: E402

IGNORE = ["lm_head", "re:.*mlp.gate$", "re:.*experts.*down_proj"]


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """A tiny random Qwen3-MoE (stacked experts) saved to disk, and samples."""
    config = qwen3_moe_config(num_experts=4, num_experts_per_tok=2, hidden_size=32, moe_intermediate_size=16,
                              head_dim=16)
    path = saved_random_model(tmp_path_factory, "qwen3_moe", transformers.Qwen3MoeForCausalLM, config)
    return path, token_samples(2)


def test_ignored_expert_projections_stay_in_full_precision_as_oneshot_writes_them(moe, tmp_path):
    from llmcompressor.modifiers.quantization import QuantizationModifier

    path, samples = moe
    theirs, ours = str(tmp_path / "llm_compressor"), str(tmp_path / "qstats")
    llm_compressor_oneshot(load_causal_lm(path), samples, QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC",
                                                                               ignore=IGNORE), theirs)
    model = load_causal_lm(path)
    plan = qstats.Recipe.from_scheme("FP8_DYNAMIC", ignore=IGNORE, experts="Qwen3MoeExperts").resolve(model)
    assert sorted(plan.sites["model.layers.0.mlp.experts"]) == ["gate_up_proj", "input"]
    states = qstats.calibrate(model, [{"input_ids": s[None]} for s in samples], plan, progress=False, all_experts=True)
    qstats.export.compressed_tensors(model, qstats.compute_qparams_tree(states, plan), ours, plan)
    their_tensors = load_file(os.path.join(theirs, "model.safetensors"))
    our_tensors = load_file(os.path.join(ours, "model.safetensors"))
    assert their_tensors["model.layers.0.mlp.experts.2.down_proj.weight"].dtype == torch.float32
    assert sorted(our_tensors) == sorted(their_tensors)
    assert not [name for name in their_tensors if not bit_equal(our_tensors[name], their_tensors[name])]


def test_ignoring_some_experts_of_a_stack_is_refused_by_name(moe):
    recipe = qstats.Recipe.from_scheme("FP8_DYNAMIC", ignore=["lm_head", r"re:.*experts\.1\.down_proj"],
                                       experts="Qwen3MoeExperts")
    with pytest.raises(ValueError, match=r"names 1 of the 4 per-expert Linears behind 'down_proj'"):
        recipe.resolve(load_causal_lm(moe[0]))
