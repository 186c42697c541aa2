"""Edge cases of checkpoints (qstats.save / load) and of qstats.distributed.all_reduce across 2 gloo
ranks (tests/_distributed_edges_worker.py), checked against plain torch computations."""

from __future__ import annotations

import multiprocessing
import os
import sys

import pytest
import torch

import qstats

sys.path.insert(0, os.path.dirname(__file__))
import _distributed_edges_worker as worker  # noqa: E402
from _shared import free_port  # noqa: E402


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone(memory_format=torch.contiguous_format).reshape(-1).view(torch.uint8)


# ------------------------------------------------------------------------------------------------
# Checkpoints


def test_views_shared_storage_empty_containers_and_none_round_trip(tmp_path):
    base = torch.randn(5, 3)
    views = {
        "column": base[:1, 0],  # one element, stride 3
        "transposed": base.t(),
        "strided": base[::2, 1:],
        "expanded": torch.tensor([1.5]).expand(4),
        "bf16": base.to(torch.bfloat16)[1],
        "fp16_same_storage": [base.half(), base.half()[2:]],
        "float64_scalar": torch.tensor(-0.0, dtype=torch.float64),
    }
    tree = {"views": views, "empty": {"d": {}, "l": [], "t": ()}, "none": None, "nested_none": [None, (None,)]}
    qstats.save(tmp_path / "x.safetensors", tree)
    back = qstats.load(tmp_path / "x.safetensors")
    assert back["empty"] == {"d": {}, "l": [], "t": ()} and back["none"] is None
    assert back["nested_none"] == [None, (None,)]
    flat_in = [views["column"], views["transposed"], views["strided"], views["expanded"], views["bf16"],
               *views["fp16_same_storage"], views["float64_scalar"]]
    got = back["views"]
    flat_out = [got["column"], got["transposed"], got["strided"], got["expanded"], got["bf16"],
                *got["fp16_same_storage"], got["float64_scalar"]]
    for a, b in zip(flat_in, flat_out):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def test_resuming_with_another_model_or_recipe_names_the_mismatch(tmp_path):
    torch.manual_seed(0)

    def model(hidden):
        return torch.nn.Sequential(torch.nn.Linear(16, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 4)).eval()

    def recipe(observer):
        spec = qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(-1))
        return qstats.Recipe([qstats.Rule("Linear", sites=("input", "weight"), observer=observer, spec=spec)])

    batches = [torch.randn(8, 16) for _ in range(2)]
    qstats.save(tmp_path / "s.safetensors", qstats.calibrate(model(32), batches, recipe(qstats.minmax), progress=False))
    with pytest.raises((TypeError, ValueError), match="shape"):
        qstats.calibrate(model(8), batches, recipe(qstats.minmax), states=qstats.load(tmp_path / "s.safetensors"),
                         progress=False)
    with pytest.raises((TypeError, ValueError), match="MinMaxState"):
        qstats.calibrate(model(32), batches, recipe(qstats.histogram), states=qstats.load(tmp_path / "s.safetensors"),
                         progress=False)


# ------------------------------------------------------------------------------------------------
# Distributed


def _wait(proc, timeout):
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join()
    return proc.exitcode


@pytest.fixture(scope="module")
def edges(tmp_path_factory):
    out = tmp_path_factory.mktemp("edges")
    context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    port = free_port()
    procs = [context.Process(target=worker.run_rank, args=(rank, port, str(out))) for rank in range(worker.WORLD)]
    for p in procs:
        p.start()
    codes = [_wait(p, 150) for p in procs]
    files = [out / f"edges{rank}.pt" for rank in range(worker.WORLD)]
    results = [torch.load(f, weights_only=False) if f.exists() else {"crash": "no results"} for f in files]
    assert codes == [0, 0] and not any("crash" in r for r in results), (codes, results)
    return results


def _ok(results, name):
    for rank, r in enumerate(results):
        assert not isinstance(r[name], dict), (name, rank, r[name])
    return [r[name] for r in results]


def test_a_one_element_strided_view_in_a_folded_state(edges):
    """Rank 1 passes channel 0 of a single-expert stacked moving-average state (views of stride 3),
    rank 0 the init state of a rank that saw no batch. The raw-byte view of the all_gather buffer
    used to refuse the stride on rank 1 (RuntimeError there) while rank 0 waited in all_gather
    until the timeout."""
    x = worker.rank_data(1)[0, :, 0]  # rank 1's channel-0 tokens; rank 0 saw none
    for leaves in _ok(edges, "strided_fold"):
        min_val, max_val, batches, count, nonfinite = leaves
        assert torch.equal(min_val, x.amin().reshape(1)) and torch.equal(max_val, x.amax().reshape(1))
        assert batches.tolist() == [1] and count.tolist() == [x.numel()] and nonfinite.tolist() == [0]


def test_states_of_dtypes_gloo_cannot_reduce_merge(edges):
    """Float8 extremes and an int16 count (min/max/sum declared): gloo refuses these dtypes
    ("Invalid scalar type"; negating a float8 max first raised NotImplementedError); they now fold."""
    rows = torch.cat([worker.rank_data(r)[0] for r in range(worker.WORLD)])
    for min_val, max_val, count in _ok(edges, "fp8_state"):
        assert min_val.dtype == worker.FP8 and count.dtype == torch.int16
        assert torch.equal(_bits(min_val), _bits(rows.amin(0).to(worker.FP8)))
        assert torch.equal(_bits(max_val), _bits(rows.amax(0).to(worker.FP8)))
        assert count.item() == rows.shape[0]


def test_a_rank_with_other_dtypes_raises_on_every_rank(edges):
    """Rank 1 holds float8 extremes where rank 0 holds float32: rank 1 used to fail its local NaN
    check with a RuntimeError (float8 does not promote) before the structure check, and rank 0 then
    waited for it until the process group's timeout."""
    for rank, r in enumerate(edges):
        error = r["dtype_differs"]
        assert isinstance(error, dict) and error["error"].startswith("ValueError"), (rank, error)
        assert "different state trees" in error["error"], (rank, error)
    rows = torch.cat([worker.rank_data(r)[0] for r in range(worker.WORLD)])
    for min_val, max_val, count, nonfinite in _ok(edges, "after"):  # the group is still in step
        assert torch.equal(min_val, rows.amin()) and torch.equal(max_val, rows.amax()) and count == rows.numel()


def test_a_failing_reduce_ops_declaration_on_one_rank_raises_on_every_rank(edges):
    """Rank 1's tree holds a state whose declared ops callable raises KeyError: that escaped the local
    checks (only TypeError/ValueError were kept for the structure check), so rank 1 raised alone
    while rank 0 waited in the check collective."""
    bad, other = edges[1]["ops_callable_fails"], edges[0]["ops_callable_fails"]
    assert isinstance(bad, dict) and "this rank's tree is not valid" in bad["error"] and "KeyError" in bad["error"], bad
    assert isinstance(other, dict) and "another rank's tree failed its local checks" in other["error"], other
