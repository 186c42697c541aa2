"""qstats.calibrate_layerwise on transformers' hybrid attention/state-space models, against
`qstats.calibrate` on the model ``from_pretrained`` loads from the same shards.

- Jamba and Zamba2: decoder layers of two classes in one list (declared in ``_no_split_modules``),
  found without ``layers=``.
- FalconH1: each Mamba mixer's ``mup_vector`` buffer is not saved; ``from_pretrained`` has the
  model around the layers (``FalconH1Model._init_weights``) fill it.
- Bamba: its layers return ``(hidden_states, attention_weights)``, which the forward unpacks, and
  get a mask of their own kind (recurrent or causal).
"""

from __future__ import annotations

import warnings

import pytest

import qstats

transformers = pytest.importorskip("transformers")
from _shared import assert_site_states_equal, left_padded_id_batches, saved_loaded_and_meta  # noqa: E402

SPEC_W = qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0))
SPEC_A = qstats.QuantSpec(dtype="int8", mapping="asymmetric")
RECIPE = qstats.Recipe([qstats.Rule("Linear", sites=("input", "output"), spec=SPEC_A),
                        qstats.Rule("Linear", sites=("weight",), spec=SPEC_W)])  # fmt: skip
SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=64)  # fmt: skip
MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8, mamba_chunk_size=8)


def _configs() -> dict:
    return {
        "jamba": transformers.JambaConfig(
            **SMALL, num_hidden_layers=3, num_experts=4, num_experts_per_tok=2, attn_layer_period=2,
            attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, mamba_d_state=4, mamba_dt_rank=4,
            use_mamba_kernels=False),
        "zamba2": transformers.Zamba2Config(
            **SMALL, num_hidden_layers=4, layers_block_type=["mamba", "hybrid", "mamba", "hybrid"], mamba_d_state=8,
            mamba_ngroups=1, n_mamba_heads=4, mamba_headdim=16, attention_head_dim=16, num_mem_blocks=1),
        "falcon_h1": transformers.FalconH1Config(**SMALL, **MAMBA2, num_hidden_layers=3, head_dim=8, mamba_d_ssm=64),
        "bamba": transformers.BambaConfig(**SMALL, **MAMBA2, num_hidden_layers=3, attn_layer_indices=[1]),
    }  # fmt: skip


@pytest.mark.parametrize("name", ["jamba", "zamba2", "falcon_h1", "bamba"])
def test_hybrid_models_equal_the_full_model_without_naming_their_layers(tmp_path, name):
    config = _configs()[name]
    loaded, model = saved_loaded_and_meta(tmp_path, config)
    weight = lambda batch: batch["attention_mask"]  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the state-space kernels' torch fallbacks
        want = qstats.calibrate(loaded, left_padded_id_batches(), RECIPE, progress=False, observation_weight=weight)
        got = qstats.calibrate_layerwise(model, str(tmp_path), left_padded_id_batches(), RECIPE, progress=False,
                                         observation_weight=weight)  # fmt: skip
    assert_site_states_equal(got, want)
    assert f"model.layers.{config.num_hidden_layers - 1}" in "".join(got)
    assert all(value.device.type == "meta" for value in [*model.parameters(), *model.buffers()])
