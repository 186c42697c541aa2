"""Llama 4's stacked expert weights (transformers' ``Llama4TextExperts``: ``gate_up_proj [E, H, 2I]``, gate
the first half of its last dimension, and ``down_proj [E, I, H]``, stored transposed) read through their
`qstats.experts.StackLayout` as the per-expert ``gate_proj``/``up_proj``/``down_proj`` Linear weights
``[out, in]`` that llm-compressor 0.14's ``Llama4LinearExperts`` makes of them: ``Recipe.from_scheme`` +
``calibrate`` + ``compute_qparams_tree`` + the export write the checkpoint ``oneshot`` saves, every tensor
bit for bit; ``fake_quantized`` fake-quantizes the weights that checkpoint holds and computes the logits of that
checkpoint loaded by compressed-tensors, bit for bit (but NVFP4's, below); ``gptq_layerwise`` gives
llm-compressor's GPTQ codes."""

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

EXPERTS = "language_model.model.layers.{}.feed_forward.experts"
# int8 channel weights with dynamic per-token inputs, FP8 per-tensor with static inputs, FP8 channel with
# dynamic inputs, NVFP4 (its input global scales static), int4 groups of 128 without activations
SCHEMES = ["W8A8", "FP8", "FP8_DYNAMIC", "NVFP4", "W4A16"]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_checkpoint_and_fake_quantized_logits_equal_llm_compressor_oneshot(scheme, tmp_path, per_row_dynamic_tokens,
                                                                           single_thread_quiet):
    from llmcompressor.modifiers.quantization import QuantizationModifier

    folder, theirs, ours = (str(tmp_path / name) for name in ("float", "theirs", "ours"))
    tiny.saved("llama4", folder, scheme)
    tiny.oneshot("llama4", folder, QuantizationModifier(targets="Linear", scheme=scheme, ignore=tiny.IGNORE["llama4"]),
                 theirs)
    model, plan, qparams = tiny.qstats_export("llama4", folder, tiny.recipe("llama4", scheme), ours)
    assert plan.sites[EXPERTS.format(0)]["gate_up_proj"].layout == qstats.experts.StackLayout(transposed=True)
    our_tensors = load_file(os.path.join(ours, "model.safetensors"))
    their_tensors = load_file(os.path.join(theirs, "model.safetensors"))
    assert set(our_tensors) == set(their_tensors)
    assert f"{EXPERTS.format(1)}.3.up_proj.weight_scale" in their_tensors  # per-expert Linears, both
    assert [name for name in their_tensors if not bit_equal(our_tensors[name], their_tensors[name])] == []

    loaded = tiny.loaded_checkpoint("llama4", folder, theirs)
    with torch.no_grad(), qstats.fake_quantized(model, qparams, plan):
        for layer in range(2):
            stacked = model.get_submodule(EXPERTS.format(layer))
            linears = loaded.get_submodule(EXPERTS.format(layer))
            for e in range(stacked.num_experts):  # [H, 2I]: gate columns, then up columns, in plain torch
                gate_up = torch.cat([linears[e].gate_proj.weight.T, linears[e].up_proj.weight.T], dim=1)
                assert torch.equal(stacked.gate_up_proj[e], gate_up)
                assert torch.equal(stacked.down_proj[e], linears[e].down_proj.weight.T)
    ours_logits, their_logits, float_logits = tiny.logits(loaded, model, plan, qparams)
    assert not torch.equal(their_logits, float_logits)
    if scheme != "NVFP4":
        assert torch.equal(ours_logits, their_logits)
    # in bfloat16 the stacked experts' bmm and the linearized experts' F.linear round differently (float
    # logits 0.011 apart), which NVFP4's 4-bit activations amplify: 0.96 measured, its effect 1.0


def test_stacked_weights_are_observed_as_the_per_expert_linears(single_thread_quiet):
    """Per-channel weight states: one row per output channel of each expert's ``gate_proj`` then
    ``up_proj`` (``gate_up_proj[e, :, :I].T``, ``gate_up_proj[e, :, I:].T``) and ``down_proj``
    (``down_proj[e].T``), in plain torch; ``report`` measures those rows."""
    model = tiny.tiny("llama4")
    spec = qstats.QuantSpec(dtype="int8", mapping="symmetric", granularity=qstats.PerAxis(0))
    recipe = qstats.Recipe([qstats.Rule("Llama4TextExperts", sites=("gate_up_proj", "down_proj"), spec=spec)])
    states = qstats.calibrate(model, tiny.batches(), recipe, progress=False)
    experts = model.get_submodule(EXPERTS.format(0))
    inter = experts.expert_dim
    for e in range(experts.num_experts):
        gate_up = experts.gate_up_proj[e].detach()
        rows = torch.cat([gate_up[:, :inter].T, gate_up[:, inter:].T])
        assert torch.equal(states[EXPERTS.format(0)]["gate_up_proj"].max_val[e], rows.amax(dim=1))
        assert torch.equal(states[EXPERTS.format(0)]["down_proj"].min_val[e], experts.down_proj[e].detach().T.amin(1))
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    row = next(r for r in qstats.report(states, qparams, model, recipe, tiny.batches()).rows
               if r.module == EXPERTS.format(0) and r.site == "down_proj")
    down = experts.down_proj.detach().transpose(1, 2)  # [E, H, I]: one scale per row of H
    scale = qparams[EXPERTS.format(0)]["down_proj"].scale.reshape(down.shape[0], down.shape[1], 1)
    noise = (down - torch.clamp(torch.round(down / scale), -128, 127) * scale).double().pow(2).sum()
    assert row.sqnr_db == pytest.approx(float(10 * torch.log10(down.double().pow(2).sum() / noise)), rel=1e-6)


def test_gptq_layerwise_equals_llm_compressor_gptq(tmp_path, single_thread_quiet):
    """W4A16 GPTQ of the stacked experts, each expert's ``[out, in]`` weights (basic pipeline, every
    expert calibrated on every row of its calls): in the first layer, whose inputs do not depend on
    GPTQ, the codes of the 4 experts' ``gate_proj``/``up_proj``/``down_proj`` equal llm-compressor's
    (0.99986 measured: float rounding of the Hessian sums)."""
    codes = tiny.gptq_codes("llama4", str(tmp_path))
    assert codes["experts"][0] == 12 and codes["experts"][1] >= 0.999
    assert codes["others"][0] and codes["others"][1] >= 0.999
