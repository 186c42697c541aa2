"""NVFP4 input global scales under a moving average (llm-compressor's ``minmax``, ``mse``), read by
``Recipe.from_compressed_tensors`` and calibrated by ``qstats.calibrate`` (``all_experts`` and routed),
against llm-compressor 0.14's ``oneshot`` (``moe_calibrate_all_experts`` the same) on tiny random MoE
models: the same checkpoint bit for bit. llm-compressor's ``flatten_for_calibration`` views a 3-D ``[batch, tokens,
features]`` input as groups of 16 features (each group's extremes averaged, its range searched), but a
2-D ``[rows, features]`` input, as its linearized experts and Qwen2-MoE's shared expert get, with no
group dimension: its range averaged (searched) per tensor."""

from __future__ import annotations

import os

import pytest
import torch

import qstats

transformers = pytest.importorskip("transformers")
pytest.importorskip("llmcompressor")

from compressed_tensors.quantization.quant_scheme import NVFP4  # noqa: E402
from test_export_moe_linearized import _assert_same_checkpoint, _load  # noqa: E402
from test_moe_families import _model  # noqa: E402

from _shared import bit_equal, llm_compressor_oneshot  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

OBSERVERS = {  # llm-compressor's input observer and its kwargs
    "minmax": ("minmax", {"averaging_constant": 0.3}),
    "mse": ("mse", {"averaging_constant": 0.3}),
    "memoryless_mse": ("memoryless_mse", {}),
    "nvfp4_expanded_mse": ("nvfp4_expanded_mse", {}),
}


def _saved(family: str, folder: str) -> None:
    """test_moe_families' tiny model with one layer: the next layer's inputs would differ in their last bits
    (llm-compressor multiplies by the unpacked gate and up Linears, transformers by the fused stack)."""
    config = _model(family).config
    config.num_hidden_layers = 1
    if family.startswith("deepseek"):  # multi-head latent attention under eager: as many kv heads as heads
        config.num_key_value_heads = config.num_attention_heads
    for name in ("layer_types", "mlp_layer_types"):
        if isinstance(getattr(config, name, None), list):
            setattr(config, name, getattr(config, name)[:1])
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).eval().save_pretrained(folder)


def _samples():
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(1, 128, (length,), generator=generator) for length in (12, 7, 9)]


def _modifier(observer: str):
    from llmcompressor.modifiers.quantization import QuantizationModifier

    name, kwargs = OBSERVERS[observer]
    inputs = {**NVFP4["input_activations"].model_dump(), "observer": name, "observer_kwargs": kwargs}
    group = {"targets": ["Linear"], "weights": NVFP4["weights"].model_dump(), "input_activations": inputs}
    return QuantizationModifier(config_groups={"g": group}, ignore=["lm_head"])


CASES = [(family, observer, True, torch.float32)
         for family in ("qwen3_moe", "qwen2_moe") for observer in sorted(OBSERVERS)]
CASES += [("qwen3_moe", observer, False, torch.float32) for observer in ("minmax", "mse")]  # routed
CASES += [("qwen3_moe", observer, True, torch.bfloat16) for observer in ("minmax", "mse")]  # observed in bf16


def _load_as(folder: str, dtype: torch.dtype):
    return _load(folder) if dtype == torch.float32 else transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=dtype).eval()


@pytest.mark.parametrize("family, observer, all_experts, dtype", CASES, ids=str)
def test_moving_average_nvfp4_inputs_equal_llm_compressor_oneshot(family, observer, all_experts, dtype, tmp_path,
                                                                  single_thread_quiet):
    saved, theirs, ours = (str(tmp_path / name) for name in ("float", "llm_compressor", "qstats"))
    _saved(family, saved)
    modifier = _modifier(observer)
    llm_compressor_oneshot(_load_as(saved, dtype), _samples(), modifier, theirs, moe_calibrate_all_experts=all_experts)
    model = _load_as(saved, dtype)
    model.set_attn_implementation("eager")
    plan = qstats.Recipe.from_compressed_tensors(modifier, observed_dtype=dtype).resolve(model)
    states = qstats.calibrate(model, [{"input_ids": s[None]} for s in _samples()], plan, progress=False,
                              all_experts=all_experts)
    qstats.export.compressed_tensors(model, qstats.compute_qparams_tree(states, plan), ours, plan)
    _assert_same_checkpoint(ours, theirs)


def test_four_dimensional_input_is_averaged_per_position_by_llm_compressor(tmp_path, single_thread_quiet):
    """DeepSeek-V3's ``kv_b_proj`` gets a 4-D ``[batch, 1, tokens, rank]`` input: llm-compressor's view
    (``flatten(0, 1)``) keeps the token dimension, so its ``minmax`` averages each (position, group) entry
    and fails on batches of another length; qstats averages each group of features over every token
    (documented in docs/observers.md): on equal-length batches only that scale differs."""
    saved, theirs, ours = (str(tmp_path / name) for name in ("float", "llm_compressor", "qstats"))
    _saved("deepseek_v3", saved)
    with pytest.raises(RuntimeError, match="must match the size"):
        llm_compressor_oneshot(_load(saved), _samples(), _modifier("minmax"), moe_calibrate_all_experts=True)
    samples = [torch.randint(1, 128, (12,), generator=torch.Generator().manual_seed(seed)) for seed in range(3)]
    llm_compressor_oneshot(_load(saved), samples, _modifier("minmax"), theirs, moe_calibrate_all_experts=True)
    model = _load(saved)
    model.set_attn_implementation("eager")
    plan = qstats.Recipe.from_compressed_tensors(_modifier("minmax")).resolve(model)
    states = qstats.calibrate(model, [{"input_ids": s[None]} for s in samples], plan, progress=False, all_experts=True)
    qstats.export.compressed_tensors(model, qstats.compute_qparams_tree(states, plan), ours, plan)
    theirs, ours = (load_file(os.path.join(folder, "model.safetensors")) for folder in (theirs, ours))
    assert [name for name in theirs if not bit_equal(theirs[name], ours[name])] == [
        "model.layers.0.self_attn.kv_b_proj.input_global_scale"]
    assert float(theirs["model.layers.0.self_attn.kv_b_proj.input_global_scale"]) > 1.1 * float(
        ours["model.layers.0.self_attn.kv_b_proj.input_global_scale"])  # 1170.1 vs 968.5
