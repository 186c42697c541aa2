"""Two gloo ranks calibrating shards of a tiny random transformers Llama's batches, merged with
``all_reduce``, against one process calibrating every batch (docs/distributed.md): min/max and
histogram states bit for bit; the float sums of ``hessian``, ``imatrix`` and ``moments`` to rounding
only, and with ``exact=True`` bit for bit the ranks' states folded with ``obs.merge`` in rank order."""

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
from _shared import exit_rank, fork_ranks, gloo_group  # noqa: E402

WORLD = 2
SPEC = qstats.QuantSpec(dtype="int8")
OBSERVERS = {"minmax": qstats.minmax, "histogram": qstats.histogram, "hessian": qstats.hessian,
             "imatrix": qstats.imatrix, "moments": qstats.moments}


def recipe(name: str) -> qstats.Recipe:
    return qstats.Recipe([qstats.Rule("Linear", sites=("input",), observer=OBSERVERS[name], spec=SPEC)])


def model_and_batches():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    generator = torch.Generator().manual_seed(1)
    batches = [{"input_ids": torch.randint(0, 64, (2, 5 + i), generator=generator)} for i in range(5)]
    return transformers.LlamaForCausalLM(config).eval(), batches


def calibrated(model, batches, name: str) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return qstats.calibrate(model, batches, recipe(name), progress=False)


def _rank(rank: int, port: int, out: str) -> None:
    results: dict = {}
    try:
        with gloo_group(rank, port, world=WORLD, timeout=timedelta(seconds=30)):
            model, batches = model_and_batches()
            for name in OBSERVERS:
                local = calibrated(model, batches[rank::WORLD], name)
                results[name, "local"] = optree.tree_map(torch.clone, local)
                observers = recipe(name).observers(local, model)
                for exact in (False, True):
                    merged = distributed.all_reduce(local, observers, exact=exact)
                    results[name, exact] = optree.tree_map(torch.clone, merged)
    except Exception:
        results["crash"] = traceback.format_exc()
    torch.save(results, os.path.join(out, f"sums{rank}.pt"))
    exit_rank(0)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("sums")
    assert fork_ranks(_rank, str(out), world=WORLD) == [0] * WORLD
    results = [torch.load(out / f"sums{rank}.pt", weights_only=False) for rank in range(WORLD)]
    assert not any("crash" in r for r in results), [r.get("crash") for r in results]
    return results


def _pairs(got: dict, want: dict):
    assert set(got) == set(want)
    for path in want:
        for field, a, b in zip(want[path]["input"]._fields, got[path]["input"], want[path]["input"], strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape, (path, field)
            yield path, field, a, b


@pytest.mark.parametrize("name", ["minmax", "histogram"])
def test_extremes_and_counts_equal_one_process_bit_for_bit(ranks, name):
    model, batches = model_and_batches()
    one_process = calibrated(model, batches, name)
    for result in ranks:
        for exact in (False, True):
            for path, field, a, b in _pairs(result[name, exact], one_process):
                assert torch.equal(a, b), (name, exact, path, field)


@pytest.mark.parametrize("name", ["hessian", "imatrix", "moments"])
def test_float_sums_equal_one_process_to_rounding_and_the_rank_fold_with_exact(ranks, name):
    model, batches = model_and_batches()
    one_process = calibrated(model, batches, name)
    shards = [result[name, "local"] for result in ranks]  # computed there: one thread per rank
    observers = recipe(name).observers(one_process, model)
    folded = {path: {"input": functools.reduce(observers[path]["input"].merge, [s[path]["input"] for s in shards])}
              for path in one_process}
    differ = 0
    for result in ranks:
        for path, field, a, b in _pairs(result[name, True], folded):
            assert torch.equal(a, b), (name, path, field)
        for path, field, a, b in _pairs(result[name, False], one_process):
            if a.is_floating_point():
                eps = torch.finfo(torch.float32).eps  # a few float32 ulps (the activations) of the largest entry
                torch.testing.assert_close(a, b, rtol=0, atol=float(16 * eps * b.abs().max()))
                differ += int(not torch.equal(a, b))
            else:
                assert torch.equal(a, b), (name, path, field)
    assert differ > 0  # the sums are added in another order than one process adds them
