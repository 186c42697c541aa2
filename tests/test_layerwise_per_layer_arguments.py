"""qstats.calibrate_layerwise on models whose forward gives each decoder layer its own arguments
though their layers are all of one kind, against `qstats.calibrate` on the loaded model.

- GraniteSWA with ``layer_types`` all full attention and per-layer ``layer_rope_theta``: a layer of
  theta 0 (NoPE) gets ``position_embeddings=None``, the others the rotary embeddings of their theta.
- A plain ``nn.Module`` whose forward passes each layer its index (``layer_idx=``).

Replaying the first layer's arguments to every layer gives other states from the second layer on.
"""

from __future__ import annotations


import pytest
import torch

import qstats

transformers = pytest.importorskip("transformers")
from safetensors.torch import save_file  # noqa: E402
from _shared import assert_site_states_equal, left_padded_id_batches, saved_loaded_and_meta  # noqa: E402

SPEC_W = qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0))
SPEC_A = qstats.QuantSpec(dtype="int8", mapping="asymmetric")
RECIPE = qstats.Recipe([qstats.Rule("Linear", sites=("input",), spec=SPEC_A),
                        qstats.Rule("Linear", sites=("weight",), spec=SPEC_W)])  # fmt: skip


def test_granite_swa_nope_and_per_layer_rope_thetas_equal_the_full_model(tmp_path):
    config = transformers.GraniteSWAConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, layer_types=["full_attention"] * 3,
        layer_rope_theta=[10000.0, 0, 500.0],
    )  # fmt: skip
    loaded, model = saved_loaded_and_meta(tmp_path, config)
    weight = lambda batch: batch["attention_mask"]  # noqa: E731
    want = qstats.calibrate(loaded, left_padded_id_batches(), RECIPE, progress=False, observation_weight=weight)
    got = qstats.calibrate_layerwise(model, str(tmp_path), left_padded_id_batches(), RECIPE, progress=False,
                                     observation_weight=weight)  # fmt: skip
    assert_site_states_equal(got, want)


class _Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, hidden, scale, layer_idx):
        return self.proj(hidden * scale) * (layer_idx + 1)


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.layers = torch.nn.ModuleList(_Layer() for _ in range(3))
        self.head = torch.nn.Linear(8, 4)

    def forward(self, ids):
        hidden, scale = self.embed(ids), torch.full((1,), 0.5)
        for index, layer in enumerate(self.layers):
            hidden = layer(hidden, scale, layer_idx=index)
        return self.head(hidden)


def test_a_layer_index_passed_by_the_forward_reaches_each_layer(tmp_path):
    torch.manual_seed(0)
    loaded = _Model().eval()
    save_file({name: value.contiguous() for name, value in loaded.state_dict().items()},
              str(tmp_path / "model.safetensors"))  # fmt: skip
    with torch.device("meta"):
        model = _Model().eval()
    batches = [torch.randint(0, 16, (2, 5), generator=torch.Generator().manual_seed(seed)) for seed in range(3)]
    want = qstats.calibrate(loaded, batches, RECIPE, progress=False)
    got = qstats.calibrate_layerwise(model, str(tmp_path), batches, RECIPE, progress=False)
    assert_site_states_equal(got, want)
