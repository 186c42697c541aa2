"""A model tying ``lm_head`` to the embeddings over a sharded checkpoint holding both with different
values (saved untied): the error names both tensors and the shards holding them, those the checkpoint's
own ``model.safetensors.index.json`` gives (the reference, read here with ``json``), before any batch
runs; it named the tensors only."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

import qstats

transformers = pytest.importorskip("transformers")
from _shared import tiny_llama_config  # noqa: E402

RECIPE = qstats.Recipe([qstats.Rule("Linear", sites=("input",), spec=qstats.QuantSpec(dtype="int8"))])


def test_a_tied_tensor_held_twice_with_other_values_is_named_with_both_shards(tmp_path):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.AutoModelForCausalLM.from_config(tiny_llama_config(tie_word_embeddings=False)).save_pretrained(
            tmp_path, max_shard_size="4KB")
    with open(os.path.join(tmp_path, "model.safetensors.index.json")) as file:
        weight_map = json.load(file)["weight_map"]
    shards = [os.path.join(tmp_path, weight_map[name]) for name in ("model.embed_tokens.weight", "lm_head.weight")]
    assert shards[0] != shards[1]
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(tiny_llama_config(tie_word_embeddings=True)).eval()
    drawn: list = []

    def batches():
        drawn.append(1)
        yield {"input_ids": torch.randint(0, 96, (1, 5))}

    with pytest.raises(ValueError, match="'model.embed_tokens.weight' and 'lm_head.weight'.*different values") as raised:
        qstats.calibrate_layerwise(model, tmp_path, batches(), RECIPE, progress=False)
    assert all(repr(shard) in str(raised.value) for shard in shards), str(raised.value)
    assert drawn == []
