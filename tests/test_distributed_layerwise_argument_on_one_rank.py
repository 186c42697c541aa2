"""One rank passes `calibrate_layerwise` / `gptq_layerwise` (``all_reduce=True`` on the others) an
argument that rank refused before the first collective, on 2 gloo ranks and a tiny Llama: an
``all_reduce`` of None or 0 (falsy, from a config; that rank joined no collective and raised its
TypeError alone), a ``weights_dir`` that is no path (`os.fspath` raised before any check); or an
argument that decides the collectives, compared across ranks: a ``weights_dir`` given on one rank
only (the ranks with one waited at the end, in the collective after rank 0 writes the index, for
ranks that had returned). Every rank now raises: that rank its own error, naming the argument, the other a
RuntimeError saying another rank failed (it waited in the first collective for a rank that had
raised). The group stays in step: a merge afterwards equals ``torch.amin``/``amax`` of both ranks' data."""

from __future__ import annotations

import datetime
import os
import sys
import warnings

import pytest
import torch

import qstats
from qstats import distributed

sys.path.insert(0, os.path.dirname(__file__))
from _shared import exit_rank, fork_ranks, gloo_group  # noqa: E402

transformers = pytest.importorskip("transformers")
RECIPE = qstats.Recipe([
    qstats.Rule("Linear", sites=("input",), spec=qstats.QuantSpec(dtype="int8")),
    qstats.Rule("Linear", sites=("weight",), spec=qstats.QuantSpec(dtype="int4", granularity=qstats.PerAxis(0))),
])  # fmt: skip
MINMAX = qstats.minmax(qstats.QuantSpec())
FAILED = "RuntimeError: another rank failed (see the error on that rank)"
DIFFERENT = "ValueError: gptq_layerwise: the ranks passed different arguments (weights_dir="
# case: (gptq_layerwise rather than calibrate_layerwise, rank 0's and rank 1's arguments (FOLDER: a new
# folder), the start of rank 0's error, what rank 1's error holds)
CASES = {
    "all_reduce=None": (False, {}, {"all_reduce": None}, FAILED, "all_reduce must be True or False, got None"),
    "all_reduce=0 gptq": (True, {}, {"all_reduce": 0}, FAILED, "all_reduce must be True or False, got 0"),
    "weights_dir=123 gptq": (True, {}, {"weights_dir": 123}, FAILED, "weights_dir must be a path, got 123"),
    "weights_dir on rank 1 only": (True, {}, {"weights_dir": "FOLDER"}, DIFFERENT, DIFFERENT),
    "weights_dir on rank 0 only": (True, {"weights_dir": "FOLDER"}, {}, DIFFERENT, DIFFERENT),
}


def _config():
    return transformers.LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                                    num_attention_heads=2, num_key_value_heads=1, head_dim=4)


def _batches(rank: int) -> list:
    return [{"input_ids": torch.randint(0, 32, (1, 4), generator=torch.Generator().manual_seed(rank))}]


def _data(rank: int) -> torch.Tensor:
    return torch.randn(4, generator=torch.Generator().manual_seed(rank)) * (rank + 1)


def _rank(rank: int, port: int, checkpoint: str, out: str, case: str) -> None:
    gptq, *options, _, _ = CASES[case]
    results: dict = {}
    try:
        with gloo_group(rank, port, timeout=datetime.timedelta(seconds=15)):
            with torch.device("meta"):
                model = transformers.AutoModelForCausalLM.from_config(_config()).eval()
            mine = {name: os.path.join(out, "weights") if value == "FOLDER" else value
                    for name, value in options[rank].items()}
            run = qstats.gptq_layerwise if gptq else qstats.calibrate_layerwise
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    run(model, checkpoint, _batches(rank), RECIPE, progress=False, **{"all_reduce": True, **mine})
                results["error"] = "no error"
            except Exception as error:  # noqa: BLE001  (what each rank raised is the result)
                results["error"] = f"{type(error).__name__}: {error}"
            state = MINMAX.update(MINMAX.init(_data(rank)), _data(rank))
            results["merged"] = distributed.all_reduce({"a": state}, MINMAX)["a"]
    except Exception as error:  # noqa: BLE001
        results["crash"] = f"{type(error).__name__}: {error}"
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    exit_rank(0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.AutoModelForCausalLM.from_config(_config()).save_pretrained(directory)
    return str(directory)


@pytest.mark.parametrize("case", list(CASES))
def test_an_argument_one_rank_refuses_raises_on_every_rank(checkpoint, tmp_path, case):
    assert fork_ranks(_rank, checkpoint, str(tmp_path), case, timeout=90) == [0, 0]
    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    assert not any("crash" in r for r in results), results
    assert results[0]["error"].startswith(CASES[case][3]), results[0]["error"]
    assert CASES[case][4] in results[1]["error"], results[1]["error"]
    both = torch.stack([_data(0), _data(1)])
    for result in results:
        assert torch.equal(result["merged"].min_val, both.amin()) and torch.equal(result["merged"].max_val, both.amax())
