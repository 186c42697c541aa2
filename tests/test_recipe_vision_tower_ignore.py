"""An ``ignore`` entry written under a model's checkpoint names (``re:visual.*`` of Qwen2-VL, whose
transformers 5 module paths are ``model.visual.*``): llm-compressor 0.14's ``QuantizationModifier``
matches it against module paths only and quantizes the vision tower; a Recipe leaves it out, as the
entry says (docs/differences.md). An entry matching the module paths reads alike in both."""

import copy
import warnings

import pytest
import torch

import qstats

transformers = pytest.importorskip("transformers")
pytest.importorskip("llmcompressor")
from llmcompressor.modifiers.quantization import QuantizationModifier  # noqa: E402


@pytest.fixture(scope="module")
def qwen2_vl():
    config = transformers.Qwen2VLConfig(
        text_config=dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2, in_channels=3,
                           patch_size=2, spatial_merge_size=1, temporal_patch_size=1),
    )
    torch.manual_seed(0)
    return transformers.AutoModelForImageTextToText.from_config(config).eval()


def _llm_compressor_quantizes(model, ignore: list) -> set:
    model = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        QuantizationModifier(scheme="W8A16", ignore=ignore).initialize_quantization(model)
    return {path for path, module in model.named_modules()
            if getattr(module, "quantization_scheme", None) is not None and module.quantization_scheme.weights}


def _recipe_quantizes(model, ignore: list) -> set:
    return set(qstats.Recipe.from_scheme("W8A16", ignore=ignore).resolve(model).sites)


def test_a_checkpoint_name_ignore_leaves_out_the_vision_tower_llm_compressor_quantizes(qwen2_vl):
    ignore = ["re:visual.*", "lm_head"]
    theirs, ours = _llm_compressor_quantizes(qwen2_vl, ignore), _recipe_quantizes(qwen2_vl, ignore)
    vision = {path for path in theirs if path.startswith("model.visual.")}
    assert vision and not ours & vision
    assert ours == theirs - vision


def test_an_ignore_of_the_module_paths_reads_alike(qwen2_vl):
    ignore = ["re:model.visual.*", "lm_head"]
    assert _recipe_quantizes(qwen2_vl, ignore) == _llm_compressor_quantizes(qwen2_vl, ignore)
