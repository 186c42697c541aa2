"""Core benchmarks: minmax update against torch.aminmax, stacked experts against torch.ao.

Prints markdown table rows with ratios measured in this run (alternating blocks of runs; each
candidate's best run counts). On one thread the CPU time of the calling thread is measured
(``time.thread_time``: other programs on a busy machine disturb it much less); on more threads,
or with ``--wall``, wall-clock time. The references are measured beside qstats in the same process:
``torch.aminmax`` for the per-tensor update; for 64 stacked experts, a loop of torch.ao
``PerChannelMinMaxObserver`` (built beforehand), raw ``amin`` + ``amax`` over the stack, and one
``sum`` over the stack (one read of it: a floor for any form that reads the tensor).

    python bench/bench_core.py [--threads 1 2] [--no-compile] [--streamed] [--wall]
"""

from __future__ import annotations

import argparse
import itertools
import time

import torch
from torch.ao.quantization import PerChannelMinMaxObserver

import qstats

_REFERENCES = ("torch.ao loop", "raw amin+amax", "one read")


def interleaved_best(functions: dict, clock, rounds: int = 4, block: int = 8, warmup: int = 3) -> dict:
    """Best time (``clock``) of each function, measured in alternating blocks: every round runs
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
                start = clock()
                function()
                best[name] = min(best[name], clock() - start)
    return best


def bench_per_tensor_update(clock) -> dict:
    """``minmax`` update of a 4096x1024 fp32 tensor (per tensor) beside ``torch.aminmax``."""
    x = torch.randn(4096, 1024)
    obs = qstats.minmax(qstats.QuantSpec(dtype="int8"))
    state = obs.init(x)
    return interleaved_best({"qstats": lambda: obs.update(state, x), "torch.aminmax": lambda: torch.aminmax(x)},
                            clock, rounds=8)


def _experts_spec():
    return qstats.QuantSpec(dtype="int8", mapping="symmetric", granularity=qstats.PerAxis(0))


def _torch_ao_loop(observers, stack):
    """The reference: each expert's observer built beforehand (calibration attaches them once),
    reset, then forward + calculate_qparams per expert (qstats' side starts from init)."""
    out = []
    for observer, w in zip(observers, stack):
        observer.reset_min_max_vals()
        observer(w)
        out.append(observer.calculate_qparams())
    return out


def _torch_ao_observers(count):
    return [
        PerChannelMinMaxObserver(ch_axis=0, dtype=torch.qint8, qscheme=torch.per_channel_symmetric)
        for _ in range(count)
    ]


def experts_forms(experts: torch.Tensor, compile_too: bool) -> dict:
    """init + update + compute_qparams over a ``[E, C, L]`` stack, per channel of every expert:
    ``qstats.stacked_observer`` + ``qstats.stacked_qparams`` (torch.vmap of the observer's own
    functions), ``torch.vmap`` of a user's one-expert function, and ``torch.compile`` of the first."""
    spec = _experts_spec()
    obs = qstats.minmax(spec)
    stacked = qstats.stacked_observer(obs, experts.shape[0])

    def stacked_form(w):
        return qstats.stacked_qparams(stacked.update(stacked.init(w), w), spec)

    vmapped = torch.vmap(lambda w: qstats.compute_qparams(obs.update(obs.init(w), w), spec))
    forms = {"stacked_observer": stacked_form, "torch.vmap(one expert)": vmapped}
    if compile_too:
        forms["torch.compile(stacked_observer)"] = torch.compile(stacked_form, fullgraph=True)
    return forms


def check_against_torch_ao(forms: dict, experts: torch.Tensor) -> None:
    """Same answer before timing: every form's scales equal torch.ao's per expert."""
    for name, form in forms.items():
        scale = form(experts).scale
        assert scale.shape == experts.shape[:2], name
        for i in (0, experts.shape[0] // 2, experts.shape[0] - 1):
            observer = _torch_ao_observers(1)[0]
            observer(experts[i])
            assert torch.equal(scale[i], observer.calculate_qparams()[0]), name


def bench_stacked_experts(clock, compile_too: bool = True) -> dict:
    """Times (seconds) of every form over 64 stacked experts [64, 512, 256] beside the torch.ao
    loop, raw amin + amax and one read of the stack, all measured round-robin."""
    experts = torch.randn(64, 512, 256)
    forms = experts_forms(experts, compile_too)
    check_against_torch_ao(forms, experts)
    observers = _torch_ao_observers(len(experts))
    functions = {name: (lambda form=form: form(experts)) for name, form in forms.items()}
    functions["torch.ao loop"] = lambda: _torch_ao_loop(observers, experts)
    functions["raw amin+amax"] = lambda: (experts.amin(dim=-1), experts.amax(dim=-1))
    functions["one read"] = lambda: experts.sum()
    return interleaved_best(functions, clock, rounds=6, block=4)


def bench_streamed_experts(clock, copies: int = 4) -> dict:
    """The same eager forms on data that no cache holds: ``copies`` different stacks (134 MB for
    4) taken in turn, so that every call reads its stack from memory, as a calibration pass over
    a model's experts does. Times in seconds."""
    stacks = [torch.randn(64, 512, 256) for _ in range(copies)]
    forms = experts_forms(stacks[0], compile_too=False)
    observers = _torch_ao_observers(64)

    def rotation(function):
        turn = itertools.cycle(stacks)
        return lambda: function(next(turn))

    functions = {name: rotation(form) for name, form in forms.items()}
    functions["torch.ao loop"] = rotation(lambda stack: _torch_ao_loop(observers, stack))
    functions["raw amin+amax"] = rotation(lambda stack: (stack.amin(dim=-1), stack.amax(dim=-1)))
    functions["one read"] = rotation(lambda stack: stack.sum())
    return interleaved_best(functions, clock, rounds=6, block=4)


def experts_rows(best: dict, threads: int, what: str) -> None:
    loop, raw, floor = best["torch.ao loop"], best["raw amin+amax"], best["one read"]
    print(f"| {what}: one read of the stack (sum), a floor | {threads} | {floor * 1e3:.2f} ms "
          f"| torch.ao loop {loop * 1e3:.2f} ms | loop / floor {loop / floor:.1f}x | (bounds the 10x) |")
    for name in [n for n in best if n not in _REFERENCES]:
        ours = best[name]
        print(f"| {what}, {name} init+update+qparams | {threads} | {ours * 1e3:.2f} ms "
              f"| torch.ao PerChannelMinMaxObserver loop {loop * 1e3:.2f} ms | {loop / ours:.1f}x faster "
              f"| >= 10x faster |")
        print(f"| same, {name}, against raw amin+amax over the stack | {threads} | {ours * 1e3:.2f} ms "
              f"| {raw * 1e3:.2f} ms | {ours / raw:.2f}x | <= 1.5x |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="*", default=[1, 2], help="torch intra-op thread counts")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile form")
    parser.add_argument("--streamed", action="store_true", help="also time the experts on stacks streamed from memory")
    parser.add_argument("--wall", action="store_true", help="wall-clock time on one thread too")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}")
    print("| benchmark | threads | qstats | reference | ratio | target |")
    print("|---|---|---|---|---|---|")
    for threads in args.threads:
        torch.set_num_threads(threads)
        # the CPU time of the calling thread misses the work of torch's other threads
        clock = time.perf_counter if args.wall or threads > 1 else time.thread_time
        best = bench_per_tensor_update(clock)
        ours, ref = best["qstats"], best["torch.aminmax"]
        print(f"| per-tensor minmax update, 4096x1024 fp32 | {threads} | {ours * 1e3:.3f} ms "
              f"| torch.aminmax {ref * 1e3:.3f} ms | {ours / ref:.2f}x | <= 1.3x |")
        experts_rows(bench_stacked_experts(clock, compile_too=not args.no_compile), threads,
                     "64 experts [64,512,256] int8 per channel")
        if args.streamed:
            experts_rows(bench_streamed_experts(clock), threads, "64 experts streamed from memory (4 stacks in turn)")


if __name__ == "__main__":
    main()
