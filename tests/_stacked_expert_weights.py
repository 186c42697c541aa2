"""Tiny random Llama 4 and GPT-OSS models (config-built: 2 layers, 4 experts, hidden and intermediate
size 128, so that a 128-column group fits) whose experts store their weights transposed
(``gate_up_proj [E, H, 2I]``, ``down_proj [E, I, H]``; GPT-OSS' gate and up interleaved, with biases),
llm-compressor 0.14's ``oneshot`` of them, qstats' calibration and export of the same recipe, and the
oneshot checkpoint loaded back by compressed-tensors. Shared by test_llama4_expert_weights and
test_gpt_oss_expert_weights."""

from __future__ import annotations

import json
import os
import warnings

import torch
import transformers

import qstats
from _packed import packed_codes
from _shared import bit_equal, llm_compressor_oneshot

IGNORE = {"llama4": ["lm_head", "re:.*vision.*", "re:.*multi_modal.*"], "gpt_oss": ["lm_head", "re:.*router"]}
EXPERTS = {"llama4": "Llama4TextExperts", "gpt_oss": "GptOssExperts"}


def tiny(family: str, dtype=torch.float32) -> torch.nn.Module:
    """The random model in ``dtype``, its stacked weights drawn from a normal distribution (Llama 4
    initialises its ``gate_up_proj`` to zeros)."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if family == "llama4":  # llm-compressor's Llama4LinearExperts reads the multimodal config's text_config
            text = dict(hidden_size=128, intermediate_size=128, intermediate_size_mlp=256, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=128,
                        num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=1, no_rope_layers=[1, 1])
            vision = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
                          image_size=28, patch_size=14, vision_output_dim=32, projector_input_dim=32,
                          projector_output_dim=128)
            model = transformers.Llama4ForConditionalGeneration(
                transformers.Llama4Config(text_config=text, vision_config=vision))
        else:
            config = transformers.GptOssConfig(vocab_size=128, hidden_size=128, intermediate_size=128,
                                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                               head_dim=32, num_local_experts=4, num_experts_per_tok=2,
                                               layer_types=["full_attention"] * 2, max_position_embeddings=64)
            model = transformers.GptOssForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".experts." in name:
                param.normal_(0, 0.1)
    return model.to(dtype).eval()


def model_class(family: str) -> type:
    return transformers.Llama4ForConditionalGeneration if family == "llama4" else transformers.GptOssForCausalLM


def load(family: str, folder: str) -> torch.nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = model_class(family).from_pretrained(folder, dtype="auto").eval()
    model.set_attn_implementation("eager")  # as llm-compressor's calibration runs it
    return model


def samples() -> list:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(1, 128, (12,), generator=generator), torch.randint(1, 128, (7,), generator=generator)]


def batches() -> list:
    return [{"input_ids": sample[None]} for sample in samples()]


def oneshot(family: str, folder: str, modifier, out: str) -> None:
    """llm-compressor's ``oneshot`` of the saved model (its experts linearized, every expert calibrated
    on every token: ``moe_calibrate_all_experts``), saved compressed to ``out``."""
    llm_compressor_oneshot(load(family, folder), samples(), modifier, out, moe_calibrate_all_experts=True)


def qstats_export(family: str, folder: str, recipe, out: str) -> tuple:
    """``(model, plan, qparams)`` of qstats' calibration of the saved model (all experts), exported to ``out``."""
    model = load(family, folder)
    plan = recipe.resolve(model)
    states = qstats.calibrate(model, batches(), plan, progress=False, all_experts=True)
    qparams = qstats.compute_qparams_tree(states, plan)
    qstats.export.compressed_tensors(model, qparams, out, plan)
    return model, plan, qparams


def loaded_checkpoint(family: str, folder: str, checkpoint: str) -> torch.nn.Module:
    """A model whose experts llm-compressor linearized, every float weight redrawn, holding the
    compressed-tensors ``checkpoint`` (its ``quantization_config`` applied, the safetensors loaded
    strictly, ``ModelCompressor.decompress_model``)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from llmcompressor.modeling.moe.linearize import linearize_moe
    from safetensors.torch import load_file

    fresh = load(family, folder)
    dtype = next(fresh.parameters()).dtype
    with torch.no_grad():
        for param in fresh.parameters():
            param.normal_()  # every weight must come from the checkpoint
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        linearize_moe(fresh)
        fresh.to(dtype)  # its Linears are made in the config's dtype
        with open(os.path.join(checkpoint, "config.json")) as file:
            config = QuantizationConfig.model_validate(json.load(file)["quantization_config"])
        apply_quantization_config(fresh, config)
        compressor = ModelCompressor(quantization_config=config)
        compressor.compress_model(fresh)
        fresh.load_state_dict(load_file(os.path.join(checkpoint, "model.safetensors")), strict=True)
        compressor.decompress_model(fresh)
    return fresh.eval()


def held_out() -> torch.Tensor:
    return torch.randint(1, 128, (2, 9), generator=torch.Generator().manual_seed(5))


def saved(family: str, folder: str, scheme: str) -> None:
    """The float model, in bfloat16 for NVFP4 (compressed-tensors decompresses its weights in bfloat16)."""
    tiny(family, torch.bfloat16 if scheme == "NVFP4" else torch.float32).save_pretrained(folder)


def recipe(family: str, scheme: str):
    """qstats' recipe of llm-compressor's ``QuantizationModifier(targets="Linear", scheme=scheme, ignore=...)``."""
    return qstats.Recipe.from_scheme(scheme, ignore=IGNORE[family],
                                     observed_dtype="bfloat16" if scheme == "NVFP4" else None)


def logits(loaded, model, plan, qparams) -> tuple:
    """``(fake_quantized logits of model, logits of the loaded checkpoint, float logits)`` of `held_out` tokens."""
    with torch.no_grad():
        with qstats.fake_quantized(model, qparams, plan):
            ours = model(input_ids=held_out()).logits
        return ours, loaded(input_ids=held_out()).logits, model(input_ids=held_out()).logits


def gptq_codes(family: str, directory: str) -> dict:
    """W4A16 GPTQ of the saved model by llm-compressor (``oneshot`` with a ``GPTQModifier``, basic
    pipeline, every expert calibrated on every token) and by ``gptq_layerwise`` on the model built on
    meta, exported (in memory and layer by layer, the same tensors): ``{"experts" | "others": (Linears,
    fraction of equal codes)}`` of the first layer, whose inputs do not depend on GPTQ."""
    from llmcompressor.modifiers.gptq import GPTQModifier
    from safetensors.torch import load_file

    folder, theirs, ours = (os.path.join(directory, name) for name in ("float", "theirs", "ours"))
    tiny(family).save_pretrained(folder)
    modifier = GPTQModifier(targets="Linear", scheme="W4A16", ignore=IGNORE[family])
    llm_compressor_oneshot(load(family, folder), samples(), modifier, theirs, "basic", moe_calibrate_all_experts=True)
    cls = model_class(family)
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        meta = cls(cls.config_class.from_pretrained(folder)).eval()
    gptq_recipe = qstats.Recipe.from_scheme("W4A16", ignore=IGNORE[family])
    result = qstats.gptq_layerwise(meta, folder, batches(), gptq_recipe, progress=False, all_experts=True)
    model = load(family, folder)
    model.load_state_dict(result.weights, strict=False)
    plan = gptq_recipe.resolve(model)
    qstats.export.compressed_tensors(model, qstats.compute_qparams_tree(result.states, plan), ours, plan)
    our_tensors, their_tensors = (load_file(os.path.join(f, "model.safetensors")) for f in (ours, theirs))
    assert set(our_tensors) == set(their_tensors)
    layerwise = os.path.join(directory, "layerwise")  # the export of the meta model, layer by layer: the same
    meta_plan = gptq_recipe.resolve(meta)
    qstats.export.compressed_tensors_layerwise(meta, folder, qstats.compute_qparams_tree(result.states, meta_plan),
                                               layerwise, meta_plan, weights=result.weights, progress=False)
    shards = [load_file(os.path.join(layerwise, f)) for f in os.listdir(layerwise) if f.endswith(".safetensors")]
    layerwise_tensors = {name: tensor for shard in shards for name, tensor in shard.items()}
    assert set(layerwise_tensors) == set(our_tensors)
    assert all(bit_equal(layerwise_tensors[name], tensor) for name, tensor in our_tensors.items())
    names = sorted(name[: -len(".weight_packed")] for name in their_tensors
                   if name.endswith(".weight_packed") and ".layers.0." in name)
    out = {}
    for kind in ("experts", "others"):
        chosen = [name for name in names if (".experts." in name) == (kind == "experts")]
        same = sum(int((packed_codes(our_tensors, n) == packed_codes(their_tensors, n)).sum()) for n in chosen)
        out[kind] = (len(chosen), same / sum(packed_codes(their_tensors, n).numel() for n in chosen))
    return out
