"""llm-compressor's mixed-precision example recipe (``recipe_nvfp4_fp8_mixed.yaml``: FP8 down
projections, NVFP4 attention and gate/up projections whose fp4 ``input_activations`` give no
``scale_dtype``) against llm-compressor 0.14's ``oneshot`` on a tiny random Llama.

compressed-tensors 0.19 leaves such args' ``scale_dtype`` None: ``generate_gparam`` gives the
same global scale as NVFP4's (448 * 6 / amax), and the run-time group scales are not rounded to
float8 (``calculate_qparams`` rounds only to a given ``scale_dtype``); qstats reads them as
unrounded float32 group scales. Its default input observer ``minmax`` averages each group's
extremes, which qstats does not (a warning, docs/recipes.md); with ``static_minmax`` every scale
and the fake-quantized logits are oneshot's bit for bit."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from _shared import bit_equal, llm_compressor_oneshot

import qstats

transformers = pytest.importorskip("transformers")
pytest.importorskip("llmcompressor")
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402
from compressed_tensors.quantization.lifecycle.forward import fake_quantize  # noqa: E402
from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp, generate_gparam  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

# tests/e2e/vLLM/recipes/non_uniform/recipe_nvfp4_fp8_mixed.yaml of llm-compressor
RECIPE = r"""
quant_stage:
  quant_modifiers:
    QuantizationModifier:
      ignore: ["lm_head"]
      config_groups:
        group_0:
          weights: {num_bits: 8, type: float, strategy: channel, dynamic: false, symmetric: true}
          input_activations: {num_bits: 8, type: float, strategy: token, dynamic: true, symmetric: true}
          targets: ["re:.*\\.down_proj$"]
        group_1:
          weights:
            num_bits: 4
            type: float
            strategy: tensor_group
            dynamic: false
            symmetric: true
            group_size: 16
            scale_dtype: float8_e4m3fn
          input_activations:
            num_bits: 4
            type: float
            strategy: tensor_group
            dynamic: local
            symmetric: true
            group_size: 16%s
          targets:
            - "re:.*self_attn\\.(k|o|q|v)_proj$"
            - "re:.*\\.(gate|up)_proj$"
"""
AS_WRITTEN = RECIPE % ""
STATIC = RECIPE % "\n            observer: static_minmax"


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    path = str(tmp_path_factory.mktemp("mixed_llama"))
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    generator = torch.Generator().manual_seed(1)
    return path, [torch.randint(1, 64, (12,), generator=generator) for _ in range(3)]


def _load(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    model.set_attn_implementation("eager")
    return model


def _oneshot(path, samples, recipe, out):
    """oneshot's model, its logits on the first sample, and the tensors it saved."""
    model = llm_compressor_oneshot(_load(path), samples, recipe)
    with torch.no_grad():
        logits = model(samples[0][None]).logits
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(str(out), save_compressed=True)
    return logits, load_file(os.path.join(out, "model.safetensors"))


def _qstats(path, samples, recipe):
    model = _load(path)
    plan = recipe.resolve(model)
    states = qstats.calibrate(model, [{"input_ids": s[None]} for s in samples], plan, progress=False)
    qparams = qstats.compute_qparams_tree(states, plan)
    with torch.no_grad(), qstats.fake_quantized(model, qparams, plan):
        logits = model(samples[0][None]).logits
    return qparams, logits


def test_fp4_local_inputs_without_scale_dtype_fake_quantize_as_compressed_tensors():
    """``QuantizationArgs`` fills no scale_dtype; the run-time group scales under a global scale are
    compressed-tensors' (``compute_dynamic_scales_and_zp``), unrounded, and so are the values."""
    args = QuantizationArgs(num_bits=4, type="float", strategy="tensor_group", group_size=16, dynamic="local")
    assert args.scale_dtype is None
    spec = qstats.QuantSpec.from_compressed_tensors(args)
    assert spec.scale_dtype == "float32"
    g = torch.Generator().manual_seed(0)
    for scale in (3.0, 1e-3, 40.0):
        x = torch.randn(2, 12, 128, generator=g) * scale
        x[0, 0, :16] = 0.0  # an all-zero group: compressed-tensors' float32 eps scale
        wide = x.abs().amax() * 1.3  # a calibrated range wider than this tensor's
        global_scale = generate_gparam(-wide.reshape(1), wide.reshape(1))
        assert torch.equal(global_scale, qstats.compute_qparams(qstats.minmax(spec).update(
            qstats.minmax(spec).init(x * 1.3), x * 1.3), spec).global_scale.reshape(1))
        group_scales, zero_points = compute_dynamic_scales_and_zp(x, args, None, global_scale=global_scale)
        assert group_scales.dtype == torch.float32 and not torch.equal(
            group_scales, group_scales.to(torch.float8_e4m3fn).float())  # not rounded to float8
        theirs = fake_quantize(x, group_scales, zero_points, args, global_scale=global_scale)
        calibrated = qstats.QParams(torch.ones(1), torch.zeros(1), global_scale.reshape(()), torch.ones(1, dtype=bool))
        ours = qstats.calibration.runtime_qparams(x, spec, calibrated)
        assert torch.equal(ours.scale, group_scales)
        assert bit_equal(qstats.fake_quantize(x, ours, spec), theirs)


def test_fp4_weights_without_scale_dtype_are_refused():
    """Weights: compressed-tensors fake-quantizes with unrounded group scales, but its NVFP4
    compressor packs the codes of those scales and stores the scales cast to float8."""
    args = QuantizationArgs(num_bits=4, type="float", strategy="tensor_group", group_size=16)
    with pytest.raises(ValueError, match="dynamic='local' activations only: compressed-tensors fake-quantizes"):
        qstats.QuantSpec.from_compressed_tensors(args)
    with pytest.raises(ValueError, match="reproduced for NVFP4 only"):  # int or fp8 tensor_group: as before
        qstats.QuantSpec.from_compressed_tensors(args.model_copy(update={"num_bits": 8}))


def test_the_recipe_as_written_warns_that_its_minmax_inputs_average_per_group(llama, tmp_path):
    """Its inputs give no observer: llm-compressor's ``minmax`` averages each group's extremes and
    takes the largest (computed here from the recorded inputs), not the tensor's average: qstats
    reads the recipe, warning so; every other scale is oneshot's."""
    path, samples = llama
    with pytest.warns(UserWarning, match="averages \\(or searches\\) the extremes of each group"):
        recipe = qstats.Recipe.from_compressed_tensors(AS_WRITTEN)
    _, saved = _oneshot(path, samples, AS_WRITTEN, tmp_path / "oneshot")
    model = _load(path)
    inputs = []
    model.model.layers[0].mlp.up_proj.register_forward_hook(lambda m, args, out: inputs.append(args[0]))
    with torch.no_grad():
        for sample in samples:
            model(sample[None])
    low = high = None
    for x in inputs:  # llm-compressor's minmax: a moving average (0.01) of each group's extremes
        groups = x.flatten(0, 1).unflatten(-1, (-1, 16))
        lo, hi = groups.amin(dim=(0, -1)), groups.amax(dim=(0, -1))
        low, high = (lo, hi) if low is None else (torch.lerp(low, lo, 0.01), torch.lerp(high, hi, 0.01))
    amax = torch.max(-low.min(), high.max()).reshape(1)
    assert bit_equal(saved["model.layers.0.mlp.up_proj.input_global_scale"], generate_gparam(-amax, amax))
    qparams, _ = _qstats(path, samples, recipe)
    ours = qparams["model.layers.0.mlp.up_proj"]["input"].global_scale.reshape(1)
    assert not torch.equal(ours, saved["model.layers.0.mlp.up_proj.input_global_scale"])
    for name, tensor in saved.items():  # weights' scales and every layer's: oneshot's
        module, _, key = name.rpartition(".")
        if key in ("weight_scale", "weight_global_scale"):
            q = qparams[module]["weight"]
            ours = q.scale if key == "weight_scale" else q.global_scale.reshape(1)
            assert bit_equal(ours.reshape(tensor.shape).to(tensor.dtype), tensor), name


def test_the_recipe_with_static_minmax_inputs_is_oneshots_bit_for_bit(llama, tmp_path):
    """Every scale oneshot writes (FP8 channel scales, NVFP4 float8 block scales, weight and input
    global scales) and the logits of oneshot's fake-quantized model (unrounded fp4 input group
    scales) are qstats'. Without scale_dtype the config oneshot writes keeps it null."""
    import json

    path, samples = llama
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        recipe = qstats.Recipe.from_compressed_tensors(STATIC)
    their_logits, saved = _oneshot(path, samples, STATIC, tmp_path / "oneshot")
    with open(tmp_path / "oneshot" / "config.json") as file:
        groups = json.load(file)["quantization_config"]["config_groups"]
    assert [group["input_activations"]["scale_dtype"] for group in groups.values()] == [None, None]
    qparams, our_logits = _qstats(path, samples, recipe)
    scales = {name: tensor for name, tensor in saved.items() if name.endswith("scale")}
    assert len(scales) == 2 * (6 * 3 + 1)  # per layer: 6 NVFP4 Linears (3 scales each), the FP8 down_proj
    for name, tensor in scales.items():
        module, _, key = name.rpartition(".")
        q = qparams[module]["weight" if key.startswith("weight") else "input"]
        ours = q.global_scale.reshape(1) if key.endswith("global_scale") else q.scale
        assert bit_equal(ours.reshape(tensor.shape).to(tensor.dtype), tensor), name
    assert torch.equal(our_logits, their_logits)
