"""qstats.imatrix / imatrix_mse against llm-compressor's imatrix_mse observer (the real library)."""

import pytest
import torch

import qstats

pytest.importorskip("llmcompressor.observers")
from _shared import llm_compressor_imatrix_mse  # noqa: E402


def _activations(seed=0):
    g = torch.Generator().manual_seed(seed)
    # input channels of very different importance
    scales = torch.logspace(-1, 1, 64)
    return [torch.randn(3, 10 + i, 64, generator=g) * scales for i in range(3)]


def test_importance_is_mean_square_per_input_channel():
    xs = _activations()
    obs = qstats.imatrix()
    state = obs.init(xs[0])
    for x in xs:
        state = obs.update(state, x)
    rows = torch.cat([x.reshape(-1, 64) for x in xs]).double()
    assert int(state.count) == rows.shape[0]
    assert torch.allclose(qstats.importance(state), (rows**2).mean(0), rtol=1e-12)
    shards = [obs.update(obs.init(x), x) for x in xs]
    merged = obs.merge(shards[1], obs.merge(shards[2], shards[0]))
    assert torch.equal(merged.count, state.count)
    assert torch.allclose(merged.square_total, state.square_total, rtol=1e-12)


def test_row_mask_and_nonfinite():
    obs = qstats.imatrix()
    x = torch.tensor([[1.0, 2.0], [3.0, float("nan")], [100.0, 100.0]])
    state = obs.update(obs.init(x), x, torch.tensor([1, 1, 0]))
    assert int(state.count) == 2 and state.nonfinite.tolist() == [0, 1]
    # channel 1 kept one finite value (2.0): the NaN is left out of its sum and of its count
    assert qstats.importance(state).tolist() == [5.0, 4.0]
    with pytest.raises(ValueError, match="input channels"):
        obs.update(state, torch.ones(3, 5))


_llmc = llm_compressor_imatrix_mse


@pytest.mark.parametrize(
    "fields",
    [dict(num_bits=4, type="int", symmetric=True, strategy="channel"),
     dict(num_bits=4, type="int", symmetric=False, strategy="group", group_size=16)],
    ids=["channel", "group"],
)
def test_imatrix_mse_equals_llm_compressor(fields):
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 24, bias=False)
    xs = _activations(1)
    kwargs = {"patience": 10**6}
    args, scale, zero_point = _llmc(fields, layer, xs, **kwargs)
    spec = qstats.QuantSpec.from_compressed_tensors(args)
    imatrix = qstats.imatrix()
    istate = imatrix.init(xs[0])
    for x in xs:
        istate = imatrix.update(istate, x)
    w = layer.weight.data
    obs = qstats.imatrix_mse(spec, w.shape, istate)
    qp = qstats.compute_qparams(obs.update(obs.init(w), w), spec)
    assert torch.equal(qp.scale, scale.reshape(qp.scale.shape))
    assert torch.equal(qp.zero_point.to(zero_point.dtype), zero_point.reshape(qp.zero_point.shape))
    # early stopping as llm-compressor's default patience
    _, scale5, _ = _llmc(fields, layer, xs, patience=5)
    qp5 = qstats.compute_qparams(obs.update(obs.init(w), w), spec, patience=5)
    assert torch.equal(qp5.scale, scale5.reshape(qp5.scale.shape))


def test_importance_changes_the_choice_towards_important_columns():
    torch.manual_seed(1)
    w = torch.randn(8, 64)
    spec = qstats.QuantSpec(dtype="int3", granularity=qstats.PerAxis(0))
    xs = _activations(2)
    istate = qstats.imatrix().update(qstats.imatrix().init(xs[0]), xs[0])
    weighted = qstats.imatrix_mse(spec, w.shape, istate)
    uniform = qstats.imatrix_mse(spec, w.shape, None)
    qp_w = qstats.compute_qparams(weighted.update(weighted.init(w), w), spec)
    qp_u = qstats.compute_qparams(uniform.update(uniform.init(w), w), spec)
    imp = qstats.importance(istate).float()

    def weighted_error(qp):
        return float(((qstats.fake_quantize(w, qp, spec) - w).abs() ** 3 * imp).sum())

    assert weighted_error(qp_w) <= weighted_error(qp_u)


def test_bad_input():
    spec = qstats.QuantSpec(dtype="int4", granularity=qstats.PerAxis(0))
    state = qstats.imatrix().init(torch.ones(2, 8))
    with pytest.raises(ValueError, match="input channels"):
        qstats.imatrix_mse(spec, (4, 16), state)
    with pytest.raises(ValueError, match="two dimensions"):
        qstats.imatrix_mse(spec, (16,), None)
    with pytest.raises(ValueError, match="shape"):
        qstats.imatrix().init(torch.tensor(1.0))


def test_importance_is_the_mean_square_over_each_channel_finite_values():
    x = torch.randn(7, 5, dtype=torch.float64)
    x[2, 1] = float("nan")
    x[4, 1] = float("inf")
    x[0, 3] = float("-inf")
    obs = qstats.imatrix()
    state = obs.update(obs.init(x), x)
    squares = torch.where(torch.isfinite(x), x * x, torch.nan)
    torch.testing.assert_close(qstats.importance(state), torch.nanmean(squares, dim=0), rtol=1e-12, atol=0.0)
    assert state.nonfinite.tolist() == [0, 2, 0, 1, 0]


@pytest.mark.parametrize(
    "activations",
    [[torch.zeros(3, 10, 64)], [torch.randn(3, 10, 64, generator=torch.Generator().manual_seed(3)) * 1e20]],
    ids=["all-zero", "overflowing"],
)
def test_imatrix_mse_falls_back_to_uniform_as_llm_compressor(activations):
    """An importance that is all zeros or not finite in float32: llm-compressor searches with
    uniform weights (every candidate would have loss 0, or NaN weights, otherwise)."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 24, bias=False)
    fields = dict(num_bits=4, type="int", symmetric=True, strategy="channel")
    args, scale, zero_point = _llmc(fields, layer, activations, patience=10**6)
    spec = qstats.QuantSpec.from_compressed_tensors(args)
    imatrix = qstats.imatrix()
    istate = imatrix.init(activations[0])
    for x in activations:
        istate = imatrix.update(istate, x)
    assert int(istate.count) > 0
    w = layer.weight.data
    obs = qstats.imatrix_mse(spec, w.shape, istate)
    qp = qstats.compute_qparams(obs.update(obs.init(w), w), spec)
    assert torch.equal(qp.scale, scale.reshape(qp.scale.shape))
    assert torch.equal(qp.zero_point.to(zero_point.dtype), zero_point.reshape(qp.zero_point.shape))


def test_imatrix_mse_names_both_shapes_for_a_tensor_of_another_shape():
    spec = qstats.QuantSpec(dtype="int4", granularity=qstats.PerAxis(0))
    x = torch.randn(5, 8)
    istate = qstats.imatrix().update(qstats.imatrix().init(x), x)
    obs = qstats.imatrix_mse(spec, (6, 8), istate)
    state = obs.init(torch.randn(6, 8))
    with pytest.raises(ValueError, match=r"\(6, 16\).*\(6, 8\)"):
        obs.update(state, torch.randn(6, 16))
    with pytest.raises(ValueError, match=r"\(6, 4\).*\(6, 8\)"):
        obs.init(torch.randn(6, 4))
    # an empty tensor leaves the state as it is
    assert all(torch.equal(a, b) for a, b in zip(obs.update(state, torch.randn(0, 8)), state))


def _llama_cpp_expert_importance(x, ids, num_experts):
    """llama.cpp's imatrix.cpp for GGML_OP_MUL_MAT_ID, reimplemented: for every expert, every token
    routed to it adds ``x**2`` to the expert's values and one to its count; the saved importance is
    values / count, zero-filled for an expert no token reached."""
    channels = x.shape[-1]
    values = [[0.0] * channels for _ in range(num_experts)]
    counts = [0] * num_experts
    for token, chosen in enumerate(ids.tolist()):
        for ex in chosen:
            counts[ex] += 1
            for j in range(channels):
                values[ex][j] += float(x[token, j]) ** 2
    return torch.tensor([[v / c if c > 0 else 0.0 for v in row] for row, c in zip(values, counts)], dtype=torch.float64)


@pytest.mark.parametrize("num_experts, channels", [(3, 8), (4, 4)], ids=["E!=C", "E==C"])
def test_stacked_importance_is_per_expert_as_llama_cpp(num_experts, channels):
    """importance() of a stacked imatrix subtracted each expert's row count from the channels'
    non-finite counts along the wrong dimension: [E] - [E, C] raised for E != C and, for E == C,
    divided each expert's channel j by expert j's count."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(24, channels, generator=g, dtype=torch.float64) * torch.logspace(-1, 1, channels, dtype=torch.float64)
    ids = torch.stack([torch.randperm(num_experts - 1, generator=g)[:2] for _ in range(24)])  # top-2; the last expert idle
    route = torch.zeros(num_experts, 24, dtype=torch.int64)
    for token, chosen in enumerate(ids.tolist()):
        route[chosen, token] = 1
    obs = qstats.stacked_observer(qstats.imatrix(), num_experts)
    stack = x.expand(num_experts, *x.shape)
    state = obs.update(obs.init(stack), stack, route)
    assert state.count.tolist() == route.sum(1).tolist()
    torch.testing.assert_close(qstats.importance(state), _llama_cpp_expert_importance(x, ids, num_experts),
                               rtol=1e-12, atol=0.0)


def test_imatrix_mse_on_stacked_experts_equals_llm_compressor_per_expert_linear():
    """A stacked importance [E, in] with an [E, out, in] weight: each expert searched with its own
    importance, as llm-compressor's imatrix_mse on each expert's Linear fed the tokens routed to it
    (an expert no token reached falls back to uniform there). The old code broadcast [E] against
    [E, in] and could not expand the importance to the weight."""
    num_experts, out_features, in_features = 3, 8, 32
    g = torch.Generator().manual_seed(5)
    x = torch.randn(40, in_features, generator=g) * torch.logspace(-1, 1, in_features)
    route = torch.stack([torch.rand(40, generator=g) < 0.5, torch.rand(40, generator=g) < 0.3, torch.zeros(40, dtype=torch.bool)])
    torch.manual_seed(2)
    layers = [torch.nn.Linear(in_features, out_features, bias=False) for _ in range(num_experts)]
    fields = dict(num_bits=4, type="int", symmetric=False, strategy="group", group_size=16)
    expected = [_llmc(fields, layers[e], [x[route[e]]] if route[e].any() else [], patience=10**6) for e in range(num_experts)]
    spec = qstats.QuantSpec.from_compressed_tensors(expected[0][0])
    imatrix = qstats.stacked_observer(qstats.imatrix(), num_experts)
    stack = x.expand(num_experts, *x.shape)
    istate = imatrix.update(imatrix.init(stack), stack, route)
    w = torch.stack([layer.weight.data for layer in layers])
    obs = qstats.imatrix_mse(spec, w.shape, istate)
    qp = qstats.compute_qparams(obs.update(obs.init(w), w), spec)
    for e, (_, scale, zero_point) in enumerate(expected):
        assert torch.equal(qp.scale[e], scale.reshape(qp.scale[e].shape)), e
        assert torch.equal(qp.zero_point[e].to(zero_point.dtype), zero_point.reshape(qp.zero_point[e].shape)), e
    with pytest.raises(ValueError, match=r"\(3,\) \+ \(out, in\)"):
        qstats.imatrix_mse(spec, (out_features, in_features), istate)


@pytest.mark.parametrize("with_state", [False, True], ids=["None", "no-rows"])
def test_uniform_imatrix_mse_on_bf16_weights_equals_llm_compressor_fallback(with_state):
    """Without importance data llm-compressor's imatrix_mse still forms every error in float32;
    imatrix_state=None used qstats.mse's bf16 error sums (llm-compressor's plain mse observer)
    instead and chose other scales for bf16 weights (4 of 768 group scales here)."""
    torch.manual_seed(3)
    layer = torch.nn.Linear(512, 24, bias=False).to(torch.bfloat16)
    fields = dict(num_bits=4, type="int", symmetric=False, strategy="group", group_size=16)
    args, scale, zero_point = _llmc(fields, layer, [], patience=10**6)  # no tokens: the uniform fallback
    spec = qstats.QuantSpec.from_compressed_tensors(args, observed_dtype=torch.bfloat16)
    w = layer.weight.data
    istate = qstats.imatrix().init(torch.zeros(1, 512)) if with_state else None
    obs = qstats.imatrix_mse(spec, w.shape, istate)
    qp = qstats.compute_qparams(obs.update(obs.init(w), w), spec)
    assert torch.equal(qp.scale, scale.reshape(qp.scale.shape))
    assert torch.equal(qp.zero_point.to(zero_point.dtype), zero_point.reshape(qp.zero_point.shape))


@pytest.mark.parametrize("expand", [0.5, float("nan"), float("inf"), True])
def test_expand_below_one_is_refused_naming_imatrix_mse(expand):
    """As llm-compressor's mse observers refuse it (its imatrix_mse takes it: docs/differences.md); the
    error named qstats.mse, which the user did not call."""
    from compressed_tensors.quantization import QuantizationArgs
    from llmcompressor.observers import Observer

    if expand == 0.5:
        args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="channel",
                                observer="memoryless_mse", observer_kwargs={"expand": expand})
        with pytest.raises(ValueError, match="expand"):
            Observer.load_from_registry("memoryless_mse", base_name="weight", args=args)
    spec = qstats.QuantSpec(dtype="int4", granularity=qstats.PerAxis(0))
    with pytest.raises(ValueError, match="^imatrix_mse: expand must be"):
        qstats.imatrix_mse(spec, (4, 16), None, expand=expand)
