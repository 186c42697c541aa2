"""The q/k/v sites of transformers attention modules (the query, key and value after the rotary
embedding and q/k norms) calibrated layer by layer (`qstats.calibrate_layerwise`) equal a
full-model `qstats.calibrate` bit for bit, padding left out by the observation weight."""

from __future__ import annotations

import warnings

import pytest
import torch

import qstats
from _shared import assert_site_states_equal

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

FP8 = dict(num_bits=8, type="float", symmetric=True, strategy="tensor", dynamic=False, observer="static_minmax")
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8


def _configs():
    common = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=HEADS,
                  num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, max_position_embeddings=64)
    return {"llama": transformers.LlamaConfig(intermediate_size=48, **common),
            "qwen3_moe": transformers.Qwen3MoeConfig(intermediate_size=48, moe_intermediate_size=16, num_experts=4,
                                                     num_experts_per_tok=2, **common)}


def _batches() -> list:
    generator = torch.Generator().manual_seed(3)
    out = []
    for index in range(2):
        ids = torch.randint(0, 96, (2, 6 + index), generator=generator)
        mask = torch.ones_like(ids)
        mask[1, : 2 + index] = 0  # left padding of the second sequence
        out.append({"input_ids": ids, "attention_mask": mask})
    return out


RECIPE = {"config_groups": {"attention": {"targets": ["re:.*self_attn$"], "input_activations": FP8}},
          "kv_cache_scheme": FP8}


@pytest.mark.parametrize("name", ["llama", "qwen3_moe"])
def test_layer_by_layer_q_k_v_states_equal_the_full_model(tmp_path, name):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.AutoModelForCausalLM.from_config(_configs()[name]).save_pretrained(tmp_path)
        loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(_configs()[name]).eval()
    recipe = qstats.Recipe.from_compressed_tensors(RECIPE)
    batches = _batches()

    def weight(batch):
        return batch["attention_mask"]

    want = qstats.calibrate(loaded, batches, recipe, progress=False, observation_weight=weight)
    got = qstats.calibrate_layerwise(meta, str(tmp_path), batches, recipe, progress=False, observation_weight=weight)
    assert_site_states_equal(got, want)
    tokens = sum(int(batch["attention_mask"].sum()) for batch in batches)  # padding not counted
    for layer in range(2):
        entry = want[f"model.layers.{layer}.self_attn"]
        assert sorted(entry) == ["k", "q", "v"]
        assert int(entry["q"].count) == tokens * HEADS * HEAD_DIM
        assert int(entry["k"].count) == int(entry["v"].count) == tokens * KV_HEADS * HEAD_DIM
