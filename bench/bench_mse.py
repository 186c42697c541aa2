"""Benchmark: qstats.mse against llm-compressor's memoryless_mse on a 512x4096 weight (default).

Same grid (maxshrink 0.2, grid 100: 20 candidates), int4 symmetric per channel, early stopping
disabled on both (qstats accumulates every candidate's loss; llm-compressor's default patience of
5 is measured too). Prints markdown rows with the ratio llm-compressor time / qstats time, both
measured in this run.

    python bench/bench_mse.py [--rows 512] [--cols 4096] [--repeats 3] [--threads N]
"""

from __future__ import annotations

import argparse
import warnings

import torch

import qstats
from _timing import best_time as _time

warnings.filterwarnings("ignore")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads for both libraries")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    from compressed_tensors.quantization import QuantizationArgs
    from llmcompressor.observers import Observer

    torch.manual_seed(0)
    weight = torch.randn(args.rows, args.cols) * 0.02

    def llmc(patience):
        qargs = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="channel",
                                 observer="memoryless_mse", observer_kwargs={"patience": patience})
        observer = Observer.load_from_registry("memoryless_mse", base_name="weight", args=qargs)
        observer(weight)
        return observer.get_qparams()["scale"], qargs

    _, qargs = llmc(10**6)
    spec = qstats.QuantSpec.from_compressed_tensors(qargs)
    obs = qstats.mse(spec)

    def ours():
        return qstats.compute_qparams(obs.update(obs.init(weight), weight), spec)

    t_ref = _time(lambda: llmc(10**6), args.repeats)
    t_ref_patience = _time(lambda: llmc(5), args.repeats)
    t_ours = _time(ours, args.repeats)
    same = torch.equal(ours().scale, llmc(10**6)[0].reshape(-1))
    shape = f"{args.rows}x{args.cols}"
    print(f"| benchmark ({shape} fp32 weight, int4 channel, 20 candidates, {torch.get_num_threads()} threads) | llm-compressor | qstats | ratio |")
    print("| --- | --- | --- | --- |")
    print(f"| qstats.mse vs memoryless_mse, no early stop (same choice: {same}) | {t_ref * 1e3:.0f} ms | {t_ours * 1e3:.0f} ms | {t_ref / t_ours:.2f}x |")
    print(f"| qstats.mse vs memoryless_mse, patience 5 | {t_ref_patience * 1e3:.0f} ms | {t_ours * 1e3:.0f} ms | {t_ref_patience / t_ours:.2f}x |")
    assert same, "qstats.mse chose other scales than llm-compressor's memoryless_mse"


if __name__ == "__main__":
    main()
