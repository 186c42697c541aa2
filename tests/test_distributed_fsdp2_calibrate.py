"""Two forked gloo ranks calibrate a tiny random transformers Llama sharded with FSDP2's
``fully_shard`` (its parameters DTensors between forwards), each rank its own batches, and merge
their activation states with `qstats.distributed.all_reduce`: every rank then holds the states one
process calibrating the unwrapped model over all the batches gets, bit for bit, for W8A8 (int8
weights per channel, int8 inputs per tensor) and W4A16 (int4 weights per group of 16); so do their
qparams; so do a Qwen3-MoE's stacked experts (weights and per-expert inputs, merged with
``partial=True``). The data does not split evenly (5 batches): the rank with fewer pads its forwards (each
one a collective under FSDP2) with a batch its observation weight (the attention mask) zeroes.
Weights that are DTensors sharded by rows (unevenly), by columns or replicated observe as
the plain weight. The model's full state dict (``get_model_state_dict``) exports on rank 0 as the unwrapped model
does; an observer handed a DTensor itself says to observe its ``full_tensor()``, and
`fake_quantized` refuses the sharded weights (a parametrization would see a shard), leaving the
model as it was (the W4A16 calibration after it still equals one process's)."""

from __future__ import annotations

import os
import sys
import traceback
import warnings
from datetime import timedelta

import optree
import pytest
import torch
from safetensors.torch import load_file

import qstats

sys.path.insert(0, os.path.dirname(__file__))
from _shared import exit_rank, fork_ranks, gloo_group, qwen3_moe_config, tiny_llama_config  # noqa: E402

transformers = pytest.importorskip("transformers")
fsdp = pytest.importorskip("torch.distributed.fsdp")
if not hasattr(fsdp, "fully_shard"):
    pytest.skip("this torch has no torch.distributed.fsdp.fully_shard (FSDP2)", allow_module_level=True)

RECIPES = {
    "w8a8": qstats.Recipe([
        qstats.Rule("Linear", sites=("weight",), observer=qstats.minmax,
                    spec=qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0))),
        qstats.Rule("Linear", sites=("input",), observer=qstats.minmax, spec=qstats.QuantSpec(dtype="int8")),
    ]),
    "w4a16": qstats.Recipe([
        qstats.Rule("Linear", sites=("weight",), observer=qstats.minmax,
                    spec=qstats.QuantSpec(dtype="int4", granularity=qstats.PerGroup(16))),
    ]),
}

MOE_RECIPE = qstats.Recipe([
    qstats.Rule("Qwen3MoeExperts", sites=("gate_up_proj", "down_proj", "gate_up_proj.input", "down_proj.input"),
                observer=qstats.minmax, spec=qstats.QuantSpec(dtype="int8")),
])


def model_and_batches(count: int = 5):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(tiny_llama_config()).eval()
    generator = torch.Generator().manual_seed(1)
    batches = []
    for i in range(count):
        ids = torch.randint(0, 96, (2, 4 + i), generator=generator)
        batches.append({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    return model, batches


def moe_model_and_batches():
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(qwen3_moe_config()).eval()
    generator = torch.Generator().manual_seed(1)
    return model, [{"input_ids": torch.randint(0, 64, (2, 4 + i), generator=generator)} for i in range(4)]


def rank_batches(batches: list, rank: int) -> list:
    """This rank's batches, padded to as many as the other rank's with a batch of zero attention mask."""
    mine, most = batches[rank::2], len(batches[0::2])
    padding = {"input_ids": batches[0]["input_ids"], "attention_mask": torch.zeros_like(batches[0]["attention_mask"])}
    return mine + [padding] * (most - len(mine))


def calibrated(model, batches, recipe, **options) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return qstats.calibrate(model, batches, recipe, progress=False, **options)


def split(states: dict) -> tuple:
    """``(weights, inputs)``: the parameter sites and the activation sites (``input``,
    ``<parameter>.input``) of a states tree."""
    def sites_of(entry: dict, inputs: bool) -> dict:
        return {site: state for site, state in entry.items() if site.endswith("input") == inputs}

    weights = {path: sites_of(entry, False) for path, entry in states.items() if sites_of(entry, False)}
    inputs = {path: sites_of(entry, True) for path, entry in states.items() if sites_of(entry, True)}
    return weights, inputs


def joined(weights: dict, inputs: dict) -> dict:
    """The tree of both: ``{path: {"weight": ..., "input": ...}}``."""
    return {path: {**weights.get(path, {}), **inputs.get(path, {})} for path in {**weights, **inputs}}


def _calibrate_sharded(model, batches, rank: int, out: str) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    results = {"sharded": isinstance(model.model.layers[0].mlp.up_proj.weight, DTensor)}
    for name, recipe in RECIPES.items():
        states = calibrated(model, rank_batches(batches, rank), recipe,
                            observation_weight=lambda batch: batch["attention_mask"])
        weights, inputs = split(states)
        merged = qstats.distributed.all_reduce(inputs, recipe.observers(inputs, model)) if inputs else {}
        results[name] = optree.tree_map(torch.clone, joined(weights, merged))
        if name == "w8a8":  # refused before any parametrization: the next calibration runs on the same model
            try:
                with qstats.fake_quantized(model, qstats.compute_qparams_tree(results[name], recipe, model), recipe):
                    pass
            except ValueError as error:
                results["fake_quantized_error"] = str(error)
    results["tensor_parallel"] = _tensor_parallel_weights()
    weight = model.model.layers[0].self_attn.q_proj.weight
    try:  # a DTensor handed to an observer itself
        observer = qstats.minmax(qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0)))
        observer.update(observer.init(weight), weight)
    except TypeError as error:
        results["dtensor_error"] = str(error)
    # the full state dict (a collective), on rank 0 only, loaded into the unwrapped model: exported
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        unwrapped, _ = model_and_batches()
        unwrapped.load_state_dict(full)
        recipe = RECIPES["w8a8"]
        qparams = qstats.compute_qparams_tree(results["w8a8"], recipe, unwrapped)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            qstats.export.compressed_tensors(unwrapped, qparams, os.path.join(out, "sharded_export"), recipe)
    return results


def _tensor_parallel_weights() -> dict:
    """The W4A16 weight states of Linear(32, 5)s whose weights are DTensors placed otherwise than
    FSDP2 places them (uneven rows, columns, replicated), calibrated over no batch."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    states = {}
    for placement in (Shard(0), Shard(1), Replicate()):
        torch.manual_seed(2)
        linear = torch.nn.Linear(32, 5)
        linear.weight = torch.nn.Parameter(distribute_tensor(linear.weight.detach(), mesh, [placement]))
        weights = calibrated(linear, [], RECIPES["w4a16"])
        states[str(placement)] = optree.tree_map(torch.clone, weights)
    return states


def sharded(model):
    for layer in model.model.layers:
        fsdp.fully_shard(layer)
    return fsdp.fully_shard(model)


def _stacked_experts(rank: int) -> dict:
    """A Qwen3-MoE's stacked experts (weights ``[E, ...]`` sharded over E), its per-expert inputs
    merged with ``partial=True`` (an expert no token of a rank reached has no state there)."""
    model, batches = moe_model_and_batches()
    weights, inputs = split(calibrated(sharded(model), batches[rank::2], MOE_RECIPE))
    merged = qstats.distributed.all_reduce(inputs, MOE_RECIPE.observers(inputs, model), partial=True)
    return optree.tree_map(torch.clone, joined(weights, merged))


def _rank(rank: int, port: int, out: str) -> None:
    try:
        with gloo_group(rank, port, timeout=timedelta(seconds=60)):
            model, batches = model_and_batches()
            results = _calibrate_sharded(sharded(model), batches, rank, out)
            results["moe"] = _stacked_experts(rank)
    except Exception:
        results = {"crash": traceback.format_exc()}
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    exit_rank(0)


def assert_trees_bit_equal(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for path, sites in want.items():
        assert set(got[path]) == set(sites), path
        for site, state in sites.items():
            assert type(got[path][site]) is type(state), (path, site)
            for a, b in zip(got[path][site], state):
                assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (path, site)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> tuple:
    out = tmp_path_factory.mktemp("fsdp2")
    assert fork_ranks(_rank, str(out), timeout=120) == [0, 0]
    results = [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(2)]
    assert not any("crash" in result for result in results), [result.get("crash") for result in results]
    return results, out


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_fully_shard_ranks_merge_to_one_process_states(ranks, name):
    results, _ = ranks
    model, batches = model_and_batches()
    one_process = calibrated(model, batches, RECIPES[name])
    weights, inputs = split(one_process)
    assert len(weights) == 15 and len(inputs) == (15 if name == "w8a8" else 0)
    want = joined(weights, inputs)
    want_qparams = qstats.compute_qparams_tree(want, RECIPES[name], model)
    for result in results:
        assert result["sharded"]  # the parameters were DTensors when calibrate read them
        assert_trees_bit_equal(result[name], want)
        got_qparams = qstats.compute_qparams_tree(result[name], RECIPES[name], model)
        assert_trees_bit_equal(got_qparams, want_qparams)


def test_full_state_dict_exports_as_the_unwrapped_model(ranks, tmp_path):
    _, out = ranks
    model, batches = model_and_batches()
    recipe = RECIPES["w8a8"]
    qparams = qstats.compute_qparams_tree(calibrated(model, batches, recipe), recipe, model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qstats.export.compressed_tensors(model, qparams, str(tmp_path / "one_process"), recipe)
    got = load_file(out / "sharded_export" / "model.safetensors")
    want = load_file(tmp_path / "one_process" / "model.safetensors")
    assert set(got) == set(want) and any(name.endswith("input_scale") for name in want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_fully_shard_stacked_experts_merge_to_one_process_states(ranks):
    results, _ = ranks
    model, batches = moe_model_and_batches()
    want = calibrated(model, batches, MOE_RECIPE)
    assert {site for sites in want.values() for site in sites} == {"gate_up_proj", "down_proj", "gate_up_proj.input",
                                                                   "down_proj.input"}
    for result in results:
        assert_trees_bit_equal(result["moe"], want)


def test_weights_sharded_by_rows_columns_or_replicated_observe_whole(ranks):
    results, _ = ranks
    torch.manual_seed(2)
    linear = torch.nn.Linear(32, 5)
    want = calibrated(linear, [], RECIPES["w4a16"])
    for result in results:
        assert sorted(result["tensor_parallel"]) == ["R", "S(0)", "S(1)"]
        for got in result["tensor_parallel"].values():
            assert_trees_bit_equal(got, want)


def test_observer_given_a_dtensor_names_full_tensor(ranks):
    results, _ = ranks
    for result in results:
        assert "DTensor" in result["dtensor_error"] and "full_tensor()" in result["dtensor_error"]


def test_fake_quantized_refuses_sharded_weights_naming_the_full_state_dict(ranks):
    results, _ = ranks
    for result in results:
        error = result["fake_quantized_error"]
        assert "'model.layers.0.self_attn.q_proj' parameter 'weight' is a DTensor" in error
        assert "get_model_state_dict" in error
