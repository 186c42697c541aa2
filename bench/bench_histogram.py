"""Benchmark: qstats.histogram update and l2 search against torch.ao HistogramObserver.

Prints one markdown table row per measurement with the ratio (torch.ao time / qstats time),
both measured in this run on the same data (a 4096x1024 float32 tensor).

    python bench/bench_histogram.py [--repeats 20] [--dist gauss|t3]
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

import qstats

warnings.filterwarnings("ignore")


def _time(fn, repeats):
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--dist", default="gauss", choices=["gauss", "t3"])
    args = parser.parse_args()
    from torch.ao.quantization.observer import HistogramObserver

    torch.manual_seed(0)
    shape = (4096, 1024)
    if args.dist == "gauss":
        batches = [torch.randn(shape) * (1 + 0.05 * i) for i in range(4)]
    else:
        batches = [torch.distributions.StudentT(3.0).sample(shape) for _ in range(4)]
    spec = qstats.QuantSpec(dtype="uint8", mapping="asymmetric")
    obs = qstats.histogram(spec)
    update = obs.update

    reference = HistogramObserver()  # quint8, per_tensor_affine, 2048 bins
    reference(batches[0])
    state = obs.update(obs.init(batches[0]), batches[0])

    counter = iter(range(10**9))
    t_ref_update = _time(lambda: reference(batches[next(counter) % 4]), args.repeats)
    counter = iter(range(10**9))
    t_update = _time(lambda: update(state, batches[next(counter) % 4]), args.repeats)

    for x in batches:
        reference(x)
        state = obs.update(state, x)
    t_ref_search = _time(reference.calculate_qparams, args.repeats)
    t_search = _time(lambda: qstats.compute_qparams(state, spec, method="l2"), args.repeats)

    print(f"| benchmark ({args.dist}, 4096x1024 fp32, {torch.get_num_threads()} threads) | torch.ao | qstats | ratio |")
    print("| --- | --- | --- | --- |")
    print(f"| histogram update vs HistogramObserver.forward | {t_ref_update * 1e3:.2f} ms | {t_update * 1e3:.2f} ms | {t_ref_update / t_update:.1f}x |")
    print(f"| l2 search vs HistogramObserver.calculate_qparams | {t_ref_search * 1e3:.2f} ms | {t_search * 1e3:.2f} ms | {t_ref_search / t_search:.1f}x |")


if __name__ == "__main__":
    main()
