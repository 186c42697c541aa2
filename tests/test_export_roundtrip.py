"""Export, then load back, as a user does: tiny random transformers models calibrated with preset
schemes, exported by `qstats.export.compressed_tensors`, compared with llm-compressor 0.14's ``oneshot``
of the same recipe (same tensors bit for bit, same ``config.json``) and loaded back by transformers'
compressed-tensors quantizer (decompressed weights equal qstats' dequantized ones bit for bit)."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

import qstats
from _shared import bit_equal, llm_compressor_oneshot, load_causal_lm

transformers = pytest.importorskip("transformers")
pytest.importorskip("llmcompressor")
from compressed_tensors.quantization import QuantizationScheme  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers.utils.quantization_config import CompressedTensorsConfig  # noqa: E402

VOCAB = 64


def _llama(path, dtype=torch.float32, **overrides):
    fields = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False)
    config = transformers.LlamaConfig(**{**fields, **overrides})
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).to(dtype).save_pretrained(path)


def _gpt2(path):
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=1, n_head=2, n_positions=32)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(path)


@pytest.fixture(scope="module")
def samples():
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(1, VOCAB, (12,), generator=generator) for _ in range(2)]


def _config(folder) -> dict:
    with open(os.path.join(folder, "config.json")) as file:
        return json.load(file)


def _modifier(scheme, targets, ignore):
    from llmcompressor.modifiers.quantization import QuantizationModifier

    if isinstance(scheme, dict):  # QuantizationArgs fields: one config group
        return QuantizationModifier(config_groups={"group_0": QuantizationScheme(targets=targets, **scheme)},
                                    ignore=list(ignore))
    return QuantizationModifier(scheme=scheme, targets=targets, ignore=list(ignore))


def _both(tmp_path, samples, scheme, build, targets=("Linear",), ignore=("lm_head",), dtype=None):
    """``(our model, plan, qparams, our folder, their folder)``: the float checkpoint ``build``
    writes, calibrated by ``oneshot`` and by qstats with the recipe of ``scheme``, both exported."""
    base, theirs, ours = (str(tmp_path / name) for name in ("base", "theirs", "ours"))
    build(base)
    llm_compressor_oneshot(load_causal_lm(base), samples, _modifier(scheme, list(targets), ignore), theirs)
    model = load_causal_lm(base)
    model.set_attn_implementation("eager")  # as llm-compressor calibrates
    recipe = qstats.Recipe.from_scheme(scheme, targets=list(targets), ignore=ignore, observed_dtype=dtype)
    plan = recipe.resolve(model)
    states = qstats.calibrate(model, [{"input_ids": s[None]} for s in samples], plan, progress=False)
    qparams = qstats.compute_qparams_tree(states, plan)
    qstats.export.compressed_tensors(model, qparams, ours, plan)
    return model, plan, qparams, ours, theirs


def _group_4bit(symmetric, group_size):
    return {"weights": dict(num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=group_size)}


# case: (scheme, model dtype, build overrides); 200 intermediate rows (not a multiple of 8) pack
# asymmetric zero points along the output dimension with padding (down_proj, 200 columns, is ignored)
CASES = {
    "W4A16-g32-sym": (_group_4bit(True, 32), torch.float32, {}),
    "W4A16-g32-asym-200-rows": (_group_4bit(False, 32), torch.float32, {"intermediate_size": 200}),
    "W4A16_ASYM-g128-fp16-bias": ("W4A16_ASYM", torch.float16, {"mlp_bias": True, "attention_bias": True}),
    "W3A16-asym-g32": ({"weights": dict(num_bits=3, type="int", symmetric=False, strategy="group", group_size=32)},
                       torch.float32, {}),
    "W8A8": ("W8A8", torch.float32, {}),
    "FP8-bf16": ("FP8", torch.bfloat16, {}),
    "FP8_DYNAMIC": ("FP8_DYNAMIC", torch.float32, {}),
    "FP8_BLOCK": ("FP8_BLOCK", torch.float32, {}),
    "NVFP4-bf16": ("NVFP4", torch.bfloat16, {}),
    "W4A8": ("W4A8", torch.float32, {}),
}


def assert_same_checkpoint(ours: str, theirs: str) -> None:
    """The two folders hold the same tensors, bit for bit, and the same config.json (but the
    transformers version)."""
    our_tensors = load_file(os.path.join(ours, "model.safetensors"))
    their_tensors = load_file(os.path.join(theirs, "model.safetensors"))
    assert sorted(our_tensors) == sorted(their_tensors)
    assert [name for name in their_tensors if not bit_equal(our_tensors[name], their_tensors[name])] == []
    our_config, their_config = _config(ours), _config(theirs)
    our_config.pop("transformers_version", None), their_config.pop("transformers_version", None)
    assert our_config == their_config


@pytest.mark.parametrize("case", sorted(CASES))
def test_preset_exports_equal_oneshot_and_decompress_to_our_dequantized_weights(tmp_path, samples, case):
    scheme, dtype, overrides = CASES[case]
    ignore = ("lm_head", "re:.*down_proj") if overrides.get("intermediate_size") == 200 else ("lm_head",)
    model, plan, qparams, ours, theirs = _both(
        tmp_path, samples, scheme, lambda path: _llama(path, dtype, **overrides), ignore=ignore,
        dtype=None if dtype == torch.float32 else dtype)
    assert_same_checkpoint(ours, theirs)

    # transformers decompresses ours (compressed-tensors' decompressors) into qstats' dequantized weights
    loaded = dict(load_causal_lm(ours, quantization_config=CompressedTensorsConfig(run_compressed=False)).named_modules())
    specs = plan.specs(qparams)
    for path, sites in qparams.items():
        weight = model.get_submodule(path).weight.detach()
        qp, spec = sites["weight"], specs[path]["weight"]
        expected = qstats.dequantize(qstats.quantize(weight, qp, spec), qp, spec).to(weight.dtype)
        assert bit_equal(loaded[path].weight.detach(), expected), path


def test_a_model_with_no_quantized_layer_writes_no_quantization_config_as_oneshot(tmp_path, samples):
    # GPT-2's layers are Conv1D: a recipe on Linear (lm_head ignored) quantizes nothing. oneshot writes
    # a float checkpoint without quantization_config; an empty one made transformers' compressed-tensors
    # quantizer fail ('NoneType' object has no attribute 'config_groups')
    with pytest.warns(UserWarning, match="no module is quantized"):
        _, _, _, ours, theirs = _both(tmp_path, samples, "W8A8", _gpt2)
    assert "quantization_config" not in _config(theirs)
    assert "quantization_config" not in _config(ours)
    our_tensors = load_file(os.path.join(ours, "model.safetensors"))
    their_tensors = load_file(os.path.join(theirs, "model.safetensors"))
    assert sorted(our_tensors) == sorted(their_tensors)
    assert all(bit_equal(our_tensors[name], their_tensors[name]) for name in their_tensors)
    batch = samples[0][None]
    with torch.no_grad():
        assert bit_equal(load_causal_lm(ours)(batch).logits, load_causal_lm(str(tmp_path / "base"))(batch).logits)


def test_the_attention_group_is_written_as_oneshot_writes_it(tmp_path, samples):
    # q/k/v of the attention modules (a config group on the attention class with static fp8 inputs):
    # compressed-tensors infers format "dense" for a group without weights, and oneshot writes it
    fp8 = dict(num_bits=8, type="float", symmetric=True, strategy="tensor", dynamic=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*before the rotary embedding", UserWarning)
        _, _, _, ours, theirs = _both(tmp_path, samples, {"input_activations": fp8}, _llama,
                                      targets=("LlamaAttention",), ignore=())
    (our_group,), (their_group,) = (_config(folder)["quantization_config"]["config_groups"].values()
                                    for folder in (ours, theirs))
    assert their_group.pop("targets") == ["LlamaAttention"]
    assert our_group.pop("targets") == ["model.layers.0.self_attn"]
    # llm-compressor names the observer it filled in ("minmax"); the scheme is the same
    their_group["input_activations"]["observer"] = our_group["input_activations"]["observer"]
    assert our_group == their_group
    with torch.no_grad():
        assert load_causal_lm(ours)(samples[0][None]).logits.isfinite().all()
