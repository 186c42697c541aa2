"""Calibrating a plain-torch mixture-of-experts layer whose experts are stacked ``[E, out, in]``.

The experts' weights live in two 3-D parameters (as transformers' fused MoE implementations keep
them), so qstats observes all experts with one call per parameter (``qstats.stacked_observer``:
``torch.vmap`` semantics, run directly on the stack for min/max observers). Each expert's
input statistics use the router's assignment as the update weight. The ``"down_proj.input"`` site
observes each expert's intermediate activation ``silu(gate) * up`` (the input of its down
projection) as the forward computes it for the tokens routed to that expert. Experts the router
never picks are reported by a warning and by the coverage mask (``QParams.calibrated``) and get the
declared fallback (scale 1), never a NaN or Inf scale.

By default each expert observes the tokens the router sends it; ``--all-experts`` observes every
token for every expert, as llm-compressor calibrates by default (``moe_calibrate_all_experts``):
then no expert is left uncalibrated.

Run:  python examples/moe_experts.py [--all-experts]
"""

from __future__ import annotations

import warnings

import torch

import qstats


class StackedExperts(torch.nn.Module):
    """``num_experts`` SwiGLU experts stored as stacked parameters; the call signature of
    transformers' fused experts: ``forward(hidden_states, top_k_index, top_k_weights)``."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = torch.nn.Parameter(torch.randn(num_experts, 2 * intermediate, hidden) / hidden**0.5)
        self.down_proj = torch.nn.Parameter(torch.randn(num_experts, hidden, intermediate) / intermediate**0.5)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for expert in range(self.num_experts):
            token, slot = torch.where(top_k_index == expert)  # the tokens routed to this expert
            gate, up = torch.nn.functional.linear(hidden_states[token], self.gate_up_proj[expert]).chunk(2, dim=-1)
            intermediate = torch.nn.functional.silu(gate) * up  # observed by the "down_proj.input" site
            expert_out = torch.nn.functional.linear(intermediate, self.down_proj[expert])
            out = out.index_add(0, token, expert_out * top_k_weights[token, slot, None])
        return out


class MoEBlock(torch.nn.Module):
    """Top-k router + stacked experts."""

    def __init__(self, num_experts: int = 16, hidden: int = 32, intermediate: int = 16, top_k: int = 2):
        super().__init__()
        self.top_k = top_k
        self.router = torch.nn.Linear(hidden, num_experts)
        self.experts = StackedExperts(num_experts, hidden, intermediate)

    def forward(self, x):
        tokens = x.reshape(-1, x.shape[-1])
        probabilities = torch.softmax(self.router(tokens), dim=-1)
        top_k_weights, top_k_index = torch.topk(probabilities, self.top_k, dim=-1)
        return x + self.experts(tokens, top_k_index, top_k_weights).reshape(x.shape)


def build(num_experts: int = 16, hidden: int = 32, intermediate: int = 16, layers: int = 2, dead_experts=(14, 15)):
    """A small MoE model; the router never picks ``dead_experts`` (their logits are pushed down)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(MoEBlock(num_experts, hidden, intermediate) for _ in range(layers))).eval()
    with torch.no_grad():
        for block in model:
            block.router.bias[list(dead_experts)] = -1e4
    return model


WEIGHTS = qstats.QuantSpec(dtype="int8", mapping="symmetric", granularity=qstats.PerAxis(0))
INPUTS = qstats.QuantSpec(dtype="int8", mapping="symmetric", on_uncalibrated="fallback")
RECIPE = qstats.Recipe(
    [
        qstats.Rule("StackedExperts", sites=("gate_up_proj", "down_proj"), observer=qstats.minmax, spec=WEIGHTS),
        qstats.Rule("StackedExperts", sites=("input", "down_proj.input"), observer=qstats.minmax, spec=INPUTS),
    ]
)


def main(batches: int = 4, tokens: int = 64, verbose: bool = True, all_experts: bool = False):
    model = build()
    generator = torch.Generator().manual_seed(1)
    data = [torch.randn(tokens, 32, generator=generator) for _ in range(batches)]
    plan = RECIPE.resolve(model)  # resolved once: calibrate, compute_qparams_tree, fake_quantized, report
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", qstats.UncalibratedWarning)
        states = qstats.calibrate(model, data, plan, progress=False, all_experts=all_experts)
    qparams = qstats.compute_qparams_tree(states, plan)
    if verbose:
        for warning in caught:
            print(f"warning: {warning.message}\n")
        for path, entry in qparams.items():
            coverage = entry["input"].calibrated
            print(f"{path}: gate_up_proj scales {tuple(entry['gate_up_proj'].scale.shape)}, "
                  f"input coverage {int(coverage.sum())}/{coverage.numel()}, uncovered experts "
                  f"{torch.arange(coverage.numel())[~coverage].tolist()}, all scales finite and > 0: "
                  f"{all(bool(torch.isfinite(q.scale).all() and (q.scale > 0).all()) for q in entry.values())}")
            print(f"{' ' * len(path)}  down_proj.input (intermediate) scales per expert: "
                  f"{[round(float(s), 5) for s in entry['down_proj.input'].scale]}")
        weights_only = {
            path: {site: qp for site, qp in entry.items() if site in ("gate_up_proj", "down_proj")}
            for path, entry in qparams.items()
        }
        x = data[0]
        with torch.no_grad():
            reference = model(x)
            with qstats.fake_quantized(model, weights_only, plan):
                quantized = model(x)
            with qstats.fake_quantized(model, qparams, plan):  # each expert's inputs under its own scale too
                quantized_inputs = model(x)
        error = float((quantized - reference).pow(2).sum() / reference.pow(2).sum())
        print(f"\nint8 per-channel expert weights: relative output error {error:.2e}")
        error = float((quantized_inputs - reference).pow(2).sum() / reference.pow(2).sum())
        print(f"and int8 per-expert inputs (input, down_proj.input): relative output error {error:.2e}")
        print()
        print(qstats.report(states, qparams, model, plan, batches=[x]).text())  # activations too, per expert
        print("\n(the weights' clipped_fraction: torch.ao's symmetric int8 scale, amax / 127.5, can round a row's "
              "positive extreme to code 128, clamped to 127 as torch.ao clamps it)")
    return model, states, qparams, caught


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all-experts", action="store_true", help="every token observed by every expert")
    main(all_experts=parser.parse_args().all_experts)
