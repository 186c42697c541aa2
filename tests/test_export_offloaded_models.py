"""``qstats.export.compressed_tensors`` of a model accelerate offloads (``from_pretrained(device_map=...,
offload_folder=...)``: meta tensors in the modules, the data in their hooks), as a user calibrates a
model too large for its device: the checkpoint equals llm-compressor 0.14's ``oneshot`` + ``save_pretrained``
of the same model, recipe and batches, every tensor bit for bit and ``config.json``, and the model is left
offloaded as it was (the export used to refuse it: "tensor(s) of the model are on the meta device")."""

from __future__ import annotations

import json
import os

import pytest
import torch
from _oneshot import random_llama, token_samples
from _shared import bit_equal, llm_compressor_oneshot

import qstats

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("llmcompressor")
from llmcompressor.modifiers.quantization import QuantizationModifier  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

DISK = {"": "disk"}
CPU_AND_DISK = {"model.embed_tokens": "cpu", "model.layers": "disk", "model.norm": "disk", "model.rotary_emb": "disk",
                "lm_head": "disk"}


def _offloaded(path, device_map, folder, dtype):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map=device_map,
                                                              offload_folder=str(folder)).eval()
    model.set_attn_implementation("eager")  # as llm-compressor calibrates
    return model


def _whole(path, dtype):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    model.set_attn_implementation("eager")
    return model


def _config(folder) -> dict:
    with open(os.path.join(folder, "config.json")) as file:
        config = json.load(file)
    config.pop("transformers_version", None)
    return config


@pytest.mark.parametrize("scheme, dtype, device_map, tied", [
    ("W8A8", torch.float32, DISK, False),
    ("W4A16_ASYM", torch.float32, CPU_AND_DISK, False),
    ("NVFP4", torch.bfloat16, DISK, True),  # quantized lm_head tied to the embeddings: re-tied as oneshot's
], ids=["w8a8-disk", "w4a16-asym-cpu-and-disk", "nvfp4-bf16-disk-tied"])
def test_offloaded_model_exports_oneshots_checkpoint(tmp_path, scheme, dtype, device_map, tied):
    base = str(tmp_path / "float")
    random_llama(tie_word_embeddings=tied).to(dtype).save_pretrained(base)
    samples = token_samples(2)
    ignore = [] if tied else ["lm_head"]
    # the reference: oneshot of the model loaded whole (oneshot of a disk-offloaded tied model fails in
    # compressed-tensors' disk cache, a KeyError)
    llm_compressor_oneshot(_whole(base, dtype), samples, QuantizationModifier(targets="Linear", scheme=scheme, ignore=ignore),
                           tmp_path / "theirs")

    model = _offloaded(base, device_map, tmp_path / "offload", dtype)
    assert any(parameter.is_meta for parameter in model.parameters())
    plan = qstats.Recipe.from_scheme(scheme, ignore=ignore, observed_dtype=dtype).resolve(model)
    states = qstats.calibrate(model, [{"input_ids": s[None]} for s in samples], plan, progress=False)
    devices = {name: parameter.device for name, parameter in model.named_parameters()}
    qstats.export.compressed_tensors(model, qstats.compute_qparams_tree(states, plan), str(tmp_path / "ours"), plan)
    assert {name: parameter.device for name, parameter in model.named_parameters()} == devices  # offloaded again

    ours = load_file(str(tmp_path / "ours" / "model.safetensors"))
    theirs = load_file(str(tmp_path / "theirs" / "model.safetensors"))
    assert sorted(ours) == sorted(theirs)
    assert [name for name in theirs if not bit_equal(ours[name], theirs[name])] == []
    assert _config(tmp_path / "ours") == _config(tmp_path / "theirs")
    with torch.no_grad():  # its hooks still run it, on the data they hold
        assert bit_equal(model(samples[0][None]).logits, _whole(base, dtype)(samples[0][None]).logits)


def test_layerwise_export_of_a_partly_offloaded_model_names_itself_and_compressed_tensors(tmp_path):
    """``compressed_tensors_layerwise`` reads a meta model's tensors from the checkpoint: a model accelerate
    offloads in part (its embeddings loaded on the CPU) is refused under the export's own name, pointing to
    `compressed_tensors`, which exports it (the refusal named calibrate_layerwise)."""
    base = str(tmp_path / "float")
    random_llama().save_pretrained(base)
    model = _offloaded(base, CPU_AND_DISK, tmp_path / "offload", torch.float32)
    plan = qstats.Recipe.from_scheme("W8A8", ignore=["lm_head"]).resolve(model)
    states = qstats.calibrate(model, [{"input_ids": s[None]} for s in token_samples(1)], plan, progress=False)
    qparams = qstats.compute_qparams_tree(states, plan)
    with pytest.raises(ValueError, match=r"^export\.compressed_tensors_layerwise: the model's parameters "
                                         r"\['model\.embed_tokens\.weight'\].*qstats\.export\.compressed_tensors$"):
        qstats.export.compressed_tensors_layerwise(model, base, qparams, str(tmp_path / "layerwise"), plan,
                                                   progress=False)
    assert not os.path.exists(tmp_path / "layerwise")
    qstats.export.compressed_tensors(model, qparams, str(tmp_path / "ours"), plan)
    assert os.path.exists(tmp_path / "ours" / "model.safetensors")


def test_offloaded_stacked_experts_export_oneshots_checkpoint(tmp_path):
    """A disk-offloaded Qwen3-MoE, NVFP4A16 on its Linears and stacked experts (read from the experts'
    own parameters, not the state dict): unpacked per expert as oneshot's linearized experts, bit for bit."""
    config = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=128, intermediate_size=128,
                                         moe_intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=1, head_dim=64, num_experts=4, num_experts_per_tok=2,
                                         decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=32)
    torch.manual_seed(0)
    base = str(tmp_path / "float")
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(base)
    samples = token_samples(2)
    ignore = ["lm_head", "re:.*mlp.gate$"]
    llm_compressor_oneshot(_whole(base, torch.float32), samples,
                           QuantizationModifier(targets="Linear", scheme="NVFP4A16", ignore=ignore), tmp_path / "theirs")
    model = _offloaded(base, DISK, tmp_path / "offload", torch.float32)
    plan = qstats.Recipe.from_scheme("NVFP4A16", ignore=ignore, experts="Qwen3MoeExperts").resolve(model)
    states = qstats.calibrate(model, [{"input_ids": s[None]} for s in samples], plan, progress=False, all_experts=True)
    qstats.export.compressed_tensors(model, qstats.compute_qparams_tree(states, plan), str(tmp_path / "ours"), plan)
    ours = load_file(str(tmp_path / "ours" / "model.safetensors"))
    theirs = load_file(str(tmp_path / "theirs" / "model.safetensors"))
    assert sorted(ours) == sorted(theirs)
    assert [name for name in theirs if not bit_equal(ours[name], theirs[name])] == []
