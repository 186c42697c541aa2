"""`qstats.report` on a model sharded with FSDP2's ``fully_shard`` (docs/distributed.md: it reads each
parameter site whole with ``full_tensor()``): two forked gloo ranks each report a tiny random
transformers Llama's W8A8 sites over their own batches (the rank with fewer padded with a batch its
observation weight zeroes, each forward a collective), against the same figures computed by hand
on the unwrapped model in this process: torch.ao's observers for the scales, torch's own
fake-quant ops for the error, the padding's tokens left out."""

from __future__ import annotations

import math
import os
import sys
import traceback
import warnings
from datetime import timedelta

import pytest
import torch
from torch.ao.quantization.observer import MinMaxObserver, PerChannelMinMaxObserver

import qstats

sys.path.insert(0, os.path.dirname(__file__))
from _shared import exit_rank, fork_ranks, gloo_group  # noqa: E402

transformers = pytest.importorskip("transformers")
fsdp = pytest.importorskip("torch.distributed.fsdp")
if not hasattr(fsdp, "fully_shard"):
    pytest.skip("this torch has no torch.distributed.fsdp.fully_shard (FSDP2)", allow_module_level=True)
from test_distributed_fsdp2_calibrate import model_and_batches, rank_batches  # noqa: E402

RECIPE = qstats.Recipe([
    qstats.Rule("Linear", sites=("weight",), spec=qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0))),
    qstats.Rule("Linear", sites=("input",), spec=qstats.QuantSpec(dtype="int8")),
])


def attention_mask(batch):
    return batch["attention_mask"]


def _rank(rank: int, port: int, out: str) -> None:
    from torch.distributed.tensor import DTensor

    try:
        with gloo_group(rank, port, timeout=timedelta(seconds=60)):
            model, batches = model_and_batches(3)
            for layer in model.model.layers:
                fsdp.fully_shard(layer)
            fsdp.fully_shard(model)
            mine = rank_batches(batches, rank)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                states = qstats.calibrate(model, mine, RECIPE, progress=False, observation_weight=attention_mask)
                qparams = qstats.compute_qparams_tree(states, RECIPE, model)
                rows = qstats.report(states, qparams, model, RECIPE, mine, observation_weight=attention_mask).rows
            sharded = isinstance(model.model.layers[0].mlp.up_proj.weight, DTensor)
            results = {"sharded": sharded, "rows": {(row.module, row.site): row.as_dict() for row in rows}}
    except Exception:
        results = {"crash": traceback.format_exc()}
    torch.save(results, os.path.join(out, f"report{rank}.pt"))
    exit_rank(0)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list:
    out = tmp_path_factory.mktemp("fsdp2_report")
    assert fork_ranks(_rank, str(out), timeout=120) == [0, 0]
    results = [torch.load(out / f"report{rank}.pt", weights_only=False) for rank in range(2)]
    assert not any("crash" in result for result in results), [result.get("crash") for result in results]
    return results


def _sqnr(pairs) -> float:
    signal = sum(float(x.double().pow(2).sum()) for x, _ in pairs)
    noise = sum(float((x.double() - q.double()).pow(2).sum()) for x, q in pairs)
    return 10 * math.log10(signal / noise)


def _inputs_by_hand(model, batches) -> dict:
    """``{path: [input rows of each batch, padding left out]}`` of every Linear of the unwrapped model."""
    captured: dict = {}
    handles = [module.register_forward_pre_hook(
        lambda module, args, path=path: captured.setdefault(path, []).append(args[0].detach()))
        for path, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    try:
        with torch.no_grad():
            for batch in batches:
                model(**batch)
    finally:
        for handle in handles:
            handle.remove()
    masks = [batch["attention_mask"] != 0 for batch in batches]
    return {path: [x[mask] for x, mask in zip(xs, masks) if mask.any()] for path, xs in captured.items()}


@pytest.mark.parametrize("rank", [0, 1])
def test_sharded_model_reports_the_unwrapped_models_figures_by_hand(ranks, rank):
    result = ranks[rank]
    assert result["sharded"]  # the parameters were DTensors when report read them
    model, batches = model_and_batches(3)
    inputs = _inputs_by_hand(model, rank_batches(batches, rank))
    linears = [path for path, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    assert sorted(result["rows"]) == sorted((path, site) for path in linears for site in ("weight", "input"))
    for path in linears:
        weight = model.get_submodule(path).weight.detach()
        observer = PerChannelMinMaxObserver(ch_axis=0, dtype=torch.qint8, qscheme=torch.per_channel_symmetric)
        observer(weight)
        scale, zero_point = observer.calculate_qparams()
        quantized = torch.fake_quantize_per_channel_affine(weight, scale, zero_point.int(), 0, -128, 127)
        row = result["rows"][path, "weight"]
        assert row["sqnr_db"] == pytest.approx(_sqnr([(weight, quantized)]), rel=1e-6), path
        assert row["mean_scale"] == pytest.approx(float(scale.mean()), rel=1e-6), path

        observer = MinMaxObserver(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric)
        for x in inputs[path]:
            observer(x)
        scale, zero_point = observer.calculate_qparams()
        pairs = [(x, torch.fake_quantize_per_tensor_affine(x, float(scale), int(zero_point), -128, 127))
                 for x in inputs[path]]
        row = result["rows"][path, "input"]
        assert row["sqnr_db"] == pytest.approx(_sqnr(pairs), rel=1e-5), path
        assert row["min"] == float(min(x.min() for x in inputs[path])), path
        assert row["nonfinite"] == 0, path
