"""Batches from an iterator that refills the same tensors in place for each batch (a streaming loader
with one preallocated buffer): `calibrate_layerwise` gives `qstats.calibrate`'s states on the loaded
model (the reference, which observes each batch as it comes). It kept each batch's own tensors, so
the modules outside the layers (run last, on the kept batches: the embeddings' output) saw the last
batch's tokens for every batch, and an observation weight returned from the batch (its attention
mask) was the last batch's for every batch, in every layer, offloaded or not."""

from __future__ import annotations

import warnings

import pytest
import torch

import qstats

transformers = pytest.importorskip("transformers")
from _shared import assert_site_states_equal, save_sharded, tiny_llama_config  # noqa: E402

SPEC = qstats.QuantSpec(dtype="int8", mapping="asymmetric")
RECIPE = qstats.Recipe([qstats.Rule(("Linear", "Embedding"), sites=("input", "output"), spec=SPEC)])


def _refilled(count: int = 3):
    """``count`` batches of other tokens and padding, each written into the same two tensors."""
    ids, mask = torch.empty(2, 8, dtype=torch.long), torch.empty(2, 8, dtype=torch.long)
    for index in range(count):
        ids.copy_(torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(index)))
        mask.fill_(1)
        mask[1, : 2 + 2 * index] = 0  # left padding, longer in each batch
        yield {"input_ids": ids, "attention_mask": mask}


@pytest.mark.parametrize("offload", [False, True])
def test_batches_refilled_in_place_give_the_full_models_states(tmp_path, offload):
    config = tiny_llama_config()
    torch.manual_seed(0)
    directory = save_sharded(tmp_path / "checkpoint", transformers.AutoModelForCausalLM.from_config(config))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    weight = lambda batch: batch["attention_mask"]  # noqa: E731
    want = qstats.calibrate(loaded, _refilled(), RECIPE, progress=False, observation_weight=weight)
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config).eval()
    spill = tmp_path / "spill"
    spill.mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = qstats.calibrate_layerwise(meta, directory, _refilled(), RECIPE, progress=False,
                                         observation_weight=weight, offload_dir=spill if offload else None)
    assert_site_states_equal(got, want)


def _refilled_four_d(count: int = 3):
    """`_refilled`'s batches with their masks as 4-D additive ones (causal, padding left out), which
    transformers passes to the layers as they are; the same three tensors each time."""
    ids, four_d = torch.empty(2, 8, dtype=torch.long), torch.empty(2, 1, 8, 8)
    causal = torch.tril(torch.ones(8, 8, dtype=torch.bool))
    for batch in _refilled(count):
        ids.copy_(batch["input_ids"])
        allowed = (causal & batch["attention_mask"][:, None, :].bool()) | torch.eye(8, dtype=torch.bool)
        four_d.copy_(torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[:, None])
        yield {"input_ids": ids, "attention_mask": four_d}


def test_a_four_d_mask_refilled_in_place_gives_the_full_models_states(tmp_path):
    """The layers' own arguments: the mask the forward passes them is the batch's tensor itself."""
    config = tiny_llama_config()
    torch.manual_seed(0)
    directory = save_sharded(tmp_path / "checkpoint", transformers.AutoModelForCausalLM.from_config(config))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    want = qstats.calibrate(loaded, _refilled_four_d(), RECIPE, progress=False)
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = qstats.calibrate_layerwise(meta, directory, _refilled_four_d(), RECIPE, progress=False)
    assert_site_states_equal(got, want)
