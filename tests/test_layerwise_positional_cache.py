"""calibrate_layerwise(propagate="quantized") on models whose forward passes the KV cache to the
layers by position (GPT-2) or as ``layer_past=`` (GPT-NeoX, Falcon), against a loop written here:
for each layer, `qstats.calibrate` of the loaded model with every Linear (GPT-2: Conv1D) of the layers before it
fake-quantized by hand (its weight replaced, hooks on its input and output) under the qparams of
the layer-by-layer states.

Each layer runs twice on a batch (observed, then propagated quantized): a cache kept in the stored
arguments made the second run attend to the first run's cached keys too (GPT-NeoX: other states
from the second layer on; GPT-2 and Falcon: a size mismatch inside attention). Each call gets an
empty cache, as the full model's layers do: GPT-J's eager attention rounds otherwise in the last
bits without one, so float propagation equals `qstats.calibrate` of the loaded model bit for bit.
"""

from __future__ import annotations


import pytest
import torch

import qstats

transformers = pytest.importorskip("transformers")
from _shared import assert_site_states_equal, saved_loaded_and_meta  # noqa: E402

SPEC_W = qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0))
SPEC_A = qstats.QuantSpec(dtype="int8", mapping="asymmetric")
LINEAR = ("Linear", "Conv1D")  # GPT-2's projections are transformers' Conv1D (a Linear with the weight transposed)
RECIPE = qstats.Recipe([qstats.Rule(LINEAR, sites=("input", "output"), spec=SPEC_A),
                        qstats.Rule(LINEAR, sites=("weight",), spec=SPEC_W)])  # fmt: skip
LAYERS = 3


def _configs() -> dict:
    return {
        "gpt2": (transformers.GPT2Config(vocab_size=96, n_embd=32, n_layer=LAYERS, n_head=4, n_positions=64), "transformer.h"),
        "gpt_neox": (transformers.GPTNeoXConfig(vocab_size=96, hidden_size=32, intermediate_size=48,
                                                num_hidden_layers=LAYERS, num_attention_heads=4,
                                                max_position_embeddings=64), "gpt_neox.layers"),
        "falcon": (transformers.FalconConfig(vocab_size=96, hidden_size=32, num_hidden_layers=LAYERS,
                                             num_attention_heads=4, new_decoder_architecture=True, num_kv_heads=2),
                   "transformer.h"),
        "gptj": (transformers.GPTJConfig(vocab_size=96, n_embd=32, n_layer=LAYERS, n_head=4, n_positions=64,
                                         rotary_dim=4), "transformer.h"),
    }  # fmt: skip


def _batches(padded: bool = False) -> list:
    """Three batches of two sequences (5, 7, 9 tokens); ``padded``: the second left-padded by 2, 3, 4."""
    generator = torch.Generator().manual_seed(1)
    out = []
    for index in range(3):
        ids = torch.randint(1, 96, (2, 5 + 2 * index), generator=generator)
        mask = torch.ones_like(ids)
        mask[1, : index + 2] = 0
        out.append({"input_ids": ids, "attention_mask": mask} if padded else {"input_ids": ids})
    return out


def _with_fake_quantized(model, qparams: dict, keep) -> list:
    """Replaces the weight of every Linear (or Conv1D) at a path ``keep`` selects by its fake-quantized value and
    hooks its input and output; returns what `_restore` puts back."""
    undo = []
    for path, entry in qparams.items():
        if not keep(path):
            continue
        module = model.get_submodule(path)
        weight = module.weight
        module._parameters["weight"] = torch.nn.Parameter(qstats.fake_quantize(weight.detach(), entry["weight"], SPEC_W),
                                                          requires_grad=weight.requires_grad)
        undo.append((module, weight))
        quantized = lambda x, site, entry=entry: qstats.fake_quantize(x, entry[site], SPEC_A)  # noqa: E731
        undo.append(module.register_forward_pre_hook(lambda m, args, q=quantized: (q(args[0], "input"), *args[1:])))
        undo.append(module.register_forward_hook(lambda m, args, output, q=quantized: q(output, "output")))
    return undo


def _restore(undo: list) -> None:
    for item in reversed(undo):
        if isinstance(item, tuple):
            item[0]._parameters["weight"] = item[1]
        else:
            item.remove()




@pytest.mark.parametrize("name", ["gpt2", "gpt_neox", "falcon", "gptj"])
def test_float_propagation_equals_the_full_model_where_the_cache_is_passed_by_position_or_as_layer_past(
        tmp_path, name):
    loaded, model = saved_loaded_and_meta(tmp_path, _configs()[name][0])
    weight = lambda batch: batch["attention_mask"]  # noqa: E731
    want = qstats.calibrate(loaded, _batches(padded=True), RECIPE, progress=False, observation_weight=weight)
    got = qstats.calibrate_layerwise(model, str(tmp_path), _batches(padded=True), RECIPE, progress=False,
                                     observation_weight=weight)  # fmt: skip
    assert_site_states_equal(got, want)


@pytest.mark.parametrize("name", ["gpt2", "gpt_neox", "falcon", "gptj"])
def test_quantized_propagation_equals_a_loop_where_the_cache_is_passed_by_position_or_as_layer_past(tmp_path, name):
    config, layers = _configs()[name]
    loaded, model = saved_loaded_and_meta(tmp_path, config)
    got = qstats.calibrate_layerwise(model, str(tmp_path), _batches(), RECIPE, progress=False, propagate="quantized")
    qparams = qstats.compute_qparams_tree(got, RECIPE, loaded)
    layer_of = lambda path: int(path[len(layers) + 1 :].split(".")[0]) if path.startswith(layers + ".") else LAYERS  # noqa: E731
    want = {}
    for index in range(LAYERS + 1):  # the modules after the layers last
        undo = _with_fake_quantized(loaded, qparams, lambda path: layer_of(path) < index)
        try:
            states = qstats.calibrate(loaded, _batches(), RECIPE, progress=False)
        finally:
            _restore(undo)
        want.update({path: entry for path, entry in states.items() if layer_of(path) == index})
    assert_site_states_equal(got, want)
    assert any(layer_of(path) == LAYERS - 1 for path in got)
