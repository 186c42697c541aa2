"""A quantized Linear the forward calls before the first decoder layer (OPT's ``project_in``, between
the embeddings and the layers) under `qstats.gptq_layerwise` and under llm-compressor 0.14's
sequential ``oneshot`` with a ``GPTQModifier``: its first subgraph holds every module before the
first layer, GPTQ'd before the layer runs on their outputs, so the first layer's Hessians come
from the GPTQ'd ``project_in``. gptq_layerwise GPTQs it first too (the Hessians of the first layer
are llm-compressor's, up to float rounding) and writes it once, its inputs offloaded or not."""

from __future__ import annotations

import glob

import pytest
import torch

import qstats
from _oneshot import saved_random_model, token_samples
from _packed import packed_codes
from _shared import llm_compressor_oneshot

transformers = pytest.importorskip("transformers")
pytest.importorskip("llmcompressor")
from safetensors.torch import load_file  # noqa: E402

TOKENS = 16


@pytest.fixture(scope="module")
def opt(tmp_path_factory):
    config = transformers.OPTConfig(vocab_size=64, hidden_size=256, word_embed_proj_dim=128, ffn_dim=256,
                                    num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64)
    return saved_random_model(tmp_path_factory, "opt_project_in", transformers.OPTForCausalLM, config)


def _samples() -> list:
    return token_samples(24, TOKENS)  # 384 rows: more than the 256 features (full-rank Hessians)


def _meta(path):
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(path)).eval()


def test_project_in_is_gptqd_before_the_first_layer_as_llm_compressor_sequential_oneshot_does(opt, tmp_path):
    from llmcompressor.modifiers.gptq import GPTQModifier

    samples = _samples()
    model = transformers.AutoModelForCausalLM.from_pretrained(opt).eval()
    assert isinstance(model.model.decoder.project_in, torch.nn.Linear)
    llm_compressor_oneshot(model, samples, GPTQModifier(targets="Linear", scheme="W4A16", ignore=["lm_head"]),
                           tmp_path / "theirs", "sequential")
    theirs = load_file(str(tmp_path / "theirs" / "model.safetensors"))

    recipe = qstats.Recipe.from_scheme("W4A16", ignore=["lm_head"])
    batches = [{"input_ids": s[None], "attention_mask": torch.ones(1, TOKENS, dtype=torch.long)} for s in samples]
    meta = _meta(opt)
    result = qstats.gptq_layerwise(meta, opt, batches, recipe, progress=False)
    plan = recipe.resolve(meta)
    qparams = qstats.compute_qparams_tree(result.states, plan)

    def same(module: str) -> float:
        assert torch.equal(theirs[f"{module}.weight_scale"], qparams[module]["weight"].scale)
        codes = qstats.quantize(result.weights[f"{module}.weight"], qparams[module]["weight"], plan.site(module, "weight").spec)
        return float((packed_codes(theirs, module) == codes).float().mean())

    assert same("model.decoder.project_in") == 1.0
    first = [name[: -len(".weight")] for name in result.weights if name.startswith("model.decoder.layers.0.")]
    assert len(first) == 6
    assert min(same(module) for module in first) >= 0.998  # 0.84 to 0.89 with a float project_in before them

    (tmp_path / "spill").mkdir()  # the first layer's inputs captured again on disk, file by file
    on_disk = qstats.gptq_layerwise(_meta(opt), opt, batches, recipe, progress=False, weights_dir=tmp_path / "w",
                                    offload_dir=tmp_path / "spill")
    written: dict = {}
    for shard in glob.glob(f"{on_disk.weights}/*.safetensors"):
        tensors = load_file(shard)
        assert not set(tensors) & set(written)  # each weight in one file
        written.update(tensors)
    assert sorted(written) == sorted(result.weights)
    assert all(torch.equal(written[name], weight) for name, weight in result.weights.items())
