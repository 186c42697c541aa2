"""The mse observer's bf16/fp16 range arithmetic (compressed-tensors specs computing in the observed
dtype, as llm-compressor keeps such inputs' ranges) under ``torch.compile``: inductor drops a plain
``x.to(half).float()`` pair of casts, so a compiled update kept float32 values that are no fp16
value and differed from the eager update."""

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs

import qstats


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each case traced afresh: the observers' update functions share code objects, so cases compiled
    earlier in the same process would count towards dynamo's recompile limit (fullgraph fails there)."""
    torch._dynamo.reset()


def _fp16_spec():
    args = QuantizationArgs(num_bits=8, type="int", symmetric=False, strategy="tensor")
    return qstats.QuantSpec.from_compressed_tensors(args, observed_dtype=torch.float16)


def _batches():
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(6, 64, generator=generator) * (i + 1)).half() for i in range(3)]


def _holds_fp16_values(t):
    return torch.equal(t.half().float(), t)


def test_compiled_moving_average_mse_keeps_the_eager_fp16_ranges():
    spec = _fp16_spec()
    obs = qstats.mse(spec, grid=10, mode="moving_average", averaging_constant=0.3)
    compiled = torch.compile(obs.update, fullgraph=True)
    batches = _batches()
    mask = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.5, 1.0])
    eager = traced = obs.init(batches[0])
    for x in batches:
        eager, traced = obs.update(eager, x, mask), compiled(traced, x, mask)
    for field in ("min_val", "max_val"):
        assert _holds_fp16_values(getattr(eager, field))  # llm-compressor keeps them in fp16
        assert torch.equal(getattr(traced, field), getattr(eager, field)), field
    assert torch.equal(qstats.compute_qparams(traced, spec).scale, qstats.compute_qparams(eager, spec).scale)


def test_compiled_expanded_mse_reference_is_the_eager_fp16_range():
    spec = _fp16_spec()
    obs = qstats.mse(spec, grid=10, expand=1.5)
    compiled = torch.compile(obs.update, fullgraph=True)
    x = _batches()[1]
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 1.0])
    eager, traced = obs.update(obs.init(x), x, mask), compiled(obs.init(x), x, mask)
    expected = (x[mask != 0].amin().float() * 1.5).half().float()  # llm-compressor: amin(x) * expand in fp16
    assert torch.equal(eager.min_val, expected)
    assert torch.equal(traced.min_val, eager.min_val) and torch.equal(traced.max_val, eager.max_val)


def test_stacked_moving_average_mse_on_fp16_experts_equals_the_loop():
    spec = _fp16_spec()
    obs = qstats.mse(spec, grid=10, mode="moving_average", averaging_constant=0.3)
    stacked = qstats.stacked_observer(obs, 3)
    batches = [torch.stack([x, 2 * x, -x]) for x in _batches()]
    routed = torch.tensor([[1.0] * 6, [1.0, 0.0] * 3, [0.0] * 6])  # the last expert receives nothing
    state = stacked.init(batches[0])
    for x in batches:
        state = stacked.update(state, x, routed)
    for expert in range(3):
        one = obs.init(batches[0][expert])
        for x in batches:
            one = obs.update(one, x[expert][routed[expert] != 0])
        for field, value in zip(one._fields, one):
            assert torch.equal(getattr(state, field)[expert], value), (expert, field)


def test_compiled_moving_average_minmax_keeps_the_eager_fp16_ranges():
    # llm-compressor's moving average of fp16 extremes is fp16 arithmetic: lerp in the input's dtype
    spec = _fp16_spec()
    obs = qstats.moving_average_minmax(spec, averaging_constant=0.3)
    compiled = torch.compile(obs.update, fullgraph=True)
    eager = traced = obs.init(_batches()[0])
    expected_lo = None
    for x in _batches():
        eager, traced = obs.update(eager, x), compiled(traced, x)
        lo = x.amin()
        expected_lo = lo if expected_lo is None else (expected_lo * (1 - 0.3)) + (lo * 0.3)  # fp16 ops
    assert torch.equal(eager.min_val.reshape(()), expected_lo.float())
    for field in ("min_val", "max_val"):
        assert _holds_fp16_values(getattr(traced, field)), field
        assert torch.equal(getattr(traced, field), getattr(eager, field)), field
