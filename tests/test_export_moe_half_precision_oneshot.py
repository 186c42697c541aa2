"""Stacked experts of bfloat16 / float16 MoE models (Qwen3-MoE, Mixtral) exported by qstats against
llm-compressor 0.14's ``oneshot`` of the same preset, which linearizes the experts: NVFP4 (gate and up
under one global scale, NVFP4 inputs), MXFP4, FP8 with static per-expert input scales, and
W4A16_ASYM (packed asymmetric zero points) write the same tensors bit for bit."""

from __future__ import annotations

import os

import pytest
import torch

import qstats
from _shared import bit_equal, llm_compressor_oneshot

transformers = pytest.importorskip("transformers")
pytest.importorskip("llmcompressor")
from safetensors.torch import load_file  # noqa: E402

_SMALL = dict(vocab_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
              max_position_embeddings=32, tie_word_embeddings=False)


def _moe(architecture, hidden, intermediate):
    if architecture == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**_SMALL, hidden_size=hidden, intermediate_size=intermediate,
                                             moe_intermediate_size=intermediate, num_experts=4, num_experts_per_tok=2)
        model_class = transformers.Qwen3MoeForCausalLM
    else:
        config = transformers.MixtralConfig(**_SMALL, hidden_size=hidden, intermediate_size=intermediate,
                                            num_local_experts=4, num_experts_per_tok=2)
        model_class = transformers.MixtralForCausalLM
    torch.manual_seed(0)
    return model_class(config).eval()


# case: (architecture, preset, dtype, hidden = moe intermediate size); W4A16_ASYM's groups of 128 need
# 128 features, whose attention (32 wide) is left out
CASES = {
    "qwen3-nvfp4-bf16": ("qwen3_moe", "NVFP4", torch.bfloat16, 64),
    "qwen3-mxfp4-bf16": ("qwen3_moe", "MXFP4", torch.bfloat16, 64),
    "qwen3-fp8-bf16": ("qwen3_moe", "FP8", torch.bfloat16, 64),
    "mixtral-nvfp4-fp16": ("mixtral", "NVFP4", torch.float16, 64),
    "mixtral-w4a16-asym-bf16": ("mixtral", "W4A16_ASYM", torch.bfloat16, 128),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_half_precision_experts_equal_llm_compressor_oneshot(tmp_path, case):
    architecture, scheme, dtype, width = CASES[case]
    saved, theirs, ours = (str(tmp_path / name) for name in ("float", "theirs", "ours"))
    _moe(architecture, width, width).to(dtype).save_pretrained(saved)
    ignore = ["lm_head", r"re:.*(mlp|block_sparse_moe)\.(gate|router)$"]
    if width == 128:
        ignore.append(r"re:.*self_attn.*")
    generator = torch.Generator().manual_seed(1)
    samples = [torch.randint(1, 64, (12,), generator=generator) for _ in range(3)]

    from llmcompressor.modifiers.quantization import QuantizationModifier

    def load():
        return transformers.AutoModelForCausalLM.from_pretrained(saved, dtype="auto").eval()

    llm_compressor_oneshot(load(), samples, QuantizationModifier(targets="Linear", scheme=scheme, ignore=ignore), theirs)
    model = load()
    model.set_attn_implementation("eager")  # as llm-compressor calibrates
    experts = next(type(module).__name__ for module in model.modules() if qstats.experts.expert_count(module))
    plan = qstats.Recipe.from_scheme(scheme, ignore=ignore, experts=experts, observed_dtype=dtype).resolve(model)
    states = qstats.calibrate(model, [{"input_ids": s[None]} for s in samples], plan, progress=False, all_experts=True)
    qstats.export.compressed_tensors(model, qstats.compute_qparams_tree(states, plan), ours, plan)
    our_tensors = load_file(os.path.join(ours, "model.safetensors"))
    their_tensors = load_file(os.path.join(theirs, "model.safetensors"))
    assert sorted(our_tensors) == sorted(their_tensors)
    assert any(".experts.3." in name for name in their_tensors)
    assert [name for name in their_tensors if not bit_equal(our_tensors[name], their_tensors[name])] == []
