"""Gemma3n's KV-shared layers read the keys and values an earlier layer wrote into one dict its
forward passes to every layer (``shared_kv_states``). `calibrate_layerwise` keeps that dict shared
between the layers under ``offload_dir`` (each batch saved to disk between layers) and with
``device=`` (each batch moved to the layer's device), as it is in memory: the states equal
`qstats.calibrate` of the model ``from_pretrained`` loads bit for bit (they raised a KeyError), and
quantized propagation gives the same states in each mode."""

from __future__ import annotations

import tempfile
import warnings

import pytest
import torch

import qstats

transformers = pytest.importorskip("transformers")

W8 = qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0))
A8 = qstats.QuantSpec(dtype="int8", mapping="asymmetric")
RECIPE = qstats.Recipe([qstats.Rule("Linear", sites=("input",), spec=A8), qstats.Rule("Linear", sites=("weight",), spec=W8)])


@pytest.fixture(scope="module")
def gemma3n():
    config = transformers.Gemma3nTextConfig(
        vocab_size=96, vocab_size_per_layer_input=96, hidden_size=32, hidden_size_per_layer_input=8, intermediate_size=48,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=4,
        num_kv_shared_layers=2, activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0], altup_num_inputs=2, laurel_rank=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"])  # fmt: skip
    folder = tempfile.mkdtemp()
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder, max_shard_size="20KB")
    generator = torch.Generator().manual_seed(1)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :2] = 0
    batches = [{"input_ids": torch.randint(0, 96, (2, 7), generator=generator), "attention_mask": mask},
               {"input_ids": torch.randint(0, 96, (1, 5), generator=generator)}]
    return config, folder, batches


def _layerwise(gemma3n, **options):
    config, folder, batches = gemma3n
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
    assert sum(layer.self_attn.is_kv_shared_layer for layer in model.model.layers) == 2
    with tempfile.TemporaryDirectory() as spill:
        if options.pop("offload", False):
            options["offload_dir"] = spill
        return qstats.calibrate_layerwise(model, folder, batches, RECIPE, progress=False, **options)


def _assert_equal(one, other):
    assert set(one) == set(other)
    for path in one:
        for site in one[path]:
            assert all(torch.equal(a, b) for a, b in zip(one[path][site], other[path][site])), (path, site)


@pytest.mark.parametrize("options", [dict(offload=True), dict(device="cpu"), dict(offload=True, device="cpu")],
                         ids=["offload_dir", "device", "both"])
def test_the_shared_keys_and_values_reach_the_later_layers(gemma3n, options):
    config, folder, batches = gemma3n
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    _assert_equal(qstats.calibrate(loaded, batches, RECIPE, progress=False), _layerwise(gemma3n, **options))


@pytest.mark.parametrize("options", [dict(offload=True), dict(device="cpu")], ids=["offload_dir", "device"])
def test_quantized_propagation_is_the_same_in_memory_on_disk_and_on_a_device(gemma3n, options):
    _assert_equal(_layerwise(gemma3n, propagate="quantized"), _layerwise(gemma3n, propagate="quantized", **options))
