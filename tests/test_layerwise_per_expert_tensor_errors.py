"""Stacked experts stored per expert (Mixtral's ``block_sparse_moe.experts.<e>.w1/w2/w3``, as transformers'
``save_pretrained`` writes them) with one bad tensor in the last layer: checked from the shards' headers
before any batch runs, as a tensor stored whole is, naming the tensor and the shard the checkpoint's own
index puts it in (the reference, read here with ``json``).

- integers in one expert (not expert 0's): `calibrate_layerwise` cast them into the float stack in
  silence (the stack took expert 0's dtype);
- another shape in one expert: found only when that layer was read, after every batch had run through
  the earlier layers, naming no file. ``from_pretrained`` refuses that checkpoint too.
"""

from __future__ import annotations

import json
import os
import re
import warnings

import pytest
import torch

import qstats

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

RECIPE = qstats.Recipe([qstats.Rule("Linear", sites=("input",), spec=qstats.QuantSpec(dtype="int8"))])
NAME = "model.layers.1.block_sparse_moe.experts.3.w2.weight"


def _config():
    return transformers.MixtralConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                      num_experts_per_tok=2)  # fmt: skip


def _batches(drawn: list):
    generator = torch.Generator().manual_seed(1)
    for index in range(2):
        drawn.append(index)
        yield {"input_ids": torch.randint(0, 96, (2, 6), generator=generator)}


CHANGES = {
    "integers": (lambda tensor: tensor.to(torch.int8), f"{re.escape(repr(NAME))} is stored as torch.int8"),
    "narrower": (lambda tensor: tensor[:, :-1].contiguous(), rf"{re.escape(repr(NAME))} \(32, 47\) stack to"),
    "shorter": (lambda tensor: tensor[:-1].contiguous(), rf"{re.escape(repr(NAME))} \(31, 48\) stack to"),
}


@pytest.mark.parametrize("how", sorted(CHANGES))
def test_a_bad_per_expert_tensor_of_the_last_layer_is_named_with_its_shard_before_any_batch(tmp_path, how):
    change, message = CHANGES[how]
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.AutoModelForCausalLM.from_config(_config()).save_pretrained(tmp_path, max_shard_size="20KB")
    with open(os.path.join(tmp_path, "model.safetensors.index.json")) as file:
        shard = os.path.join(tmp_path, json.load(file)["weight_map"][NAME])
    tensors = load_file(shard)
    tensors[NAME] = change(tensors[NAME])
    save_file(tensors, shard, metadata={"format": "pt"})
    if how != "integers":  # transformers refuses the misshapen expert too (it casts the integers)
        with pytest.raises(RuntimeError), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(_config()).eval()
    drawn: list = []
    with pytest.raises(ValueError, match=message) as raised:
        qstats.calibrate_layerwise(model, tmp_path, _batches(drawn), RECIPE, progress=False)
    assert repr(shard) in str(raised.value), str(raised.value)
    assert drawn == []  # from the headers, before the first batch
    assert all(p.device.type == "meta" for p in model.parameters())
