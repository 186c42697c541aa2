"""Fixed, placeholder, noop and recording observers against torch.ao's."""

import warnings

import pytest
import torch
from torch.ao.quantization import observer as ao

import qstats

warnings.filterwarnings("ignore")


@pytest.mark.parametrize(
    "ours,theirs",
    [(qstats.sigmoid_qparams, ao.default_fixed_qparams_range_0to1_observer),
     (qstats.tanh_qparams, ao.default_fixed_qparams_range_neg1to1_observer)],
    ids=["sigmoid", "tanh"],
)
def test_presets_match_torch_ao(ours, theirs):
    reference = theirs()
    x = torch.randn(4, 8)
    reference(x)
    scale, zero_point = reference.calculate_qparams()
    obs = ours()
    qp = qstats.compute_qparams(obs.update(obs.init(x), x), obs.spec)
    assert float(qp.scale) == float(scale)
    assert int(qp.zero_point) == int(zero_point)
    assert (obs.spec.qmin, obs.spec.qmax) == (reference.quant_min, reference.quant_max)
    # the fake-quantized values agree with torch's kernel
    expected = torch.fake_quantize_per_tensor_affine(x, float(scale), int(zero_point), reference.quant_min, reference.quant_max)
    assert torch.equal(qstats.fake_quantize(x, qp, obs.spec), expected)


def test_fixed_qparams_per_channel_and_validation():
    spec = qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0))
    obs = qstats.fixed_qparams(spec, torch.tensor([0.1, 0.2, 0.3]), 0)
    x = torch.randn(3, 5)
    state = obs.update(obs.init(x), x)
    assert int(state.count) == 15
    qp = qstats.compute_qparams(state, spec)
    assert torch.equal(qp.scale, torch.tensor([0.1, 0.2, 0.3]))
    with pytest.raises(ValueError, match="do not fit"):
        obs.init(torch.randn(4, 5))
    with pytest.raises(ValueError, match="scale"):
        qstats.fixed_qparams(spec, 0.0)
    with pytest.raises(ValueError, match="zero_point"):
        qstats.fixed_qparams(spec, 0.1, 300)
    # a scale the spec's scale dtype cannot hold (QParams' scales are its values)
    bf16 = qstats.QuantSpec(dtype="int8", scale_dtype="bfloat16")
    with pytest.raises(ValueError, match="not a bfloat16 value"):
        qstats.fixed_qparams(bf16, 0.1)
    held = float(torch.tensor(0.1).bfloat16())
    assert float(qstats.compute_qparams(qstats.fixed_qparams(bf16, held).init(x), bf16).scale) == held
    e8m0 = qstats.QuantSpec(dtype="fp8_e4m3fn", scale_dtype="e8m0")
    assert float(qstats.compute_qparams(qstats.fixed_qparams(e8m0, 0.5).init(x), e8m0).scale) == 0.5
    with pytest.raises(ValueError, match="not a power of two"):
        qstats.fixed_qparams(e8m0, 0.3)


def test_states_of_other_constants_do_not_merge():
    """Merging them kept the first argument's constants: not commutative, and one observer's
    constants silently lost. Stacked (vmap) too."""
    spec = qstats.QuantSpec(dtype="uint8", mapping="asymmetric")
    a, b = qstats.fixed_qparams(spec, 0.5, 3), qstats.fixed_qparams(spec, 0.25, 7)
    x = torch.randn(4)
    with pytest.raises(ValueError, match="different constants"):
        a.merge(a.update(a.init(x), x), b.update(b.init(x), x))
    same = a.merge(a.update(a.init(x), x), a.update(a.init(x), x))
    assert float(same.scale) == 0.5 and int(same.count) == 8
    stacked_a, stacked_b = qstats.stacked_observer(a, 2), qstats.stacked_observer(b, 2)
    xs = torch.randn(2, 4)
    with pytest.raises(ValueError, match="different constants"):
        stacked_a.merge(stacked_a.init(xs), stacked_b.init(xs))


def test_placeholder_and_noop_refuse_qparams_like_torch_ao():
    with pytest.raises(Exception):
        ao.PlaceholderObserver(dtype=torch.float16).calculate_qparams()
    with pytest.raises(Exception):
        ao.NoopObserver().calculate_qparams()
    spec = qstats.QuantSpec()
    for obs in (qstats.placeholder(spec), qstats.noop(spec)):
        x = torch.randn(3, 4)
        state = obs.update(obs.init(x), x)
        assert int(state.count) == 12
        with pytest.raises(TypeError, match="no statistics"):
            qstats.compute_qparams(state, spec)


def test_recording_keeps_everything_below_capacity_like_torch_ao():
    reference = ao.RecordingObserver()
    obs = qstats.recording(capacity=64)
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(3, 4, generator=g) for _ in range(3)]
    state = obs.init(xs[0])
    for x in xs:
        reference(x)
        state = obs.update(state, x)
    recorded = torch.cat([t.reshape(-1) for t in reference.get_tensor_value()])
    assert torch.equal(torch.sort(qstats.recorded_values(state)).values, torch.sort(recorded).values)
    assert int(state.count) == 36


def test_recording_is_bounded_and_split_invariant():
    obs = qstats.recording(capacity=50)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1000, generator=g)
    whole = obs.update(obs.init(x), x)
    assert whole.values.shape == (50,) and int(whole.count) == 1000
    parts = [obs.update(obs.init(x), p) for p in x.split([100, 450, 450])]
    merged = obs.merge(parts[2], obs.merge(parts[0], parts[1]))
    for left, right in zip(whole, merged):
        assert torch.equal(left, right)
    # a sample of the data, not its first values
    kept = qstats.recorded_values(whole)
    assert set(kept.tolist()) <= set(x.tolist()) and not torch.equal(kept, x[:50])
    with pytest.raises(ValueError, match="capacity"):
        qstats.recording(capacity=0)


def test_update_with_a_tensor_of_another_parameter_shape_raises_naming_both():
    spec = qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0))
    obs = qstats.fixed_qparams(spec, scale=torch.full((4,), 0.1))
    state = obs.init(torch.randn(4, 9))
    with pytest.raises(ValueError, match=r"\(7,\).*\(4,\)"):
        obs.update(state, torch.randn(7, 9))
    assert int(obs.update(state, torch.randn(4, 9)).count) == 36
    assert torch.equal(obs.update(state, torch.empty(0, 9)).count, state.count)


def test_fixed_scales_at_the_float32_extremes_are_refused():
    """A subnormal scale (1 / scale is Inf: fake_quantize gave NaN at x = 0, where torch's kernel
    gives 0), a scale whose code range overflows float32 (the extreme codes, and x near the float32
    limit, fake-quantized to +-Inf) and a non-finite float zero point (every value NaN) raise
    naming the problem; the extremes still accepted keep every fake-quantized value finite."""
    spec = qstats.QuantSpec(dtype="uint8", mapping="asymmetric")
    for scale in (1e-45, 1e-39, 2.2e38, 1e37):
        with pytest.raises(ValueError, match="scale .* out of range"):
            qstats.fixed_qparams(spec, scale)
    with pytest.raises(ValueError, match="scale .* out of range"):
        qstats.fixed_qparams(qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0)), torch.tensor([0.1, 1e-45]))
    x = torch.tensor([0.0, 1.0, -1.0, 3.4e38, -3.4e38])
    for scale in (float(torch.finfo(torch.float32).tiny), 1e30):
        obs = qstats.fixed_qparams(spec, scale, 128)
        qp = qstats.compute_qparams(obs.init(x), spec)
        assert torch.isfinite(qstats.fake_quantize(x, qp, spec)).all()
        assert torch.isfinite(qstats.dequantize(torch.tensor([0, 255], dtype=torch.uint8), qp, spec)).all()
    # the bound is the farthest code from the zero point: half the code range for symmetric specs
    for other, scale in ((qstats.QuantSpec(dtype="int8"), 2e36), (qstats.QuantSpec(dtype="fp8_e4m3fn"), 5e35)):
        qp = qstats.compute_qparams(qstats.fixed_qparams(other, scale).init(x), other)
        assert torch.isfinite(qstats.fake_quantize(x, qp, other)).all()
    float_zero = qstats.QuantSpec(dtype="uint8", mapping="asymmetric", zero_point_domain="float")
    for zero_point in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="zero_point must be finite"):
            qstats.fixed_qparams(float_zero, 0.1, zero_point)
