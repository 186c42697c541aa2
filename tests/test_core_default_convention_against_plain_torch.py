"""minmax + compute_qparams + fake_quantize / quantize / dequantize of the default (torch_ao) convention
against the same arithmetic written in plain torch over an independent reshape of each granularity:
integer (signed, unsigned, every mapping) and fp8 targets, every granularity (negative axes, partial
blocks), fp32/fp64/bf16/fp16 inputs with 0- and 1-size dimensions, transposed, channels-last and
strided layouts, and all-zero, constant, one-sided, subnormal and NaN-holding values."""

import math

import pytest
import torch

import qstats

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies

KINDS = ("normal", "zero", "constant", "positive", "negative", "subnormal", "large", "nan")


@st.composite
def cases(draw):
    target = draw(st.sampled_from(["int2", "int3", "int4", "int8", "uint2", "uint4", "uint8", "int16", "fp8_e4m3fn",
                                   "fp8_e5m2"]))
    mappings = ["symmetric"] if target.startswith(("fp", "u")) else ["symmetric", "narrow", "symmetric_no_clipping_err"]
    mapping = draw(st.sampled_from(mappings + ([] if target.startswith("fp") else ["asymmetric"])))
    shape = draw(st.lists(st.sampled_from([0, 1, 2, 3, 4, 6]), min_size=1, max_size=4))
    ndim = len(shape)
    kind = draw(st.sampled_from(["tensor", "axis", "group", "block", "row"]))
    if kind == "axis":
        granularity = qstats.PerAxis(draw(st.integers(-ndim, ndim - 1)))
    elif kind == "group":
        size = draw(st.sampled_from([1, 2, 3, 4]))
        shape[-1] = size * draw(st.integers(0, 3))
        granularity = qstats.PerGroup(size)
    elif kind == "block":
        shape = [3] + shape if ndim < 2 else shape
        block = (draw(st.integers(1, 4)), draw(st.integers(1, 4)))
        granularity = qstats.PerBlock(block, partial=draw(st.booleans()))
        if not granularity.partial:
            shape[-2], shape[-1] = block[0] * draw(st.integers(0, 2)), block[1] * draw(st.integers(1, 2))
    elif kind == "row":
        granularity = qstats.PerRow(draw(st.integers(-ndim, ndim - 1)))
    else:
        granularity = qstats.PerTensor()
    spec = qstats.QuantSpec(
        dtype=target, mapping=mapping, granularity=granularity, on_uncalibrated="fallback",
        eps=draw(st.sampled_from([torch.finfo(torch.float32).eps, 1e-12, 0.01])),
        zero_point_domain="none" if target.startswith("fp") else "int",
    )
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16]))
    x = _values(tuple(shape), draw(st.sampled_from(KINDS)), draw(st.integers(0, 2**20)), dtype)
    return spec, _laid_out(x, draw(st.sampled_from(["contiguous", "transposed", "channels_last", "strided"])))


def _values(shape, kind, seed, dtype):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    x = {"zero": x * 0, "constant": torch.full(shape, -2.5, dtype=torch.float64), "positive": x.abs() + 0.01,
         "negative": -x.abs() - 0.01, "subnormal": x * 1e-41, "large": x * 1e4}.get(kind, x)
    if kind == "nan" and x.numel():
        x.view(-1)[0] = math.nan
    return x.to(dtype)


def _laid_out(x, layout):
    if layout == "transposed" and x.ndim >= 2:
        return x.transpose(0, -1).contiguous().transpose(0, -1)
    if layout == "channels_last" and x.ndim == 4:
        return x.contiguous(memory_format=torch.channels_last)
    if layout == "strided":
        return torch.cat([x, x], dim=-1)[..., ::2]
    return x


def _groups(x, granularity):
    """``(groups, elements)`` of ``x`` (partial blocks padded with NaN) and the qparam shape."""
    if isinstance(granularity, qstats.PerTensor):
        return x.reshape(1, -1), ()
    if isinstance(granularity, qstats.PerAxis):
        axis = granularity.axis % x.ndim
        return x.movedim(axis, 0).reshape(x.shape[axis], -1), (x.shape[axis],)
    if isinstance(granularity, qstats.PerRow):
        moved = x.movedim(granularity.dim % x.ndim, -1)
        return moved.reshape(-1, moved.shape[-1]), moved.shape[:-1]
    if isinstance(granularity, qstats.PerGroup):
        size = granularity.group_size
        return x.reshape(-1, size), x.shape[:-1] + (x.shape[-1] // size,)
    (r, c), (rows, cols) = granularity.block_shape, x.shape[-2:]
    flat = x.reshape(-1, rows, cols)
    out = torch.full((flat.shape[0], -(-rows // r), -(-cols // c), r * c), math.nan, dtype=x.dtype)
    for i in range(out.shape[1]):
        for j in range(out.shape[2]):
            block = flat[:, i * r:(i + 1) * r, j * c:(j + 1) * c].reshape(flat.shape[0], -1)
            out[:, i, j, :block.shape[1]] = block
    return out.reshape(-1, r * c), x.shape[:-2] + out.shape[1:3]


def _reference(x, spec):
    """``(scale, zero_point, calibrated, fake-quantized groups, groups)`` as torch.ao computes them."""
    groups, qshape = _groups(x, spec.granularity)
    finite = groups.isfinite()
    calibrated = finite.any(-1)
    lo = torch.where(finite, groups.double(), math.inf).amin(-1).float().clamp(max=0)
    hi = torch.where(finite, groups.double(), -math.inf).amax(-1).float().clamp(min=0)
    lo, hi = torch.where(calibrated, lo, 0.0), torch.where(calibrated, hi, 0.0)
    qmin, qmax = spec.qrange
    zero_point = torch.full_like(lo, spec.zero_point_of_symmetric, dtype=torch.int32)
    if spec.mapping == "asymmetric":
        scale = ((hi - lo) / float(qmax - qmin)).clamp_min(spec.eps)
        zero_point = (qmin - torch.round(lo / scale)).clamp(qmin, qmax).to(torch.int32)
    elif spec.mapping == "symmetric_no_clipping_err":
        scale = torch.max(lo / qmin, hi / qmax).clamp_min(spec.eps)
    else:
        scale = (torch.max(-lo, hi) / ((qmax - qmin) / 2)).clamp_min(spec.eps)
    if spec.is_float:
        zero_point = torch.zeros_like(zero_point)
    scale, zero_point = torch.where(calibrated, scale, 1.0), torch.where(calibrated, zero_point, 0)
    s, z = scale[:, None], zero_point[:, None]
    if spec.is_float:
        fmax = spec.float_format.max
        values = (groups.float() / s).clamp(-fmax, fmax).to(spec.float_format.torch_dtype).float() * s
    else:  # torch's kernels: x * (1 / scale) in the input's precision; per tensor, a float32 product
        work = groups.double() if groups.dtype == torch.float64 else groups.float()
        codes = (torch.round(work * (1.0 / s).to(work.dtype)) + z).clamp(qmin, qmax)
        per_tensor = isinstance(spec.granularity, qstats.PerTensor)
        values = (codes - z).float() * s if per_tensor else (codes - z) * s
    limit = min(torch.finfo(x.dtype).max, torch.finfo(values.dtype).max)  # qstats saturates fp16/bf16 outputs
    values = values.clamp(-limit, limit).to(x.dtype)
    return scale.reshape(qshape), zero_point.reshape(qshape), calibrated.reshape(qshape), values, groups


@hypothesis.settings(max_examples=200, deadline=None, database=None,
                     suppress_health_check=[hypothesis.HealthCheck.too_slow])
@hypothesis.given(cases())
def test_default_convention_equals_torch_ao_arithmetic_in_plain_torch(case):
    spec, x = case
    hypothesis.assume(x.numel() > 0)
    obs = qstats.minmax(spec)
    qp = qstats.compute_qparams(obs.update(obs.init(x), x), spec)
    scale, zero_point, calibrated, values, groups = _reference(x, spec)
    assert torch.equal(qp.scale, scale) and torch.equal(qp.zero_point, zero_point)
    assert torch.equal(qp.calibrated, calibrated)
    assert bool((qp.scale > 0).all()) and bool(qp.scale.isfinite().all())
    ours = qstats.fake_quantize(x, qp, spec)
    assert ours.dtype == x.dtype and ours.shape == x.shape
    ours_groups = _groups(ours, spec.granularity)[0]
    data = ~groups.isnan()  # NaN stays NaN (and partial blocks' padding)
    assert torch.equal(ours_groups[data], values[data])
    assert bool(ours_groups[~data].isnan().all())
    kept = ~x.isnan()
    dequantized = qstats.dequantize(qstats.quantize(x, qp, spec), qp, spec, dtype=x.dtype)
    assert torch.equal(dequantized[kept], ours[kept])
