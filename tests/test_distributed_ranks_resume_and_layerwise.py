"""Several gloo ranks, each with its own batches, against one process over all of them.

`qstats.calibrate` + `qstats.distributed.all_reduce` resumed from a checkpoint written by a run of
another rank count, and `calibrate_layerwise` / `gptq_layerwise` (``all_reduce=True``) on a tiny
Qwen3-MoE (stacked experts) with uneven batch counts or a rank without batches. The reference is
one process calibrating every batch in rank order.
"""

from __future__ import annotations

import datetime
import os
import warnings

import pytest
import torch

import qstats
from _shared import bit_equal, exit_rank, fork_ranks, gloo_group

# --------------------------------------------------------------------------------------------
# qstats.calibrate: save on 2 ranks, resume on 3

_RECIPE = qstats.Recipe([
    qstats.Rule("Linear", sites=("input",), observer=qstats.histogram,
                spec=qstats.QuantSpec(dtype="uint8", mapping="asymmetric")),
    qstats.Rule("Linear", sites=("output",), observer=qstats.minmax, spec=qstats.QuantSpec(dtype="int8")),
])  # fmt: skip


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).eval()


def _data() -> list:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(2 + i, 8, generator=g) * (i + 1) for i in range(7)]


def _activations(states: dict) -> dict:
    return {path: {site: state for site, state in entry.items() if site != "weight"} for path, entry in states.items()}


def _merged(model, batches, resumed=None) -> dict:
    states = _activations(qstats.calibrate(model, batches, _RECIPE, progress=False, states=resumed))
    return qstats.distributed.all_reduce(states, _RECIPE.observers(states, model))


def _first_run(rank: int, port: int, out: str) -> None:
    with gloo_group(rank, port, world=2, timeout=datetime.timedelta(seconds=30)):
        merged = _merged(_model(), _data()[:3][rank::2])
        if rank == 0:
            qstats.save(os.path.join(out, "first.safetensors"), merged)
        torch.distributed.barrier()
    exit_rank(0)


def _second_run(rank: int, port: int, out: str) -> None:
    with gloo_group(rank, port, world=3, timeout=datetime.timedelta(seconds=30)):
        rest = _data()[3:]
        mine = {0: rest[:1], 1: rest[1:2], 2: rest[2:]}[rank]  # uneven: rank 2 gets two batches
        resumed = qstats.load(os.path.join(out, "first.safetensors")) if rank == 0 else None  # once, not per rank
        qstats.save(os.path.join(out, f"second{rank}.safetensors"), _merged(_model(), mine, resumed))
        torch.distributed.barrier()
    exit_rank(0)


def test_states_saved_by_two_ranks_resume_on_three(tmp_path):
    """Two ranks merge and save; three ranks (rank 0 resuming the saved states, uneven batches) merge
    again: every rank holds the histogram and min/max states of one process over all batches, bit for bit."""
    assert fork_ranks(_first_run, str(tmp_path), world=2, timeout=90) == [0, 0]
    assert fork_ranks(_second_run, str(tmp_path), world=3, timeout=90) == [0, 0, 0]
    want = _activations(qstats.calibrate(_model(), _data(), _RECIPE, progress=False))
    for rank in range(3):
        got = qstats.load(tmp_path / f"second{rank}.safetensors")
        assert set(got) == set(want)
        for path in want:
            for site in want[path]:
                assert all(bit_equal(a, b) for a, b in zip(got[path][site], want[path][site], strict=True))


# --------------------------------------------------------------------------------------------
# calibrate_layerwise / gptq_layerwise: uneven batch counts, a rank without batches

transformers = pytest.importorskip("transformers")
_W4 = qstats.QuantSpec(dtype="int4", granularity=qstats.PerAxis(0))
_A8 = qstats.QuantSpec(dtype="int8", mapping="asymmetric")
_MOE_RECIPE = qstats.Recipe([
    qstats.Rule(("Linear", "Qwen3MoeExperts"), sites=("input", "down_proj.input"), spec=_A8),
    qstats.Rule("Linear", sites=("weight",), spec=_W4),
    qstats.Rule("Qwen3MoeExperts", sites=("gate_up_proj", "down_proj"), spec=_W4),
])  # fmt: skip
_SPLITS = {"no_batches": ([0, 1, 2, 3], []), "uneven": ([0], [1, 2, 3])}


def _config():
    return transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=8, num_experts_per_tok=2)  # fmt: skip


def _meta() -> torch.nn.Module:
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(_config()).eval()


def _moe_batches() -> list:
    g = torch.Generator().manual_seed(5)
    return [{"input_ids": torch.randint(0, 64, (1, 3 + i), generator=g)} for i in range(4)]


def _layerwise(batches, checkpoint, gptq: bool, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if gptq:
            result = qstats.gptq_layerwise(_meta(), checkpoint, batches, _MOE_RECIPE, progress=False, **options)
            return result.states, result.weights
        return qstats.calibrate_layerwise(_meta(), checkpoint, batches, _MOE_RECIPE, progress=False, **options), {}


def _layerwise_rank(rank: int, port: int, checkpoint: str, out: str, split: str, gptq: bool) -> None:
    torch.set_num_threads(1)
    with gloo_group(rank, port, world=2, timeout=datetime.timedelta(seconds=40)):
        mine = [_moe_batches()[index] for index in _SPLITS[split][rank]]
        states, weights = _layerwise(mine, checkpoint, gptq, all_reduce=True)
        qstats.save(os.path.join(out, f"states{rank}.safetensors"), states)
        torch.save(weights, os.path.join(out, f"weights{rank}.pt"))
    exit_rank(0)


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen3_moe")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.AutoModelForCausalLM.from_config(_config()).save_pretrained(directory)
    return str(directory)


@pytest.mark.parametrize("gptq", [False, True], ids=["calibrate", "gptq"])
@pytest.mark.parametrize("split", list(_SPLITS))
def test_layerwise_ranks_with_uneven_or_no_batches_equal_one_process(moe_checkpoint, tmp_path, split, gptq):
    """Rank 1 with no batch, or one rank with 1 batch and the other 3: both ranks return the states
    (stacked experts included) of one process over the 4 batches bit for bit, and GPTQ's weights
    up to the rounding of the Hessian sums' order."""
    assert fork_ranks(_layerwise_rank, moe_checkpoint, str(tmp_path), split, gptq, timeout=180) == [0, 0]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks: a matmul's rounding may depend on the thread count
    try:
        want_states, want_weights = _layerwise(_moe_batches(), moe_checkpoint, gptq)
    finally:
        torch.set_num_threads(threads)
    assert "model.layers.1.mlp.experts" in want_states
    for rank in range(2):
        got = qstats.load(tmp_path / f"states{rank}.safetensors")
        assert set(got) == set(want_states)
        for path in want_states:
            assert set(got[path]) == set(want_states[path]), path
            for site in want_states[path]:
                assert all(bit_equal(a, b) for a, b in zip(got[path][site], want_states[path][site], strict=True))
        weights = torch.load(tmp_path / f"weights{rank}.pt")
        assert sorted(weights) == sorted(want_weights)
        for name in want_weights:
            torch.testing.assert_close(weights[name], want_weights[name], rtol=0, atol=1e-6)


_MISMATCHES = {  # (gptq, rank 0's options, rank 1's options)
    "propagate": (False, {"propagate": "float"}, {"propagate": "quantized"}),
    "all_experts": (False, {}, {"all_experts": True}),
    "experts_at_once": (True, {"experts_at_once": 4}, {"experts_at_once": 8}),
    "block_size": (True, {}, {"block_size": 4}),
}


def _mismatched_rank(rank: int, port: int, checkpoint: str, out: str, case: str) -> None:
    torch.set_num_threads(1)
    gptq, *options = _MISMATCHES[case]
    try:
        with gloo_group(rank, port, world=2, timeout=datetime.timedelta(seconds=10)):
            _layerwise(_moe_batches()[rank::2], checkpoint, gptq, all_reduce=True, **options[rank])
        message = "no error"
    except Exception as error:  # noqa: BLE001  (what each rank raised is the result)
        message = f"{type(error).__name__}: {error}"
    with open(os.path.join(out, f"rank{rank}.txt"), "w") as file:
        file.write(message)
    exit_rank(0)


@pytest.mark.parametrize("case", list(_MISMATCHES))
def test_ranks_passing_other_arguments_raise_a_value_error_naming_them(moe_checkpoint, tmp_path, case):
    """Another propagate or split of the experts runs other collectives (the ranks hung until the
    group's timeout, then a bare gloo RuntimeError); another all_experts or block_size merged unlike
    states silently. Every rank now raises, naming the arguments."""
    assert fork_ranks(_mismatched_rank, moe_checkpoint, str(tmp_path), case, timeout=90) == [0, 0]
    messages = [(tmp_path / f"rank{rank}.txt").read_text() for rank in range(2)]
    assert all(m.startswith("ValueError") and "different arguments" in m and case in m for m in messages), messages
