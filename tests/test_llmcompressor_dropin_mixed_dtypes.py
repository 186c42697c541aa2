"""An input observer given batches of different dtypes (bf16, then float32), against llm-compressor
0.14's own observers, whose statistics are tensors of the batches' dtypes: running extremes take
torch's promotion of them, an observer keeping only the latest batch its dtype."""

import warnings

import pytest
import torch
from _shared import bit_equal

pytest.importorskip("qstats.llmcompressor")  # registers the qstats_* observers (skips without llm-compressor)
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402
from compressed_tensors.quantization.quant_scheme import FP8, NVFP4  # noqa: E402
from llmcompressor.observers import Observer  # noqa: E402

ARGS = {"int8-asym": QuantizationArgs(num_bits=8, symmetric=False, strategy="tensor"),
        "fp8": FP8["input_activations"], "nvfp4": NVFP4["input_activations"]}
# (llm-compressor's observer, the qstats drop-in, observer_kwargs)
EXACT = [("static_minmax", "qstats_static_minmax", {}), ("memoryless_minmax", "qstats_memoryless_minmax", {}),
         ("minmax", "qstats_minmax", {"averaging_constant": 1.0}),
         ("memoryless_mse", "qstats_mse", {"mode": "moving_average", "averaging_constant": 1.0})]
MOVING = [("minmax", "qstats_minmax", {}), ("mse", "qstats_mse", {"mode": "moving_average", "averaging_constant": 0.3})]
ORDERS = [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16), (torch.float16, torch.bfloat16),
          (torch.bfloat16, torch.float16, torch.float32)]


def _qparams(name, args, kwargs, dtypes):
    g = torch.Generator().manual_seed(0)
    observer = Observer.load_from_registry(name, base_name="input", args=args.model_copy(deep=True, update={
        "observer_kwargs": dict(kwargs)}))
    for dtype in dtypes:
        observer((torch.randn(2, 5, 64, generator=g) * 3).to(dtype))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qparams = observer.get_qparams()
    return qparams["global_scale"] if args.dynamic == "local" else qparams["scale"]


@pytest.mark.parametrize("dtypes", ORDERS, ids=lambda d: "-".join(str(t)[6:] for t in d))
@pytest.mark.parametrize("case", sorted(ARGS))
@pytest.mark.parametrize("theirs, ours, kwargs", EXACT, ids=lambda v: str(v) if v else "-")
def test_extremes_of_batches_of_other_dtypes_equal_llm_compressors(theirs, ours, kwargs, case, dtypes):
    """Bit for bit, in llm-compressor's dtype: the first batch's dtype was kept (bf16 then float32
    under static_minmax: int8 scale 0.08544921875 in bf16 where llm-compressor's is 0.0852941 in
    float32; NVFP4 global scale 218.0 where it is 218.3147)."""
    want = _qparams(theirs, ARGS[case], kwargs, dtypes)
    got = _qparams(ours, ARGS[case], kwargs, dtypes)
    assert got.dtype == want.dtype and bit_equal(got, want)


@pytest.mark.parametrize("dtypes", ORDERS, ids=lambda d: "-".join(str(t)[6:] for t in d))
@pytest.mark.parametrize("theirs, ours, kwargs", MOVING, ids=lambda v: str(v) if v else "-")
def test_moving_averages_of_batches_of_other_dtypes_take_llm_compressors_dtype(theirs, ours, kwargs, dtypes):
    """A moving average's scale comes in llm-compressor's (promoted) dtype, within 1% of its value:
    llm-compressor rounds each product of its lerp to its operand's dtype, qstats does not
    (docs/migrating_llmcompressor.md)."""
    want = _qparams(theirs, ARGS["int8-asym"], kwargs, dtypes)
    got = _qparams(ours, ARGS["int8-asym"], kwargs, dtypes)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=0.01, atol=0)
