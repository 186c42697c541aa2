"""qstats.hessian on bfloat16 and float16 inputs (a half-precision model's activations): its laws,
save/load, the 2-rank all_reduce (``exact=True`` bit for bit with the sequential merge), against a
float64 product of the same half-precision values and llm-compressor 0.14's ``accumulate_hessian``
(which converts them to float32 first too); a float16 Inf (an overflowed activation) is left out."""

from __future__ import annotations

import functools
import os

import pytest
import torch

import qstats
from qstats.observers.hessian import HessianState, hessian
from _shared import fork_ranks

llmc_helpers = pytest.importorskip("llmcompressor.modifiers.gptq.helpers")

HALF = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", HALF)
def test_laws_on_half_precision_inputs(dtype):
    qstats.testing.check_all(hessian(), lambda g: torch.randn(12, 16, generator=g).to(dtype), max_examples=5)


@pytest.mark.parametrize("dtype", HALF)
def test_the_sum_is_float32_and_equals_float64_products_and_llm_compressor(dtype, tmp_path):
    x = torch.randn(4, 30, 64, generator=torch.Generator().manual_seed(0)).to(dtype)
    state = hessian().update(hessian().init(x), x)
    assert state.total.dtype == torch.float32
    rows = x.reshape(-1, 64).double()
    torch.testing.assert_close(state.total.double(), rows.T @ rows, rtol=1e-5, atol=1e-4)
    layer = torch.nn.Linear(64, 8, bias=False).to(dtype)
    total, samples = llmc_helpers.make_empty_hessian(layer), torch.zeros(())
    for sample in x:
        total, samples = llmc_helpers.accumulate_hessian(sample[None], layer, total, samples)
    torch.testing.assert_close(2 * state.total / 4, total / samples, rtol=1e-5, atol=1e-5)
    qstats.save(tmp_path / "h.safetensors", {"layer": {"input": state}})
    loaded = qstats.load(tmp_path / "h.safetensors")["layer"]["input"]
    assert isinstance(loaded, HessianState) and all(torch.equal(a, b) and a.dtype == b.dtype
                                                    for a, b in zip(loaded, state))


def test_a_float16_overflow_is_left_out_and_counted():
    x = torch.randn(10, 16, generator=torch.Generator().manual_seed(1)).half()
    x[3, 2] = torch.tensor(70000.0).half()  # Inf in float16
    state = hessian().update(hessian().init(x), x)
    kept = torch.cat([x[:3], x[4:]]).double()
    assert int(state.count) == 9 and int(state.nonfinite) == 1
    torch.testing.assert_close(state.total.double(), kept.T @ kept, rtol=1e-5, atol=1e-4)


def _rank_state(rank: int) -> HessianState:
    x = torch.randn(5 + 3 * rank, 2, 12, generator=torch.Generator().manual_seed(20 + rank)) * 30.0 ** rank
    return hessian().update(hessian().init(x.bfloat16()), x.bfloat16())


def _run_rank(rank: int, port: int, world: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        exact = qstats.distributed.all_reduce({"l": _rank_state(rank)}, hessian(), exact=True)["l"]
        torch.save(tuple(exact), os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_distributed_exact_all_reduce_of_bfloat16_inputs_is_the_sequential_merge(tmp_path):
    world = 2
    assert fork_ranks(_run_rank, world, str(tmp_path), world=world, timeout=60) == [0] * world
    sequential = functools.reduce(hessian().merge, [_rank_state(r) for r in range(world)])
    for rank in range(world):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(result, sequential))
