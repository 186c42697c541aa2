"""Quantization-aware training of a character-level model on Python's own source, with pure qstats states.

The task ships offline: next-character prediction over a few modules of the running Python's
standard library (90% of the text for training, every context of the last 10% for testing). The
model embeds a 12-character context and applies three Linear layers. On held-out text we compare:

- float32, and float32 trained for as many extra steps as QAT (what the extra steps alone give);
- post-training quantization (PTQ) at int8 and int4: weights symmetric, per output channel or per
  tensor; activations (the input of every Linear) asymmetric, per tensor, ranges observed on 20
  training batches;
- QAT at int4 from the float weights, with a `qstats.QATSchedule` (observe -> observe and
  fake-quantize -> freeze ranges), trained with ``torch.func.grad`` over the pure
  ``qat.apply(params, state, x, phase=...)``: the observer states are explicit inputs and outputs;
- with ``--lsq``, LSQ/LSQ+ fine-tuning of the weight and activation ranges, initialised from the
  frozen observer states.

Run: ``python examples/qat_charlm.py`` (about a minute of CPU, one thread). Prints a markdown table. The figures
depend on the Python version whose source is read.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import qstats

SEED = 0
CONTEXT = 12
BATCH = 256
FLOAT_STEPS = 3000
QAT_STEPS = 1000
LSQ_STEPS = 300
QAT_LR = 3e-4
LSQ_LR = 1e-4
FILES = ("argparse.py", "textwrap.py", "inspect.py", "dataclasses.py", "typing.py", "functools.py", "pathlib.py", "enum.py")
CHARS = [chr(i) for i in range(32, 127)] + ["\n"]  # anything else maps to " "


def load_text():
    directory = os.path.dirname(os.__file__)
    text = "".join(open(os.path.join(directory, name), encoding="utf-8").read() for name in FILES)
    lookup = {c: i for i, c in enumerate(CHARS)}
    ids = torch.tensor([lookup.get(c, 0) for c in text])
    split = int(0.9 * len(ids))
    return ids[:split], ids[split:]


def all_windows(ids):
    """Every (context, next character) pair of ``ids`` (the test set)."""
    w = ids.unfold(0, CONTEXT + 1, 1)
    return w[:, :CONTEXT], w[:, CONTEXT]


def windows(ids, count, generator):
    """``count`` random (context, next character) pairs from ``ids``."""
    start = torch.randint(0, len(ids) - CONTEXT - 1, (count,), generator=generator)
    w = ids[start[:, None] + torch.arange(CONTEXT + 1)]
    return w[:, :CONTEXT], w[:, CONTEXT]


class CharModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(len(CHARS), 16)
        self.fc1 = nn.Linear(16 * CONTEXT, 256)
        self.fc2 = nn.Linear(256, 128)
        self.out = nn.Linear(128, len(CHARS))

    def forward(self, x):
        h = self.embed(x).flatten(1)
        return self.out(F.relu(self.fc2(F.relu(self.fc1(h)))))


def cosine(optimizer, steps):
    return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)


def train_float(model, train_ids, steps, generator, lr=3e-3):
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    decay = cosine(optimizer, steps)
    for _ in range(steps):
        xb, yb = windows(train_ids, BATCH, generator)
        optimizer.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        optimizer.step()
        decay.step()


def observers(bits, weight_granularity):
    weight_spec = qstats.QuantSpec(f"int{bits}", "symmetric", granularity=weight_granularity)
    activation_spec = qstats.QuantSpec(f"uint{bits}", "asymmetric")
    return qstats.memoryless_minmax(weight_spec), qstats.moving_average_minmax(activation_spec, 0.05)


EVAL = qstats.QATPhase(observe=False, fake_quantize=True)


def accuracy(logits, test):
    return (logits.argmax(-1) == test[1]).float().mean().item()


def evaluate(qat, params, state, test, ranges=None):
    with torch.no_grad():
        out, _ = qat.apply(params, state, test[0], phase=EVAL, ranges=ranges)
    return accuracy(out, test)


def ptq(model, bits, granularity, train_ids, test, generator, batches=20):
    qat = qstats.qat.prepare(model, *observers(bits, granularity))
    params = qat.params()
    state = qat.init(test[0][:1])
    observe = qstats.QATPhase(observe=True, fake_quantize=False)
    with torch.no_grad():
        for _ in range(batches):
            _, state = qat.apply(params, state, windows(train_ids, BATCH, generator)[0], phase=observe)
    return evaluate(qat, params, state, test)


def loss_fn(qat):
    def loss(params, state, x, y, phase, ranges=None):
        out, new_state = qat.apply(params, state, x, phase=phase, ranges=ranges)
        return F.cross_entropy(out, y), new_state

    return loss


def qat_train(model, bits, granularity, train_ids, test, generator):
    qat = qstats.qat.prepare(model, *observers(bits, granularity))
    params = {k: v.detach().clone().requires_grad_(True) for k, v in qat.params().items()}
    state = qat.init(test[0][:1])
    schedule = qstats.QATSchedule(observe_at=0, fake_quantize_at=50, freeze_ranges_at=int(0.7 * QAT_STEPS))
    grad_fn = torch.func.grad(loss_fn(qat), has_aux=True)
    optimizer = torch.optim.Adam(params.values(), lr=QAT_LR)
    decay = cosine(optimizer, QAT_STEPS)
    for step in range(QAT_STEPS):
        xb, yb = windows(train_ids, BATCH, generator)
        grads, state = grad_fn(params, state, xb, yb, schedule(step))
        for name, grad in grads.items():
            params[name].grad = grad
        optimizer.step()
        decay.step()
    return qat, params, state


def lsq_finetune(qat, params, state, train_ids, generator):
    """LSQ/LSQ+: learn the ranges (weights: scale; activations: scale and zero point) and keep
    training the weights."""
    ranges = qat.learnable_ranges(state, weights=True, activations=True)
    range_tensors = [t for kind in ranges.values() for point in kind.values() for t in point]
    grad_fn = torch.func.grad(loss_fn(qat), argnums=(0, 5), has_aux=True)
    optimizer = torch.optim.Adam([{"params": list(params.values()), "lr": QAT_LR}, {"params": range_tensors, "lr": LSQ_LR}])
    decay = cosine(optimizer, LSQ_STEPS)
    for _ in range(LSQ_STEPS):
        xb, yb = windows(train_ids, BATCH, generator)
        (grads, range_grads), state = grad_fn(params, state, xb, yb, EVAL, ranges)
        for name, grad in grads.items():
            params[name].grad = grad
        for kind, points in ranges.items():
            for key, point in points.items():
                for tensor, grad in zip(point, range_grads[kind][key]):
                    tensor.grad = grad
        optimizer.step()
        decay.step()
    return ranges


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lsq", action="store_true", help="also fine-tune LSQ/LSQ+ ranges after QAT")
    args = parser.parse_args()
    torch.set_num_threads(1)  # tiny matrices: threads only contend
    torch.manual_seed(SEED)
    start = time.process_time()
    train_ids, test_ids = load_text()
    test = all_windows(test_ids)
    model = CharModel()
    print(f"training the float model ({FLOAT_STEPS} + {QAT_STEPS} steps), then PTQ and QAT per row ...", flush=True)
    train_float(model, train_ids, FLOAT_STEPS, torch.Generator().manual_seed(SEED))
    with torch.no_grad():
        float_accuracy = accuracy(model(test[0]), test)
    longer = copy.deepcopy(model)
    train_float(longer, train_ids, QAT_STEPS, torch.Generator().manual_seed(SEED + 1), lr=QAT_LR)
    with torch.no_grad():
        longer_accuracy = accuracy(longer(test[0]), test)
    print(
        f"Next-character accuracy on held-out Python {sys.version.split()[0]} standard-library source "
        f"({len(train_ids)} training characters, {len(test[1])} test contexts of {CONTEXT} characters).\n"
        f"float32: {100 * float_accuracy:.1f}% ({FLOAT_STEPS} steps); trained {QAT_STEPS} more steps in float "
        f"(as long as QAT): {100 * longer_accuracy:.1f}%.\n"
        "Weights: symmetric int, per channel or per tensor; activations (inputs of every Linear): "
        "asymmetric uint, per tensor.\n"
    )
    header = "| weights | PTQ int8 | PTQ int4 | QAT int4 | PTQ int4 loss recovered by QAT |"
    if args.lsq:
        header += " QAT int4 + LSQ/LSQ+ |"
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    for label, granularity in (("per channel", qstats.PerAxis(0)), ("per tensor", qstats.PerTensor())):
        ptq8 = ptq(model, 8, granularity, train_ids, test, torch.Generator().manual_seed(SEED + 2))
        ptq4 = ptq(model, 4, granularity, train_ids, test, torch.Generator().manual_seed(SEED + 2))
        qat, params, state = qat_train(copy.deepcopy(model), 4, granularity, train_ids, test,
                                       torch.Generator().manual_seed(SEED + 1))
        qat4 = evaluate(qat, params, state, test)
        recovered = (qat4 - ptq4) / max(float_accuracy - ptq4, 1e-9)
        row = f"| {label} | {100 * ptq8:.1f}% | {100 * ptq4:.1f}% | {100 * qat4:.1f}% | {100 * recovered:.0f}% |"
        if args.lsq:
            ranges = lsq_finetune(qat, params, state, train_ids, torch.Generator().manual_seed(SEED + 3))
            row += f" {100 * evaluate(qat, params, state, test, ranges):.1f}% |"
        print(row, flush=True)
    print(f"\n({time.process_time() - start:.0f} s of CPU)")


if __name__ == "__main__":
    main()
