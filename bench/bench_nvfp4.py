"""NVFP4 qparams + fake-quant of a 4096x4096 weight: qstats vs torchao's NVFP4 path (same run).

qstats: ``minmax`` observe -> ``compute_qparams`` (per-16 e4m3 block scales under the fp32
global scale) -> ``fake_quantize``. torchao: ``per_tensor_amax_to_scale(amax)`` ->
``NVFP4Tensor.to_nvfp4`` -> ``dequantize``. Both produce bit-identical outputs (checked here).
Prints a markdown table row; the ratio is qstats time / torchao time (lower is better).

    python bench/bench_nvfp4.py [--size 4096] [--repeats 7] [--threads N]
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

import qstats


def _best_interleaved(fns, repeats):
    """Best time of each function over ``repeats`` rounds that alternate between them, so that
    load from other processes hits both alike."""
    for fn in fns:
        fn()  # warm-up
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads for both libraries")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

    torch.manual_seed(0)
    w = torch.randn(args.size, args.size)
    spec = qstats.QuantSpec.from_torchao(nvfp4=True)
    obs = qstats.minmax(spec)

    def run_qstats():
        state = obs.update(obs.init(w), w)
        qp = qstats.compute_qparams(state, spec)
        return qstats.fake_quantize(w, qp, spec)

    def run_torchao():
        scale = per_tensor_amax_to_scale(torch.amax(torch.abs(w)))
        return NVFP4Tensor.to_nvfp4(w, per_tensor_scale=scale).dequantize(torch.float32)

    same = torch.equal(run_qstats(), run_torchao())
    t_qstats, t_torchao = _best_interleaved([run_qstats, run_torchao], args.repeats)
    print("| benchmark | qstats (ms) | torchao (ms) | ratio qstats/torchao | bit-identical |")
    print("| --- | --- | --- | --- | --- |")
    print(
        f"| NVFP4 qparams + fake-quant {args.size}x{args.size} (CPU, {torch.get_num_threads()} threads) "
        f"| {t_qstats * 1e3:.1f} | {t_torchao * 1e3:.1f} | {t_qstats / t_torchao:.2f} | {same} |"
    )
    assert same, "qstats' NVFP4 fake-quantized weight is not bit-identical to torchao's"


if __name__ == "__main__":
    main()
