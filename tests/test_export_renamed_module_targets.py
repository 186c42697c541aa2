"""The export of a model whose checkpoint names differ from its module paths (Qwen2-VL in transformers
5: ``model.language_model.layers.0...`` saved as ``model.layers.0...``, ``model.visual...`` as
``visual...``), loaded back by transformers: compressed-tensors matches the config's targets and ignore
list against the module paths of the model it builds, so the modules the recipe quantized, and only
those, load quantized, and the loaded model computes the logits of `qstats.fake_quantized`."""

from __future__ import annotations

import warnings

import pytest
import torch

import qstats

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

W8 = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
W4 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}
FP8 = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": False}
IGNORE = ["lm_head", "re:.*visual.*"]
RECIPES = {
    # one group of Linear modules: the config targets ["Linear"] less the ignore list
    "one-group": lambda: qstats.Recipe.from_scheme("W8A8", ignore=IGNORE),
    # several groups: each targets its modules by name
    "two-groups": lambda: qstats.Recipe.from_compressed_tensors(
        {"config_groups": {"g0": {"targets": ["Linear"], "weights": W8},
                           "g1": {"targets": ["re:.*down_proj"], "weights": W4, "input_activations": FP8}},
         "ignore": IGNORE}),
    # an attention group (q, k, v) beside the Linear one
    "attention-group": lambda: qstats.Recipe.from_compressed_tensors(
        {"config_groups": {"g0": {"targets": ["Linear"], "weights": W8},
                           "attention": {"targets": ["re:.*self_attn$"], "input_activations": FP8}},
         "ignore": IGNORE}),
}


def _qwen2_vl():
    config = transformers.Qwen2VLConfig(
        text_config=dict(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1,
                         rope_scaling={"type": "mrope", "mrope_section": [4, 6, 6]}),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, in_channels=3,
                           patch_size=2, spatial_merge_size=1, temporal_patch_size=1),
        tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForImageTextToText.from_config(config).eval()
    model.set_attn_implementation("eager")
    return model


@pytest.mark.parametrize("case", sorted(RECIPES))
def test_transformers_loads_the_modules_the_recipe_quantized(tmp_path, case):
    model = _qwen2_vl()
    plan = RECIPES[case]().resolve(model)
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(1))
    states = qstats.calibrate(model, [{"input_ids": ids}], plan, progress=False)
    qparams = qstats.compute_qparams_tree(states, plan)
    qstats.export.compressed_tensors(model, qparams, str(tmp_path), plan)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = transformers.AutoModelForImageTextToText.from_pretrained(str(tmp_path)).eval()
    weights = {path for path, sites in plan.sites.items() if "weight" in sites}
    quantized = {path for path, module in loaded.named_modules()
                 if getattr(getattr(module, "quantization_scheme", None), "weights", None) is not None}
    assert quantized == weights and any(path.startswith("model.language_model.") for path in quantized)
    attention = {path for path, sites in plan.sites.items() if "q" in sites}
    assert {path for path, module in loaded.named_modules() if hasattr(module, "q_scale")} == attention
    with torch.no_grad():
        with qstats.fake_quantized(model, qparams, plan):
            ours = model(ids).logits
        theirs = loaded(ids).logits
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=1e-4), (ours - theirs).abs().max()
