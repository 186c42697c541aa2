"""Start-up cost: ``import qstats`` after ``import torch``.

Each figure is the median of fresh interpreters, measured in this run beside the reference:
``import torch`` itself, in the same processes. Also says whether ``import qstats`` loads the
compiler (``torch._dynamo``), which would add to every user's start-up. Prints markdown rows.

    python bench/bench_import.py [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

_PROBE = r"""
import json, sys, time
start = time.perf_counter()
import torch
after_torch = time.perf_counter()
compiler_before = "torch._dynamo" in sys.modules
import qstats
after_qstats = time.perf_counter()
print(json.dumps({
    "torch": after_torch - start,
    "qstats": after_qstats - after_torch,
    "compiler_loaded": "torch._dynamo" in sys.modules and not compiler_before,
}))
"""


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    runs = []
    for _ in range(args.runs):
        done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True)
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    torch_time = statistics.median(run["torch"] for run in runs)
    qstats_time = statistics.median(run["qstats"] for run in runs)
    print("| start-up step | median of runs | reference: `import torch` | ratio |")
    print("|---|---|---|---|")
    print(f"| `import qstats` after `import torch` | {qstats_time:.2f} s | {torch_time:.2f} s | {qstats_time / torch_time:.2f}x |")
    loaded = any(run["compiler_loaded"] for run in runs)
    print(f"compiler (torch._dynamo) loaded by import qstats: {loaded}; {args.runs} runs")


if __name__ == "__main__":
    main()
