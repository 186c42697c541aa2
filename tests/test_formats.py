"""Element formats, e8m0 scales and bad input (qstats/_formats.py).

References: torch's own fp8 casts (fp8 e4m3fn/e5m2/fnuz), torchao's fp4/fp6 bit-code
conversions, compressed-tensors' ``cast_to_fp4`` and float64 arithmetic for power-of-two scales.
"""

import dataclasses
import math
import warnings

import pytest
import torch

import qstats
from qstats import _formats

warnings.filterwarnings("ignore")

FP8 = ("fp8_e4m3fn", "fp8_e5m2", "fp8_e4m3fnuz", "fp8_e5m2fnuz")
EMULATED = ("fp6_e2m3", "fp6_e3m2", "fp4_e2m1")
ALL = FP8 + EMULATED


def _fmt(name):
    return qstats.QuantSpec(dtype=name).float_format


def _edge_values(fmt, n=4000, seed=0):
    g = torch.Generator().manual_seed(seed)
    grid = _all_values(fmt)
    grid = grid[torch.isfinite(grid)]
    pos = grid[grid > 0].sort().values
    midpoints = (pos[1:] + pos[:-1]) / 2  # exact ties
    tiny = pos[0] / 2
    values = torch.cat(
        [
            torch.randn(n, generator=g) * fmt.max / 4,
            torch.rand(n, generator=g) * fmt.min_normal * 2,
            midpoints,
            -midpoints,
            torch.tensor([0.0, -0.0, tiny, -tiny, tiny * 1.01, fmt.max, -fmt.max, fmt.max * 1.01, fmt.max * 1e6]),
            torch.tensor([1e-30, -1e-30, 1e30, -1e30]),
        ]
    )
    return values.float()


def _all_values(fmt):
    bits = 1 + fmt.exponent_bits + fmt.mantissa_bits
    if fmt.torch_dtype is not None:
        return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fmt.torch_dtype).float()
    return _formats.decode(torch.arange(2**bits, dtype=torch.uint8), fmt)


@pytest.mark.parametrize("name", FP8)
def test_emulated_rounding_equals_torch_fp8_cast(name):
    fmt = _fmt(name)
    emulated = dataclasses.replace(fmt, torch_dtype=None)
    x = _edge_values(fmt)
    reference = x.clamp(-fmt.max, fmt.max).to(fmt.torch_dtype).float()
    ours = _formats.round_to_format(x, emulated)
    assert torch.equal(ours.view(torch.int32), reference.view(torch.int32)) or torch.equal(ours, reference)
    assert torch.equal(ours, reference)


@pytest.mark.parametrize("name", EMULATED)
def test_encode_decode_match_torchao(name):
    from torchao.prototype.mx_formats import kernels

    to_codes, to_float = {
        "fp4_e2m1": (kernels.f32_to_f4_unpacked, kernels.f4_unpacked_to_f32),
        "fp6_e2m3": (kernels.f32_to_f6_e2m3_unpacked, kernels.f6_e2m3_unpacked_to_f32),
        "fp6_e3m2": (kernels.f32_to_f6_e3m2_unpacked, kernels.f6_e3m2_unpacked_to_f32),
    }[name]
    fmt = _fmt(name)
    x = _edge_values(fmt)
    assert torch.equal(_formats.encode(x, fmt), to_codes(x))
    codes = torch.arange(2 ** (1 + fmt.exponent_bits + fmt.mantissa_bits), dtype=torch.uint8)
    assert torch.equal(_formats.decode(codes, fmt), to_float(codes))


def test_fp4_rounding_matches_compressed_tensors_cast():
    from compressed_tensors.quantization.utils.fp4_utils import cast_to_fp4

    fmt = _fmt("fp4_e2m1")
    x = _edge_values(fmt).clamp(-6, 6)
    assert torch.equal(_formats.round_to_format(x, fmt), cast_to_fp4(x.clone()))


@pytest.mark.parametrize("name", ALL)
def test_every_representable_value_round_trips(name):
    fmt = _fmt(name)
    values = _all_values(fmt)
    values = values[torch.isfinite(values)]
    spec = qstats.QuantSpec(dtype=name, granularity=qstats.PerTensor(), zero_point_domain="none")
    qp = qstats.QParams(torch.tensor(1.0), torch.tensor(0, dtype=torch.int32), torch.tensor(1.0), torch.tensor(True))
    codes = qstats.quantize(values, qp, spec)
    assert codes.dtype == qstats.code_dtype(spec)
    assert torch.equal(qstats.dequantize(codes, qp, spec), values)
    assert torch.equal(qstats.fake_quantize(values, qp, spec), values)
    # with a power-of-two scale too
    qp2 = qp._replace(scale=torch.tensor(2.0**-5))
    assert torch.equal(qstats.dequantize(qstats.quantize(values * 2.0**-5, qp2, spec), qp2, spec), values * 2.0**-5)


@pytest.mark.parametrize("name", ("nvfp4", "mxfp4", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp8", "mxfp8_e5m2"))
def test_round_trip_of_grid_values_through_observed_qparams(name):
    spec = qstats.preset(name, on_uncalibrated="fallback")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 64, generator=g)
    obs = qstats.minmax(spec)
    qp = qstats.compute_qparams(obs.update(obs.init(x), x), spec)
    grid = qstats.fake_quantize(x, qp, spec)  # values exactly on the quantization grid
    codes = qstats.quantize(grid, qp, spec)
    assert torch.equal(qstats.dequantize(codes, qp, spec), grid)


def test_power_of_two_int_scales_against_float64():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(16, 32, generator=g) * torch.logspace(-3, 3, 16).unsqueeze(1)
    for rounding in ("floor", "ceil", "rceil"):
        spec = qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0), scale_dtype="e8m0", scale_rounding=rounding)
        obs = qstats.minmax(spec)
        qp = qstats.compute_qparams(obs.update(obs.init(x), x), spec)
        amax = x.abs().amax(1).double()
        if rounding == "floor":
            expected = [2.0 ** (math.floor(math.log2(a)) - 6) for a in amax.tolist()]
        elif rounding == "ceil":
            expected = [2.0 ** (math.ceil(math.log2(a)) - 6) for a in amax.tolist()]
        else:
            expected = [2.0 ** math.ceil(math.log2(a / 127)) for a in amax.tolist()]
        assert torch.equal(qp.scale.double(), torch.tensor(expected, dtype=torch.float64))
        codes = qstats.quantize(x, qp, spec)
        assert codes.dtype == torch.int8
        if rounding == "rceil":  # never clips
            assert torch.equal(codes.float(), torch.round(x / qp.scale.unsqueeze(1)))


def test_power_of_two_scales_on_unsigned_targets_use_the_symmetric_zero_point():
    x = torch.tensor([[-3.0, 1.0, 2.5, 0.0]])
    spec = qstats.QuantSpec(dtype="uint8", scale_dtype="e8m0", scale_rounding="rceil")
    obs = qstats.minmax(spec)
    qp = qstats.compute_qparams(obs.update(obs.init(x), x), spec)
    assert qp.zero_point.item() == 128 and qp.scale.item() == 2.0 ** math.ceil(math.log2(3.0 / 127))
    expected = torch.round(x / qp.scale) + 128  # rceil never clips
    assert torch.equal(qstats.quantize(x, qp, spec).float(), expected)


@pytest.mark.parametrize("name", ("nvfp4", "mxfp4", "mxfp6_e2m3", "mxfp8"))
@pytest.mark.parametrize("rounding", ("floor", "ceil", "even", "rceil", "round_then_floor", "round"))
@pytest.mark.parametrize("convention", ("torch_ao", "torchao", "compressed_tensors"))
def test_all_zero_and_tiny_blocks_give_finite_nonzero_scales(name, rounding, convention):
    formula = "range_over_amax" if convention == "compressed_tensors" else "amax_over_range"
    overrides = dict(convention=convention, global_scale_formula=formula)
    if name != "nvfp4":
        overrides["scale_rounding"] = rounding
    elif rounding != "floor":
        pytest.skip("rounding applies to e8m0 scales only")
    spec = qstats.preset(name, **overrides)
    for x in (torch.zeros(2, 64), torch.full((2, 64), 1e-40), torch.cat([torch.zeros(1, 64), torch.ones(1, 64)])):
        obs = qstats.minmax(spec)
        qp = qstats.compute_qparams(obs.update(obs.init(x), x), spec)
        for t in (qp.scale, qp.global_scale):
            assert torch.isfinite(t).all() and (t > 0).all()
        out = qstats.fake_quantize(x, qp, spec)
        assert torch.isfinite(out).all()
        assert torch.equal(out[x == 0], torch.zeros_like(out[x == 0]))


def test_bad_specs_raise_naming_the_field():
    with pytest.raises(ValueError, match="scale_rounding"):
        qstats.QuantSpec(dtype="fp4_e2m1", scale_dtype="e8m0", scale_rounding="nearest")
    with pytest.raises(ValueError, match="global_scale_formula"):
        qstats.QuantSpec(dtype="fp4_e2m1", granularity=qstats.TensorGroup(16), global_scale_formula="x")
    with pytest.raises(ValueError, match="e8m0"):
        qstats.QuantSpec(dtype="int8", mapping="asymmetric", scale_dtype="e8m0")
    with pytest.raises(ValueError, match="e8m0"):
        qstats.QuantSpec(dtype="fp4_e2m1", granularity=qstats.TensorGroup(16), scale_dtype="e8m0")
    with pytest.raises(ValueError, match="TensorGroup"):
        qstats.QuantSpec(dtype="int4", mapping="asymmetric", granularity=qstats.TensorGroup(16))
    with pytest.raises(ValueError, match="unknown preset"):
        qstats.preset("mxfp3")
    with pytest.raises(ValueError, match="fp4_e2m1|unknown target"):
        qstats.QuantSpec(dtype="fp4_e3m0")


def test_group_that_does_not_divide_raises_with_shapes():
    spec = qstats.preset("nvfp4")
    obs = qstats.minmax(spec)
    with pytest.raises(ValueError, match=r"\(4, 40\)"):
        obs.init(torch.zeros(4, 40))
    spec = qstats.preset("fp8_block")
    with pytest.raises(ValueError, match=r"\(200, 128\)"):
        qstats.minmax(spec).init(torch.zeros(200, 128))


@pytest.mark.parametrize("name", ("nvfp4", "mxfp4", "mxfp6_e3m2"))
def test_vmap_matches_loop(name):
    spec = qstats.preset(name)
    g = torch.Generator().manual_seed(3)
    xs = torch.randn(3, 4, 32, generator=g) * torch.tensor([0.01, 1.0, 100.0]).view(3, 1, 1)
    obs = qstats.minmax(spec)

    def qparams_and_fq(x):
        qp = qstats.compute_qparams(obs.update(obs.init(x), x), spec)
        return qp.scale, qp.global_scale, qstats.fake_quantize(x, qp, spec)

    batched = torch.func.vmap(qparams_and_fq)(xs)
    for i in range(3):
        for got, want in zip(batched, qparams_and_fq(xs[i])):
            assert torch.equal(got[i], want)


def test_fake_quantize_gradient_is_straight_through_inside_range():
    spec = qstats.preset("mxfp4")
    x = torch.randn(2, 32, requires_grad=True)
    obs = qstats.minmax(spec)
    qp = qstats.compute_qparams(obs.update(obs.init(x.detach()), x.detach()), spec)
    qstats.fake_quantize(x, qp, spec).sum().backward()
    assert set(x.grad.unique().tolist()) <= {0.0, 1.0}
    assert x.grad.sum() > 0


def test_nvfp4_qparams_and_fake_quantize_compile_without_graph_breaks():
    spec = qstats.preset("nvfp4")
    obs = qstats.minmax(spec)

    def observe_and_fake_quantize(x):
        qp = qstats.compute_qparams(obs.update(obs.init(x), x), spec)
        return qstats.fake_quantize(x, qp, spec)

    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(6))
    compiled = torch.compile(observe_and_fake_quantize, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), observe_and_fake_quantize(x))


@pytest.mark.parametrize("rounding", ["floor", "ceil", "even", "rceil", "round_then_floor", "round"])
@pytest.mark.parametrize("dtype", ["int8", "int4", "uint8", "fp8_e4m3fn", "fp8_e5m2", "fp4_e2m1"])
def test_e8m0_scales_of_the_widest_ranges_keep_every_code_finite(dtype, rounding):
    """Power-of-two (e8m0) scales of ranges up to the float32 limit: rounding a clipped range up
    to a power of two never puts the farthest code (-128 for int8, past ``element_max``'s 127;
    the element format's largest value) past float32, so the scale times it, and every
    fake-quantized value, is finite (the parity tests against torchao and compressed-tensors
    cover ordinary ranges)."""
    mappings = ["symmetric"] if dtype.startswith(("fp", "u")) else ["symmetric", "narrow", "symmetric_no_clipping_err"]
    for mapping in mappings:
        spec = qstats.QuantSpec(
            dtype=dtype, mapping=mapping, scale_dtype="e8m0", scale_rounding=rounding,
            zero_point_domain="none" if dtype.startswith("fp") else "int",
        )
        x = torch.tensor([[-3.4e38, 1.0, 3.3e38, -1.0], [-1.7e38, 2.0, 0.5, 1e38], [-1.0, 0.25, 3.0, 0.0]])
        obs = qstats.minmax(spec)
        qp = qstats.compute_qparams(obs.update(obs.init(x), x), spec)
        if dtype.startswith("fp"):
            farthest = float(spec.float_format.max)
        else:
            lo, hi = spec.qrange
            farthest = float(max(hi - spec.zero_point_of_symmetric, spec.zero_point_of_symmetric - lo))
        assert torch.isfinite(qp.scale * farthest).all(), (mapping, qp.scale)
        assert torch.isfinite(qstats.fake_quantize(x, qp, spec)).all(), mapping


@pytest.mark.parametrize("convention", ["torch_ao", "compressed_tensors", "torchao"])
def test_int32_codes_saturate_at_the_top_code_instead_of_wrapping(convention):
    """float32 cannot hold 2**31 - 1: the largest value's code must not wrap to -2**31 (it did under
    the compressed-tensors and torchao conventions). Reference: torch.quantize_per_tensor."""
    x = torch.tensor([-1e4, 0.5, 1e4, 9999.0])
    spec = qstats.QuantSpec(dtype="int32", convention=convention)
    obs = qstats.minmax(spec)
    qp = qstats.compute_qparams(obs.update(obs.init(x), x), spec)
    codes = qstats.quantize(x, qp, spec)
    reference = torch.quantize_per_tensor(x, float(qp.scale), int(qp.zero_point), torch.qint32).int_repr()
    assert codes.dtype == torch.int32 and codes[2] == 2**31 - 1
    assert (codes - reference).abs().max() <= 1  # the conventions round x / scale in their own arithmetic
    assert torch.equal(qstats.dequantize(codes, qp, spec), qstats.fake_quantize(x, qp, spec))


@pytest.mark.parametrize("convention", ["compressed_tensors", "torchao"])
@pytest.mark.parametrize("bits", [12, 16])
def test_codes_of_half_precision_compute_stay_in_the_range(convention, bits):
    """bfloat16 cannot hold 2**(b-1) - 1 for wide targets: clamped there it became 2**(b-1), which
    int16 wrapped to -32768 (the largest value quantized to the smallest code) or which lay past
    quant_max. Codes saturate at quant_max; fake_quantize keeps the library's own value."""
    x = (torch.arange(64.0) - 31.5).reshape(2, 32).to(torch.bfloat16)
    spec = qstats.QuantSpec(dtype=f"int{bits}", convention=convention, compute_dtype="bfloat16",
                            scale_dtype="bfloat16" if convention == "torchao" else "float32")
    obs = qstats.minmax(spec)
    qp = qstats.compute_qparams(obs.update(obs.init(x), x), spec)
    codes = qstats.quantize(x, qp, spec)
    assert codes.min() >= spec.qmin and codes.max() <= spec.qmax
    assert codes[-1, -1] == spec.qmax  # the largest value gets the top code, not a wrapped one
    assert (codes.float() * torch.sign(x.float()) >= 0).all()
