"""GPTQ Hessians of a 64-expert layer's inputs: qstats' stacked observer against llm-compressor's
per-expert ``accumulate_hessian``, same batches, same run.

Each batch is ``--tokens`` hidden states ``[tokens, hidden]`` routed top-``k`` among the experts by a
random router (OLMoE's 64 experts, top 8). Both sides accumulate, per expert, the sum of ``x^T x``
over the tokens routed to it (first table) or over every token (second table: llm-compressor's
``oneshot`` default for MoE, ``moe_calibrate_all_experts=True``; qstats' ``all_experts=True``):

- qstats: one ``qstats.stacked_observer(qstats.hessian(), 64).update`` per batch, the hidden states
  shared by every expert (an expanded view) and the routing mask as the update weight;
- llm-compressor: what its GPTQ hook does per expert module and batch, ``accumulate_hessian`` on the
  tokens routed to that expert (selected before timing; hook dispatch not timed).

Both give the same Hessians (checked: llm-compressor's is ``2 * total``). Both multiply each expert's
routed rows once (``qstats::add_masked_grams`` gathers them and runs one ``mm`` per
expert), so on one thread the products cost the same; qstats' update also gathers the routed rows
(llm-compressor's are selected before timing) and writes a new ``[E, in, in]`` state per batch
(pure update) where llm-compressor adds in place. torch runs one thread; the
CPU time of this process is measured (``--wall``: wall-clock). Prints the best time of each side over
``--repeats`` and the range of llm-compressor's time over qstats' in the same repeat.

Run:  python bench/bench_hessian.py [--repeats 3] [--tokens 512] [--batches 4] [--hidden 256]
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

import qstats

warnings.filterwarnings("ignore")

MAX_RELATIVE_DIFFERENCE = 1e-6  # bench/README.md: the same Hessians (2.1e-7 and 2.2e-7 relative)


def make_batches(num_batches: int, tokens: int, hidden: int, experts: int, top_k: int):
    """``(hidden_states, routing_mask [E, tokens], per-expert routed rows)`` per batch; ``top_k``
    None: every expert takes every token."""
    gen = torch.Generator().manual_seed(0)
    router = torch.randn(hidden, experts, generator=gen)
    batches = []
    for _ in range(num_batches):
        x = torch.randn(tokens, hidden, generator=gen)
        if top_k is None:
            batches.append((x, torch.ones(experts, tokens), [x] * experts))
            continue
        chosen = torch.topk(x @ router, top_k, dim=-1).indices
        mask = torch.zeros(tokens, experts).scatter_(1, chosen, 1.0).T.contiguous()
        batches.append((x, mask, [x[mask[e].bool()] for e in range(experts)]))
    return batches


def compare(batches, experts: int, hidden: int, repeats: int, clock, title: str) -> float:
    """Times both sides on ``batches`` and prints their ratio; the largest difference of the
    Hessians, relative to llm-compressor's largest entry (computed before timing)."""
    from llmcompressor.modifiers.gptq.helpers import accumulate_hessian, make_empty_hessian

    modules = [torch.nn.Linear(hidden, 1, bias=False) for _ in range(experts)]
    observer = qstats.stacked_observer(qstats.hessian(), experts)

    def ours():
        state = observer.init(batches[0][0].expand(experts, *batches[0][0].shape))
        for x, mask, _ in batches:
            state = observer.update(state, x.expand(experts, *x.shape), mask)
        return state

    def llm_compressor():
        hessians = [make_empty_hessian(module) for module in modules]
        samples = [torch.zeros(()) for _ in modules]
        for _, _, routed in batches:
            for e, module in enumerate(modules):
                hessians[e], samples[e] = accumulate_hessian(routed[e], module, hessians[e], samples[e])
        return hessians

    state, reference = ours(), llm_compressor()
    worst = max(float((2 * state.total[e] - reference[e]).abs().max() / reference[e].abs().max().clamp(min=1e-30))
                for e in range(experts))
    rows = {"qstats stacked hessian": ours, "llm-compressor accumulate_hessian per expert": llm_compressor}
    times = {name: [] for name in rows}
    for _ in range(repeats):
        for name, fn in rows.items():
            start = clock()
            fn()
            times[name].append(clock() - start)
    base = times["qstats stacked hessian"]
    print(f"{title} ({sum(int(mask.sum()) for _, mask, _ in batches)} rows in all); largest difference to "
          f"llm-compressor's Hessian, relative to its largest entry: {worst:.1e}")
    for name, values in times.items():
        ratios = [v / b for v, b in zip(values, base)]
        print(f"  {name:46s} best {min(values):7.4f} s   time / qstats: {min(ratios):.2f}-{max(ratios):.2f}x")
    return worst


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--wall", action="store_true", help="wall-clock time instead of this process's CPU time")
    options = parser.parse_args(argv)
    torch.set_num_threads(1)
    experts, hidden = options.experts, options.hidden
    clock = time.perf_counter if options.wall else time.process_time
    print(f"Hessians of {experts} experts, hidden {hidden}, {options.batches} batches of {options.tokens} tokens, "
          f"1 thread, {'wall-clock' if options.wall else 'CPU'} time, {options.repeats} repeats")
    worst = {}
    for top_k, title in ((options.top_k, f"routed top-{options.top_k}"), (None, "every expert on every token")):
        batches = make_batches(options.batches, options.tokens, hidden, experts, top_k)
        worst[title] = compare(batches, experts, hidden, options.repeats, clock, title)
    for title, difference in worst.items():
        assert difference <= MAX_RELATIVE_DIFFERENCE, (
            f"{title}: the Hessians differ from llm-compressor's by {difference:.1e} relative "
            f"(at most {MAX_RELATIVE_DIFFERENCE:.0e})")


if __name__ == "__main__":
    main()
