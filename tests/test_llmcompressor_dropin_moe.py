"""The qstats drop-in observers under llm-compressor's own ``oneshot`` on tiny random MoE models
(Qwen3-MoE, Mixtral, DeepSeek-V3; llm-compressor 0.14 linearizes their stacked experts into
per-expert Linears and, by default, sends every token through every expert): the same recipe with
llm-compressor's observers and with the qstats ones writes byte-identical checkpoints (same keys,
tensors bit for bit, ``quantization_config`` equal but for the observer names), for W8A8, FP8,
NVFP4 (static inputs), an mse weight observer and GPTQ (basic and sequential pipelines, float32
and bfloat16), and under DDP (forked gloo ranks) with experts no rank saw. Where they differ, the
tests pin down how."""

import json
import os
import re
import warnings

import pytest
import torch
from _shared import bit_equal, fork_ranks, gloo_group, llm_compressor_oneshot

pytest.importorskip("llmcompressor")
transformers = pytest.importorskip("transformers")
pytest.importorskip("qstats.llmcompressor")  # registers the qstats_* observers
from compressed_tensors.quantization.quant_scheme import FP8, INT8_W8A8, NVFP4, W4A16  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from test_export_moe_linearized import _saved  # noqa: E402

FAMILIES = ("qwen3_moe", "mixtral", "deepseek_v3")
STATIC_W8A8 = {"weights": INT8_W8A8["weights"],
               "input_activations": INT8_W8A8["input_activations"].model_copy(
                   update={"strategy": "tensor", "dynamic": False, "symmetric": False})}
W4_GROUP16 = {"weights": W4A16["weights"].model_copy(update={"group_size": 16})}  # hidden 64: groups of 16
# case: (scheme, modifier, llm-compressor's (weight, input) observers, the qstats ones)
CASES = {
    "w8a8": (STATIC_W8A8, "QuantizationModifier", ("memoryless_minmax", "minmax"),
             ("qstats_memoryless_minmax", "qstats_minmax")),
    "fp8": (FP8, "QuantizationModifier", ("memoryless_minmax", "minmax"),
            ("qstats_memoryless_minmax", "qstats_minmax")),
    "nvfp4": (NVFP4, "QuantizationModifier", ("memoryless_minmax", "static_minmax"),
              ("qstats_memoryless_minmax", "qstats_static_minmax")),
    "mse": ({"weights": INT8_W8A8["weights"]}, "QuantizationModifier", ("memoryless_mse", None), ("qstats_mse", None)),
    "gptq": (W4_GROUP16, "GPTQModifier", ("memoryless_minmax", None), ("qstats_memoryless_minmax", None)),
    "gptq-mse": (W4_GROUP16, "GPTQModifier", ("memoryless_mse", None), ("qstats_mse", None)),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``{family: folder}`` of the tiny random float models, written once."""
    folders = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for family in FAMILIES:
            folders[family] = str(tmp_path_factory.mktemp(family))
            _saved(family, folders[family])
    return folders


def _samples(count=3):
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(1, 128, (12,), generator=generator) for _ in range(count)]


def _load(folder, dtype=torch.float32):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()


def _recipe(case, observers):
    from llmcompressor.modifiers import quantization

    scheme, modifier, *_ = CASES[case]
    group = {"targets": ["Linear"]}
    for key, observer in zip(("weights", "input_activations"), observers):
        if key in scheme:
            group[key] = scheme[key].model_copy(update={"observer": observer}).model_dump()
    return getattr(quantization, modifier)(config_groups={"group_0": group}, ignore=["lm_head"])


def _oneshot(folder, out, case, observers, dtype=torch.float32, samples=None, model=None, **options):
    model = model if model is not None else _load(folder, dtype)
    llm_compressor_oneshot(model, samples or _samples(), _recipe(case, observers), out, **options)
    return str(out)


def _config(folder):
    with open(os.path.join(folder, "config.json")) as file:
        config = json.load(file)["quantization_config"]
    for group in config["config_groups"].values():
        for args in group.values():
            if isinstance(args, dict):
                args.pop("observer", None)  # the one field that names the observers
    return config


def _differing(theirs, ours):
    """The names of the tensors that differ (the keys must be the same); the configs must match."""
    a, b = load_file(os.path.join(theirs, "model.safetensors")), load_file(os.path.join(ours, "model.safetensors"))
    assert sorted(a) == sorted(b)
    assert _config(theirs) == _config(ours)
    return [name for name in sorted(a) if not bit_equal(a[name], b[name])]


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("family", FAMILIES)
def test_moe_oneshot_with_qstats_observers_writes_llm_compressors_checkpoint(saved, tmp_path, family, case,
                                                                             single_thread_quiet):
    theirs = _oneshot(saved[family], tmp_path / "theirs", case, CASES[case][2])
    ours = _oneshot(saved[family], tmp_path / "ours", case, CASES[case][3])
    assert _differing(theirs, ours) == []
    with open(os.path.join(ours, "config.json")) as file:
        group = json.load(file)["quantization_config"]["config_groups"]["group_0"]
    assert group["weights"]["observer"] == CASES[case][3][0]  # the qstats observers did calibrate


@pytest.mark.parametrize("case", ["w8a8", "nvfp4", "gptq-mse"])
def test_sequential_pipeline_moe_checkpoint_is_llm_compressors(saved, tmp_path, case, single_thread_quiet):
    theirs = _oneshot(saved["qwen3_moe"], tmp_path / "theirs", case, CASES[case][2], pipeline="sequential")
    ours = _oneshot(saved["qwen3_moe"], tmp_path / "ours", case, CASES[case][3], pipeline="sequential")
    assert _differing(theirs, ours) == []


@pytest.mark.parametrize("case", ["w8a8", "fp8", "mse"])
def test_bfloat16_moe_checkpoint_is_llm_compressors(saved, tmp_path, case, single_thread_quiet):
    """A bfloat16 model: qparams computed in bfloat16 as compressed-tensors computes them."""
    theirs = _oneshot(saved["qwen3_moe"], tmp_path / "theirs", case, CASES[case][2], torch.bfloat16)
    ours = _oneshot(saved["qwen3_moe"], tmp_path / "ours", case, CASES[case][3], torch.bfloat16)
    assert _differing(theirs, ours) == []


def test_nvfp4_qstats_minmax_inputs_of_linearized_experts_equal_llm_compressors(saved, tmp_path, single_thread_quiet):
    """NVFP4 inputs under ``minmax``: llm-compressor averages each group's extremes of a 3-D input and the
    tensor's extremes of a linearized expert's 2-D rows (its view has no group dimension there), and so does
    ``qstats_minmax`` (it averaged each group's there too: the experts' input global scales differed)."""
    theirs = _oneshot(saved["qwen3_moe"], tmp_path / "theirs", "nvfp4", ("memoryless_minmax", "minmax"))
    ours = _oneshot(saved["qwen3_moe"], tmp_path / "ours", "nvfp4", ("qstats_memoryless_minmax", "qstats_minmax"))
    assert _differing(theirs, ours) == []


def _routed_experts(model):
    """Forward hooks on each MoE layer's router recording ``{(layer, expert)}`` it sends a token to
    (the routers return their top-k indices last)."""
    routed = set()
    for index, layer in enumerate(model.model.layers):
        def record(module, args, output, index=index):
            routed.update((index, int(e)) for e in output[-1].flatten())

        layer.mlp.gate.register_forward_hook(record)
    return routed


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_experts_without_tokens_differ_only_in_llm_compressors_uninitialized_input_scales(saved, tmp_path, family,
                                                                                          single_thread_quiet):
    """``moe_calibrate_all_experts=False`` and two tokens: most experts see no token. Their input
    observers have no statistics, so llm-compressor skips them whatever the observer (a warning) and
    writes the input scale compressed-tensors allocated with ``torch.empty``: arbitrary bytes, which
    differ between any two runs. Everything else is bit for bit, the routed experts' scales included."""
    model = _load(saved[family])
    routed = _routed_experts(model)
    few = [torch.tensor([5, 9])]
    theirs = _oneshot(saved[family], tmp_path / "theirs", "w8a8", CASES["w8a8"][2], samples=few, model=model,
                      moe_calibrate_all_experts=False)
    ours = _oneshot(saved[family], tmp_path / "ours", "w8a8", CASES["w8a8"][3], samples=few,
                    moe_calibrate_all_experts=False)
    experts = model.config.num_local_experts if family == "mixtral" else model.config.num_experts
    unrouted = {(layer, e) for layer in range(2) for e in range(experts)} - routed
    assert routed and unrouted
    for name in _differing(theirs, ours):  # Mixtral's checkpoint names its MoE block block_sparse_moe
        match = re.fullmatch(r"model\.layers\.(\d+)\.\w+\.experts\.(\d+)\.(gate|up|down)_proj\.input_scale", name)
        assert match and (int(match[1]), int(match[2])) in unrouted, name


# --- distributed: experts no rank routed a token to -------------------------------------------


def _experts_rank(rank, port, out):
    """One forked rank: three experts' input observers (llm-compressor's and qstats' static and
    moving-average min/max); expert 0 sees one batch on rank 0 and two on rank 1, expert 1 none on
    any rank (no token routed to it), expert 2 one on each; then llm-compressor's own
    ``sync_obs_act_stats`` over them. Saves each observer's qparams (None: no statistics)."""
    from compressed_tensors.quantization import QuantizationArgs
    from llmcompressor.modifiers.quantization.quantization.mixin import QuantizationMixin
    from llmcompressor.observers import Observer

    args = QuantizationArgs(num_bits=8, symmetric=False, strategy="tensor", dynamic=False)
    generator = torch.Generator().manual_seed(20 + rank)
    data = {0: [torch.randn(1, 3 + rank, 64, generator=generator) * (1 + 2 * rank) for _ in range(1 + rank)], 1: [],
            2: [torch.randn(1, 2, 64, generator=generator) - rank]}
    results = {}
    with gloo_group(rank, port):
        for name in ("static_minmax", "qstats_static_minmax", "minmax", "qstats_minmax"):
            experts = [torch.nn.Linear(64, 8) for _ in data]
            for index, expert in enumerate(experts):
                expert.input_observer = Observer.load_from_registry(name, base_name="input",
                                                                    args=args.model_copy(deep=True))
                for x in data[index]:
                    expert.input_observer(x)
            try:
                QuantizationMixin.sync_obs_act_stats(None, experts)  # uses no field of the modifier
            except ValueError as error:
                results[name] = str(error)
                continue
            results[name] = [e.input_observer.get_qparams() if e.input_observer.has_statistics else None
                             for e in experts]
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))


def test_ddp_sync_leaves_experts_no_rank_saw_without_statistics_as_llm_compressor(tmp_path):
    """``moe_calibrate_all_experts=False`` under DDP: an expert no rank routed a token to has no
    statistics on any rank; llm-compressor's ``static_minmax`` skips it in the sync (and warns at
    ``update_qparams``), the qstats observer did the same (it raised on every rank, aborting the run);
    the other experts' qparams are llm-compressor's merged ones bit for bit."""
    assert fork_ranks(_experts_rank, str(tmp_path)) == [0, 0]
    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        theirs, ours = results["static_minmax"], results["qstats_static_minmax"]
        assert not isinstance(ours, str), ours
        assert theirs[1] is None and ours[1] is None
        for want, got in zip(theirs[::2], ours[::2]):
            assert bit_equal(got["scale"], want["scale"]) and bit_equal(got["zero_point"], want["zero_point"])




def test_ddp_moving_average_merge_weighs_ranks_by_their_batches(tmp_path):
    """``minmax`` under DDP: llm-compressor all-reduces the ranks' moving averages with ``AVG``, one
    weight per rank; ``qstats_minmax`` merges them weighted by each rank's batch count (documented).
    Equal counts on two ranks (expert 2): bit for bit; rank 1 with two batches to rank 0's one
    (expert 0): they differ. Experts no rank saw: without statistics in both."""
    assert fork_ranks(_experts_rank, str(tmp_path)) == [0, 0]
    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        theirs, ours = results["minmax"], results["qstats_minmax"]
        assert theirs[1] is None and ours[1] is None
        assert bit_equal(ours[2]["scale"], theirs[2]["scale"])
        assert bit_equal(ours[2]["zero_point"], theirs[2]["zero_point"])
        assert not bit_equal(ours[0]["scale"], theirs[0]["scale"])
