"""NVFP4 input global scales of a tiny Qwen3-MoE against llm-compressor 0.14's own ``oneshot``
(issue 22, item 9): the attention projections, and the experts' gate/up/down projections routed
(qstats' default, llm-compressor's ``moe_calibrate_all_experts=False``) or with every token sent
to every expert (``calibrate(all_experts=True)``, llm-compressor's default). llm-compressor's
sequential pipeline (its default for data-driven modifiers) runs this model's attention without
its causal mask, which is what made its ``o_proj`` input global scales differ: they equal those
qstats observes on the same model made non-causal."""


import pytest
import torch
from _oneshot import saved_random_model, token_samples
from _shared import llm_compressor_oneshot, qwen3_moe_config, word_tokenizer

import qstats

transformers = pytest.importorskip("transformers")
pytest.importorskip("llmcompressor")
pytest.importorskip("tokenizers")

EXPERTS = 8
TOKENS = 12


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny random Qwen3-MoE saved to disk (llm-compressor reads its config from there), the
    calibration samples and a stand-in tokenizer (the samples are token ids already)."""
    config = qwen3_moe_config(num_experts=EXPERTS, num_experts_per_tok=2, moe_intermediate_size=16)
    path = saved_random_model(tmp_path_factory, "tiny_qwen3_moe", transformers.Qwen3MoeForCausalLM, config)
    return path, token_samples(4, TOKENS), word_tokenizer()


def _load(path):
    return transformers.Qwen3MoeForCausalLM.from_pretrained(path).eval()


def _oneshot(saved, pipeline, all_experts) -> dict:
    """``{module path: input_global_scale}`` of llm-compressor's NVFP4 oneshot."""
    from llmcompressor.modifiers.quantization import QuantizationModifier

    path, samples, tokenizer = saved
    model = llm_compressor_oneshot(_load(path), samples, QuantizationModifier(targets="Linear", scheme="NVFP4",
                                                                              ignore=["lm_head"]),
                                   pipeline=pipeline, tokenizer=tokenizer, moe_calibrate_all_experts=all_experts)
    return {name: module.input_global_scale.reshape(()) for name, module in model.named_modules()
            if hasattr(module, "input_global_scale")}


def _qstats(model, samples, all_experts) -> dict:
    """``{llm-compressor's module path: input global scale}`` of qstats on the same samples."""
    from compressed_tensors.quantization.quant_scheme import NVFP4

    spec = qstats.QuantSpec.from_compressed_tensors(NVFP4["input_activations"])
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("input",), spec=spec),
                            qstats.Rule("Qwen3MoeExperts", sites=("input", "down_proj.input"), spec=spec)],
                           ignore=["re:(.*\\.)?lm_head"])
    states = qstats.calibrate(model, [s[None] for s in samples], recipe, progress=False, all_experts=all_experts)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    scales = {}
    for path, entry in qparams.items():
        if not path.endswith("experts"):
            scales[path] = entry["input"].global_scale.reshape(())
            continue
        for expert in range(EXPERTS):  # unpacked as llm-compressor names them
            for name, site in (("gate_proj", "input"), ("up_proj", "input"), ("down_proj", "down_proj.input")):
                scales[f"{path}.{expert}.{name}"] = entry[site].global_scale[expert]
    return scales


def _assert_equal_scales(ours: dict, theirs: dict):
    assert sorted(ours) == sorted(theirs)
    for name, scale in theirs.items():
        # llm-compressor runs unpacked gate/up Linears where the model multiplies by the fused
        # stack: last-bit differences, also in the layers after
        torch.testing.assert_close(ours[name], scale.float(), rtol=1e-6, atol=0, msg=name)


@pytest.mark.parametrize("all_experts", [False, True])
def test_input_global_scales_equal_llmcompressor_oneshot(saved, all_experts):
    path, samples, _ = saved
    ours = _qstats(_load(path), samples, all_experts)
    _assert_equal_scales(ours, _oneshot(saved, "basic", all_experts))
    gate = [ours[f"model.layers.0.mlp.experts.{e}.gate_proj"] for e in range(EXPERTS)]
    assert (len(set(map(float, gate))) == 1) == all_experts  # all tokens: one range for every expert


def test_llmcompressor_sequential_pipeline_runs_attention_without_its_causal_mask(saved):
    """The cause of the ``o_proj`` difference: llm-compressor's default (sequential) pipeline
    gives the input global scales of this model made non-causal (every token attending to every
    token), not those of the model; qstats observes the model's own forward."""
    path, samples, _ = saved
    sequential = _oneshot(saved, "sequential", True)
    model = _load(path)
    assert float(sequential["model.layers.0.self_attn.o_proj"]) != pytest.approx(
        float(_qstats(model, samples, True)["model.layers.0.self_attn.o_proj"]), rel=0.1)
    model.set_attn_implementation("eager")
    for layer in model.model.layers:
        layer.self_attn.is_causal = False

    class _Bidirectional(torch.nn.Module):
        """The model called with an all-zero additive mask: no causal masking."""

        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids):
            return self.inner(input_ids, attention_mask=torch.zeros(1, 1, TOKENS, TOKENS))

    wrapped = _Bidirectional(model)
    ours = {name.removeprefix("inner."): scale for name, scale in _qstats(wrapped, samples, True).items()}
    _assert_equal_scales(ours, sequential)
