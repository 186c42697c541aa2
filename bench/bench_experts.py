"""Calibrating the stacked experts of a 64-expert MoE layer: qstats' stacked path against
llm-compressor's per-module observers, in the same run.

The layer is transformers' ``Qwen3MoeExperts`` built from a config with 64 experts, top-8 routing
(OLMoE's expert count and top-k, smaller widths so it fits a laptop), random weights. Both sides
do the same W8A8 calibration work, given the same hidden states and router choices per batch:

- weights: int8 symmetric per output channel, for ``gate_up_proj`` and ``down_proj`` of every
  expert, then their scales and zero points;
- inputs: int8 asymmetric per tensor, per expert over the tokens routed to it (static min/max),
  then their scales and zero points.

llm-compressor calibrates fused experts by unpacking them into per-expert ``gate_proj``, ``up_proj``
and ``down_proj`` Linear modules (its ``linear_experts``); here each such module gets its quantization
scheme and goes through llm-compressor's own ``initialize_observer`` / ``observe`` /
``update_qparams`` (``memoryless_minmax`` weight observers); inputs use one ``static_minmax``
observer per expert fed with that expert's tokens (selected in a Python loop); qstats calls each
stacked observer once per batch (``qstats.stacked_observer``: ``torch.vmap`` of the observer's own
functions over experts, routing mask as the update weight) and computes all quantization
parameters with one call (``qstats.stacked_qparams``, vmap of ``compute_qparams``), as
``qstats.calibrate`` does.
Both produce the same scales (checked). A last row times one read of every weight (one full
reduction per stack): no calibrator can beat it, so llm-compressor's time over it bounds any
speed-up; wide experts are bound by it. The forward pass of the
experts, common to both, is not timed. By default torch runs one thread and the CPU time of that thread is
measured (less disturbed by other programs on a busy machine); ``--wall`` measures wall-clock.

Run:  python bench/bench_experts.py [--repeats 5] [--batches 128]

The default 4 batches (1K tokens) make the one weight pass weigh most; ``--batches 128`` (32K
tokens, still far fewer than a usual calibration set) weighs weights and routed inputs as a
calibration run does.
"""

from __future__ import annotations

import argparse
import gc
import time
import warnings

import torch

import qstats
from qstats.experts import routing_mask

warnings.filterwarnings("ignore")


def build_layer(num_experts: int, hidden: int, intermediate: int):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=intermediate, num_experts=num_experts)
    torch.manual_seed(0)
    experts = Qwen3MoeExperts(config)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, hidden**-0.5)
        experts.down_proj.normal_(0, intermediate**-0.5)
    return experts.eval()


def make_batches(num_batches: int, tokens: int, hidden: int, num_experts: int, top_k: int):
    generator = torch.Generator().manual_seed(1)
    router = torch.randn(hidden, num_experts, generator=generator)
    batches = []
    for _ in range(num_batches):
        x = torch.randn(tokens, hidden, generator=generator)
        batches.append((x, torch.topk(x @ router, top_k, dim=-1).indices))
    return batches


def measure(num_experts, hidden, intermediate, top_k, num_batches, tokens, repeats, clock):
    """Best times (seconds) of both sides for the weights and for the routed inputs."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.lifecycle.initialize import initialize_module_for_quantization
    from llmcompressor.modifiers.quantization.calibration import initialize_observer, observe, update_qparams
    from llmcompressor.observers import Observer

    experts = build_layer(num_experts, hidden, intermediate)
    batches = make_batches(num_batches, tokens, hidden, num_experts, top_k)
    weight_args = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
    input_args = QuantizationArgs(num_bits=8, type="int", symmetric=False, strategy="tensor")
    weight_spec = qstats.QuantSpec.from_compressed_tensors(weight_args)
    input_spec = qstats.QuantSpec.from_compressed_tensors(input_args)
    stacks = {"gate_up_proj": experts.gate_up_proj.detach(), "down_proj": experts.down_proj.detach()}

    # llm-compressor calibrates fused experts by unpacking them into per-expert gate_proj, up_proj
    # and down_proj Linear modules (llmcompressor.modeling.moe.linear_experts); each module gets its
    # quantization scheme and its own weight observer.
    scheme = QuantizationScheme(targets=["Linear"], weights=weight_args)
    modules = []
    with torch.no_grad():
        for expert in range(num_experts):
            for name, weight in (
                ("gate_proj", stacks["gate_up_proj"][expert, :intermediate]),
                ("up_proj", stacks["gate_up_proj"][expert, intermediate:]),
                ("down_proj", stacks["down_proj"][expert]),
            ):
                module = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
                module.weight.copy_(weight)
                initialize_module_for_quantization(module, scheme.model_copy(deep=True))
                modules.append((name, expert, module))

    def llmcompressor_weights():
        qparams = {}
        for name, expert, module in modules:
            initialize_observer(module, "weight")
            observe(module, "weight")
            update_qparams(module, "weight")
            qparams[(name, expert)] = {"scale": module.weight_scale, "zero_point": module.weight_zero_point}
        return qparams

    def llmcompressor_inputs():
        observers = [
            Observer.load_from_registry("static_minmax", base_name="input", args=input_args.model_copy(deep=True))
            for _ in range(num_experts)
        ]
        for hidden_states, index in batches:
            for expert in range(num_experts):
                observers[expert](hidden_states[(index == expert).any(dim=-1)])
        return {
            ("input", expert): observer.get_qparams()
            for expert, observer in enumerate(observers)
            if observer.has_statistics
        }

    weight_observer = qstats.stacked_observer(qstats.minmax(weight_spec), num_experts)
    input_observer = qstats.stacked_observer(qstats.minmax(input_spec), num_experts)

    def weight_qparams(state):
        return qstats.stacked_qparams(state, weight_spec)

    def input_qparams(state):
        return qstats.stacked_qparams(state, input_spec)

    def qstats_weights():
        return {
            site: weight_qparams(weight_observer.update(weight_observer.init(stack), stack))
            for site, stack in stacks.items()
        }

    def qstats_inputs():
        state = None
        for hidden_states, index in batches:
            mask = routing_mask((hidden_states, index), {}, num_experts, hidden_states.shape[0])
            # what qstats.calibrate does for min/max observers: the tokens shared by every expert
            # (reduced once), the routing mask as the weight
            x, weight = hidden_states.expand(num_experts, *hidden_states.shape), mask
            state = input_observer.init(x) if state is None else state
            state = input_observer.update(state, x, weight)
        return {"input": input_qparams(state)}

    # same results (and warm-up)
    reference = {**llmcompressor_weights(), **llmcompressor_inputs()}
    ours = {**qstats_weights(), **qstats_inputs()}
    pieces = {
        "gate_proj": ("gate_up_proj", slice(0, intermediate)),
        "up_proj": ("gate_up_proj", slice(intermediate, 2 * intermediate)),
        "down_proj": ("down_proj", slice(None)),
        "input": ("input", slice(None)),
    }
    for (name, expert), expected in reference.items():
        site, rows = pieces[name]
        got = ours[site]
        got_scale = got.scale[expert][rows] if got.scale.ndim > 1 else got.scale[expert]
        got_zero_point = got.zero_point[expert][rows] if got.zero_point.ndim > 1 else got.zero_point[expert]
        assert torch.equal(got_scale.reshape(-1), expected["scale"].reshape(-1)), (name, expert)
        assert torch.equal(got_zero_point.reshape(-1).to(torch.int64), expected["zero_point"].reshape(-1).to(torch.int64))

    def one_pass():
        # A lower bound for any calibrator: one read of every weight (a single full reduction).
        return [stack.amax() for stack in stacks.values()]

    runs = {
        "one_pass": one_pass,
        "llmc_weights": llmcompressor_weights,
        "qstats_weights": qstats_weights,
        "llmc_inputs": llmcompressor_inputs,
        "qstats_inputs": qstats_inputs,
    }
    # Each side runs `repeats` times in a row (warm caches for both, as timeit), and the blocks
    # alternate over two rounds so that both sides share the machine's noise.
    best = {name: float("inf") for name in runs}
    for _ in range(2):
        for name, function in runs.items():
            for _ in range(repeats):
                gc.disable()  # as timeit does: no collection of the other side's garbage inside a timing
                try:
                    start = clock()
                    function()
                    best[name] = min(best[name], clock() - start)
                finally:
                    gc.enable()
    return best


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument(
        "--widths", default="64x32,128x64,256x128,512x256", help="comma-separated hiddenxintermediate expert widths"
    )
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--wall", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    # the CPU time of the calling thread misses the work of torch's other threads
    clock = time.perf_counter if args.wall or args.threads > 1 else time.thread_time

    print(f"{args.experts} experts, top-{args.top_k}, {args.batches} batches x {args.tokens} tokens; best of "
          f"{args.repeats}, {torch.get_num_threads()} thread(s), {'CPU' if clock is time.thread_time else 'wall-clock'} time; "
          "same scales and zero points on both sides (checked)")
    print()
    print("| layer (hidden x intermediate) | what | llm-compressor per-expert (ms) | qstats stacked (ms) | speed-up |")
    print("| --- | --- | --- | --- | --- |")
    ratios = {}
    for width in args.widths.split(","):
        hidden, intermediate = (int(part) for part in width.split("x"))
        best = measure(args.experts, hidden, intermediate, args.top_k, args.batches, args.tokens, args.repeats, clock)
        for what, key in (("stacked weights (gate_up, down)", "weights"), ("routed inputs", "inputs")):
            ratio = best[f"llmc_{key}"] / best[f"qstats_{key}"]
            ratios[(width, key)] = ratio
            print(f"| {args.experts} experts, {hidden} x {intermediate} | {what} | {best[f'llmc_{key}'] * 1e3:.2f} | "
                  f"{best[f'qstats_{key}'] * 1e3:.2f} | {ratio:.1f}x |")
        llmc = best["llmc_weights"] + best["llmc_inputs"]
        ours = best["qstats_weights"] + best["qstats_inputs"]
        ratios[(width, "layer")] = llmc / ours
        print(f"| {args.experts} experts, {hidden} x {intermediate} | **whole layer** | {llmc * 1e3:.2f} | "
              f"{ours * 1e3:.2f} | **{llmc / ours:.1f}x** |")
        floor = best["one_pass"]
        ratios[(width, "bound")] = llmc / floor
        print(f"| {args.experts} experts, {hidden} x {intermediate} | bound: one read of the weights, no other work "
              f"| {llmc * 1e3:.2f} | {floor * 1e3:.2f} | {llmc / floor:.1f}x |")
    return ratios


if __name__ == "__main__":
    main()
