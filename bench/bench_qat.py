"""One QAT training step: qstats pure fake-quant against torch.ao's FusedMovingAvgObsFakeQuantize.

Both models are the same MLP; the weight and the input activation of every Linear are
fake-quantized with moving-average min/max observers (weights: per channel, symmetric qint8;
activations: per tensor, affine quint8; averaging constant 0.01, torch.ao's defaults):

- torch.ao: ``FusedMovingAvgObsFakeQuantize`` modules (one fused C++ op: observer update, qparams
  and fake quant), the torch.ao QAT default;
- qstats: ``qstats.qat.prepare(model, ...)`` and ``qat.apply(params, state, x, phase=...)``:
  observer update, ``compute_qparams`` and ``fake_quantize`` as pure functions, state in and out.

A step is forward, cross-entropy, backward and an SGD update, with observers and fake quant on.
Both are timed eagerly and under ``torch.compile`` (the loss function compiled, backward through
AOTAutograd), interleaved in the same run; the ratio is qstats time / torch.ao time (lower is
better for qstats). Run: ``python bench/bench_qat.py [--no-compile] [--steps N]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.ao.quantization import (
    FusedMovingAvgObsFakeQuantize,
    MovingAverageMinMaxObserver,
    MovingAveragePerChannelMinMaxObserver,
)

import qstats


class MLP(nn.Module):
    def __init__(self, sizes):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.relu(x)
        return x


class TorchAoQAT(nn.Module):
    """The MLP with torch.ao fused fake-quant modules on every Linear's weight and input."""

    def __init__(self, mlp: MLP):
        super().__init__()
        self.mlp = mlp
        n = len(mlp.layers)
        self.activations = nn.ModuleList(
            FusedMovingAvgObsFakeQuantize(observer=MovingAverageMinMaxObserver, quant_min=0, quant_max=255,
                                          dtype=torch.quint8, qscheme=torch.per_tensor_affine)
            for _ in range(n)
        )
        self.weights = nn.ModuleList(
            FusedMovingAvgObsFakeQuantize(observer=MovingAveragePerChannelMinMaxObserver, quant_min=-128,
                                          quant_max=127, dtype=torch.qint8, qscheme=torch.per_channel_symmetric,
                                          ch_axis=0)
            for _ in range(n)
        )

    def forward(self, x):
        for i, layer in enumerate(self.mlp.layers):
            x = F.linear(self.activations[i](x), self.weights[i](layer.weight), layer.bias)
            if i < len(self.mlp.layers) - 1:
                x = F.relu(x)
        return x


def qstats_qat(mlp: MLP):
    weight_spec = qstats.QuantSpec.from_torch_ao(torch.qint8, torch.per_channel_symmetric, ch_axis=0)
    activation_spec = qstats.QuantSpec.from_torch_ao(torch.quint8, torch.per_tensor_affine)
    return qstats.qat.prepare(
        mlp,
        weight_observer=qstats.moving_average_minmax(weight_spec, 0.01),
        activation_observer=qstats.moving_average_minmax(activation_spec, 0.01),
    )


def make_steps(sizes, batch, compile_):
    torch.manual_seed(0)
    x = torch.randn(batch, sizes[0])
    y = torch.randint(0, sizes[-1], (batch,))

    reference = TorchAoQAT(MLP(sizes))
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=1e-3)
    ref_loss = lambda x, y: F.cross_entropy(reference(x), y)  # noqa: E731
    if compile_:
        ref_loss = torch.compile(ref_loss)

    def ref_step():
        ref_optimizer.zero_grad(set_to_none=True)
        ref_loss(x, y).backward()
        ref_optimizer.step()

    mlp = MLP(sizes)
    qat = qstats_qat(mlp)
    params = qat.params()
    optimizer = torch.optim.SGD(params.values(), lr=1e-3)
    phase = qstats.QATPhase(observe=True, fake_quantize=True)
    holder = {"state": qat.init(x)}
    holder["state"] = qat.apply(params, holder["state"], x, phase=qstats.QATPhase(True, False))[1]

    def loss_fn(params, state, x, y):
        out, new_state = qat.apply(params, state, x, phase=phase)
        return F.cross_entropy(out, y), new_state

    if compile_:
        loss_fn = torch.compile(loss_fn, fullgraph=True)

    def qstats_step():
        optimizer.zero_grad(set_to_none=True)
        loss, holder["state"] = loss_fn(params, holder["state"], x, y)
        loss.backward()
        optimizer.step()

    return ref_step, qstats_step


def timeit(step, steps):
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps


def measure(ref_step, qstats_step, steps, rounds):
    for _ in range(3):  # warm-up (and compilation)
        ref_step()
        qstats_step()
    ref_times, qstats_times = [], []
    for _ in range(rounds):  # interleaved so that contention hits both alike
        ref_times.append(timeit(ref_step, steps))
        qstats_times.append(timeit(qstats_step, steps))
    ref, ours = statistics.median(ref_times), statistics.median(qstats_times)
    return ref, ours


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    configs = [((64, 256, 256, 10), 128), ((784, 1024, 1024, 10), 256)]
    modes = [False] if args.no_compile else [False, True]
    print(f"torch {torch.__version__}, {args.threads} thread(s); median of {args.rounds} rounds x {args.steps} steps\n")
    print("| MLP (batch) | mode | torch.ao fused step | qstats step | ratio qstats / torch.ao |")
    print("|---|---|---|---|---|")
    for sizes, batch in configs:
        for compile_ in modes:
            ref_step, qstats_step = make_steps(sizes, batch, compile_)
            ref, ours = measure(ref_step, qstats_step, args.steps, args.rounds)
            mode = "torch.compile" if compile_ else "eager"
            name = "-".join(map(str, sizes))
            print(f"| {name} ({batch}) | {mode} | {ref * 1e3:.3f} ms | {ours * 1e3:.3f} ms | {ours / ref:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
