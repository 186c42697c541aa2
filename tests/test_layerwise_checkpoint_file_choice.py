"""Which files of a checkpoint folder the layer-by-layer functions read, against ``from_pretrained``.

``save_pretrained`` of one file into a folder of shards removes the shards but leaves their
``model.safetensors.index.json``; ``from_pretrained`` reads ``model.safetensors`` first, so it loads
the new weights. `qstats.calibrate_layerwise` and `qstats.export.compressed_tensors_layerwise` read
the same file: states equal `qstats.calibrate` on ``from_pretrained``'s model, and the export equals
the in-memory export of that model.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import qstats
from _shared import assert_site_states_equal, save_sharded, tiny_llama_config

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

RECIPE = qstats.Recipe([
    qstats.Rule("Linear", sites=("weight",), spec=qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0))),
    qstats.Rule("Linear", sites=("input",), spec=qstats.QuantSpec(dtype="int8", mapping="asymmetric")),
], ignore=["lm_head"])  # fmt: skip


def _resaved_folder(folder) -> str:
    """A folder where a model saved in shards was saved again as one file (seeds 0, then 1)."""
    torch.manual_seed(0)
    save_sharded(folder, transformers.AutoModelForCausalLM.from_config(tiny_llama_config()))
    torch.manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.AutoModelForCausalLM.from_config(tiny_llama_config()).save_pretrained(folder)
    assert {"model.safetensors", "model.safetensors.index.json"} <= set(os.listdir(folder))
    return str(folder)


def _batches():
    generator = torch.Generator().manual_seed(2)
    return [{"input_ids": torch.randint(0, 96, (2, 8), generator=generator)} for _ in range(2)]


def _meta_model():
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(tiny_llama_config()).eval()


def test_calibrate_layerwise_reads_model_safetensors_over_a_stale_index_as_from_pretrained(tmp_path):
    folder = _resaved_folder(tmp_path / "checkpoint")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    expected = qstats.calibrate(loaded, _batches(), RECIPE, progress=False)
    states = qstats.calibrate_layerwise(_meta_model(), folder, _batches(), RECIPE, progress=False)
    assert_site_states_equal(states, expected)


def test_the_layerwise_export_reads_model_safetensors_over_a_stale_index_as_from_pretrained(tmp_path):
    folder = _resaved_folder(tmp_path / "checkpoint")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    qparams = qstats.compute_qparams_tree(qstats.calibrate(loaded, _batches(), RECIPE, progress=False), RECIPE, loaded)
    qstats.export.compressed_tensors(loaded, qparams, str(tmp_path / "in_memory"), RECIPE)
    qstats.export.compressed_tensors_layerwise(_meta_model(), folder, qparams, str(tmp_path / "layerwise"), RECIPE,
                                               progress=False, max_shard_size="1GB")  # fmt: skip
    expected = load_file(str(tmp_path / "in_memory" / "model.safetensors"))
    written = load_file(str(tmp_path / "layerwise" / "model.safetensors"))
    assert written.keys() == expected.keys()
    assert all(torch.equal(written[name], expected[name]) for name in expected)
