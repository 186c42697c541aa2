"""qstats.calibrate_layerwise's default decoder layers on a multimodal model whose vision encoder
has more blocks than its language model has layers (Qwen2-VL: 32 vision blocks, 28 decoder layers).

The reference is `qstats.calibrate` on transformers' ``from_pretrained`` model over the same text
batches: the layer-by-layer states equal it bit for bit. The longest list of layers is the vision
encoder's, which a text-only forward never calls.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import qstats

transformers = pytest.importorskip("transformers")
from _shared import assert_site_states_equal  # noqa: E402

RECIPE = qstats.Recipe([
    qstats.Rule("Linear", sites=("input",), spec=qstats.QuantSpec(dtype="int8", mapping="asymmetric")),
    qstats.Rule("Linear", sites=("weight",), spec=qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0))),
])  # fmt: skip


def _config():
    text = dict(vocab_size=160, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64,
                rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]})  # fmt: skip
    vision = dict(depth=3, embed_dim=16, hidden_size=32, num_heads=2, in_chans=3, patch_size=2,
                  spatial_merge_size=1, temporal_patch_size=1)  # fmt: skip
    return transformers.Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=150,
                                      video_token_id=151, vision_start_token_id=152)  # fmt: skip


@pytest.fixture
def checkpoint(tmp_path):
    directory = str(tmp_path / "checkpoint")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.Qwen2VLForConditionalGeneration(_config()).save_pretrained(directory, max_shard_size="40KB")
    return directory


def _meta(directory: str) -> torch.nn.Module:
    config = transformers.AutoConfig.from_pretrained(directory)
    with torch.device("meta"):
        return transformers.Qwen2VLForConditionalGeneration(config).eval()


def _batches() -> list:
    generator = torch.Generator().manual_seed(0)
    out = []
    for index in range(2):
        ids = torch.randint(0, 140, (2, 5 + index), generator=generator)
        mask = torch.ones_like(ids)
        mask[1, :index + 1] = 0  # left padding
        out.append({"input_ids": ids, "attention_mask": mask})
    return out


def test_the_text_layers_are_calibrated_though_the_vision_encoder_has_more_blocks(checkpoint):
    meta = _meta(checkpoint)
    assert len(meta.model.visual.blocks) > len(meta.model.language_model.layers)
    loaded = transformers.Qwen2VLForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    weight = lambda batch: batch["attention_mask"]  # noqa: E731
    want = qstats.calibrate(loaded, _batches(), RECIPE, progress=False, observation_weight=weight)
    got = qstats.calibrate_layerwise(meta, checkpoint, _batches(), RECIPE, progress=False, observation_weight=weight)
    assert_site_states_equal(got, want)
    assert "model.language_model.layers.1.mlp.down_proj" in got and "lm_head" in got
    named = qstats.calibrate_layerwise(meta, checkpoint, _batches(), RECIPE, progress=False,
                                       observation_weight=weight, layers="model.language_model.layers")
    assert_site_states_equal(named, want)
    assert all(value.device.type == "meta" for value in meta.parameters())


def test_the_export_writes_one_shard_per_text_layer(checkpoint, tmp_path):
    """The export's shards follow the same layers: one per decoder layer of the language model and
    one for the rest (the vision encoder among it), under the names save_pretrained gives them."""
    import json
    import os

    meta = _meta(checkpoint)
    loaded = transformers.Qwen2VLForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    recipe = qstats.Recipe(RECIPE.rules, ignore=("re:.*visual.*", "lm_head"))
    states = qstats.calibrate(loaded, _batches(), recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe, loaded)
    out = str(tmp_path / "export")
    qstats.export.compressed_tensors_layerwise(meta, checkpoint, qparams, out, recipe, progress=False)
    with open(os.path.join(out, "model.safetensors.index.json")) as file:
        weight_map = json.load(file)["weight_map"]
    layer_shards = {weight_map[f"model.layers.{index}.mlp.down_proj.weight"] for index in range(2)}
    assert len(layer_shards) == 2 and len(set(weight_map.values())) == 3


def test_layers_the_forward_never_calls_are_refused_naming_them(checkpoint):
    """The vision blocks named as the decoder layers: a text-only forward never calls them, and the
    error names the first of them and ``layers=``."""
    with pytest.raises(ValueError, match=r"never called its first decoder layer, model\.visual\.blocks\.0; pass layers="):
        qstats.calibrate_layerwise(_meta(checkpoint), checkpoint, _batches(), RECIPE, progress=False,
                                   layers="model.visual.blocks")
