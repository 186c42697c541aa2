"""Checkpoints under the legacy names ``from_pretrained`` renames on load (transformers' "legacy"
conversions): ``bert-base-uncased``'s safetensors hold ``LayerNorm.gamma`` / ``LayerNorm.beta`` for
``weight`` / ``bias``. `qstats.calibrate_layerwise` and `qstats.export.compressed_tensors_layerwise`
read them as ``from_pretrained`` does: the states are those of `qstats.calibrate` on
``from_pretrained``'s model, and the layerwise checkpoint loads into the same model."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import qstats
from _shared import assert_site_states_equal, bit_equal

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

CONFIG = dict(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
              max_position_embeddings=16)


def _legacy_checkpoint(folder, model) -> str:
    """``model`` saved, its LayerNorm tensors (drawn away from their initial ones and zeros) renamed
    ``gamma`` / ``beta`` as old BERT checkpoints hold them."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.normal_(1.0, 0.1), module.bias.normal_(0.0, 0.1)
    model.save_pretrained(folder)
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    renamed = {name.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): tensor
               for name, tensor in tensors.items()}
    assert sum("LayerNorm.gamma" in name for name in renamed) >= 5  # embeddings and 2 per layer
    save_file(renamed, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    return str(folder)


@pytest.mark.parametrize("saved_class", ["BertModel", "BertForPreTraining"])  # keys without and with "bert." (bert-base-uncased)
def test_a_checkpoint_of_legacy_layer_norm_names_calibrates_as_from_pretrained_loads_it(tmp_path, saved_class):
    config = transformers.BertConfig(**CONFIG)
    torch.manual_seed(0)
    checkpoint = _legacy_checkpoint(tmp_path / "legacy", getattr(transformers, saved_class)(config).eval())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a task checkpoint's head: unused by the base model
        loaded = transformers.BertModel.from_pretrained(checkpoint).eval()
    norm = loaded.embeddings.LayerNorm
    assert not torch.equal(norm.weight, torch.ones_like(norm.weight))  # read from the checkpoint, not initialised
    recipe = qstats.Recipe.from_scheme("W8A8", targets=["Linear"], ignore=["re:.*pooler.*"])
    generator = torch.Generator().manual_seed(1)
    batches = [{"input_ids": torch.randint(0, 50, (2, 8), generator=generator)} for _ in range(2)]
    expected = qstats.calibrate(loaded, batches, recipe, progress=False)

    with torch.device("meta"):
        meta = transformers.BertModel(config).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        states = qstats.calibrate_layerwise(meta, checkpoint, batches, recipe, progress=False)
    assert_site_states_equal(states, expected)

    qparams = qstats.compute_qparams_tree(states, recipe, loaded)
    out = str(tmp_path / "export")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qstats.export.compressed_tensors_layerwise(meta, checkpoint, qparams, out, recipe, progress=False)
        reloaded = transformers.BertModel.from_pretrained(out).eval()
    assert bit_equal(reloaded.embeddings.LayerNorm.weight.data, norm.weight.data)
    assert bit_equal(reloaded.encoder.layer[1].output.LayerNorm.bias.data, loaded.encoder.layer[1].output.LayerNorm.bias.data)
