"""Start-up cost: ``import qstats`` after ``import torch``, and the native kernel's first use.

Each figure is the median of fresh interpreters, measured in this run beside the reference:
``import torch`` itself, in the same processes. The kernel's first use is measured twice per
run with a fresh cache directory: the first process builds it (C++ compiler), the next loads
the kept build. Prints markdown rows.

    python bench/bench_import.py [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

_PROBE = r"""
import json, sys, time
start = time.perf_counter()
import torch
after_torch = time.perf_counter()
import qstats
after_qstats = time.perf_counter()
from qstats import _native
built = _native.available()
after_build = time.perf_counter()
print(json.dumps({
    "torch": after_torch - start,
    "qstats": after_qstats - after_torch,
    "build": after_build - after_qstats,
    "built": built,
    "compiler_loaded": "torch._dynamo" in sys.modules,
}))
"""


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    runs = []
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, QSTATS_CACHE_DIR=os.path.join(cache, "qstats"))
            env.pop("QSTATS_NATIVE_CACHE", None)
            pair = []
            for _ in range(2):  # the first process builds and keeps the kernel, the second loads it
                done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True, env=env)
                pair.append(json.loads(done.stdout.strip().splitlines()[-1]))
            runs.append(pair)
    torch_time = statistics.median(p["torch"] for pair in runs for p in pair)
    qstats_time = statistics.median(p["qstats"] for pair in runs for p in pair)
    build_time = statistics.median(pair[0]["build"] for pair in runs)
    load_time = statistics.median(pair[1]["build"] for pair in runs)
    built = all(p["built"] for pair in runs for p in pair)
    print("| start-up step | median of runs | reference: `import torch` | ratio |")
    print("|---|---|---|---|")
    print(f"| `import qstats` after `import torch` | {qstats_time:.2f} s | {torch_time:.2f} s | {qstats_time / torch_time:.2f}x |")
    print(f"| native kernel, first use on a machine (C++ build{'' if built else '; no compiler: not built'}) "
          f"| {build_time:.2f} s | {torch_time:.2f} s | {build_time / torch_time:.2f}x |")
    print(f"| native kernel, first use in a later process (kept build) | {load_time * 1e3:.1f} ms | {torch_time:.2f} s "
          f"| {load_time / torch_time:.3f}x |")
    loaded = any(p["compiler_loaded"] for pair in runs for p in pair)
    print(f"compiler (torch._dynamo) loaded by import qstats: {loaded}; {args.runs} runs")


if __name__ == "__main__":
    main()
