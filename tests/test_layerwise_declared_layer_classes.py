"""qstats.calibrate_layerwise's default decoder layers where another list of modules outside them is
longer: a two-layer Gemma3n (its default ``altup_num_inputs=4`` gives ``model.altup_projections``, three
Linear layers). transformers names its decoder layer class in ``_no_split_modules``: the list of those
is the layers, however short.

The reference is `qstats.calibrate` on the model ``from_pretrained`` loads from the same shards: the
layer-by-layer states equal it bit for bit.
"""

from __future__ import annotations

import pytest

import qstats

transformers = pytest.importorskip("transformers")
from _shared import assert_site_states_equal, left_padded_id_batches, saved_loaded_and_meta  # noqa: E402

RECIPE = qstats.Recipe([
    qstats.Rule("Linear", sites=("input",), spec=qstats.QuantSpec(dtype="int8", mapping="asymmetric")),
    qstats.Rule("Linear", sites=("weight",), spec=qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0))),
])  # fmt: skip


def test_the_declared_layers_are_found_beside_a_longer_list_of_linear_layers(tmp_path):
    config = transformers.Gemma3nTextConfig(
        vocab_size=96, vocab_size_per_layer_input=96, hidden_size=32, hidden_size_per_layer_input=8,
        intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        sliding_window=4, num_kv_shared_layers=0, activation_sparsity_pattern=[0.0, 0.0], laurel_rank=4,
        layer_types=["sliding_attention", "full_attention"])  # fmt: skip
    loaded, model = saved_loaded_and_meta(str(tmp_path), config)
    assert len(model.model.altup_projections) == 3 > len(model.model.layers)
    batches = left_padded_id_batches()
    weight = lambda batch: batch["attention_mask"]  # noqa: E731
    states = qstats.calibrate_layerwise(model, str(tmp_path), batches, RECIPE, progress=False,
                                        observation_weight=weight)
    assert_site_states_equal(states, qstats.calibrate(loaded, batches, RECIPE, progress=False,
                                                      observation_weight=weight))
