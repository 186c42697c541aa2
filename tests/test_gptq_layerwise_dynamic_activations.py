"""`qstats.gptq_layerwise` with a scheme whose input activations are dynamic int8 per token (W4A8:
int4 groups of 128, symmetric) against llm-compressor 0.14's sequential ``oneshot``: its pipeline
runs with quantization disabled, so the Hessians read float inputs and each layer's outputs are
computed with float activations; the dynamic activations never enter GPTQ."""

from __future__ import annotations

import pytest
import torch

import qstats
from _packed import packed_codes
from _shared import llm_compressor_oneshot

transformers = pytest.importorskip("transformers")
pytest.importorskip("llmcompressor")
from safetensors.torch import load_file  # noqa: E402

TOKENS = 16


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    config = transformers.Qwen3Config(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                      max_position_embeddings=64)
    torch.manual_seed(0)
    path = str(tmp_path_factory.mktemp("gptq_qwen3_bf16"))
    transformers.Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def samples():
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(1, 64, (TOKENS,), generator=generator) for _ in range(8)]


def _loaded(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    model.set_attn_implementation("eager")  # llm-compressor 0.14 calibrates with eager attention
    return model


def _theirs(path, samples, scheme, out):
    from llmcompressor.modifiers.gptq import GPTQModifier

    modifier = GPTQModifier(targets="Linear", scheme=scheme, ignore=["lm_head"])
    llm_compressor_oneshot(_loaded(path), samples, modifier, out, "sequential")
    return load_file(f"{out}/model.safetensors")


def _ours(path, samples, recipe, out):
    config = transformers.AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config).eval()
    meta.set_attn_implementation("eager")
    batches = [{"input_ids": s[None], "attention_mask": torch.ones(1, TOKENS, dtype=torch.long)} for s in samples]
    result = qstats.gptq_layerwise(meta, path, batches, recipe, progress=False)
    model = _loaded(path)
    model.load_state_dict(result.weights, strict=False)
    plan = recipe.resolve(model)
    qstats.export.compressed_tensors(model, qstats.compute_qparams_tree(result.states, plan), out, plan)
    return load_file(f"{out}/model.safetensors")


def _codes(tensors, name):
    """int4 codes of ``name``: stored as int8 (W4A8's int-quantized format) or packed (W4A16's)."""
    if f"{name}.weight_packed" in tensors:
        return packed_codes(tensors, name)
    return tensors[f"{name}.weight"]


def test_w4a8_equals_llm_compressor_sequential_gptq(qwen3, samples, tmp_path, single_thread_quiet):
    """Every scale and code of the 14 Linears equals oneshot's, as W4A16's do; oneshot's W4A8 codes
    are its W4A16 codes (its dynamic int8 inputs are not quantized while GPTQ's hooks read them)."""
    theirs = _theirs(qwen3, samples, "W4A8", str(tmp_path / "theirs"))
    recipe = qstats.Recipe.from_scheme("W4A8", ignore=["lm_head"], observed_dtype=torch.bfloat16)
    ours = _ours(qwen3, samples, recipe, str(tmp_path / "ours"))
    assert sorted(ours) == sorted(theirs)
    names = sorted(name[: -len(".weight_scale")] for name in theirs if name.endswith(".weight_scale"))
    assert len(names) == 14
    for name in theirs:
        assert torch.equal(ours[name], theirs[name]), name  # scales, int8-stored codes, float tensors
    weights_only = _theirs(qwen3, samples, "W4A16", str(tmp_path / "w4a16"))
    for name in names:
        assert torch.equal(_codes(theirs, name), _codes(weights_only, name)), name
