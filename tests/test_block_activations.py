"""FP8_BLOCK's dynamic per-group-128 input activations on a Linear whose input width 128 does not
divide (a Llama with ``intermediate_size=96``: ``down_proj`` reads 96 features; Qwen3-MoE with
``moe_intermediate_size=96``).

compressed-tensors 0.19 has no smaller last group for dynamic group activations: its forward
(``compute_dynamic_scales_and_zp``) unflattens the features into ``(ceil(n / 128), 128)`` and
raises, on the checkpoint llm-compressor 0.14's ``oneshot`` writes for such a model too. qstats
refuses these sites, in ``calibrate`` and ``fake_quantized``, and says so.
"""

from __future__ import annotations

import pytest
import torch
from _shared import llm_compressor_oneshot, qwen3_moe_config, word_tokenizer

import qstats

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

IGNORE = ["lm_head", "re:.*mlp.gate$"]
SAYS_CT_CANNOT = r"compressed-tensors 0\.19 cannot run .*llm-compressor 0\.14's oneshot .* writes a checkpoint"


def _llama(intermediate_size=96):
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=128, intermediate_size=intermediate_size, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def _samples():
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(1, 64, (8,), generator=generator) for _ in range(2)]


@pytest.mark.parametrize("width", [96, 200])
def test_compressed_tensors_dynamic_groups_need_a_divisible_width(width):
    """compressed-tensors' own dynamic group quantization of an activation: 256 features run, 96
    (one short group) and 200 (a partial last group) raise."""
    from compressed_tensors.quantization import QuantizationStatus, preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import forward_quantize

    args = preset_name_to_scheme("FP8_BLOCK", ["Linear"]).input_activations
    assert args.dynamic is True and args.group_size == 128
    module = torch.nn.Linear(1, 1)
    module.quantization_status = QuantizationStatus.FROZEN
    forward_quantize(module, torch.randn(2, 3, 256), "input", args)
    with pytest.raises(RuntimeError, match="unflatten"):
        forward_quantize(module, torch.randn(2, 3, width), "input", args)


def test_llm_compressor_writes_a_checkpoint_compressed_tensors_cannot_run(tmp_path):
    """llm-compressor's FP8_BLOCK oneshot of the Llama with 96 intermediate features saves a
    checkpoint; loaded back (compressed-tensors decompresses it), its forward raises at
    down_proj's input."""
    from llmcompressor.modifiers.quantization import QuantizationModifier

    path, out = str(tmp_path / "model"), str(tmp_path / "theirs")
    _llama().save_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    modifier = QuantizationModifier(targets="Linear", scheme="FP8_BLOCK", ignore=["lm_head"])
    llm_compressor_oneshot(model, _samples(), modifier, out, tokenizer=word_tokenizer())
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert loaded.model.layers[0].mlp.down_proj.quantization_scheme.input_activations.group_size == 128
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"unflatten.*\(96\)"):
        loaded(_samples()[0][None])


def test_calibrate_refusal_says_compressed_tensors_cannot_run():
    model = _llama()
    recipe = qstats.Recipe.from_scheme("FP8_BLOCK", targets="Linear", ignore=["lm_head"])
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.down_proj' site 'input'.*" + SAYS_CT_CANNOT):
        qstats.calibrate(model, [s[None] for s in _samples()], recipe, progress=False)


def test_fake_quantized_refusal_names_the_site_and_says_compressed_tensors_cannot_run():
    model = _llama()
    recipe = qstats.Recipe.from_scheme("FP8_BLOCK", targets="Linear", ignore=["lm_head"])
    qparams = {"model.layers.0.mlp.down_proj": {"input": None}}  # run-time scales: nothing calibrated
    pattern = r"fake_quantized: module 'model\.layers\.0\.mlp\.down_proj' site 'input'.*" + SAYS_CT_CANNOT
    with qstats.fake_quantized(model, qparams, recipe), torch.no_grad(), pytest.raises(ValueError, match=pattern):
        model(_samples()[0][None])


def test_stacked_experts_refusal_says_compressed_tensors_cannot_run():
    """Qwen3-MoE with ``moe_intermediate_size=96``: the experts' routed ``down_proj.input`` (gate and up
    ignored: their fused 128-row blocks would straddle the 96-row halves, which the recipe refuses first)."""
    config = qwen3_moe_config(hidden_size=128, intermediate_size=128, moe_intermediate_size=96, num_experts=4,
                              head_dim=64)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    ignore = IGNORE + ["re:.*experts.*gate_proj", "re:.*experts.*up_proj"]
    recipe = qstats.Recipe.from_scheme("FP8_BLOCK", ignore=ignore, experts="Qwen3MoeExperts")
    with pytest.raises(ValueError, match=r"site 'down_proj\.input'.*" + SAYS_CT_CANNOT):
        qstats.calibrate(model, [s[None] for s in _samples()], recipe, progress=False)
