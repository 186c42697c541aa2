"""calibrate_layerwise(..., offload_dir=) reads each batch's file once per pass over the batches: once
per layer (its inputs), once for the modules outside the layers (the batch and the last layer's outputs).
The observation weight of each batch (small: one value per token) stays in memory; it was read by loading
the batch's whole file again, and the stand-ins of the last pass loaded it a second time for the last
layer's outputs: every file was read twice per pass. The states equal `qstats.calibrate` of the model
``from_pretrained`` loads, with and without an observation weight."""

from __future__ import annotations

import pytest
import torch

import qstats
from qstats import layerwise

transformers = pytest.importorskip("transformers")
from _shared import (assert_site_states_equal, left_padded_id_batches, saved_loaded_and_meta,  # noqa: E402
                     tiny_llama_config)

RECIPE = qstats.Recipe([
    qstats.Rule("Linear", sites=("input",), spec=qstats.QuantSpec(dtype="int8", mapping="asymmetric")),
    qstats.Rule("Linear", sites=("weight",), spec=qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0))),
])  # fmt: skip


@pytest.mark.parametrize("weighted", [False, True])
def test_each_offloaded_batch_is_read_once_per_pass(tmp_path, monkeypatch, weighted):
    loaded, model = saved_loaded_and_meta(str(tmp_path / "checkpoint"), tiny_llama_config())
    spill = tmp_path / "spill"
    spill.mkdir()
    reads: list = []
    load = torch.load

    def counted(path, *args, **kwargs):
        reads.append(path)
        return load(path, *args, **kwargs)

    monkeypatch.setattr(layerwise.torch, "load", counted)
    batches = left_padded_id_batches()
    weight = (lambda batch: batch["attention_mask"]) if weighted else None
    states = qstats.calibrate_layerwise(model, str(tmp_path / "checkpoint"), batches, RECIPE, progress=False,
                                        offload_dir=str(spill), observation_weight=weight)
    monkeypatch.undo()
    passes = len(model.model.layers) + 1  # each layer, then the modules outside them
    assert len(reads) == passes * len(batches)
    assert all(str(path).startswith(str(spill)) for path in reads)
    assert_site_states_equal(states, qstats.calibrate(loaded, batches, RECIPE, progress=False,
                                                      observation_weight=weight))
