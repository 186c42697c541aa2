"""Peak memory and time of `qstats.calibrate_layerwise` on a Qwen3-MoE checkpoint larger than it.

Writes a random-weight Qwen3-MoE model (bf16, about 6.3 GB by default) as safetensors shards, one
decoder layer per shard with per-expert keys as transformers saves them, without ever holding the
whole model: the model is built on the meta device and each layer gets random tensors only while
its shard is written. A fresh Python process then calibrates it layer by layer (W8A8 min/max:
every Linear's and every expert's weights per channel, their inputs per tensor, the experts'
``down_proj.input``, all experts) on a few short random-token sequences, and reports its peak
resident memory (VmHWM of /proc/self/status) against the checkpoint size (target: at most 1/3) and the time.
The same process's resident memory after its imports is printed too (what any run costs). With
``--llmcompressor``, llm-compressor's sequential pipeline (which loads the whole model) calibrates
the same model in another fresh process, timed and measured the same way. The checkpoint is deleted
at the end unless ``--keep`` (a kept one is reused by the next run).

With ``--gptq``, the child runs `qstats.gptq_layerwise` (W4A16, all experts, the GPTQ'd weights
written to disk) and `qstats.export.compressed_tensors_layerwise` instead, and ``--llmcompressor``
llm-compressor's ``GPTQModifier`` with its sequential pipeline and compressed save.

With ``--gptq --ranks N``, `gptq_layerwise` also runs on N gloo ranks of one thread each (torchrun),
each rank calibrating its share of the sequences and GPTQ'ing its share of the weights.

Run:  python bench/bench_layerwise.py [--dir /tmp/qstats_bench_layerwise] [--layers 10] [--keep] [--llmcompressor]
      [--gptq [--ranks 2]]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time

import torch


def config(layers: int):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=32000, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=4, head_dim=128, num_experts=64, num_experts_per_tok=8,
        max_position_embeddings=4096, tie_word_embeddings=False, dtype="bfloat16",
    )  # fmt: skip


def _checkpoint_tensors(name: str, value: torch.Tensor) -> dict:
    """The checkpoint's tensors for one model tensor: stacked experts split per expert (gate_up_proj
    into gate_proj and up_proj), as transformers writes Qwen3-MoE checkpoints."""
    prefix, _, leaf = name.rpartition(".")
    if value.ndim == 3 and leaf == "gate_up_proj":
        half = value.shape[1] // 2
        return {
            f"{prefix}.{e}.{proj}.weight": value[e, rows].clone()
            for e in range(value.shape[0])
            for proj, rows in (("gate_proj", slice(None, half)), ("up_proj", slice(half, None)))
        }
    if value.ndim == 3 and leaf == "down_proj":
        return {f"{prefix}.{e}.down_proj.weight": value[e].clone() for e in range(value.shape[0])}
    return {name: value}


def _random_like(name: str, meta: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(meta.shape, dtype=torch.bfloat16)
    return (torch.randn(meta.shape, generator=generator) * 0.02).to(torch.bfloat16)


def build(directory: str, layers: int) -> int:
    """Writes the checkpoint under ``directory`` (one shard per layer, one for the rest); its bytes."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    cfg = config(layers)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    os.makedirs(directory, exist_ok=True)
    cfg.save_pretrained(directory)
    generator = torch.Generator().manual_seed(0)
    groups = [f"model.layers.{i}." for i in range(layers)] + [None]
    shards = len(groups)
    weight_map, total = {}, 0
    for index, prefix in enumerate(groups):
        tensors = {}
        for name, meta in model.named_parameters():
            inside = name.startswith(prefix) if prefix else not name.startswith("model.layers.")
            if inside:
                tensors.update(_checkpoint_tensors(name, _random_like(name, meta, generator)))
        shard = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        save_file(tensors, os.path.join(directory, shard), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update({key: shard for key in tensors})
        del tensors
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as file:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, file)
    return total


def _high_water_bytes() -> int:
    """This process's peak resident memory: VmHWM, not ``ru_maxrss`` (Linux carries a parent's
    peak at fork over ``exec`` into the child's ``ru_maxrss``, and the parent built the model)."""
    with open("/proc/self/status") as file:
        for line in file:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def calibrate(directory: str, sequences: int, tokens: int) -> dict:
    """Runs in the child process: the layer-by-layer calibration; its peak RSS and time."""
    import qstats
    from transformers import AutoConfig, AutoModelForCausalLM

    imported = _high_water_bytes()
    cfg = AutoConfig.from_pretrained(directory)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg).eval()
    w8 = qstats.QuantSpec(dtype="int8", mapping="symmetric", granularity=qstats.PerAxis(0))
    a8 = qstats.QuantSpec(dtype="int8", mapping="asymmetric")
    recipe = qstats.Recipe([
        qstats.Rule(("Linear", "Qwen3MoeExperts"), sites=("input", "down_proj.input"), spec=a8),
        qstats.Rule("Linear", sites=("weight",), spec=w8),
        qstats.Rule("Qwen3MoeExperts", sites=("gate_up_proj", "down_proj"), spec=w8),
    ])  # fmt: skip
    generator = torch.Generator().manual_seed(1)
    batches = [
        {"input_ids": torch.randint(0, cfg.vocab_size, (1, tokens), generator=generator)} for _ in range(sequences)
    ]
    from qstats.layerwise import calibrate_layerwise

    start = time.perf_counter()
    states = calibrate_layerwise(model, directory, batches, recipe, all_experts=True, progress=True)
    seconds = time.perf_counter() - start
    peak = _high_water_bytes()
    return {"peak_rss": peak, "rss_after_imports": imported, "seconds": seconds, "paths": len(states)}


def llmcompressor_sequential(directory: str, sequences: int, tokens: int) -> dict:
    """Runs in a child process: llm-compressor's sequential pipeline (``oneshot``) on the model
    loaded with ``from_pretrained`` (it holds the whole model), a static W8A8 scheme on every
    Linear (per-channel int8 weights, per-tensor int8 inputs), all experts; peak RSS and time."""
    import transformers
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    imported = _high_water_bytes()
    start = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype="auto").eval()
    loading = time.perf_counter() - start
    generator = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, model.config.vocab_size, (tokens,), generator=generator).tolist() for _ in range(sequences)]
    dataset = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * tokens for _ in ids]})
    scheme = {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
        "input_activations": {"num_bits": 8, "type": "int", "symmetric": False, "strategy": "tensor", "dynamic": False},
    }
    start = time.perf_counter()
    oneshot(model=model, dataset=dataset, recipe=QuantizationModifier(config_groups={"group_0": scheme}),
            pipeline="sequential", num_calibration_samples=sequences, max_seq_length=tokens,
            moe_calibrate_all_experts=True)  # fmt: skip
    seconds = time.perf_counter() - start
    return {"peak_rss": _high_water_bytes(), "rss_after_imports": imported, "seconds": seconds, "loading": loading}


MOE_IGNORE = ["lm_head", "re:.*mlp.gate$"]
MIN_EQUAL_CODES = 0.99  # bench/README.md: 99.52% of layer 0's q/k/v codes equal to llm-compressor's


def _batches(vocab_size: int, sequences: int, tokens: int) -> list:
    generator = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(0, vocab_size, (1, tokens), generator=generator)} for _ in range(sequences)]


def gptq(directory: str, sequences: int, tokens: int) -> dict:
    """Runs in the child process: `qstats.gptq_layerwise` (W4A16 from the scheme, all experts, the
    GPTQ'd weights written to disk as it goes), then `qstats.export.compressed_tensors_layerwise`
    into ``directory + "_qstats_w4a16"``; peak RSS and the time of each step."""
    import tempfile

    import qstats
    from transformers import AutoConfig, AutoModelForCausalLM

    imported = _high_water_bytes()
    ranked = "RANK" in os.environ  # started by torchrun (--ranks): each rank takes its share of the batches
    if ranked:
        torch.distributed.init_process_group("gloo")
    rank, world = (torch.distributed.get_rank(), torch.distributed.get_world_size()) if ranked else (0, 1)
    cfg = AutoConfig.from_pretrained(directory)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg).eval()
    recipe = qstats.Recipe.from_scheme("W4A16", ignore=MOE_IGNORE, experts="Qwen3MoeExperts",
                                       observed_dtype=torch.bfloat16)  # fmt: skip
    batches = _batches(cfg.vocab_size, sequences, tokens)[rank::world]
    with tempfile.TemporaryDirectory(dir=os.path.dirname(directory)) as weights_dir:
        start = time.perf_counter()
        result = qstats.gptq_layerwise(model, directory, batches, recipe, all_experts=True, weights_dir=weights_dir,
                                       all_reduce=ranked, progress=rank == 0)
        seconds = time.perf_counter() - start
        if ranked:
            torch.distributed.destroy_process_group()  # the export is rank 0's alone
        if rank != 0:
            return {}
        plan = recipe.resolve(model)
        start = time.perf_counter()
        qstats.export.compressed_tensors_layerwise(model, directory, qstats.compute_qparams_tree(result.states, plan),
                                                   directory + "_qstats_w4a16", plan, weights=result.weights)
        export = time.perf_counter() - start
    return {"peak_rss": _high_water_bytes(), "rss_after_imports": imported, "seconds": seconds, "export": export}


def llmcompressor_gptq(directory: str, sequences: int, tokens: int) -> dict:
    """Runs in a child process: llm-compressor's ``oneshot`` with ``GPTQModifier(scheme="W4A16")``
    and the sequential pipeline on the model loaded with ``from_pretrained``, all experts, then
    its compressed save into ``directory + "_llmcompressor_w4a16"``; peak RSS and times."""
    import transformers
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier

    imported = _high_water_bytes()
    start = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype="auto").eval()
    loading = time.perf_counter() - start
    ids = [batch["input_ids"][0].tolist() for batch in _batches(model.config.vocab_size, sequences, tokens)]
    dataset = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * tokens for _ in ids]})
    start = time.perf_counter()
    oneshot(model=model, dataset=dataset, recipe=GPTQModifier(targets="Linear", scheme="W4A16", ignore=MOE_IGNORE),
            pipeline="sequential", num_calibration_samples=sequences, max_seq_length=tokens,
            moe_calibrate_all_experts=True)  # fmt: skip
    seconds = time.perf_counter() - start
    start = time.perf_counter()
    model.save_pretrained(directory + "_llmcompressor_w4a16", save_compressed=True)
    export = time.perf_counter() - start
    return {"peak_rss": _high_water_bytes(), "rss_after_imports": imported, "seconds": seconds, "loading": loading,
            "export": export}


def same_codes(directory: str, names: list) -> float:
    """The fraction of equal int4 codes of ``names`` in the two GPTQ checkpoints."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from safetensors import safe_open

    def read(folder, key):
        shard = "model.safetensors"
        if os.path.exists(os.path.join(folder, "model.safetensors.index.json")):
            with open(os.path.join(folder, "model.safetensors.index.json")) as file:
                shard = json.load(file)["weight_map"][key]
        with safe_open(os.path.join(folder, shard), "pt") as file:
            return file.get_tensor(key)

    same = total = 0
    for name in names:
        codes = []
        for folder in (directory + "_qstats_w4a16", directory + "_llmcompressor_w4a16"):
            shape = tuple(read(folder, f"{name}.weight_shape").tolist())
            codes.append(unpack_from_int32(read(folder, f"{name}.weight_packed"), 4, shape))
        same += int((codes[0] == codes[1]).sum())
        total += codes[0].numel()
    return same / total


def _gptq_rows(args, size: int, result: dict, reference) -> float | None:
    """Prints the GPTQ table; the fraction of equal codes of layer 0's q/k/v (None without reference)."""
    gib = 1024**3
    print(f"| GPTQ W4A16 (all experts, {args.sequences} x {args.tokens} tokens) | qstats `gptq_layerwise` + "
          f"`compressed_tensors_layerwise` | llm-compressor sequential `GPTQModifier` + `save_pretrained` |")
    print("|---|---|---|")
    ours = f"{result['peak_rss'] / gib:.2f} GiB ({result['peak_rss'] / size:.3f} of the checkpoint)"
    theirs = "-" if reference is None else f"{reference['peak_rss'] / gib:.2f} GiB ({reference['peak_rss'] / size:.3f})"
    print(f"| peak RSS | {ours} | {theirs} |")
    theirs = "-" if reference is None else (f"{reference['loading']:.1f} s + {reference['seconds']:.1f} s + "
                                            f"{reference['export']:.1f} s")  # fmt: skip
    print(f"| time (load + calibrate and GPTQ + export) | - + {result['seconds']:.1f} s + {result['export']:.1f} s "
          f"| {theirs} |")
    if reference is not None:
        total = reference["loading"] + reference["seconds"] + reference["export"]
        print(f"| qstats time / llm-compressor time | {(result['seconds'] + result['export']) / total:.2f} | |")
        names = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
        equal = same_codes(args.dir, names)
        print(f"| equal codes, layer 0 q/k/v | {equal:.4%} | |")
        return equal
    return None


def _child(args, which: str, ranks: int = 1) -> dict:
    """Runs ``which`` in a fresh process (``ranks`` > 1: that many under torchrun, one thread each)
    and returns what it (rank 0) printed last."""
    child = [sys.executable, os.path.abspath(__file__), "--child", which, "--dir", args.dir,
             "--sequences", str(args.sequences), "--tokens", str(args.tokens)]  # fmt: skip
    if ranks > 1:
        child[1:1] = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
    output = subprocess.run(child, check=True, stdout=subprocess.PIPE, text=True).stdout
    return json.loads([line for line in output.strip().splitlines() if line.startswith("{")][-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/tmp/qstats_bench_layerwise")
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--sequences", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint (and reuse it next time)")
    parser.add_argument("--llmcompressor", action="store_true", help="also time llm-compressor's sequential pipeline")
    parser.add_argument("--gptq", action="store_true", help="GPTQ W4A16 and the export instead of W8A8 calibration")
    parser.add_argument("--ranks", type=int, default=1,
                        help="with --gptq: also run it on this many gloo ranks of one thread (torchrun)")
    parser.add_argument("--child", choices=tuple(CHILDREN), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        result = CHILDREN[args.child](args.dir, args.sequences, args.tokens)
        if result:  # ranks other than 0 report nothing
            print(json.dumps(result))
        return
    index = os.path.join(args.dir, "model.safetensors.index.json")
    start = time.perf_counter()
    if os.path.exists(index):
        with open(index) as file:
            size = json.load(file)["metadata"]["total_size"]
    else:
        size = build(args.dir, args.layers)
    built = time.perf_counter() - start
    ours, theirs = ("qstats_gptq", "llmcompressor_gptq") if args.gptq else ("qstats", "llmcompressor")
    try:
        result = _child(args, ours)
        reference = _child(args, theirs) if args.llmcompressor else None
        if args.gptq:
            equal = _gptq_rows(args, size, result, reference)
            if args.ranks > 1:
                shutil.rmtree(args.dir + "_qstats_w4a16")
                ranked = _child(args, ours, args.ranks)
                print(f"| {args.ranks} ranks, one thread each: calibrate and GPTQ | {ranked['seconds']:.1f} s "
                      f"({ranked['seconds'] / result['seconds']:.2f}x the one process's {result['seconds']:.1f} s); "
                      f"rank 0 peak RSS {ranked['peak_rss'] / 1024**3:.2f} GiB | |")
            assert equal is None or equal >= MIN_EQUAL_CODES, (
                f"layer 0 q/k/v codes equal to llm-compressor's: {equal:.4%} (at least {MIN_EQUAL_CODES:.0%})")
            return
    finally:
        for folder in ("", "_qstats_w4a16", "_llmcompressor_w4a16"):
            if folder or not args.keep:
                shutil.rmtree(args.dir + folder, ignore_errors=True)
    gib = 1024**3
    print(f"| checkpoint | {size / gib:.2f} GiB (bf16, {args.layers} layers, 64 experts; written in {built:.0f} s) |")
    print(f"| calibration | {args.sequences} x {args.tokens} tokens, all experts, {result['paths']} modules |")
    print(f"| peak RSS of the calibrating process | {result['peak_rss'] / gib:.2f} GiB |")
    print(f"| peak RSS / checkpoint size | {result['peak_rss'] / size:.3f} (target <= 0.333) |")
    print(f"| RSS after imports alone | {result['rss_after_imports'] / gib:.2f} GiB |")
    print(f"| calibration time | {result['seconds']:.1f} s ({result['seconds'] / args.layers:.1f} s per layer) |")
    if reference is not None:
        print(f"| llm-compressor sequential: peak RSS | {reference['peak_rss'] / gib:.2f} GiB "
              f"({reference['peak_rss'] / size:.3f} of the checkpoint) |")  # fmt: skip
        total = reference["seconds"] + reference["loading"]
        print(f"| llm-compressor sequential: time | {reference['seconds']:.1f} s, {total:.1f} s with from_pretrained "
              f"(qstats, which reads the checkpoint as it goes / llm-compressor with loading: "
              f"{result['seconds'] / total:.2f}) |")  # fmt: skip


CHILDREN = {"qstats": calibrate, "llmcompressor": llmcompressor_sequential, "qstats_gptq": gptq,
            "llmcompressor_gptq": llmcompressor_gptq}

if __name__ == "__main__":
    main()
