"""qstats.llmcompressor's drop-in observers on edge uses, against llm-compressor 0.14's own observers:
``qstats_mse`` weights stop their search early as ``memoryless_mse`` does (its default patience 5,
visible where a late candidate wins: an expanded range), NVFP4 ``qstats_mse`` weights as
``memoryless_mse`` / ``nvfp4_expanded_mse``, and an observer observing again after ``get_qparams``
(its statistics deleted) computes in the new tensor's dtype, as llm-compressor's."""

import os
import warnings

import pytest
import torch
from _shared import bit_equal, llm_compressor_oneshot, word_tokenizer

pytest.importorskip("llmcompressor")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
import qstats.llmcompressor  # noqa: E402,F401  (registers the qstats_* observers)
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402
from compressed_tensors.quantization.quant_scheme import NVFP4  # noqa: E402
from llmcompressor.observers import Observer  # noqa: E402
from llmcompressor.observers.fusion import FusionHandler  # noqa: E402
from safetensors.torch import load_file  # noqa: E402


def _qparams(name, args, weight):
    observer = Observer.load_from_registry(name, base_name="weight", args=args.model_copy(deep=True))
    return observer(weight).get_qparams()


FP8_TENSOR = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor"}
INT8_TENSOR = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "tensor"}
INT4_GROUP_ASYM = {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 16}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fields", [FP8_TENSOR, INT8_TENSOR, INT4_GROUP_ASYM], ids=["fp8", "int8", "int4-group-asym"])
def test_qstats_mse_weights_stop_early_as_memoryless_mse(fields, dtype):
    """An expanded range (``expand=1.5``) puts the best candidate late, past memoryless_mse's early
    stop (patience 5): qstats_mse searched every candidate (27 of 40 fp8 weights got another, smaller
    scale); with llm-compressor's default patience the scales are memoryless_mse's, bit for bit."""
    args = QuantizationArgs(**fields, observer_kwargs={"expand": 1.5})
    for seed in range(12):
        weight = (torch.randn(8, 64, generator=torch.Generator().manual_seed(seed)) ** 3).to(dtype)
        want, got = _qparams("memoryless_mse", args, weight), _qparams("qstats_mse", args, weight)
        assert bit_equal(got["scale"], want["scale"]), seed
        assert bit_equal(got["zero_point"], want["zero_point"]), seed


def test_qstats_mse_weight_patience_is_still_the_users():
    """A ``patience`` in observer_kwargs is taken as given (None: the whole search, which finds a
    loss no larger than the early-stopped one)."""
    weight = torch.randn(8, 64, generator=torch.Generator().manual_seed(31)) ** 3
    for patience in (1, 2, 50):
        args = QuantizationArgs(**FP8_TENSOR, observer_kwargs={"expand": 1.5, "patience": patience})
        want = _qparams("memoryless_mse", args, weight)["scale"]
        assert bit_equal(_qparams("qstats_mse", args, weight)["scale"], want), patience
    early = _qparams("qstats_mse", QuantizationArgs(**FP8_TENSOR, observer_kwargs={"expand": 1.5}), weight)
    whole = QuantizationArgs(**FP8_TENSOR, observer_kwargs={"expand": 1.5, "patience": None})
    full = _qparams("qstats_mse", whole, weight)
    assert not bit_equal(full["scale"], early["scale"])


@pytest.mark.parametrize("reference,kwargs", [
    ("memoryless_mse", {"expand": 1.5}),
    ("nvfp4_expanded_mse", {"expand": 1.8, "maxshrink": 1 - 0.8 / 1.8, "grid": 200.0, "patience": 1000}),
], ids=["memoryless_mse-expand", "nvfp4_expanded_mse"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_nvfp4_qstats_mse_weights_of_a_fused_group_equal_llmcompressor(reference, kwargs, dtype):
    """q/k/v NVFP4 weights fused as llm-compressor's FusionHandler fuses them: block scales and the
    shared global scale of qstats_mse equal memoryless_mse's (with ``expand``) and
    nvfp4_expanded_mse's (its defaults spelled out), bit for bit."""
    g = torch.Generator().manual_seed(0)
    modules = [torch.nn.Linear(64, rows, bias=False).to(dtype) for rows in (32, 16, 16)]
    for i, module in enumerate(modules):
        module.weight.data = (torch.randn(module.weight.shape, generator=g) * (i + 1)).to(dtype)

    def fused_qparams(name, observer_kwargs):
        args = NVFP4["weights"].model_copy(update={"observer_kwargs": observer_kwargs})
        observers = [Observer.load_from_registry(name, base_name="weight", args=args.model_copy(deep=True))
                     for _ in modules]
        FusionHandler.fuse(list(zip(observers, modules)))
        return [observer(module.weight).get_qparams() for observer, module in zip(observers, modules)]

    theirs = fused_qparams(reference, {} if reference == "nvfp4_expanded_mse" else kwargs)
    ours = fused_qparams("qstats_mse", kwargs)
    for want, got in zip(theirs, ours):
        for key in ("scale", "zero_point", "global_scale"):
            assert bit_equal(got[key], want[key]), key


@pytest.mark.parametrize("name", ["memoryless_minmax", "static_minmax", "mse"])
def test_a_weight_observed_again_after_get_qparams_computes_in_its_dtype(name):
    """After ``get_qparams`` (statistics deleted) an observer observing a bfloat16 / float16 weight
    computes its qparams in that dtype, as llm-compressor's: the spec of the first (float32)
    observation was kept, and the scales came out float32 with other values."""
    reference = "memoryless_mse" if name == "mse" else name
    args = QuantizationArgs(num_bits=4, symmetric=False, strategy="group", group_size=16)
    theirs = Observer.load_from_registry(reference, base_name="weight", args=args.model_copy(deep=True))
    ours = Observer.load_from_registry(f"qstats_{name}", base_name="weight", args=args.model_copy(deep=True))
    g = torch.Generator().manual_seed(2)
    weights = [torch.randn(16, 64, generator=g), (torch.randn(16, 64, generator=g) * 5).bfloat16(),
               torch.randn(8, 64, generator=g).half()]
    for weight in weights:
        want, got = theirs(weight).get_qparams(), ours(weight).get_qparams()
        assert bit_equal(got["scale"], want["scale"]), weight.dtype
        assert bit_equal(got["zero_point"], want["zero_point"]), weight.dtype


def test_oneshot_with_qstats_mse_expanded_fp8_weights_writes_memoryless_mse_checkpoint(tmp_path):
    """llm-compressor's oneshot on a tiny Llama, FP8 per-tensor weights searched from 1.5x their
    range: qstats_mse writes memoryless_mse's checkpoint (it wrote other weight scales)."""
    from llmcompressor.modifiers.quantization import QuantizationModifier

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    path = str(tmp_path / "tiny_llama")
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    samples = [torch.randint(1, 64, (12,), generator=torch.Generator().manual_seed(1)) for _ in range(2)]
    outs = []
    for observer in ("memoryless_mse", "qstats_mse"):
        weights = {**FP8_TENSOR, "observer": observer, "observer_kwargs": {"expand": 1.5}}
        recipe = QuantizationModifier(config_groups={"group_0": {"targets": ["Linear"], "weights": weights}},
                                      ignore=["lm_head"])
        model = transformers.LlamaForCausalLM.from_pretrained(path).eval()
        out = str(tmp_path / observer)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            llm_compressor_oneshot(model, samples, recipe, out, "basic", word_tokenizer())
        outs.append(load_file(os.path.join(out, "model.safetensors")))
    theirs, ours = outs
    assert sorted(theirs) == sorted(ours)
    for key in theirs:
        assert bit_equal(ours[key], theirs[key]), key


def test_triton_error_buffer_is_taken_and_unknown_mse_options_fail_at_construction():
    """``triton_error_buffer`` (an llm-compressor 0.14 mse option its CPU search ignores) gave a
    TypeError from deep in compute_qparams at ``get_qparams``, after the whole calibration; now the
    qparams are memoryless_mse's / mse's, and an unknown option raises when the observer is made."""
    weight = torch.randn(16, 64, generator=torch.Generator().manual_seed(4))
    args = QuantizationArgs(num_bits=8, symmetric=True, strategy="channel", observer_kwargs={"triton_error_buffer": 0.3})
    assert bit_equal(_qparams("qstats_mse", args, weight)["scale"], _qparams("memoryless_mse", args, weight)["scale"])
    g = torch.Generator().manual_seed(5)
    batches = [torch.randn(2, 5, 64, generator=g), torch.randn(1, 3, 64, generator=g) * 3]
    qparams = {}
    for name, kwargs in (("mse", {}), ("qstats_mse", {"mode": "moving_average"})):
        args = QuantizationArgs(num_bits=8, symmetric=False, strategy="tensor",
                                observer_kwargs={"triton_error_buffer": 0.5, **kwargs})
        observer = Observer.load_from_registry(name, base_name="input", args=args)
        for x in batches:
            observer(x)
        qparams[name] = observer.get_qparams()
    assert bit_equal(qparams["qstats_mse"]["scale"], qparams["mse"]["scale"])
    assert bit_equal(qparams["qstats_mse"]["zero_point"], qparams["mse"]["zero_point"])
    for kwargs in ({"no_such_option": 1}, {"mode": "moving_average", "no_such_option": 1}):
        with pytest.raises(TypeError, match="no_such_option"):
            Observer.load_from_registry("qstats_mse", base_name="input",
                                        args=QuantizationArgs(num_bits=8, observer_kwargs=kwargs))


@pytest.mark.parametrize("name", ["static_minmax", "memoryless_minmax", "minmax"])
def test_channels_of_only_nan_warn_and_the_others_equal_llmcompressor(name):
    """A weight channel holding only NaN/Inf: llm-compressor's own observer gives it a NaN scale, the
    drop-in scale 1 and zero point 0 with an UncalibratedWarning naming the count (it was silent);
    every other channel's scale equals llm-compressor's bit for bit."""
    args = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
    weight = torch.randn(6, 32, generator=torch.Generator().manual_seed(0))
    weight[2] = float("nan")
    weight[4] = float("inf")
    want = _qparams(name, args, weight)
    with pytest.warns(qstats.UncalibratedWarning, match="2 of 6 weight quantization parameter"):
        got = _qparams(f"qstats_{name}", args, weight)
    finite = torch.tensor([True, True, False, True, False, True])
    assert not torch.isfinite(want["scale"].reshape(-1)[~finite]).any()
    assert bit_equal(got["scale"].reshape(-1)[finite], want["scale"].reshape(-1)[finite])
    assert torch.equal(got["scale"].reshape(-1)[~finite], torch.ones(2))
    assert torch.equal(got["zero_point"].reshape(-1)[~finite], torch.zeros(2, dtype=got["zero_point"].dtype))


def test_calibrated_weights_do_not_warn():
    args = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
    with warnings.catch_warnings():
        warnings.simplefilter("error", qstats.UncalibratedWarning)
        _qparams("qstats_static_minmax", args, torch.randn(6, 32))
