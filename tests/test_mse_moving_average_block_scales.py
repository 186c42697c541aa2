"""qstats.mse(spec, mode="moving_average") against llm-compressor's ``mse`` observer (the real
library), batch by batch: MXFP4, NVFP4, int4 groups and int8 channels in bf16, fp16 and float32.

llm-compressor forms a bf16/fp16 input's candidate ranges ``min * p`` in its dtype; the search scored
them in float32 while the state kept them rounded, so a candidate rounded across an exponent
boundary took another e8m0 scale than the one it was scored with (MXFP4 bf16: 1-3 of 2048 blocks).
"""

import pytest
import torch

import qstats

llmc_observers = pytest.importorskip("llmcompressor.observers")
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402
from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES  # noqa: E402
from llmcompressor.observers.helpers import flatten_for_calibration  # noqa: E402


def _preset(name):
    return PRESET_SCHEMES[name]["weights"].model_dump(exclude={"observer", "observer_kwargs"})


FIELDS = {
    "mxfp4": _preset("MXFP4"),
    "nvfp4": _preset("NVFP4"),
    "int4-group": dict(num_bits=4, type="int", symmetric=False, strategy="group", group_size=32),
    "int8-channel": dict(num_bits=8, type="int", symmetric=True, strategy="channel"),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _weights(seed, dtype, batches, rows=64, cols=256):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g) * (1 + i)).to(dtype)
            for i in range(batches)]


def _compare(fields, dtype, xs, update, constant=0.01):
    """Feeds ``xs`` to llm-compressor's ``mse`` observer and to ``update``; asserts the ranges equal
    after every batch and the qparams at the end. llm-compressor's weight observer keeps its first
    batch when called, so every batch goes to its statistics update, as a calibration of
    activations feeds it."""
    args = QuantizationArgs(**fields, observer="mse", observer_kwargs={"averaging_constant": constant})
    reference = llmc_observers.Observer.load_from_registry("mse", base_name="weight", args=args)
    spec = qstats.QuantSpec.from_compressed_tensors(QuantizationArgs(**fields), observed_dtype=dtype)
    obs = qstats.mse(spec, mode="moving_average", averaging_constant=constant)
    state = obs.init(xs[0])
    for index, x in enumerate(xs):
        reference.update_statistics_from_observed(flatten_for_calibration(x, "weight", args))
        state = update(obs, state, x)
        for got, want in ((state.min_val, reference.min_vals), (state.max_val, reference.max_vals)):
            assert torch.equal(got, want.float().reshape(got.shape)), index
    want = reference.get_qparams()
    qp = qstats.compute_qparams(state, spec)
    unequal = int((qp.scale.float().reshape(-1) != want["scale"].float().reshape(-1)).sum())
    assert unequal == 0, f"{unequal} of {qp.scale.numel()} scales differ"
    assert torch.equal(qp.zero_point.float().reshape(-1), want["zero_point"].float().reshape(-1))
    if want["global_scale"] is not None:
        assert torch.equal(qp.global_scale.float().reshape(-1), want["global_scale"].float().reshape(-1))


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("fields", FIELDS.values(), ids=FIELDS.keys())
def test_moving_average_ranges_and_scales_equal_llm_compressor_mse(fields, dtype):
    for seed in range(2):
        _compare(fields, dtype, _weights(seed, dtype, batches=3), lambda obs, state, x: obs.update(state, x))


@pytest.mark.parametrize("shape", [(32, 128), (16, 512)], ids=["32x128", "16x512"])
def test_mxfp4_bf16_one_and_five_batches_equal_llm_compressor_mse(shape):
    for seed in range(3):
        for batches in (1, 5):
            xs = _weights(seed, torch.bfloat16, batches, *shape)
            _compare(FIELDS["mxfp4"], torch.bfloat16, xs, lambda obs, state, x: obs.update(state, x))


def test_compiled_moving_average_equals_llm_compressor_mse_on_mxfp4_bf16():
    """The rounded candidates hold under torch.compile (one graph)."""
    torch._dynamo.reset()
    compiled = {}

    def update(obs, state, x):
        step = compiled.setdefault("update", torch.compile(obs.update, fullgraph=True, backend="aot_eager"))
        return step(state, x)

    _compare(FIELDS["mxfp4"], torch.bfloat16, _weights(0, torch.bfloat16, batches=2), update)
