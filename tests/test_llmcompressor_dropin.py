"""qstats.llmcompressor against llm-compressor 0.14 itself: the moving average bit for bit, each
registered observer's qparams against its llm-compressor counterpart, and llm-compressor's own
``oneshot`` on a tiny random Llama whose checkpoint is byte-identical with qstats' min/max
observers and loads and runs with the histogram and mse ones."""

import dataclasses
import json
import os
import warnings

import pytest
import torch
from _oneshot import saved_random_model, token_samples
from _shared import bit_equal, fork_ranks, llm_compressor_oneshot, word_tokenizer

import qstats

pytest.importorskip("llmcompressor")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
import qstats.llmcompressor  # noqa: E402,F401  (registers the qstats_* observers)
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402
from compressed_tensors.quantization.quant_scheme import FP8, INT8_W8A8, NVFP4, W4A16  # noqa: E402
from llmcompressor.observers import Observer  # noqa: E402
from llmcompressor.observers.helpers import flatten_for_calibration  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

TOKENS = 12


# --- the moving average ---------------------------------------------------------------------


@pytest.mark.parametrize("constant", [0, 0.01, 1], ids=lambda c: f"c={c}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("strategy", ["tensor", "channel"])
def test_moving_average_equals_llmcompressor_minmax_bit_for_bit(strategy, dtype, constant):
    """200 updates of llm-compressor's ``minmax`` observer (its ``lerp``) and of
    ``moving_average_minmax`` under the compressed-tensors spec: equal extremes after every one
    (``averaging_constant=0``, which llm-compressor takes, keeps the first batch's); at 0.01
    torch.ao's formula (the torch_ao spec) differs from it in most of them."""
    args = QuantizationArgs(num_bits=8, symmetric=False, strategy=strategy, observer="minmax",
                            observer_kwargs={"averaging_constant": constant})
    base = "input" if strategy == "tensor" else "weight"
    reference = Observer.load_from_registry("minmax", base_name=base, args=args)
    spec = qstats.QuantSpec.from_compressed_tensors(args, observed_dtype=dtype)
    obs = qstats.moving_average_minmax(spec, constant)
    torch_ao = qstats.moving_average_minmax(dataclasses.replace(spec, convention="torch_ao", compute_dtype="float32"), constant)
    g = torch.Generator().manual_seed(0)
    shape = (4, 16, 32) if base == "input" else (8, 32)
    state = torch_ao_state = None
    differ = 0
    for _ in range(200):
        x = (torch.randn(shape, generator=g) * torch.rand((), generator=g) * 10).to(dtype)
        # the weight observer observes once per forward; its update itself is the moving average
        reference.update_statistics_from_observed(flatten_for_calibration(x, base, args))
        state = obs.update(obs.init(x) if state is None else state, x)
        torch_ao_state = torch_ao.update(torch_ao.init(x) if torch_ao_state is None else torch_ao_state, x)
        want_min = reference.min_vals.float().reshape(state.min_val.shape)
        want_max = reference.max_vals.float().reshape(state.max_val.shape)
        assert bit_equal(state.min_val, want_min) and bit_equal(state.max_val, want_max)
        differ += not bit_equal(torch_ao_state.min_val, want_min)
    if constant == 0.01:
        assert differ > 100


# --- each observer's qparams ----------------------------------------------------------------

QPARAM_CASES = {
    "int8-channel-weight": (INT8_W8A8["weights"], "weight", "memoryless_minmax"),
    "w4a16-group-weight": (W4A16["weights"], "weight", "memoryless_minmax"),
    "nvfp4-weight": (NVFP4["weights"], "weight", "memoryless_minmax"),
    "fp8-input-moving": (FP8["input_activations"], "input", "minmax"),
    "fp8-input-static": (FP8["input_activations"], "input", "static_minmax"),
    "int8-asym-input-moving": (QuantizationArgs(num_bits=8, symmetric=False, strategy="tensor"), "input", "minmax"),
    "nvfp4-input-global-scale": (NVFP4["input_activations"], "input", "static_minmax"),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", sorted(QPARAM_CASES))
def test_observer_qparams_equal_llmcompressor(case, dtype):
    args, base, name = QPARAM_CASES[case]
    g = torch.Generator().manual_seed(0)
    if base == "input":
        xs = [(torch.randn(2, 8, 256, generator=g) * (i + 1)).to(dtype) for i in range(5)]
    else:
        xs = [torch.randn(32, 256, generator=g).to(dtype)]
    theirs = Observer.load_from_registry(name, base_name=base, args=args.model_copy(deep=True))
    ours = Observer.load_from_registry(f"qstats_{name}", base_name=base, args=args.model_copy(deep=True))
    for x in xs:
        theirs(x)
        ours(x)
    want, got = theirs.get_qparams(), ours.get_qparams()
    assert not ours.has_statistics  # deleted after get_qparams, as llm-compressor's
    keys = ["global_scale"] if args.dynamic else ["scale", "zero_point", "global_scale"]  # dynamic: scales at run time
    for key in keys:
        if want[key] is None:
            assert got[key] is None, key
        else:
            assert bit_equal(got[key], want[key]), key


def test_observer_kwargs_configure_the_qstats_observer():
    """``averaging_constant`` goes to the factory (llm-compressor's own kwarg); a histogram's
    ``method`` to compute_qparams: ``method="minmax"`` gives static_minmax's qparams exactly."""
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(2, 8, 64, generator=g) * (i + 1) for i in range(4)]

    def qparams(name, **kwargs):
        args = QuantizationArgs(num_bits=8, symmetric=False, strategy="tensor", observer_kwargs=kwargs)
        observer = Observer.load_from_registry(name, base_name="input", args=args)
        for x in xs:
            observer(x)
        return observer.get_qparams()

    assert bit_equal(qparams("qstats_minmax", averaging_constant=0.5)["scale"], qparams("minmax", averaging_constant=0.5)["scale"])
    for constant in (0, 0.01, 1):  # 0 (the first batch's range) as llm-compressor takes it; it used to raise
        ours, theirs = qparams("qstats_minmax", averaging_constant=constant), qparams("minmax", averaging_constant=constant)
        assert bit_equal(ours["scale"], theirs["scale"]) and bit_equal(ours["zero_point"], theirs["zero_point"]), constant
    assert not bit_equal(qparams("qstats_minmax", averaging_constant=0.5)["scale"], qparams("qstats_minmax")["scale"])
    histogram = qparams("qstats_histogram", method="minmax")
    static = qparams("static_minmax")
    assert bit_equal(histogram["scale"], static["scale"]) and bit_equal(histogram["zero_point"], static["zero_point"])
    with pytest.raises(TypeError):
        qparams("qstats_minmax", no_such_option=1)


# --- llm-compressor's oneshot ---------------------------------------------------------------

STATIC_W8A8 = {
    "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
    "input_activations": {"num_bits": 8, "type": "int", "symmetric": False, "strategy": "tensor", "dynamic": False},
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny random Llama on disk, calibration samples (token ids) and a stand-in tokenizer."""
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    path = saved_random_model(tmp_path_factory, "tiny_llama", transformers.LlamaForCausalLM, config)
    return path, token_samples(4, TOKENS), word_tokenizer()


def _oneshot(saved, out, pipeline="basic", scheme=None, preset=None, count=4, **observers) -> str:
    """llm-compressor's oneshot of the saved model on ``count`` samples, written compressed to ``out``."""
    from llmcompressor.modifiers.quantization import QuantizationModifier

    path, samples, tokenizer = saved
    model = transformers.LlamaForCausalLM.from_pretrained(path).eval()
    if preset is not None:
        recipe = QuantizationModifier(targets="Linear", scheme=preset, ignore=["lm_head"], **observers)
    else:
        recipe = QuantizationModifier(config_groups={"group_0": {"targets": ["Linear"], **scheme}},
                                      ignore=["lm_head"], **observers)
    llm_compressor_oneshot(model, samples[:count], recipe, out, pipeline, tokenizer)
    return str(out)


def _quantization_config(path: str, observer_names: bool) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)["quantization_config"]
    if not observer_names:  # the one field that names the observers
        for group in config["config_groups"].values():
            for args in group.values():
                if isinstance(args, dict):
                    args.pop("observer", None)
    return config


def _assert_same_checkpoint(a: str, b: str):
    tensors_a = load_file(os.path.join(a, "model.safetensors"))
    tensors_b = load_file(os.path.join(b, "model.safetensors"))
    assert sorted(tensors_a) == sorted(tensors_b)
    for name in tensors_a:
        assert bit_equal(tensors_a[name], tensors_b[name]), name
    assert _quantization_config(a, False) == _quantization_config(b, False)


@pytest.mark.parametrize("pipeline", ["basic", "sequential"])
def test_oneshot_with_qstats_minmax_observers_writes_the_same_checkpoint(saved, tmp_path, pipeline):
    """Static W8A8 (int8 channel weights, asymmetric per-tensor int8 inputs): llm-compressor's
    default observers (moving-average ``minmax`` inputs) and the qstats ones give the same bytes."""
    theirs = _oneshot(saved, tmp_path / "theirs", pipeline, STATIC_W8A8)
    ours = _oneshot(saved, tmp_path / "ours", pipeline, STATIC_W8A8,
                    weight_observer="qstats_memoryless_minmax", input_observer="qstats_minmax")
    _assert_same_checkpoint(theirs, ours)
    assert _quantization_config(ours, True)["config_groups"]["group_0"]["input_activations"]["observer"] == "qstats_minmax"
    static = _oneshot(saved, tmp_path / "static", pipeline, STATIC_W8A8, input_observer="static_minmax")
    ours_static = _oneshot(saved, tmp_path / "ours_static", pipeline, STATIC_W8A8, input_observer="qstats_static_minmax")
    _assert_same_checkpoint(static, ours_static)
    # the moving average and the running extremes differ: the comparison sees the input scales
    with pytest.raises(AssertionError):
        _assert_same_checkpoint(theirs, static)


def test_oneshot_nvfp4_fused_global_scales_equal_llmcompressor(saved, tmp_path):
    """NVFP4: q/k/v and gate/up share a weight global scale (llm-compressor's FusionHandler
    drives qstats.fused_global_scale); input global scales from qstats_static_minmax."""
    theirs = _oneshot(saved, tmp_path / "theirs", preset="NVFP4")
    ours = _oneshot(saved, tmp_path / "ours", preset="NVFP4", weight_observer="qstats_memoryless_minmax",
                    input_observer="qstats_static_minmax")
    _assert_same_checkpoint(theirs, ours)


def test_oneshot_nvfp4_with_samples_of_different_lengths(saved, tmp_path):
    """NVFP4 inputs (``dynamic="local"``: only a global scale calibrated) over unpadded samples of
    different lengths: the qstats state of an input is per tensor, not shaped by the first
    sample's length (it refused the second sample), and the checkpoint is llm-compressor's."""
    path, samples, tokenizer = saved
    ragged = (path, [sample[:length] for sample, length in zip(samples, (12, 7, 9, 5))], tokenizer)
    theirs = _oneshot(ragged, tmp_path / "theirs", preset="NVFP4")
    ours = _oneshot(ragged, tmp_path / "ours", preset="NVFP4", weight_observer="qstats_memoryless_minmax",
                    input_observer="qstats_static_minmax")
    _assert_same_checkpoint(theirs, ours)


@pytest.mark.parametrize("name", ["qstats_static_minmax", "qstats_minmax", "qstats_histogram", "qstats_mse"])
def test_runtime_scaled_input_observer_takes_batches_of_any_length(name):
    """One NVFP4 input observer over batches of different shapes; pickled midway, it goes on."""
    import pickle

    g = torch.Generator().manual_seed(4)
    xs = [torch.randn(1, 10, 64, generator=g), torch.randn(1, 14, 64, generator=g) * 3, torch.randn(2, 7, 64, generator=g)]
    ours = Observer.load_from_registry(name, base_name="input", args=NVFP4["input_activations"].model_copy(deep=True))
    ours(xs[0])
    ours = pickle.loads(pickle.dumps(ours))
    for x in xs[1:]:
        ours(x)
    got = ours.get_qparams()["global_scale"]
    assert got.shape == (1,) and torch.isfinite(got).all()
    if name == "qstats_static_minmax":
        theirs = Observer.load_from_registry("static_minmax", base_name="input",
                                             args=NVFP4["input_activations"].model_copy(deep=True))
        for x in xs:
            theirs(x)
        assert bit_equal(got, theirs.get_qparams()["global_scale"])


STATIC_GROUP_INPUT = {"num_bits": 8, "type": "int", "symmetric": False, "strategy": "group", "group_size": 16,
                      "dynamic": False}


@pytest.mark.parametrize("strategy", ["group", "tensor_group"])
def test_static_group_input_observers_are_refused_as_compressed_tensors_cannot_apply_their_scales(strategy):
    """llm-compressor's ``static_minmax`` gives static per-group inputs one scale per group of the
    features, whatever the batches' lengths; compressed-tensors' ``fake_quantize`` broadcasts those
    scales against the sequence dimension: it fails unless the length is 1 or the group count, and
    then puts token i under group i's scale. The qstats observers refuse the configuration (they
    raised a shape mismatch at ``get_qparams``, or at the first observation). Dynamic groups and
    NVFP4's ``dynamic="local"`` inputs are still observed."""
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize

    args = QuantizationArgs(**STATIC_GROUP_INPUT)
    g = torch.Generator().manual_seed(5)
    theirs = Observer.load_from_registry("static_minmax", base_name="input", args=args.model_copy(deep=True))
    for length in (5, 7, 3):
        theirs(torch.randn(2, length, 64, generator=g))
    qparams = theirs.get_qparams()
    assert qparams["scale"].shape == (4,)
    with pytest.raises(RuntimeError):
        fake_quantize(torch.randn(2, 5, 64, generator=g), qparams["scale"], qparams["zero_point"], args)
    x = torch.randn(1, 4, 64, generator=g)  # 4 tokens of 4 groups: token i under group i's scale
    per_token = fake_quantize(x, qparams["scale"], qparams["zero_point"], args)
    groups = x.unflatten(-1, (4, 16))
    scale, zero_point = qparams["scale"].reshape(4, 1), qparams["zero_point"].reshape(4, 1).float()
    transposed = (torch.clamp(torch.round(groups / scale.reshape(4, 1, 1) + zero_point.reshape(4, 1, 1)), -128, 127)
                  - zero_point.reshape(4, 1, 1)) * scale.reshape(4, 1, 1)
    assert torch.equal(per_token, transposed.flatten(-2))
    if strategy == "tensor_group":
        args = NVFP4["input_activations"].model_copy(update={"dynamic": False})
    for name in ("qstats_static_minmax", "qstats_minmax", "qstats_histogram", "qstats_mse"):
        refused = rf"strategy '{strategy}'.*static per-group activations .* not supported end to end"
        with pytest.raises(ValueError, match=refused):
            Observer.load_from_registry(name, base_name="input", args=args.model_copy(deep=True))
    for dynamic in (NVFP4["input_activations"], args.model_copy(update={"dynamic": True})):
        Observer.load_from_registry("qstats_static_minmax", base_name="input", args=dynamic.model_copy(deep=True))


def test_oneshot_of_static_group_inputs_writes_a_checkpoint_compressed_tensors_cannot_run(saved, tmp_path):
    """End to end: llm-compressor's oneshot writes (num_groups,) input scales, but the checkpoint's
    compressed-tensors forward fails at every length; the qstats observers refuse it up front."""
    scheme = {"weights": STATIC_W8A8["weights"], "input_activations": STATIC_GROUP_INPUT}
    theirs = _oneshot(saved, tmp_path / "theirs", "basic", scheme, input_observer="static_minmax")
    tensors = load_file(os.path.join(theirs, "model.safetensors"))
    assert tensors["model.layers.0.self_attn.q_proj.input_scale"].shape == (2,)  # 32 features / 16
    assert tensors["model.layers.0.mlp.down_proj.input_scale"].shape == (4,)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = transformers.AutoModelForCausalLM.from_pretrained(theirs).eval()
    for length in (1, 2, 4, 12):
        with pytest.raises(RuntimeError), torch.no_grad():
            loaded(torch.randint(1, 64, (1, length)))
    with pytest.raises(ValueError, match="static per-group activations"):
        _oneshot(saved, tmp_path / "ours", "basic", scheme, input_observer="qstats_static_minmax")


@pytest.mark.parametrize("observer", ["qstats_histogram", "qstats_mse"])
def test_oneshot_with_histogram_and_mse_observers_loads_and_runs(saved, tmp_path, observer):
    """The checkpoint loads with transformers' compressed-tensors quantizer and its logits stay
    close to the float model's. The recipe's observer_kwargs reach the qstats factory (coarser
    per-channel weight histograms: a faster search)."""
    weight_kwargs = {"buckets_per_octave": 16} if observer == "qstats_histogram" else {}
    scheme = {"weights": {**STATIC_W8A8["weights"], "observer": observer, "observer_kwargs": weight_kwargs},
              "input_activations": {**STATIC_W8A8["input_activations"], "observer": observer}}
    out = _oneshot(saved, tmp_path / "out", "basic", scheme, count=2)
    with open(os.path.join(out, "config.json")) as f:
        written = json.load(f)["quantization_config"]["config_groups"]["group_0"]["weights"]
    assert written["observer"] == observer and written["observer_kwargs"] == weight_kwargs
    path, samples, _ = saved
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert loaded.model.layers[0].self_attn.q_proj.weight.dtype == torch.int8
    plain = transformers.LlamaForCausalLM.from_pretrained(path).eval()
    batch = torch.stack(samples)
    with torch.no_grad():
        quantized, reference = loaded(batch).logits, plain(batch).logits
    assert torch.isfinite(quantized).all() and not torch.equal(quantized, reference)
    assert torch.nn.functional.cosine_similarity(quantized.flatten(), reference.flatten(), dim=0) > 0.99


# --- optional dependency, distributed sync ----------------------------------------------------


def test_missing_llmcompressor_gives_a_clear_import_error(monkeypatch):
    import importlib
    import sys

    monkeypatch.setitem(sys.modules, "llmcompressor", None)  # as if it were not installed
    monkeypatch.setitem(sys.modules, "llmcompressor.observers.base", None)
    monkeypatch.delitem(sys.modules, "qstats.llmcompressor")
    with pytest.raises(ImportError, match="pip install llmcompressor"):
        importlib.import_module("qstats.llmcompressor")


SYNC_ARGS = QuantizationArgs(num_bits=8, symmetric=False, strategy="tensor")


def _rank_data(rank: int) -> list:
    """Uneven data per rank: rank 1 sees wider batches, and more of them."""
    g = torch.Generator().manual_seed(10 + rank)
    return [torch.randn(2, 8, 64, generator=g) * (1 + 3 * rank) for _ in range(1 + rank)]


def _sync_rank(rank: int, port: int, out: str):
    """One forked rank: observe its data, sync like llm-compressor's QuantizationMixin, save qparams."""
    import torch.distributed as dist

    torch.set_num_threads(1)  # a forked child must not enter the parent's OpenMP pool (it hangs)

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        results = {}
        for name in ("qstats_static_minmax", "qstats_histogram"):
            observer = Observer.load_from_registry(name, base_name="input", args=SYNC_ARGS.model_copy(deep=True))
            weight = Observer.load_from_registry(name, base_name="weight", args=SYNC_ARGS.model_copy(deep=True))
            for x in _rank_data(rank):
                observer(x)
            weight(torch.full((4, 4), float(rank)))  # weights differ here to show they are not merged
            assert observer.sync_activation_stats() == [] and weight.sync_activation_stats() == []
            results[name] = (observer.get_qparams(), weight.get_qparams())
        torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_sync_activation_stats_merges_the_ranks_states(tmp_path):
    """Two gloo ranks (forked) with uneven data: after ``sync_activation_stats`` every rank's
    activation qparams equal those of one observer over all the data (llm-compressor's
    static_minmax for the min/max one, bit for bit); weight observers are left alone."""
    assert fork_ranks(_sync_rank, str(tmp_path)) == [0, 0]
    everything = _rank_data(0) + _rank_data(1)
    for name, reference_name in (("qstats_static_minmax", "static_minmax"), ("qstats_histogram", "qstats_histogram")):
        reference = Observer.load_from_registry(reference_name, base_name="input", args=SYNC_ARGS.model_copy(deep=True))
        for x in everything:
            reference(x)
        want = reference.get_qparams()
        weight_scales = []
        for rank in range(2):
            activation, weight = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)[name]
            assert bit_equal(activation["scale"], want["scale"]), (name, rank)
            assert bit_equal(activation["zero_point"], want["zero_point"]), (name, rank)
            weight_scales.append(weight["scale"])
        assert not bit_equal(*weight_scales)  # each rank kept its own weight's


def _empty_rank(rank: int, port: int, out: str):
    """One forked rank; rank 0 observes nothing, then both sync: each records its qparams or what it raised."""
    import datetime

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    try:
        observer = Observer.load_from_registry("qstats_static_minmax", base_name="input",
                                               args=SYNC_ARGS.model_copy(deep=True))
        for x in _rank_data(rank)[: rank]:  # rank 0: no batch
            observer(x)
        try:
            observer.sync_activation_stats()
            result = observer.get_qparams()
        except ValueError as error:
            result = str(error)
        torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_sync_with_a_rank_that_saw_no_data_gives_every_rank_the_other_ranks_statistics(tmp_path):
    """An MoE expert whose tokens all went to rank 1: both ranks get llm-compressor's static_minmax
    qparams over rank 1's batches (tests/test_llmcompressor_dropin_sync_partial.py: more cases)."""
    codes = fork_ranks(_empty_rank, str(tmp_path), timeout=120)
    assert codes == [0, 0], f"exit codes {codes} (None: a rank hung in the collective)"
    reference = Observer.load_from_registry("static_minmax", base_name="input", args=SYNC_ARGS.model_copy(deep=True))
    for x in _rank_data(1)[:1]:
        reference(x)
    want = reference.get_qparams()
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert isinstance(got, dict), (rank, got)
        assert bit_equal(got["scale"], want["scale"]) and bit_equal(got["zero_point"], want["zero_point"]), rank


def test_fused_group_mixing_qstats_and_llmcompressor_observers_is_refused():
    from llmcompressor.observers.fusion import FusionHandler

    q, k = torch.nn.Linear(64, 32), torch.nn.Linear(64, 32)
    ours = Observer.load_from_registry("qstats_memoryless_minmax", base_name="weight", args=NVFP4["weights"].model_copy(deep=True))
    theirs = Observer.load_from_registry("memoryless_minmax", base_name="weight", args=NVFP4["weights"].model_copy(deep=True))
    FusionHandler.fuse([(ours, q), (theirs, k)])
    ours(q.weight)
    with pytest.raises(TypeError, match="mixes qstats and llm-compressor observers"):
        ours.get_qparams()


def test_fused_group_of_different_qstats_observers_shares_llmcompressors_global_scale():
    """q/k under min/max and v under mse (llm-compressor fuses its own observers of both kinds): one
    global scale over each member's own range; it raised 'the group mixes state types'."""
    from llmcompressor.observers.fusion import FusionHandler

    generator = torch.Generator().manual_seed(3)
    weights = [torch.randn(8, 32, generator=generator) * (i + 1) for i in range(3)]

    def global_scales(kinds):
        modules = [torch.nn.Linear(32, 8, bias=False) for _ in weights]
        observers = []
        for kind, module, weight in zip(kinds, modules, weights):
            module.weight.data = weight
            args = NVFP4["weights"].model_copy(update={"observer": kind}, deep=True)
            observers.append(Observer.load_from_registry(kind, base_name="weight", args=args))
        FusionHandler.fuse(list(zip(observers, modules)))
        for observer, weight in zip(observers, weights):
            observer(weight)
        return [observer.get_qparams()["global_scale"] for observer in observers]

    theirs = global_scales(["memoryless_minmax", "memoryless_minmax", "memoryless_mse"])
    ours = global_scales(["qstats_memoryless_minmax", "qstats_memoryless_minmax", "qstats_mse"])
    assert all(bit_equal(a, b) for a, b in zip(ours, theirs))
    assert bit_equal(ours[0], ours[2])


@pytest.mark.parametrize("name", sorted(qstats.llmcompressor.OBSERVERS))
def test_observers_pickle_with_their_state_as_llm_compressors_do(name):
    """``torch.save`` of a model under calibration pickles its observers (llm-compressor's own
    pickle); a qstats one comes back with its state and gives the same qparams."""
    import pickle

    args = QuantizationArgs(num_bits=8, symmetric=True, strategy="tensor", observer=f"qstats_{name}")
    ours = Observer.load_from_registry(f"qstats_{name}", base_name="input", args=args)
    reference = Observer.load_from_registry("static_minmax", base_name="input", args=args.model_copy())
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(0))
    ours(x), reference(x)
    assert type(pickle.loads(pickle.dumps(reference))) is type(reference)
    again = pickle.loads(pickle.dumps(ours))
    assert type(again) is type(ours)
    for a, b in zip(again.get_qparams().values(), ours.get_qparams().values()):
        assert (a is None and b is None) or bit_equal(a, b)
