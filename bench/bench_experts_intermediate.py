"""The cost of observing the per-expert intermediate activation (``"down_proj.input"``) of a fused
experts layer, against plain forward passes and against llm-compressor's per-expert observers.

One transformers ``Qwen3MoeExperts`` layer (random weights), run on the same routed batches by:

- ``forward``: the plain experts forward under ``torch.no_grad()``;
- ``qstats``: ``qstats.calibrate`` with a ``"down_proj.input"`` site (int8 asymmetric per-tensor
  min/max): the forward under the capture mode, then one masked vmapped update per call;
- ``llm-compressor``: the plain forward plus one ``static_minmax`` observer per expert fed with that
  expert's intermediate (what llm-compressor does after unpacking the experts into per-expert
  Linear modules). The intermediates are computed beforehand, outside the timing, which favours
  the reference.

Both are measured in the same run, best of several repetitions, one torch thread, CPU time of the
thread (``time.thread_time``; wall-clock with ``--wall`` or more than one thread). Prints markdown rows.

Run:  python bench/bench_experts_intermediate.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

import qstats


class _Layer(torch.nn.Module):
    def __init__(self, experts):
        super().__init__()
        self.experts = experts

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return self.experts(hidden_states, top_k_index, top_k_weights)


def build(num_experts, hidden, intermediate, top_k, implementation):
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = transformers.Qwen3MoeConfig(
        hidden_size=hidden, moe_intermediate_size=intermediate, num_experts=num_experts, num_experts_per_tok=top_k
    )
    config._experts_implementation = implementation
    torch.manual_seed(0)
    experts = Qwen3MoeExperts(config)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0.0, hidden**-0.5)
        experts.down_proj.normal_(0.0, intermediate**-0.5)
    return _Layer(experts).eval()


def make_batches(count, tokens, hidden, num_experts, top_k):
    generator = torch.Generator().manual_seed(1)
    router = torch.randn(hidden, num_experts, generator=generator)
    batches = []
    for _ in range(count):
        x = torch.randn(tokens, hidden, generator=generator)
        weights, index = torch.topk(torch.softmax(x @ router, dim=-1), top_k, dim=-1)
        batches.append((x, index, weights))
    return batches


def intermediates(experts, batches):
    """Per batch, per expert: the intermediate of its routed tokens (computed by hand)."""
    out = []
    with torch.no_grad():
        for x, index, _ in batches:
            per_expert = []
            for expert in range(experts.num_experts):
                rows = x[(index == expert).any(dim=-1)]
                gate, up = torch.nn.functional.linear(rows, experts.gate_up_proj[expert]).chunk(2, dim=-1)
                per_expert.append(experts.act_fn(gate) * up)
            out.append(per_expert)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--wall", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    # the CPU time of the calling thread misses the work of torch's other threads
    clock = time.perf_counter if args.wall or args.threads > 1 else time.thread_time

    def best_time(fn, repeats):
        fn()
        best = float("inf")
        for _ in range(repeats):
            start = clock()
            fn()
            best = min(best, clock() - start)
        return best

    from compressed_tensors.quantization import QuantizationArgs
    from llmcompressor.observers import Observer

    input_args = QuantizationArgs(num_bits=8, type="int", symmetric=False, strategy="tensor")
    spec = qstats.QuantSpec.from_compressed_tensors(input_args).replace(on_uncalibrated="fallback")
    recipe = qstats.Recipe([qstats.Rule("Qwen3MoeExperts", sites=("down_proj.input",), spec=spec)])

    print("| experts implementation | E x hidden x intermediate, top-k | forward (ms) | qstats (ms) | "
          "qstats / forward | llm-compressor (ms) | llm-compressor / qstats |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for num_experts, hidden, intermediate, top_k in ((64, 64, 32, 4), (64, 256, 128, 8)):
        batches = make_batches(args.batches, args.tokens, hidden, num_experts, top_k)
        for implementation in ("eager", "grouped_mm"):
            layer = build(num_experts, hidden, intermediate, top_k, implementation)
            precomputed = intermediates(layer.experts, batches)

            def forward():
                with torch.no_grad():
                    for batch in batches:
                        layer(*batch)

            def with_qstats():
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    return qstats.calibrate(layer, batches, recipe, progress=False)

            def with_llmcompressor():
                forward()
                observers = [
                    Observer.load_from_registry("static_minmax", base_name="input", args=input_args.model_copy(deep=True))
                    for _ in range(num_experts)
                ]
                seen = [False] * num_experts
                for per_expert in precomputed:
                    for expert, (observer, values) in enumerate(zip(observers, per_expert)):
                        if values.numel():
                            observer(values)
                            seen[expert] = True
                # an expert no token reached has no statistics (get_qparams asserts): None
                return [observer.get_qparams() if s else None for observer, s in zip(observers, seen)]

            qstats_states = with_qstats()
            qparams = qstats.compute_qparams_tree(qstats_states, recipe, layer)["experts"]["down_proj.input"]
            reference = with_llmcompressor()
            for expert, entry in enumerate(reference):
                assert bool(qparams.calibrated[expert]) == (entry is not None), expert
                if entry is not None:
                    assert torch.equal(qparams.scale[expert].reshape(1), entry["scale"].reshape(1)), expert

            times = {}
            for _ in range(2):  # interleaved rounds; keep each side's best
                for name, fn in (("forward", forward), ("qstats", with_qstats), ("llmc", with_llmcompressor)):
                    times[name] = min(times.get(name, float("inf")), best_time(fn, args.repeats))
            print(
                f"| {implementation} | {num_experts} x {hidden} x {intermediate}, {top_k} | "
                f"{times['forward'] * 1e3:.1f} | {times['qstats'] * 1e3:.1f} | {times['qstats'] / times['forward']:.2f}x | "
                f"{times['llmc'] * 1e3:.1f} | {times['llmc'] / times['qstats']:.2f}x |"
            )


if __name__ == "__main__":
    main()
