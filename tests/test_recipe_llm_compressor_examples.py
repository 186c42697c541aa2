"""llm-compressor's example recipes (``tests/e2e/vLLM/recipes`` of llm-compressor, as YAML text) read
as a migrating user reads them: FP8 block and an FP8 kv cache reproduce ``oneshot``'s scales (and the
block recipe its fake-quantized logits) on a tiny random Llama; W4A16 under GPTQ with
``actorder: weight`` reads with a warning naming GPTQ's options as GPTQ applies them; SmoothQuant
beside the quantization, and recipes of several stages, are refused naming what is not read."""

from __future__ import annotations

import warnings

import pytest
import torch
from _oneshot import load_eager, oneshot_logits_and_tensors, qparams_and_fake_quantized_logits, saved_llama, token_samples
from _shared import bit_equal

import qstats

transformers = pytest.importorskip("transformers")
pytest.importorskip("llmcompressor")

FP8_BLOCK = """
quant_stage:
  quant_modifiers:
    QuantizationModifier:
      targets: "Linear"
      scheme: "FP8_BLOCK"
      ignore: ["lm_head", "re:.*mlp.gate$"]
"""
KV_CACHE = """
quant_stage:
  quant_modifiers:
    QuantizationModifier:
      kv_cache_scheme:
        {num_bits: 8, type: float, symmetric: true, strategy: tensor}
"""
ACTORDER = """
quant_stage:
  quant_modifiers:
    GPTQModifier:
      ignore: ["lm_head", "re:vision_tower.*"]
      config_groups:
        group_0:
          weights: {num_bits: 4, type: "int", symmetric: true, strategy: "group", group_size: 128, actorder: "weight"}
          targets: ["Linear"]
"""
SMOOTHQUANT_W8A8 = """
quant_stage:
  quant_modifiers:
    SmoothQuantModifier:
      smoothing_strength: 0.8
    GPTQModifier:
      ignore: [lm_head]
      config_groups:
        group_0:
          weights: {num_bits: 8, type: int, symmetric: true, strategy: channel}
          input_activations: {num_bits: 8, type: int, symmetric: true, strategy: tensor}
          targets: [Linear]
"""
SPARSE_THEN_FP8 = """
sparsity_stage:
  run_type: oneshot
  sparsity_modifiers:
    SparseGPTModifier: {sparsity: 0.5, mask_structure: "2:4", targets: ["Linear"], ignore: ["re:.*lm_head"]}
quantization_stage:
  run_type: oneshot
  quantization_modifiers:
    QuantizationModifier: {targets: ["Linear"], ignore: ["lm_head"], scheme: "FP8_DYNAMIC"}
"""
TWO_QUANTIZATION_STAGES = """
attention_stage:
  quant_modifiers:
    GPTQModifier: {ignore: ["lm_head"], scheme: "W4A16", targets: ["re:.*self_attn\\\\.(k|q|o|v)_proj$"]}
mlp_stage:
  quant_modifiers:
    QuantizationModifier: {ignore: ["lm_head"], scheme: "FP8_DYNAMIC", targets: ["re:.*mlp\\\\.(down|gate|up)_proj$"]}
"""


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return saved_llama(tmp_path_factory, "examples_llama"), token_samples(3)


def _both(llama, text, out):
    """(oneshot's logits, the scales it saved, qstats' qparams, qstats' fake-quantized logits)."""
    path, samples = llama
    their_logits, saved = oneshot_logits_and_tensors(path, samples, text, out)
    model = load_eager(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the ignore entry "re:.*mlp.gate$" names no Llama module
        plan = qstats.Recipe.from_compressed_tensors(text).resolve(model)
    qparams, our_logits = qparams_and_fake_quantized_logits(model, samples, plan)
    return their_logits, {k: v for k, v in saved.items() if k.endswith("scale")}, qparams, our_logits


def test_fp8_block_recipe_is_oneshots(llama, tmp_path):
    their_logits, scales, qparams, our_logits = _both(llama, FP8_BLOCK, tmp_path / "oneshot")
    assert len(scales) == 2 * 7  # one weight_scale per Linear; the inputs' per-group scales are dynamic
    for name, tensor in scales.items():
        ours = qparams[name.rpartition(".")[0]]["weight"].scale
        assert bit_equal(ours.reshape(tensor.shape).to(tensor.dtype), tensor), name
    assert torch.equal(our_logits, their_logits)


def test_kv_cache_recipe_is_oneshots(llama, tmp_path):
    _, scales, qparams, _ = _both(llama, KV_CACHE, tmp_path / "oneshot")
    assert sorted(scales) == sorted(f"model.layers.{i}.self_attn.{s}_scale" for i in (0, 1) for s in "kv")
    for name, tensor in scales.items():
        module, _, key = name.rpartition(".")
        ours = qparams[module][key[0]].scale
        assert bit_equal(ours.reshape(tensor.shape).to(tensor.dtype), tensor), name


def test_gptq_actorder_recipe_warns_with_the_actorder_gptq_applies():
    """GPTQModifier's own ``actorder`` is a "static" sentinel; the warning names the config group's."""
    with pytest.warns(UserWarning, match="algorithm options .*'actorder': 'weight'"):
        recipe = qstats.Recipe.from_compressed_tensors(ACTORDER)
    without = qstats.Recipe.from_compressed_tensors({"config_groups": {"group_0": {
        "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128},
        "targets": ["Linear"]}}, "ignore": ["lm_head", "re:vision_tower.*"]})
    assert [(r.sites, r.spec, r.observer) for r in recipe.rules] == [(r.sites, r.spec, r.observer) for r in without.rules]
    assert recipe.ignore == without.ignore


@pytest.mark.parametrize("text, named", [
    (SMOOTHQUANT_W8A8, r"\['SmoothQuantModifier'\]"),
    (SPARSE_THEN_FP8, r"\['SparseGPTModifier'\]"),
    (TWO_QUANTIZATION_STAGES, r"\['GPTQModifier', 'QuantizationModifier'\] \(several quantization modifiers\)"),
], ids=["smoothquant", "sparsity_stage", "two_quantization_stages"])
def test_recipes_of_other_modifiers_or_several_stages_are_refused_naming_them(text, named):
    with pytest.raises(ValueError, match="holds one quantization modifier and nothing else; it holds .*" + named):
        qstats.Recipe.from_compressed_tensors(text)
