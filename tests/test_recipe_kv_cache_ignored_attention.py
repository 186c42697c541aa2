"""A ``kv_cache_scheme`` whose attention modules ``ignore`` skips, every one: ``resolve`` refuses it
naming the modules, where it warned and the export wrote a checkpoint without the kv-cache scheme
(llm-compressor's ``oneshot`` saves compressed-tensors' uninitialised k/v scales there). An ignore
list that skips some attention modules resolves: the others keep their k/v sites (the export
refuses the checkpoint, tested in the export's attention tests)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

import qstats

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")
sys.path.insert(0, os.path.dirname(__file__))
from _shared import tiny_llama_config  # noqa: E402

KV = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": False}


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(tiny_llama_config()).eval()


def _attention(model) -> list:
    from compressed_tensors.quantization.lifecycle.initialize import is_cached_attention_module

    return [path for path, module in model.named_modules() if is_cached_attention_module(module)]


@pytest.mark.parametrize("build", [
    lambda ignore: qstats.Recipe.from_scheme("W4A16", kv_cache_scheme=KV, ignore=ignore),
    lambda ignore: qstats.Recipe.from_compressed_tensors({"config_groups": {}, "kv_cache_scheme": KV, "ignore": ignore}),
])
def test_a_kv_cache_scheme_with_every_attention_module_ignored_is_refused(llama, build):
    assert _attention(llama) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]  # what compressed-tensors caches
    with pytest.raises(ValueError, match=r"kv_cache_scheme .* ignore skips every one \('model\.layers\.0\.self_attn' "
                                         r"and 1 more\)"):
        build(["lm_head", "re:.*self_attn.*"]).resolve(llama)
    plan = build(["lm_head", "re:.*layers\\.0\\.self_attn.*"]).resolve(llama)
    assert [path for path, sites in plan.sites.items() if "k" in sites] == ["model.layers.1.self_attn"]
