"""qstats.imatrix / imatrix_mse against their references: llm-compressor 0.14's imatrix_mse observer
(the real library) for the weighted search and its uniform fallbacks, and an independent
reimplementation of llama.cpp's imatrix collection (sum of x**2 per input column and a row count,
per expert) for the statistics."""

import math
import os
import tempfile

import pytest
import torch

import qstats
import qstats.io
from qstats import testing

pytest.importorskip("llmcompressor.observers")
from _shared import llm_compressor_imatrix_mse  # noqa: E402


def _llmc(fields, layer, xs, **kwargs):
    """llm-compressor's imatrix_mse without early stopping (patience 10**6) unless ``kwargs`` say so."""
    return llm_compressor_imatrix_mse(fields, layer, xs, **{"patience": 10**6, **kwargs})


def _qstats(args, w, xs, with_state=True, **kwargs):
    observed = {} if w.dtype == torch.float32 else {"observed_dtype": w.dtype}
    spec = qstats.QuantSpec.from_compressed_tensors(args, **observed)
    state = None
    if with_state:
        obs = qstats.imatrix()
        state = obs.init(xs[0])
        for x in xs:
            state = obs.update(state, x)
    weighted = qstats.imatrix_mse(spec, w.shape, state, **kwargs)
    return qstats.compute_qparams(weighted.update(weighted.init(w), w), spec)


def _assert_same(qp, scale, zero_point):
    assert torch.equal(qp.scale, scale.reshape(qp.scale.shape)), int((qp.scale != scale.reshape(qp.scale.shape)).sum())
    assert torch.equal(qp.zero_point.to(zero_point.dtype), zero_point.reshape(qp.zero_point.shape))


def _acts(seed, batches=2, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(2, 17, 128, generator=g) * torch.logspace(-2, 2, 128)).to(dtype) for _ in range(batches)]


def _layer(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Linear(128, 32, bias=False).to(dtype)


@pytest.mark.parametrize("fields, dtype", [
    (dict(num_bits=4, type="int", symmetric=False, strategy="channel"), torch.float32),
    (dict(num_bits=8, type="int", symmetric=False, strategy="channel"), torch.float16),
    (dict(num_bits=3, type="int", symmetric=False, strategy="group", group_size=32), torch.bfloat16),
    (dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=16), torch.bfloat16),
    (dict(num_bits=4, type="int", symmetric=False, strategy="group", group_size=128), torch.float32),
    (dict(num_bits=8, type="float", symmetric=True, strategy="channel"), torch.float32),
], ids=["int4-asym-channel", "int8-asym-channel-fp16", "int3-asym-g32-bf16", "int4-sym-g16-bf16",
        "int4-asym-g128", "fp8-channel"])
def test_weighted_search_equals_llm_compressor(fields, dtype):
    layer, xs = _layer(dtype), _acts(1, dtype=dtype)
    args, scale, zero_point = _llmc(fields, layer, xs)
    _assert_same(_qstats(args, layer.weight.data, xs), scale, zero_point)


def test_search_options_equal_llm_compressor():
    fields = dict(num_bits=4, type="int", symmetric=False, strategy="group", group_size=32)
    layer, xs = _layer(), _acts(2)
    options = dict(grid=7, maxshrink=0.5, norm=2.0, expand=1.3)
    args, scale, zero_point = _llmc(fields, layer, xs, **options)
    _assert_same(_qstats(args, layer.weight.data, xs, **options), scale, zero_point)


def _with_nonfinite(value):
    xs = _acts(3)
    xs[0][1, 4, 7] = value
    return xs


@pytest.mark.parametrize("xs", [
    _with_nonfinite(float("nan")),
    _with_nonfinite(float("inf")),
    [torch.randn(2, 17, 128, generator=torch.Generator().manual_seed(4)) * 5e18],
], ids=["nan", "inf", "float32-sum-overflows"])
def test_non_finite_float32_sums_fall_back_to_uniform_as_llm_compressor(xs):
    """llm-compressor sums x**2 in float32: one NaN/Inf activation, or a sum past the float32 range
    (activations near 5e18, whose mean square still fits float32), makes its importance non-finite
    and it searches uniformly. qstats left the NaN out (or summed in float64) and weighted the search
    with the rest, choosing other channel scales."""
    fields = dict(num_bits=4, type="int", symmetric=False, strategy="channel")
    layer = _layer()
    args, scale, zero_point = _llmc(fields, layer, xs)
    _assert_same(_qstats(args, layer.weight.data, xs), scale, zero_point)


def test_stacked_expert_with_a_nan_falls_back_alone():
    """Per expert, as llm-compressor's per-expert Linears: only the expert that a NaN token was
    routed to searches uniformly; a NaN in a token routed elsewhere changes nothing."""
    num_experts = 2
    g = torch.Generator().manual_seed(5)
    x = torch.randn(30, 128, generator=g) * torch.logspace(-2, 2, 128)
    x[3, 9] = float("nan")
    route = torch.zeros(num_experts, 30, dtype=torch.bool)
    route[0, :15], route[1, 15:] = True, True
    fields = dict(num_bits=4, type="int", symmetric=False, strategy="group", group_size=32)
    layers = [_layer(seed=e) for e in range(num_experts)]
    expected = [_llmc(fields, layers[e], [x[route[e]]]) for e in range(num_experts)]
    stacked = qstats.stacked_observer(qstats.imatrix(), num_experts)
    tokens = x.expand(num_experts, *x.shape)
    state = stacked.update(stacked.init(tokens), tokens, route)
    assert state.nonfinite.sum(-1).tolist() == [1, 0]
    spec = qstats.QuantSpec.from_compressed_tensors(expected[0][0])
    w = torch.stack([layer.weight.data for layer in layers])
    obs = qstats.imatrix_mse(spec, w.shape, state)
    qp = qstats.compute_qparams(obs.update(obs.init(w), w), spec)
    for e, (_, scale, zero_point) in enumerate(expected):
        _assert_same(qp._replace(scale=qp.scale[e], zero_point=qp.zero_point[e]), scale, zero_point)


def test_block_strategy_is_weighted_where_llm_compressor_falls_back():
    """llm-compressor's imatrix_mse supports channel and group strategies only and searches a block
    spec uniformly (as a per-tensor one): qstats' imatrix_mse without a state gives its choice."""
    fields = dict(num_bits=8, type="float", symmetric=True, strategy="block", block_structure=[16, 32])
    layer, xs = _layer(), _acts(6)
    args, scale, zero_point = _llmc(fields, layer, xs)
    _assert_same(_qstats(args, layer.weight.data, xs, with_state=False), scale, zero_point)


def _llama_cpp(rows, ids, num_experts):
    """llama.cpp's imatrix collection, reimplemented in Python floats: every row routed to an expert
    adds x**2 to its values and 1 to its count. Non-finite values (and squares) are left out of
    their column's sum and count, qstats' policy (llama.cpp stops on them)."""
    channels = len(rows[0])
    values = [[0.0] * channels for _ in range(num_experts)]
    counts = [[0] * channels for _ in range(num_experts)]
    for row, experts in zip(rows, ids):
        for e in experts:
            for j, v in enumerate(row):
                square = v * v
                if math.isfinite(square):
                    values[e][j] += square
                    counts[e][j] += 1
    means = [[v / max(c, 1) for v, c in zip(vs, cs)] for vs, cs in zip(values, counts)]
    return torch.tensor(means, dtype=torch.float64)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64], ids=["fp16", "bf16", "fp64"])
def test_per_expert_importance_with_padding_equals_llama_cpp(dtype):
    """[E, batch, seq, C] activations, a [E, batch, seq] mask (padding and routing). fp64 inputs
    hold 1e200, whose square overflows: left out and counted as a NaN is (it made the channel's
    importance Inf)."""
    num_experts, batch, seq, channels = 3, 2, 5, 6
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(batch, seq, channels, generator=g, dtype=torch.float64) * 100).to(dtype)
    x[0, 1, 2] = float("nan")
    x[1, 0, 4] = 1e200 if dtype == torch.float64 else float("inf")
    padding = torch.ones(batch, seq, dtype=torch.bool)
    padding[1, 3:] = False
    route = torch.rand(num_experts, batch, seq, generator=g) < 0.6
    route[2] = False  # an idle expert
    mask = route & padding
    stacked = qstats.stacked_observer(qstats.imatrix(), num_experts)
    tokens = x.expand(num_experts, *x.shape)
    state = stacked.update(stacked.init(tokens), tokens, mask)
    rows = [[float(v) for v in row] for row in x.reshape(-1, channels).double()]
    ids = [[e for e in range(num_experts) if mask[e].reshape(-1)[t]] for t in range(len(rows))]
    assert state.count.tolist() == mask.reshape(num_experts, -1).sum(1).tolist()
    torch.testing.assert_close(qstats.importance(state), _llama_cpp(rows, ids, num_experts), rtol=1e-12, atol=0.0)


def test_float64_square_overflow_is_left_out_and_counted():
    x = torch.tensor([[1e200, 3.0], [2.0, 4.0]], dtype=torch.float64)
    obs = qstats.imatrix()
    state = obs.update(obs.init(x), x)
    assert state.nonfinite.tolist() == [1, 0]
    assert qstats.importance(state).tolist() == [4.0, (9.0 + 16.0) / 2]


@pytest.mark.parametrize("state, field", [
    (qstats.IMatrixState(torch.zeros(4), torch.tensor(0), torch.zeros(4, dtype=torch.int64)), "square_total"),
    (qstats.IMatrixState(torch.zeros(4, dtype=torch.float64), torch.tensor(0.0), torch.zeros(4)), "count"),
    (qstats.IMatrixState(torch.zeros(4, dtype=torch.float64), torch.zeros(2, dtype=torch.int64),
                         torch.zeros(4, dtype=torch.int64)), "line up"),
], ids=["float32-sum", "float-count", "count-shape"])
def test_corrupt_states_raise_naming_the_field(state, field):
    """A float32 sum became float64 after an update, a float count divided importance by a
    float, a count of shape (2,) broadcast against the channels: all were accepted."""
    obs = qstats.imatrix()
    good = obs.init(torch.zeros(1, 4))
    for call in (lambda: obs.update(state, torch.ones(2, 4)), lambda: obs.merge(good, state),
                 lambda: qstats.importance(state)):
        with pytest.raises(ValueError, match=field):
            call()


def test_empty_batch_still_checks_the_weight():
    obs = qstats.imatrix()
    state = obs.init(torch.zeros(1, 3))
    with pytest.raises(ValueError, match=r"weight of shape \(7,\)"):
        obs.update(state, torch.zeros(0, 3), torch.ones(7))
    assert obs.update(state, torch.zeros(0, 3), torch.ones(0)) is state


def test_laws_and_checkpoints_of_half_precision_and_stacked_states():
    obs = qstats.imatrix()
    testing.check_all(obs, lambda g: (torch.randn(2, 5, 8, generator=g) * 300).to(torch.float16), max_examples=3)
    stacked = qstats.stacked_observer(obs, 3)
    testing.check_all(stacked, lambda g: torch.randn(3, 6, 8, generator=g).to(torch.bfloat16),
                      max_examples=2, batch_dims=1)
    x = torch.randn(3, 6, 8)
    x[1, 2, 3] = float("nan")
    state = stacked.update(stacked.init(x), x, torch.tensor([[1, 0, 1, 1, 0, 1]] * 3))
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "imatrix.safetensors")
        qstats.io.save(path, {"experts": state})
        back = qstats.io.load(path)["experts"]
    assert type(back) is qstats.IMatrixState
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(back, state))
