"""A checkpoint written by ``qstats.export.compressed_tensors``, loaded back by compressed-tensors (its
``quantization_config`` applied to a fresh model whose stacked experts llm-compressor linearized, the
safetensors loaded strictly, ``ModelCompressor.decompress_model``), computes the logits that
``qstats.fake_quantized(model, qparams, recipe)`` computes, bit for bit: tiny random Llama, Qwen3-MoE and
Mixtral (transformers configs, no download), hand-written Rules on the stacked experts' sites.

compressed-tensors' dynamic ``"token"`` strategy gives one scale to a whole 2-D input (a linearized
expert's rows; docs/differences.md), where qstats and vLLM give one per row: the reference runs its
own function on the rows as a 3-D ``[1, rows, hidden]`` input, its per-token case."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

import qstats

transformers = pytest.importorskip("transformers")
pytest.importorskip("llmcompressor")
from compressed_tensors.compressors import ModelCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

EXPERTS = r"re:.*experts$"
INT8_CHANNEL = qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0))
FP8_TOKEN = qstats.QuantSpec(dtype="fp8_e4m3fn", granularity=qstats.PerToken())
INT8_TENSOR = qstats.QuantSpec.from_compressed_tensors(dict(num_bits=8, type="int", symmetric=True, strategy="tensor"))


def _model(family: str):
    torch.manual_seed(0)
    if family == "llama":
        config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        return transformers.LlamaForCausalLM(config).eval()
    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(vocab_size=96, hidden_size=64, intermediate_size=128,
                                             moe_intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                             num_key_value_heads=1, head_dim=32, num_experts=4, num_experts_per_tok=2,
                                             decoder_sparse_step=1, mlp_only_layers=[])
        return transformers.Qwen3MoeForCausalLM(config).eval()
    config = transformers.MixtralConfig(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_local_experts=4,
                                        num_experts_per_tok=2)
    return transformers.MixtralForCausalLM(config).eval()


def _checkpoint_names_as_modules(text: str) -> str:
    """Mixtral's checkpoint names (``block_sparse_moe``, ``w1``/``w2``/``w3``) as the linearized model's."""
    for saved, module in (("block_sparse_moe", "mlp"), (".w1.", ".gate_proj."), (".w3.", ".up_proj."),
                          (".w2.", ".down_proj.")):
        text = text.replace(saved, module)
    return text.replace('.w1"', '.gate_proj"').replace('.w3"', '.up_proj"').replace('.w2"', '.down_proj"')


def _loaded(family: str, folder: str, dtype=torch.float32):
    """A fresh model (other float weights) holding the checkpoint, as compressed-tensors decompresses it."""
    from llmcompressor.modeling.moe.linearize import linearize_moe

    fresh = _model(family).to(dtype)
    fresh.set_attn_implementation("eager")
    with torch.no_grad():
        for param in fresh.parameters():
            param.normal_()  # every weight must come from the checkpoint
    if family != "llama":
        linearize_moe(fresh)
        fresh.to(dtype)  # its Linears are made in the default dtype
    with open(os.path.join(folder, "config.json")) as file:
        config = json.loads(_checkpoint_names_as_modules(file.read()))["quantization_config"]
    config = QuantizationConfig.model_validate(config)
    apply_quantization_config(fresh, config)
    compressor = ModelCompressor(quantization_config=config)
    compressor.compress_model(fresh)
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    fresh.load_state_dict({_checkpoint_names_as_modules(name): tensor for name, tensor in tensors.items()},
                          strict=True)
    compressor.decompress_model(fresh)
    return fresh


def _logits(family: str, recipe, folder: str, dtype=torch.float32) -> tuple:
    """``(fake_quantized logits, loaded checkpoint logits, float logits, export warnings)``."""
    model = _model(family).to(dtype)
    model.set_attn_implementation("eager")
    generator = torch.Generator().manual_seed(1)
    batches = [{"input_ids": torch.randint(0, 96, (2, 8), generator=generator)} for _ in range(2)]
    plan = recipe.resolve(model)
    states = qstats.calibrate(model, batches, plan, progress=False, all_experts=family != "llama")
    qparams = qstats.compute_qparams_tree(states, plan)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qstats.export.compressed_tensors(model, qparams, folder, plan)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = _loaded(family, folder, dtype)
    x = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        with qstats.fake_quantized(model, qparams, plan):
            ours = model(input_ids=x).logits
        theirs, float_logits = loaded(input_ids=x).logits, model(input_ids=x).logits
    return ours, theirs, float_logits, [str(w.message) for w in caught]


RECIPES = {
    # the routed hidden states only: down_proj's input stays float, in the checkpoint too
    "experts input dynamic": [qstats.Rule(EXPERTS, sites=("gate_up_proj", "down_proj"), spec=INT8_CHANNEL),
                              qstats.Rule(EXPERTS, sites=("input",), spec=FP8_TOKEN)],
    "experts inputs dynamic": [qstats.Rule(EXPERTS, sites=("gate_up_proj", "down_proj"), spec=INT8_CHANNEL),
                               qstats.Rule(EXPERTS, sites=("input", "down_proj.input"), spec=FP8_TOKEN)],
    "experts down_proj input dynamic": [qstats.Rule(EXPERTS, sites=("gate_up_proj", "down_proj"), spec=INT8_CHANNEL),
                                        qstats.Rule(EXPERTS, sites=("down_proj.input",), spec=FP8_TOKEN)],
    "experts input static": [qstats.Rule(EXPERTS, sites=("gate_up_proj", "down_proj"), spec=INT8_CHANNEL),
                             qstats.Rule(EXPERTS, sites=("input",), spec=INT8_TENSOR)],
    "experts gate_up_proj only": [qstats.Rule(EXPERTS, sites=("gate_up_proj",), spec=INT8_CHANNEL)],
    "linear inputs only": [qstats.Rule("Linear", sites=("input",), spec=FP8_TOKEN)],
    "linear weights and static outputs": [qstats.Rule("Linear", sites=("weight",), spec=INT8_CHANNEL),
                                          qstats.Rule("Linear", sites=("output",), spec=INT8_TENSOR)],
}


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_moe_checkpoint_logits_equal_fake_quantized(family, name, tmp_path, per_row_dynamic_tokens,
                                                    single_thread_quiet):
    recipe = qstats.Recipe(RECIPES[name], ignore=["lm_head"])
    ours, theirs, float_logits, _ = _logits(family, recipe, str(tmp_path))
    assert (theirs - float_logits).abs().max() > 1e-5  # the quantization shows in the logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


@pytest.mark.parametrize("scheme", ["FP8", "FP8_DYNAMIC", "W8A8", "NVFP4", "MXFP4"])
def test_bfloat16_qwen3_moe_preset_checkpoint_logits_equal_fake_quantized(scheme, tmp_path, per_row_dynamic_tokens,
                                                                           single_thread_quiet):
    """Presets on the Linears and the stacked experts of a bfloat16 model (compressed-tensors decompresses
    NVFP4 and MX weights in bfloat16: a float32 model's would be rounded, docs/differences.md)."""
    recipe = qstats.Recipe.from_scheme(scheme, ignore=["lm_head"], observed_dtype="bfloat16",
                                       experts="Qwen3MoeExperts")
    ours, theirs, float_logits, _ = _logits("qwen3_moe", recipe, str(tmp_path), torch.bfloat16)
    assert (theirs - float_logits).abs().max() > 1e-3
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_llama_checkpoint_with_ignored_q_proj_logits_equal_fake_quantized(tmp_path, single_thread_quiet):
    """q_proj left out of its fused q/k/v group (ignored): written float, as fake_quantized leaves it."""
    rules = [qstats.Rule("Linear", sites=("weight",), spec=INT8_CHANNEL),
             qstats.Rule("Linear", sites=("input",), spec=FP8_TOKEN)]
    recipe = qstats.Recipe(rules, ignore=["lm_head", "re:.*q_proj"])
    ours, theirs, float_logits, _ = _logits("llama", recipe, str(tmp_path))
    assert (theirs - float_logits).abs().max() > 1e-3
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_integer_activations_of_another_convention_warn(tmp_path, single_thread_quiet):
    """Dynamic per-tensor int8 inputs under torch.ao's convention: fake_quantized rounds x * (1 / scale),
    the loaded checkpoint x / scale; on this Mixtral some codes differ (logits apart), and the export
    says so, naming the sites. Under compressed-tensors' convention the two agree bit for bit."""
    torch_ao = qstats.QuantSpec(dtype="int8")
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("input",), spec=torch_ao, dynamic=True)], ignore=["lm_head"])
    ours, theirs, _, messages = _logits("mixtral", recipe, str(tmp_path / "torch_ao"))
    assert any("round(x / scale)" in message and "o_proj/input" in message for message in messages)
    assert (ours - theirs).abs().max() > 0
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("input",), spec=INT8_TENSOR, dynamic=True)],
                           ignore=["lm_head"])
    ours, theirs, _, messages = _logits("mixtral", recipe, str(tmp_path / "compressed_tensors"))
    assert not any("round(x / scale)" in message for message in messages)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
