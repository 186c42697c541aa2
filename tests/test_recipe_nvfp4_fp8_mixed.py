"""llm-compressor's mixed-precision example recipe (``recipe_nvfp4_fp8_mixed.yaml``: FP8 down
projections, NVFP4 attention and gate/up projections whose fp4 ``input_activations`` give no
``scale_dtype``) against llm-compressor 0.14's ``oneshot`` on a tiny random Llama.

compressed-tensors 0.19 leaves such args' ``scale_dtype`` None: ``generate_gparam`` gives the
same global scale as NVFP4's (448 * 6 / amax), and the run-time group scales are not rounded to
float8 (``calculate_qparams`` rounds only to a given ``scale_dtype``); qstats reads them as
unrounded float32 group scales. Its default input observer ``minmax`` averages each group of 16
features' extremes over the batches (``mse`` searches each group's range), and qstats observes such
inputs per group too (`column_groups`): under these and ``static_minmax`` every
scale and the fake-quantized logits are oneshot's bit for bit."""

from __future__ import annotations

import warnings

import pytest
import torch
from _oneshot import load_eager, oneshot_logits_and_tensors, qparams_and_fake_quantized_logits, saved_llama, token_samples
from _shared import bit_equal

import qstats

transformers = pytest.importorskip("transformers")
pytest.importorskip("llmcompressor")
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402
from compressed_tensors.quantization.lifecycle.forward import fake_quantize  # noqa: E402
from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp, generate_gparam  # noqa: E402

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
    return saved_llama(tmp_path_factory, "mixed_llama"), token_samples(3)


def _qstats(path, samples, recipe):
    model = load_eager(path)
    return qparams_and_fake_quantized_logits(model, samples, recipe.resolve(model))


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


def test_the_recipe_as_written_averages_each_group_as_oneshot(llama, tmp_path):
    """Its inputs give no observer: llm-compressor's ``minmax`` averages each group's extremes over the
    batches and takes the largest (computed here from the recorded inputs, in its arithmetic
    ``average * (1 - c) + batch * c``), not the whole tensor's average; qstats reads the recipe without
    a warning and observes those inputs per group of features, giving oneshot's global scale."""
    path, samples = llama
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        recipe = qstats.Recipe.from_compressed_tensors(AS_WRITTEN)
    _, saved = oneshot_logits_and_tensors(path, samples, AS_WRITTEN, tmp_path / "oneshot")
    model = load_eager(path)
    inputs = []
    model.model.layers[0].mlp.up_proj.register_forward_hook(lambda m, args, out: inputs.append(args[0]))
    with torch.no_grad():
        for sample in samples:
            model(sample[None])
    low = high = whole_low = whole_high = None
    for x in inputs:  # llm-compressor's minmax: a moving average (0.01) of each group's extremes
        groups = x.flatten(0, 1).unflatten(-1, (-1, 16))
        lo, hi = groups.amin(dim=(0, -1)), groups.amax(dim=(0, -1))
        low, high = (lo, hi) if low is None else (low * 0.99 + lo * 0.01, high * 0.99 + hi * 0.01)
        lo, hi = x.min(), x.max()  # the whole tensor's
        whole_low, whole_high = (lo, hi) if whole_low is None else (whole_low * 0.99 + lo * 0.01,
                                                                    whole_high * 0.99 + hi * 0.01)
    amax = torch.max(-low.min(), high.max()).reshape(1)
    whole = torch.max(-whole_low, whole_high).reshape(1)
    theirs = saved["model.layers.0.mlp.up_proj.input_global_scale"]
    assert bit_equal(theirs, generate_gparam(-amax, amax))
    assert not torch.equal(theirs, generate_gparam(-whole, whole))  # the grouping matters on these batches
    qparams, _ = _qstats(path, samples, recipe)
    assert bit_equal(qparams["model.layers.0.mlp.up_proj"]["input"].global_scale.reshape(1), theirs)


@pytest.mark.parametrize("observer", ["", "\n            observer: static_minmax", "\n            observer: mse",
                                      "\n            observer: memoryless_mse"],
                         ids=["as_written", "static_minmax", "mse", "memoryless_mse"])
def test_the_recipe_is_oneshots_bit_for_bit(llama, tmp_path, observer):
    """Every scale oneshot writes (FP8 channel scales, NVFP4 float8 block scales, weight and input
    global scales) and the logits of oneshot's fake-quantized model (unrounded fp4 input group
    scales) are qstats', under the moving-average ``minmax`` the recipe implies, ``static_minmax``
    and the (moving-average or latest) per-group ``mse`` searches. Without scale_dtype the config
    oneshot writes keeps it null."""
    import json

    path, samples = llama
    text = RECIPE % observer
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        recipe = qstats.Recipe.from_compressed_tensors(text)
    their_logits, saved = oneshot_logits_and_tensors(path, samples, text, tmp_path / "oneshot")
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


def test_column_groups_are_llm_compressors_group_statistics():
    """`column_groups` keeps llm-compressor's ``minmax`` statistics of a tensor_group input (each group's
    moving-average extremes over batches of any length); a padding mask leaves its rows out, and an
    input whose features the group does not divide, or a weight that is no prefix of its shape, is refused."""
    from llmcompressor.observers import Observer
    from qstats.observers._column_groups import column_groups

    args = QuantizationArgs(num_bits=4, type="float", strategy="tensor_group", group_size=16, dynamic="local")
    spec = qstats.QuantSpec.from_compressed_tensors(args).replace(granularity=qstats.PerAxis(1))
    ours = column_groups(qstats.moving_average_minmax(spec), 16)
    theirs = Observer.load_from_registry("minmax", base_name="input", args=args)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(2, tokens, 64, generator=g) * s for tokens, s in ((5, 1.0), (9, 3.0), (3, 2.0))]
    state = ours.init(batches[0])
    for x in batches:
        theirs(x)
        state = ours.update(state, x)
    assert bit_equal(state.min_val, theirs.min_vals) and bit_equal(state.max_val, theirs.max_vals)
    x, keep = batches[1], torch.rand(2, 9, generator=g) > 0.5
    masked = ours.update(ours.init(x), x, keep)
    assert torch.equal(masked.max_val, x[keep].unflatten(-1, (4, 16)).amax(dim=(0, 2)))
    with pytest.raises(ValueError, match="groups of 16 features need a last dimension that 16 divides"):
        ours.update(state, torch.randn(3, 40))
    with pytest.raises(ValueError, match=r"does not match the leading \(row\) dimensions"):
        ours.update(state, x, torch.ones(9))
    with pytest.raises(TypeError, match="weight must be a tensor or None, got list"):  # as every observer's
        ours.update(state, x, [1.0] * 2)
