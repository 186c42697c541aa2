"""Core benchmarks: minmax update against torch.aminmax, vmapped experts against torch.ao.

Prints markdown table rows with ratios measured in this run (alternating blocks of runs; each
candidate's best run counts), and floors for the experts: one ``sum`` over the stack, qstats'
native pass with nothing around it, and ``torch.vmap`` around that pass (`bare_pass_functions`):
the torch.ao loop over a floor bounds what any form built on it can reach:

    python bench/bench_core.py
"""

from __future__ import annotations

import argparse
import itertools
import time

import torch
from torch.ao.quantization import PerChannelMinMaxObserver

import qstats


def interleaved_best(functions: dict, rounds: int = 4, block: int = 8, warmup: int = 3) -> dict:
    """Best wall-clock time of each function, measured in alternating blocks: every round runs
    each function ``block`` times in a row (warm caches, as timeit), and the rounds alternate, so
    that all functions meet the machine in the same states (a shared machine's speed drifts within
    a process; one block per function would compare one state with another)."""
    for function in functions.values():
        for _ in range(warmup):
            function()
    best = dict.fromkeys(functions, float("inf"))
    for _ in range(rounds):
        for name, function in functions.items():
            for _ in range(block):
                start = time.perf_counter()
                function()
                best[name] = min(best[name], time.perf_counter() - start)
    return best


def bench_per_tensor_update():
    x = torch.randn(4096, 1024)
    spec = qstats.QuantSpec(dtype="int8")
    obs = qstats.minmax(spec)
    state = obs.init(x)
    best = interleaved_best({"ours": lambda: obs.update(state, x), "ref": lambda: torch.aminmax(x)}, rounds=8)
    return best["ours"], best["ref"]


_REFERENCES = ("torch.ao loop", "torch.ao loop, building", "raw", "one read", "bare pass", "vmap floor")


def bare_pass_functions(experts: torch.Tensor, spec) -> dict:
    """The least work any eager form does around qstats' native pass, as floors for the forms
    above (empty where this machine has no kernel): "bare pass" allocates the pass's outputs (the
    new state and its scales) and calls the kernel on the plain stack; "vmap floor" does the same
    under ``torch.vmap`` (unwrap the batched stack, allocate, call the kernel, wrap the scales back
    and return them as QParams), which no function that ``torch.vmap`` runs over can undercut.
    Neither checks anything: they are not usable code, only the cost of the pass itself and of
    ``torch.vmap``'s entry and exit around it (private functorch and kernel APIs)."""
    from qstats import _native
    from qstats._qparams import native_scales

    if not _native.available():
        return {}
    kernel = _native._kernel()[1]
    functorch = torch._C._functorch
    experts_n, channels, length = experts.shape
    half_range, eps, cap, zero_point, zero_point_dtype, floor_at_eps, round_to = native_scales(spec)
    state = (
        torch.full((channels,), torch.inf),
        torch.full((channels,), -torch.inf),
        torch.zeros(channels, dtype=torch.int64),
        torch.zeros(channels, dtype=torch.int64),
    )
    dtypes = (torch.float32, torch.float32, torch.int64, torch.int64, torch.float32, zero_point_dtype, torch.bool)

    def run(stack, ones_shape):
        outputs = [torch.empty((experts_n, channels), dtype=dtype) for dtype in dtypes]
        ones = torch.empty(ones_shape)
        pointers = [t.data_ptr() for t in outputs]
        bad = kernel(
            stack.data_ptr(), 0, experts_n * channels, length, *(t.data_ptr() for t in state), *pointers[:4],
            channels, _native._threads(stack), half_range, eps, cap, int(floor_at_eps), round_to, pointers[4],
            pointers[5], int(zero_point_dtype == torch.float32), zero_point, pointers[6], ones.data_ptr(), ones.numel(),
        )
        assert bad == 0
        return outputs[4:], ones

    def bare_pass():
        (scale, zero_points, calibrated), ones = run(experts, (experts_n,))
        return qstats.QParams(scale, zero_points, ones, calibrated)

    def one_expert(w):
        level = functorch.maybe_current_level()
        (scale, zero_points, calibrated), ones = run(functorch._unwrap_batched(w, level)[0], ())
        scale, zero_points, calibrated = (functorch._add_batch_dim(t, 0, level) for t in (scale, zero_points, calibrated))
        return qstats.QParams(scale, zero_points, ones, calibrated)

    floor = torch.vmap(one_expert)
    return {"bare pass": bare_pass, "vmap floor": lambda: floor(experts)}


def bench_stacked_experts(compile_too=True):
    """Times (seconds) of init + update + compute_qparams over 64 stacked experts: ``torch.vmap``
    of the one-expert functions, the stacked observer (`qstats.stacked_observer` +
    `qstats.stacked_qparams`: the same results without vmap's per-op overhead) and, optionally,
    ``torch.compile`` of both; the torch.ao loop and raw amin/amax, all measured round-robin."""
    experts = torch.randn(64, 512, 256)
    spec = qstats.QuantSpec(dtype="int8", mapping="symmetric", granularity=qstats.PerAxis(0))
    obs = qstats.minmax(spec)
    stacked = qstats.stacked_observer(obs, 64)

    def one_expert(w):
        return qstats.compute_qparams(obs.update(obs.init(w), w), spec)

    vmapped = torch.vmap(one_expert)
    functions = {
        "vmap": lambda: vmapped(experts),
        "stacked": lambda: qstats.stacked_qparams(stacked.update(stacked.init(experts), experts), spec),
    }
    if compile_too:
        compiled = torch.compile(vmapped, fullgraph=True)
        functions["torch.compile(vmap)"] = lambda: compiled(experts)
        compiled_stacked = torch.compile(
            lambda w: qstats.stacked_qparams(stacked.update(stacked.init(w), w), spec), fullgraph=True
        )
        functions["torch.compile(stacked)"] = lambda: compiled_stacked(experts)

    # The reference: each expert's observer built beforehand (calibration attaches them once), then
    # forward + calculate_qparams per expert, after a reset so that every call does the work of a
    # fresh observer (qstats' side starts from init).
    observers = [
        PerChannelMinMaxObserver(ch_axis=0, dtype=torch.qint8, qscheme=torch.per_channel_symmetric)
        for _ in range(len(experts))
    ]

    def torch_ao_loop():
        out = []
        for observer, w in zip(observers, experts):
            observer.reset_min_max_vals()
            observer(w)
            out.append(observer.calculate_qparams())
        return out

    def torch_ao_loop_building():
        # the same with a new observer per expert and call (this bench's reference before
        # 2026-12-01: building the module is about a fifth of it)
        out = []
        for w in experts:
            observer = PerChannelMinMaxObserver(ch_axis=0, dtype=torch.qint8, qscheme=torch.per_channel_symmetric)
            observer(w)
            out.append(observer.calculate_qparams())
        return out

    functions["torch.ao loop"] = torch_ao_loop
    functions["torch.ao loop, building"] = torch_ao_loop_building
    functions["raw"] = lambda: (experts.amin(dim=-1), experts.amax(dim=-1))
    # The machine's floor: one vectorised read of the stacked tensor. Where the torch.ao loop takes
    # less than 10x this, no method that reads the tensor can be 10x faster than the loop.
    functions["one read"] = lambda: experts.sum()
    functions.update(bare_pass_functions(experts, spec))

    # Same answer before timing: every path's scales equal torch.ao's per expert.
    spec_ao = qstats.QuantSpec.from_torch_ao(torch.qint8, torch.per_channel_symmetric)
    for name in [n for n in functions if n not in _REFERENCES or n in ("bare pass", "vmap floor")]:
        scale = functions[name]().scale
        assert scale.shape == (64, 512), name
        for i in (0, 31, 63):
            observer = PerChannelMinMaxObserver(ch_axis=0, dtype=torch.qint8, qscheme=torch.per_channel_symmetric)
            observer(experts[i])
            state = qstats.minmax(spec_ao).update(qstats.minmax(spec_ao).init(experts[i]), experts[i])
            assert torch.equal(qstats.compute_qparams(state, spec_ao).scale, observer.calculate_qparams()[0])
            assert torch.equal(scale[i], observer.calculate_qparams()[0]), name
    return interleaved_best(functions, rounds=4, block=4)


def bench_streamed_experts(copies: int = 4) -> dict:
    """The same forms on data that no cache holds: ``copies`` different stacks (134 MB for 4, past
    the 48 MB L3 of this project's CI machines) taken in turn, so that every call reads its stack
    from memory, as a calibration pass over a model's experts does. The stack above is read again
    and again, and stays in the L3 cache of a machine nobody else loads. Times in seconds."""
    stacks = [torch.randn(64, 512, 256) for _ in range(copies)]
    spec = qstats.QuantSpec(dtype="int8", mapping="symmetric", granularity=qstats.PerAxis(0))
    obs = qstats.minmax(spec)
    stacked = qstats.stacked_observer(obs, 64)
    vmapped = torch.vmap(lambda w: qstats.compute_qparams(obs.update(obs.init(w), w), spec))
    observers = [
        PerChannelMinMaxObserver(ch_axis=0, dtype=torch.qint8, qscheme=torch.per_channel_symmetric) for _ in range(64)
    ]

    def rotation():
        turn = itertools.cycle(stacks)
        return lambda: next(turn)

    loop_stack, vmap_stack, stacked_stack, sum_stack = rotation(), rotation(), rotation(), rotation()

    def torch_ao_loop():
        out = []
        for observer, w in zip(observers, loop_stack()):
            observer.reset_min_max_vals()
            observer(w)
            out.append(observer.calculate_qparams())
        return out

    def stacked_form():
        experts = stacked_stack()
        return qstats.stacked_qparams(stacked.update(stacked.init(experts), experts), spec)

    return interleaved_best(
        {"torch.ao loop": torch_ao_loop, "vmap": lambda: vmapped(vmap_stack()), "stacked": stacked_form,
         "one read": lambda: sum_stack().sum()},
        rounds=6, block=4,
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="*", default=[1, 2], help="torch intra-op thread counts")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile variant")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}")
    print("| benchmark | threads | qstats | reference | ratio | target |")
    print("|---|---|---|---|---|---|")
    for threads in args.threads:
        torch.set_num_threads(threads)
        ours, ref = bench_per_tensor_update()
        print(
            f"| per-tensor minmax update, 4096x1024 fp32 | {threads} | {ours * 1e3:.3f} ms "
            f"| torch.aminmax {ref * 1e3:.3f} ms | {ours / ref:.2f}x | <= 1.3x |"
        )
        best = bench_stacked_experts(compile_too=not args.no_compile)
        loop, raw = best["torch.ao loop"], best["raw"]
        print(
            f"| floor: one read of the stacked tensor (sum) | {threads} | {best['one read'] * 1e3:.2f} ms "
            f"| torch.ao loop {loop * 1e3:.2f} ms | loop / floor {loop / best['one read']:.1f}x | (bound on the 10x) |"
        )
        for floor, what in (("bare pass", "the native pass and its outputs, no checks"),
                            ("vmap floor", "torch.vmap around that bare pass")):
            if floor in best:
                print(
                    f"| floor: {what} | {threads} | {best[floor] * 1e3:.2f} ms | torch.ao loop {loop * 1e3:.2f} ms "
                    f"| loop / floor {loop / best[floor]:.1f}x | (bound on the 10x) |"
                )
        building = best["torch.ao loop, building"]
        print(
            f"| torch.ao loop building each observer (the earlier reference) | {threads} | {building * 1e3:.2f} ms "
            f"| torch.ao loop {loop * 1e3:.2f} ms | {building / loop:.2f}x | |"
        )
        streamed = bench_streamed_experts()
        loop_streamed = streamed["torch.ao loop"]
        for how in ("vmap", "stacked", "one read"):
            print(
                f"| 64 experts, data streamed from memory (4 stacks taken in turn), {how} | {threads} "
                f"| {streamed[how] * 1e3:.2f} ms | torch.ao loop {loop_streamed * 1e3:.2f} ms "
                f"| {loop_streamed / streamed[how]:.1f}x faster | >= 10x faster{' (a floor)' if how == 'one read' else ''} |"
            )
        for how in [name for name in best if name not in _REFERENCES]:
            ours = best[how]
            print(
                f"| 64 experts [64,512,256] per-channel int8, {how} init+update+qparams | {threads} "
                f"| {ours * 1e3:.2f} ms | torch.ao PerChannelMinMaxObserver loop {loop * 1e3:.2f} ms "
                f"| {loop / ours:.1f}x faster | >= 10x faster |"
            )
            print(
                f"| same, {how}, against raw amin/amax over the stacked tensor | {threads} | {ours * 1e3:.2f} ms "
                f"| {raw * 1e3:.2f} ms | {ours / raw:.2f}x | <= 1.5x |"
            )
            floor = "vmap floor" if "vmap" in how else "bare pass"
            if floor in best:
                print(
                    f"| same, {how}, against the {floor} | {threads} | {ours * 1e3:.2f} ms "
                    f"| {best[floor] * 1e3:.2f} ms | {ours / best[floor]:.2f}x | |"
                )


if __name__ == "__main__":
    main()
