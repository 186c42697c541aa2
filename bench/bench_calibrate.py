"""How much a `qstats.calibrate` pass adds to the plain forward passes over all-MiniLM-L6-v2.

Both are measured in the same run, interleaved, on the same calibration batches (standard-library
docstring sentences, as in examples/quantize_minilm.py): the plain loop ``model(**batch)`` under
``torch.no_grad()``, and ``qstats.calibrate`` with a W8A8 recipe (every Linear's weight, observed
once, and input, masked by the attention mask). The best of several repetitions of each is kept
(the machine is shared, so the minimum is the least noisy estimate). By default torch runs one
thread and the CPU time of that thread is measured (``time.thread_time``), which other programs
on a busy machine disturb much less than wall-clock time; ``--wall`` measures wall-clock time.
Prints markdown rows.

Run:  python bench/bench_calibrate.py [--repeats 5] [--sentences 256]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

import qstats  # noqa: E402
from quantize_minilm import VARIANTS, attention_mask, load_minilm, make_batches, stdlib_sentences  # noqa: E402


def main(argv=None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sentences", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--wall", action="store_true", help="measure wall-clock instead of CPU time")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.wall else time.thread_time

    tokenizer, model = load_minilm()
    batches = make_batches(tokenizer, stdlib_sentences()[: args.sentences], args.batch_size)
    recipes = {name: VARIANTS[name] for name in ("minmax (per-tensor W)", "moving_average_minmax c=0.1 (per-channel W)")}

    def forward():
        with torch.no_grad():
            for batch in batches:
                model(**batch)

    def calibrate(recipe):
        return lambda: qstats.calibrate(model, batches, recipe, progress=False, observation_weight=attention_mask)

    first = next(iter(recipes.values()))

    def session_per_batch():  # the user drives the forward inside qstats.observing
        with qstats.observing(model, first) as session, torch.no_grad():
            for batch in batches:
                with session.weighted(attention_mask(batch)):
                    model(**batch)
        return session.states

    def calibrate_per_batch():  # one calibrate call per batch, resuming from the states
        states = None
        for batch in batches:
            states = qstats.calibrate(model, [batch], first, states, progress=False, observation_weight=attention_mask)
        return states

    runs = {"forward": forward, **{name: calibrate(recipe) for name, recipe in recipes.items()},
            "session": session_per_batch, "per_batch": calibrate_per_batch}
    best = {name: float("inf") for name in runs}
    for function in runs.values():
        function()  # warm-up
    for _ in range(args.repeats):
        for name, function in runs.items():
            gc.disable()  # as timeit does
            try:
                start = clock()
                function()
                best[name] = min(best[name], clock() - start)
            finally:
                gc.enable()

    print(f"MiniLM, {len(batches)} batches of {args.batch_size} sentences, best of {args.repeats}, "
          f"{torch.get_num_threads()} thread(s), {'wall-clock' if args.wall else 'CPU'} time")
    print()
    print("| recipe | plain forward (s) | qstats.calibrate (s) | ratio calibrate / forward |")
    print("| --- | --- | --- | --- |")
    worst = 0.0
    for name in recipes:
        ratio = best[name] / best["forward"]
        worst = max(worst, ratio)
        print(f"| W8A8 {name} | {best['forward']:.3f} | {best[name]:.3f} | {ratio:.2f}x |")
    name = next(iter(recipes))
    print()
    print(f"Batch by batch, W8A8 {name}, against one `qstats.calibrate` call over the same batches:")
    print()
    print("| driving the forward | time (s) | ratio to one calibrate call |")
    print("| --- | --- | --- |")
    for label, key in (("`qstats.observing` session, user's loop", "session"), ("`qstats.calibrate` per batch (resume)", "per_batch")):
        print(f"| {label} | {best[key]:.3f} | {best[key] / best[name]:.2f}x |")
    return worst


if __name__ == "__main__":
    main()
