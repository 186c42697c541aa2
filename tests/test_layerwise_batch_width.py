"""A batch whose hidden states are of another width than the others (``inputs_embeds`` of another
model) is named by `calibrate_layerwise` when it is captured, before the layers run over the batches
(before: torch's shape error from inside the first layer, naming no batch, once every batch was captured)."""

import warnings

import pytest
import torch

import qstats

transformers = pytest.importorskip("transformers")


def test_a_batch_of_another_width_is_a_value_error_naming_it_before_the_layers_run(tmp_path, monkeypatch):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    loaded = transformers.AutoModelForCausalLM.from_config(config).eval()
    loaded.save_pretrained(str(tmp_path))
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config).eval()
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("input",), spec=qstats.QuantSpec(dtype="int8"))])
    batches = [{"inputs_embeds": torch.randn(2, 7, 32)}, {"inputs_embeds": torch.randn(1, 5, 48)}]
    with pytest.raises(RuntimeError, match="48"), warnings.catch_warnings():  # the reference: torch's shape error
        warnings.simplefilter("ignore")
        qstats.calibrate(loaded, batches, recipe, progress=False)
    read = []
    load_modules = qstats.layerwise.load_modules
    monkeypatch.setattr(qstats.layerwise, "load_modules", lambda model, paths, *a, **k: read.extend(paths)
                        or load_modules(model, paths, *a, **k))
    with pytest.raises(ValueError, match=r"batch 1 gives model\.layers\.0 hidden states of 48 features, batch 0 32"):
        qstats.calibrate_layerwise(meta, str(tmp_path), batches, recipe, progress=False)
    assert "model.layers.1" not in read  # the first layer is read once, by the checks on the first batch
    assert all(p.device.type == "meta" for p in meta.parameters())
