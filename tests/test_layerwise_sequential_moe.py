"""`qstats.calibrate_layerwise` on tiny Qwen3-MoE, Mixtral and DeepSeek-V3 models (stacked experts,
``all_experts``) under ``QuantizationModifier(targets="Linear", scheme=S, ignore=["lm_head"])``, S in FP8, NVFP4 and
W8A8, against llm-compressor 0.14's ``oneshot(..., pipeline="sequential")`` (which linearizes the
experts) and against compressed-tensors' own fake quantization.

- llm-compressor's sequential pipeline runs every pass under ``DisableQuantization``: for a
  ``QuantizationModifier`` it propagates float outputs, so its checkpoint is that of the default
  ``propagate="float"``. Layer 0 and the modules outside the layers are bit for bit; layer 1's static
  input scales are within an ulp: llm-compressor propagates the outputs of its linearized experts
  (separate gate/up Linears, every token through every expert), whose float sums differ from the
  model's stacked experts in the last bits (checked below on layer 0's outputs). W8A8 (dynamic
  inputs) is bit for bit everywhere.
- ``propagate="quantized"``: layer 1's input scales equal those observed on llm-compressor's
  oneshot model with compressed-tensors' quantization enabled in layer 0 only, within the same ulp.
- The sequential pipeline calls the layers of Qwen3-MoE and Mixtral without their causal mask (an
  all-ones mask, docs/differences.md; DeepSeek-V3 keeps it). qstats is given the same attention: a
  4-D float mask of zeros, which eager attention adds exactly (a 4-D bool mask is added as ones,
  which moves softmax's last bits).
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import qstats
from _shared import bit_equal, llm_compressor_oneshot

transformers = pytest.importorskip("transformers")
pytest.importorskip("llmcompressor")

from safetensors.torch import load_file  # noqa: E402
from test_export_moe_linearized import _load, _saved  # noqa: E402

TOKENS = 12
RTOL = 2e-6  # a few float32 ulps: the linearized experts' sums (worst seen: 6.3e-7)


def _samples():
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(1, 128, (TOKENS,), generator=generator) for _ in range(2)]


def _batches(family):
    """The samples with the attention llm-compressor's sequential pipeline runs: both ways (an additive
    4-D mask of zeros) on Qwen3-MoE and Mixtral, whose layers it calls without a mask; causal on DeepSeek-V3."""
    both_ways = family in ("qwen3_moe", "mixtral")
    mask = torch.zeros(1, 1, TOKENS, TOKENS) if both_ways else torch.ones(1, TOKENS, dtype=torch.long)
    return [{"input_ids": s[None], "attention_mask": mask} for s in _samples()]


def _modifier(scheme):
    from llmcompressor.modifiers.quantization import QuantizationModifier

    return QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"])


def _input_scale(qparams, scheme) -> torch.Tensor:
    """The tensor the checkpoint's ``input_scale`` (FP8) or ``input_global_scale`` (NVFP4) holds."""
    return qparams.global_scale if scheme == "NVFP4" else qparams.scale


def _reference_layer1_scales(model, family, scheme) -> dict:
    """``{linearized Linear path: input (global) scale}`` of layer 1, observed on llm-compressor's
    calibrated model with compressed-tensors' fake quantization enabled in layer 0 alone."""
    from compressed_tensors.quantization import disable_quantization, enable_quantization
    from llmcompressor.modeling.moe.context import moe_calibration_context

    model.apply(disable_quantization)
    model.model.layers[0].apply(enable_quantization)
    plan = qstats.Recipe.from_compressed_tensors(_modifier(scheme)).resolve(model)
    with moe_calibration_context():  # every token through every linearized expert, as all_experts
        states = qstats.calibrate(model, _batches(family), plan, progress=False)
    qparams = qstats.compute_qparams_tree(states, plan)
    return {path: _input_scale(entry["input"], scheme).reshape(()) for path, entry in qparams.items()
            if ".layers.1." in path and entry.get("input") is not None}


FAMILIES = ("qwen3_moe", "mixtral", "deepseek_v3")


@pytest.fixture(scope="module", params=[(f, s) for f in FAMILIES for s in ("FP8", "NVFP4", "W8A8")],
                ids=lambda p: "-".join(p))
def oneshot(request, tmp_path_factory):
    """``(family, scheme, float checkpoint, oneshot's sequential checkpoint, reference layer-1 scales)``."""
    from compressed_tensors.quantization import enable_quantization

    family, scheme = request.param
    root = tmp_path_factory.mktemp(f"{family}_{scheme}")
    saved, theirs = str(root / "float"), str(root / "theirs")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _saved(family, saved)
            model = llm_compressor_oneshot(_load(saved), _samples(), _modifier(scheme), pipeline="sequential")
            reference = {} if scheme == "W8A8" else _reference_layer1_scales(model, family, scheme)
            model.apply(enable_quantization)  # as oneshot left it
            model.save_pretrained(theirs, save_compressed=True)
    finally:
        torch.set_num_threads(threads)
    return family, scheme, saved, load_file(os.path.join(theirs, "model.safetensors")), reference


def _layerwise(saved, family, scheme, propagate, out):
    """calibrate_layerwise (eager attention, all experts) and the layer-by-layer export: ``(qparams, tensors)``."""
    config = transformers.AutoConfig.from_pretrained(saved)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.set_attn_implementation("eager")
    plan = qstats.Recipe.from_compressed_tensors(_modifier(scheme)).resolve(model)
    states = qstats.calibrate_layerwise(model, saved, _batches(family), plan, progress=False, all_experts=True,
                                        propagate=propagate)
    qparams = qstats.compute_qparams_tree(states, plan)
    qstats.export.compressed_tensors_layerwise(model, saved, qparams, out, plan, progress=False)
    tensors = {}
    for name in sorted(os.listdir(out)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(out, name)))
    return qparams, tensors


def _is_input_scale(name):
    return name.endswith(("input_scale", "input_global_scale"))


def _relative(ours, theirs):
    relative = float(((ours.float() - theirs.float()).abs() / theirs.float().abs()).max())
    assert relative == relative, (ours, theirs)  # not NaN (max() would skip it)
    return relative


def test_float_propagation_equals_llm_compressor_sequential(oneshot, tmp_path, single_thread_quiet):
    family, scheme, saved, theirs, _ = oneshot
    _, ours = _layerwise(saved, family, scheme, "float", str(tmp_path / "ours"))
    assert sorted(ours) == sorted(theirs)
    exact = [n for n in theirs if ".layers.1." not in n or not _is_input_scale(n)]
    assert not [n for n in exact if not bit_equal(ours[n], theirs[n])]  # layer 0, weights, outside the layers
    close = [n for n in theirs if n not in exact]
    assert scheme != "W8A8" or not close
    assert not [n for n in close if _relative(ours[n], theirs[n]) > RTOL]
    if scheme == "W8A8":  # dynamic inputs: nothing propagated reaches the checkpoint
        _, quantized = _layerwise(saved, family, scheme, "quantized", str(tmp_path / "quantized"))
        assert not [n for n in theirs if not bit_equal(quantized[n], theirs[n])]


def test_linearized_experts_sum_differently_in_the_last_bits(oneshot, single_thread_quiet):
    """Why layer 1's input scales are within an ulp only: layer 0's outputs of the model's stacked
    experts and of llm-compressor's linearized experts (all experts, as it calibrates) differ there."""
    family, scheme, saved, _, _ = oneshot
    if scheme != "FP8":
        pytest.skip("one scheme is enough: the outputs are float")
    from llmcompressor.modeling.moe.context import moe_calibration_context
    from llmcompressor.modeling.moe.linearize import linearize_moe

    outputs = []
    for linearize in (False, True):
        model = _load(saved)
        model.set_attn_implementation("eager")
        if linearize:
            linearize_moe(model)
        got = []
        model.model.layers[0].register_forward_hook(lambda m, a, o: got.append(o[0] if isinstance(o, tuple) else o))
        with torch.no_grad(), moe_calibration_context():
            for batch in _batches(family):
                model(**batch)
        outputs.append(torch.cat(got))
    assert not torch.equal(*outputs)
    torch.testing.assert_close(*outputs, rtol=1e-6, atol=1e-7)


def test_quantized_propagation_equals_compressed_tensors_quantized_layer(oneshot, tmp_path, single_thread_quiet):
    """propagate="quantized": layer 1 is calibrated on layer 0's fake-quantized outputs, as compressed-tensors
    quantizes them (static per-expert input scales); "float" is not (llm-compressor's sequential checkpoint)."""
    family, scheme, saved, _, reference = oneshot
    if scheme == "W8A8":
        pytest.skip("no static input scale")
    found = {}
    for propagate in ("quantized", "float"):
        qparams, _ = _layerwise(saved, family, scheme, propagate, str(tmp_path / propagate))
        worst = 0.0
        for path, scale in reference.items():
            stacked, _, rest = path.partition(".experts.")
            if rest:  # model.layers.1.mlp.experts.<e>.<proj>: the stacked experts' site
                expert, proj = rest.split(".")
                site = "down_proj.input" if proj == "down_proj" else "input"
                ours = _input_scale(qparams[f"{stacked}.experts"][site], scheme)[int(expert)]
            else:
                ours = _input_scale(qparams[path]["input"], scheme)
            worst = max(worst, _relative(ours.reshape(()), scale))
        found[propagate] = worst
    assert sum(".experts." in path for path in reference) == 3 * 8  # every expert's gate, up and down
    assert found["quantized"] <= RTOL, found
    assert found["float"] > 1e-3, found
