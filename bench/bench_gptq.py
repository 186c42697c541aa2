"""GPTQ of 64 stacked experts ``[64, 512, 256]``, int4 group 128: qstats against llm-compressor, same run.

Both sides get the same weights, the same Hessians (``2 / rows * sum x^T x`` of random correlated
inputs, one per expert) and the same min/max quantization parameters (llm-compressor 0.14 passes its
weight observer's), block size 128, no activation ordering:

- qstats: one ``qstats.gptq`` call on the ``[E, out, in]`` stack (one batched column loop), and
  ``torch.vmap`` of its call on one expert (the same loop, batched by vmap);
- llm-compressor: ``quantize_weight`` (its eager column loop) called once per expert, as a per-module
  GPTQ loop does; a second row calls it once on the whole batch (its ``batched_quantization``).

The codes are compared before timing (the same float operations in the same order; the batched
matmuls that carry a block's error may round a few codes in a million differently). torch runs one thread;
the CPU time of this process is measured (``--wall``: wall-clock). Prints the best time of each
row over ``--repeats`` and the range of its ratio to qstats' time of the same repeat.

``--every-token``: every expert's Hessian is of the same tokens (llm-compressor's ``oneshot`` default
for MoE); qstats then factors it once for the stack, llm-compressor once per expert.

Run:  python bench/bench_gptq.py [--repeats 3] [--experts 64] [--wall] [--every-token]
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

import qstats

warnings.filterwarnings("ignore")

MIN_IDENTICAL_CODES = 0.999  # bench/README.md: 100%, 99.9995% on the routed run of its last machine


def make_inputs(experts: int, out: int, features: int, group: int, every_token: bool = False):
    from compressed_tensors.quantization import QuantizationArgs

    gen = torch.Generator().manual_seed(0)
    weights = torch.randn(experts, out, features, generator=gen) * features**-0.5
    x = torch.randn(experts, 256, 32, generator=gen) @ torch.randn(32, features, generator=gen)
    x = x + 0.1 * torch.randn(experts, 256, features, generator=gen)
    if every_token:  # every expert on the same tokens: equal Hessians (llm-compressor's MoE default)
        x = x[:1].expand_as(x)
    observer = qstats.stacked_observer(qstats.hessian(), experts)
    state = observer.update(observer.init(x), x)
    args = QuantizationArgs(num_bits=4, symmetric=True, strategy="group", group_size=group)
    spec = qstats.QuantSpec.from_compressed_tensors(args)
    weight_observer = qstats.stacked_observer(qstats.minmax(spec), experts)
    qparams = qstats.stacked_qparams(weight_observer.update(weight_observer.init(weights), weights), spec)
    return weights, state, spec, args, qparams


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--out", type=int, default=512)
    parser.add_argument("--features", type=int, default=256)
    parser.add_argument("--group", type=int, default=128)
    parser.add_argument("--wall", action="store_true", help="wall-clock time instead of this process's CPU time")
    parser.add_argument("--every-token", action="store_true", help="every expert on the same tokens (equal Hessians)")
    options = parser.parse_args(argv)
    torch.set_num_threads(1)
    from llmcompressor.modifiers.gptq.gptq_quantize import quantize_weight

    weights, state, spec, args, qparams = make_inputs(options.experts, options.out, options.features, options.group,
                                                       options.every_token)
    hessians = torch.stack([qstats.observers.hessian.gptq_hessian(qstats.HessianState(*(f[e] for f in state)))
                            for e in range(options.experts)])
    scale, zero_point = qparams.scale, qparams.zero_point

    def ours():
        return qstats.gptq(weights, state, spec, qparams=qparams)

    def vmapped(w, total, count, nonfinite, *qparam_fields):
        state_one = qstats.HessianState(total, count, nonfinite)
        return qstats.gptq(w, state_one, spec, qparams=qstats.QParams(*qparam_fields))

    def ours_vmap():
        return torch.vmap(vmapped)(weights, *state, *qparams)

    def llmc_loop():
        return [quantize_weight(weights[e:e + 1].clone(), hessians[e:e + 1].clone(), scale[e:e + 1],
                                zero_point[e:e + 1], None, args)[0] for e in range(options.experts)]

    def llmc_batched():
        return quantize_weight(weights.clone(), hessians.clone(), scale, zero_point, None, args)[0]

    _, codes, _ = ours()
    reference = torch.cat(llmc_loop())
    same = (torch.vmap(lambda w, q: qstats.quantize(w, q, spec))(reference, qparams) == codes)
    identical = same.float().mean().item()
    print(f"codes identical to llm-compressor's: {identical:.6f}")
    assert torch.equal(ours_vmap()[1], codes)
    rows = {"qstats.gptq of the stack": ours, "torch.vmap(qstats.gptq) of one expert": ours_vmap,
            "llm-compressor quantize_weight per expert": llmc_loop, "llm-compressor quantize_weight batched": llmc_batched}
    clock = time.perf_counter if options.wall else time.process_time
    times = {name: [] for name in rows}
    for _ in range(options.repeats):
        for name, fn in rows.items():
            start = clock()
            fn()
            times[name].append(clock() - start)
    base = times["qstats.gptq of the stack"]
    print(f"GPTQ of [{options.experts}, {options.out}, {options.features}] int4 group {options.group}, 1 thread, "
          f"{'wall-clock' if options.wall else 'CPU'} time, {options.repeats} repeats")
    for name, values in times.items():
        ratios = [v / b for v, b in zip(values, base)]
        print(f"  {name:45s} best {min(values):7.3f} s   time / qstats: {min(ratios):.2f}-{max(ratios):.2f}x")
    assert identical >= MIN_IDENTICAL_CODES, (
        f"codes identical to llm-compressor's: {identical:.6f} (at least {MIN_IDENTICAL_CODES})")


if __name__ == "__main__":
    main()
