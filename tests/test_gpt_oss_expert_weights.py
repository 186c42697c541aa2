"""GPT-OSS' stacked expert weights (transformers' ``GptOssExperts``: ``gate_up_proj [E, H, 2I]`` stored
transposed, gate its columns ``0::2`` and up ``1::2``, ``down_proj [E, I, H]``, biases ``gate_up_proj_bias
[E, 2I]`` and ``down_proj_bias [E, H]``) read through their `qstats.experts.StackLayout` as the per-expert
``gate_proj``/``up_proj``/``down_proj`` Linears ``[out, in]`` (with their biases) that llm-compressor 0.14's
``GptOssLinearExperts`` makes of them: ``Recipe.from_scheme`` + ``calibrate`` + ``compute_qparams_tree`` +
the export write the checkpoint ``oneshot`` saves (every weight, scale, zero point, packed weight, global
scale and bias bit for bit); ``fake_quantized`` fake-quantizes the weights that checkpoint holds, and its
logits are those of the checkpoint loaded by compressed-tensors up to float rounding; ``gptq_layerwise``
gives llm-compressor's GPTQ codes. Experts of another class stored transposed or interleaved stay refused.

The two models compute the experts' activations in other float operations: transformers' stacked
``x @ gate_up_proj[e] + bias`` over the interleaved columns, llm-compressor's linearized ``F.linear`` per
projection. Static input scales that depend on those activations (``down_proj``'s, and those of the next
layer) then differ in the last bits, and so do the logits (measured below)."""

from __future__ import annotations

import os

import pytest
import torch

import qstats

transformers = pytest.importorskip("transformers")
pytest.importorskip("llmcompressor")

import _stacked_expert_weights as tiny  # noqa: E402
from _shared import bit_equal  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

EXPERTS = "model.layers.{}.mlp.experts"
SCHEMES = ["W8A8", "FP8", "FP8_DYNAMIC", "NVFP4", "W4A16"]
# bounds of the difference of the logits, above the largest measured (W8A8 0.0014, FP8 2.7e-7, FP8_DYNAMIC
# 3.0e-7, W4A16 3.6e-7, NVFP4 0.115), against the quantization's own effect on them (0.021, 0.77, 0.78,
# 0.82, 0.76): W8A8's int8 per-token inputs round an activation that differs in its last bits to
# another code now and then; NVFP4 runs in bfloat16, its static input global scales 1-2 units in the
# last place apart
LOGITS_ATOL = {"W8A8": 3e-3, "FP8": 1e-5, "FP8_DYNAMIC": 1e-5, "NVFP4": 0.15, "W4A16": 1e-5}


def _input_scale(name: str) -> bool:
    return name.endswith((".input_scale", ".input_global_scale"))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_checkpoint_and_fake_quantized_logits_equal_llm_compressor_oneshot(scheme, tmp_path, per_row_dynamic_tokens,
                                                                           single_thread_quiet):
    from llmcompressor.modifiers.quantization import QuantizationModifier

    folder, theirs, ours = (str(tmp_path / name) for name in ("float", "theirs", "ours"))
    tiny.saved("gpt_oss", folder, scheme)
    modifier = QuantizationModifier(targets="Linear", scheme=scheme, ignore=tiny.IGNORE["gpt_oss"])
    tiny.oneshot("gpt_oss", folder, modifier, theirs)
    model, plan, qparams = tiny.qstats_export("gpt_oss", folder, tiny.recipe("gpt_oss", scheme), ours)
    our_tensors = load_file(os.path.join(ours, "model.safetensors"))
    their_tensors = load_file(os.path.join(theirs, "model.safetensors"))
    assert set(our_tensors) == set(their_tensors)
    assert f"{EXPERTS.format(1)}.3.up_proj.bias" in their_tensors  # per-expert Linears with biases, both
    differ = [name for name in their_tensors if not bit_equal(our_tensors[name], their_tensors[name])]
    assert [name for name in differ if not _input_scale(name)] == []
    rtol = 4 * torch.finfo(next(model.parameters()).dtype).eps  # a few units in the last place of the activations
    for name in differ:  # static input scales of activations computed in other float operations
        torch.testing.assert_close(our_tensors[name], their_tensors[name], rtol=rtol, atol=0)

    loaded = tiny.loaded_checkpoint("gpt_oss", folder, theirs)
    with torch.no_grad(), qstats.fake_quantized(model, qparams, plan):
        for layer in range(2):
            stacked = model.get_submodule(EXPERTS.format(layer))
            linears = loaded.get_submodule(EXPERTS.format(layer))
            for e in range(stacked.num_experts):  # gate and up columns interleaved again, in plain torch
                gate_up = torch.stack([linears[e].gate_proj.weight.T, linears[e].up_proj.weight.T], dim=-1)
                assert torch.equal(stacked.gate_up_proj[e], gate_up.flatten(-2))
                assert torch.equal(stacked.down_proj[e], linears[e].down_proj.weight.T)
    ours_logits, their_logits, float_logits = tiny.logits(loaded, model, plan, qparams)
    difference = float((ours_logits - their_logits).abs().max())
    assert difference <= LOGITS_ATOL[scheme]
    assert difference < float((their_logits - float_logits).abs().max()) / 5


def test_gptq_layerwise_equals_llm_compressor_gptq(tmp_path, single_thread_quiet):
    """W4A16 GPTQ of the stacked experts as each expert's ``[out, in]`` weights (basic pipeline, every
    expert calibrated on every token): in the first layer, whose inputs do not depend on GPTQ, the codes
    of every expert's ``gate_proj``/``up_proj``/``down_proj`` equal llm-compressor's."""
    codes = tiny.gptq_codes("gpt_oss", str(tmp_path))
    assert codes["experts"][0] == 12 and codes["experts"][1] >= 0.999
    assert codes["others"][0] and codes["others"][1] >= 0.999


def _other_transposed_experts(model):
    """``model`` (GPT-OSS) whose experts' class is another (same transposed, interleaved stacks): a
    layout qstats does not map to llm-compressor's Linears."""
    for layer in range(2):
        experts = model.get_submodule(EXPERTS.format(layer))
        experts.__class__ = type("OtherTransposedExperts", (type(experts),), {})
    return model


def test_stacks_of_other_transposed_experts_are_refused_naming_the_module(tmp_path, single_thread_quiet):
    """A plain Rule on them calibrates (the stacks as stored), but neither the export nor GPTQ, which
    need the per-expert Linear weights, takes them; llm-compressor's own recipes are refused."""
    model = _other_transposed_experts(tiny.tiny("gpt_oss"))
    spec = qstats.QuantSpec(dtype="int8", mapping="symmetric", granularity=qstats.PerAxis(0))
    recipe = qstats.Recipe([qstats.Rule("OtherTransposedExperts", sites=("gate_up_proj", "down_proj"), spec=spec)])
    plan = recipe.resolve(model)
    assert plan.sites[EXPERTS.format(0)]["gate_up_proj"].layout is None
    qparams = qstats.compute_qparams_tree(qstats.calibrate(model, tiny.batches(), plan, progress=False), plan)
    with pytest.raises(ValueError, match=rf"{EXPERTS.format(0)}.*transposed"):
        qstats.export.compressed_tensors(model, qparams, str(tmp_path / "ours"), plan)
    assert not os.path.exists(tmp_path / "ours" / "model.safetensors")
    with pytest.raises(ValueError, match=rf"{EXPERTS.format(0)}.*transposed"):
        qstats.Recipe.from_scheme("W8A8", ignore=tiny.IGNORE["gpt_oss"]).resolve(model)
    with pytest.raises(ValueError, match=rf"experts=.*{EXPERTS.format(0)}.*transposed"):
        qstats.Recipe.from_scheme("W8A8", ignore=tiny.IGNORE["gpt_oss"], experts="OtherTransposedExperts").resolve(model)
    model.save_pretrained(str(tmp_path / "float"))
    with torch.device("meta"):
        meta = _other_transposed_experts(transformers.GptOssForCausalLM(model.config).eval())
    with pytest.raises(ValueError, match=rf"{EXPERTS.format(0)}.*transposed"):
        qstats.gptq_layerwise(meta, str(tmp_path / "float"), tiny.batches(), recipe, progress=False)
