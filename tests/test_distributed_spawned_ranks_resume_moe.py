"""Three spawned gloo ranks (``start_method="spawn"``, as torch.multiprocessing.spawn starts them)
each calibrate a shard of a tiny random transformers Qwen3-MoE (stacked experts) in two halves: the
first half's states saved per rank (`qstats.save`), loaded (`qstats.load`) and resumed with the
second half, then merged with ``all_reduce(partial=True)`` (the third rank has no batch in the first
half). Every rank gets the activation states one process calibrating all the batches gets, bit for
bit, for minmax (experts' inputs) and histogram (attention projections) observers."""

from __future__ import annotations

import os
import sys
import traceback
import warnings
from datetime import timedelta

import optree
import pytest
import torch

import qstats
from qstats import distributed

sys.path.insert(0, os.path.dirname(__file__))
from _shared import assert_site_states_equal, exit_rank, fork_ranks, gloo_group, qwen3_moe_config  # noqa: E402

WORLD = 3
RECIPE = qstats.Recipe([
    qstats.Rule("Qwen3MoeExperts", sites=("gate_up_proj.input", "down_proj.input"), observer=qstats.minmax,
                spec=qstats.QuantSpec(dtype="int8")),
    qstats.Rule("Linear", sites=("input",), observer=qstats.histogram,
                spec=qstats.QuantSpec(dtype="uint8", mapping="asymmetric")),
])


def model_and_batches():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(qwen3_moe_config()).eval()
    generator = torch.Generator().manual_seed(1)
    batches = [{"input_ids": torch.randint(0, 64, (2, 4 + i), generator=generator)} for i in range(5)]
    return model, batches


def calibrated(model, batches, states=None) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # experts without tokens
        return qstats.calibrate(model, batches, RECIPE, states=states, progress=False)


def activations(states: dict) -> dict:
    return {path: {site: state for site, state in sites.items() if "weight" not in site}
            for path, sites in states.items()}


def _rank(rank: int, port: int, out: str) -> None:
    results: dict = {}
    try:
        with gloo_group(rank, port, world=WORLD, timeout=timedelta(seconds=60)):
            model, batches = model_and_batches()
            first, second = batches[:2], batches[2:]  # rank 2 has no batch of the first half
            path = os.path.join(out, f"rank{rank}.safetensors")
            qstats.save(path, calibrated(model, first[rank::WORLD]))
            resumed = calibrated(model, second[rank::WORLD], states=qstats.load(path))
            local = activations(resumed)
            results["merged"] = optree.tree_map(torch.clone, distributed.all_reduce(
                local, RECIPE.observers(local, model), partial=True))
    except Exception:
        results["crash"] = traceback.format_exc()
    torch.save(results, os.path.join(out, f"spawned{rank}.pt"))
    exit_rank(0)


def test_spawned_ranks_resumed_from_their_files_equal_one_process(tmp_path):
    assert fork_ranks(_rank, str(tmp_path), world=WORLD, timeout=300, start_method="spawn") == [0] * WORLD
    results = [torch.load(tmp_path / f"spawned{rank}.pt", weights_only=False) for rank in range(WORLD)]
    assert not any("crash" in r for r in results), [r.get("crash") for r in results]
    model, batches = model_and_batches()
    one_process = activations(calibrated(model, batches))
    assert any("gate_up_proj.input" in sites for sites in one_process.values())
    for result in results:
        assert_site_states_equal(result["merged"], one_process)
