"""quantize / dequantize / fake_quantize against torch's own quantization ops, bit for bit.

For every torch.ao observer configuration (dtype x qscheme x reduce_range x some custom ranges),
the torch.ao observer's parameters are used twice: by ``torch.fake_quantize_per_tensor_affine`` /
``torch.fake_quantize_per_channel_affine`` (float zero points for
``per_channel_affine_float_qparams``) and ``torch.quantize_per_tensor`` / ``quantize_per_channel``,
and by qstats' ``fake_quantize`` / ``quantize`` / ``dequantize`` with ``QuantSpec.from_torch_ao``.
Inputs cover the calibration data, values far outside the range, exact ``.5`` ties of the scaled
value, and float32/bfloat16/float16. Gradients are compared with torch's fake-quant ops (1 inside,
0 where clipped).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from test_compat_torch_ao import ALLOWED_DTYPES as DTYPES  # every dtype torch.ao's observers accept
from test_compat_torch_ao import PER_CHANNEL, PER_TENSOR
from torch.ao.quantization import observer as ao

import qstats

RANGES = ((None, None), (0, 15), (-8, 7), (-3, 4), (0, 1000), (-(2**15), 2**15 - 1), (-(2**31), 2**31 - 1))
HALF_AND_SINGLE = (torch.float32, torch.bfloat16, torch.float16)
# float64: torch computes x * inv_scale in float64 and the per-channel product (code - zero point) * scale
# in float64, the per-tensor one in float32 (issue 22, item 6)
INPUT_DTYPES = HALF_AND_SINGLE + (torch.float64,)
CH_AXIS = 1
# torch.fake_quantize_per_tensor_affine clamps before casting to int64 from torch 2.9 on (before,
# infinities land on quant_min there too, as in the per-channel kernel)
PER_TENSOR_SATURATES = torch.torch_version.TorchVersion(torch.__version__) >= "2.9"


# Thousands of tiny reductions: one torch thread (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("single_thread_quiet")


def _configurations(qschemes):
    for dtype, qscheme, reduce_range, (quant_min, quant_max) in itertools.product(
        DTYPES, qschemes, (False, True), RANGES
    ):
        kwargs = dict(dtype=dtype, qscheme=qscheme, reduce_range=reduce_range, quant_min=quant_min, quant_max=quant_max)
        try:
            spec = qstats.QuantSpec.from_torch_ao(**kwargs, ch_axis=CH_AXIS)
        except ValueError:
            continue
        if qscheme in PER_TENSOR:
            try:
                reference = ao.MinMaxObserver(**kwargs)
            except NotImplementedError:
                continue  # quint8 per_tensor_symmetric with reduce_range: HistogramObserver's only (as uint8)
        else:
            reference = ao.PerChannelMinMaxObserver(ch_axis=CH_AXIS, **kwargs)
        yield kwargs, spec, reference


def _calibrated(spec, reference, x):
    """torch.ao's (scale, zero point) and qstats' QParams for ``x`` (checked equal)."""
    reference(x)
    scale, zero_point = reference.calculate_qparams()
    obs = qstats.minmax(spec)
    qp = qstats.compute_qparams(obs.update(obs.init(x), x), spec)
    assert torch.equal(qp.scale.reshape(-1), scale.reshape(-1))
    assert torch.equal(qp.zero_point.reshape(-1).double(), zero_point.reshape(-1).double())
    return scale, zero_point, qp


def _test_input(x, scale, zero_point, spec, generator, per_channel):
    """Calibration data, values far outside the range and exact .5 ties of ``x * (1 / scale)``."""
    channels = x.shape[CH_AXIS]
    shape = (1, channels, 1) if per_channel else (1, 1, 1)
    s = scale.reshape(shape)
    z = zero_point.reshape(shape).to(torch.float64)
    inv = 1.0 / s  # float32, as torch's kernels
    # ties: targets k + 0.5 of the scaled value (k + 0.5 - zero point for float zero points)
    k = (torch.arange(-130, 130, dtype=torch.float64) + 0.5).reshape(-1, 1, 5)
    target = k - z if spec.zero_point_domain == "float" else k
    ties = (target / inv.double()).float().expand(-1, channels, 5)
    # far outside the range; per-tensor up to float16 overflow (torch's per-channel kernels cast
    # x / scale to int64 before clamping, so infinities land on quant_min there: see
    # test_per_channel_infinities_clip_to_the_nearest_end)
    top = 4 if per_channel else 6
    far = torch.randn(x.shape, generator=generator) * torch.logspace(0, top, x.shape[-1]).reshape(1, 1, -1)
    return torch.cat([x, x * 3, far, -far, ties], dim=0), ties


def _torch_fake_quantize(x, scale, zero_point, reference, spec):
    if isinstance(spec.granularity, qstats.PerAxis):
        zp = zero_point if zero_point.dtype.is_floating_point else zero_point.to(torch.int32)
        return torch.fake_quantize_per_channel_affine(x, scale, zp, CH_AXIS, reference.quant_min, reference.quant_max)
    return torch.fake_quantize_per_tensor_affine(
        x, float(scale), int(zero_point), reference.quant_min, reference.quant_max
    )


def _torch_quantize(x, scale, zero_point, spec):
    """torch's integer codes, clamped to the spec's range (torch clamps to its dtype's range)."""
    qmin, qmax = spec.qrange
    if -128 <= qmin and qmax <= 127:
        qdtype = torch.qint8
    elif 0 <= qmin and qmax <= 255:
        qdtype = torch.quint8
    else:
        qdtype = torch.qint32
    if isinstance(spec.granularity, qstats.PerAxis):
        zp = zero_point if zero_point.dtype.is_floating_point else zero_point.long()
        q = torch.quantize_per_channel(x, scale.double(), zp, CH_AXIS, qdtype)
    else:
        q = torch.quantize_per_tensor(x, float(scale), int(zero_point), qdtype)
    return q.int_repr().long().clamp(qmin, qmax)


def _check(kwargs, spec, reference, x, generator, counts):
    scale, zero_point, qp = _calibrated(spec, reference, x)
    per_channel = isinstance(spec.granularity, qstats.PerAxis)
    test_x, ties = _test_input(x, scale, zero_point, spec, generator, per_channel)
    inv = 1.0 / (scale.reshape(1, -1, 1) if per_channel else scale)
    scaled = ties * inv
    if spec.zero_point_domain == "float":
        scaled = scaled + zero_point.reshape(1, -1, 1)
    counts["ties"] += int((scaled - scaled.floor() == 0.5).sum())
    in_range = (reference.quant_min <= zero_point) & (zero_point <= reference.quant_max)
    if spec.zero_point_domain == "int" and not bool(in_range.all()):
        # symmetric uint8 with reduce_range: torch.ao's zero point 128 is outside (0, 127) and
        # torch's fake-quant ops refuse it; nothing to compare
        with pytest.raises(RuntimeError, match="zero_point"):
            _torch_fake_quantize(test_x, scale, zero_point, reference, spec)
        with pytest.raises(ValueError, match="zero point"):
            qstats.fake_quantize(test_x, qp, spec)
        counts["refused_by_torch"] += 1
        return
    for dtype in INPUT_DTYPES:
        xt = test_x.to(dtype)
        context = f"{kwargs} input {dtype}"
        theirs_in = xt.clone().requires_grad_(True)
        theirs = _torch_fake_quantize(theirs_in, scale, zero_point, reference, spec)
        theirs.backward(torch.ones_like(theirs))
        ours_in = xt.clone().requires_grad_(True)
        ours = qstats.fake_quantize(ours_in, qp, spec)
        ours.backward(torch.ones_like(ours))
        assert ours.dtype == theirs.dtype == dtype, context
        mismatch = ours != theirs
        if not (per_channel or PER_TENSOR_SATURATES):
            mismatch &= torch.isfinite(xt)  # (see PER_TENSOR_SATURATES)
        assert not mismatch.any(), (
            f"fake_quantize differs for {context} at {int(mismatch.sum())} values, e.g. x={xt[mismatch][:4].tolist()}: "
            f"torch {theirs[mismatch][:4].tolist()} qstats {ours[mismatch][:4].tolist()}"
        )
        assert torch.equal(ours_in.grad, theirs_in.grad), f"fake_quantize gradient differs for {context}"
        assert int(ours_in.grad.sum()) > 0, f"test input must have unclipped values: {context}"
        counts["clipped"] += ours_in.numel() - int(ours_in.grad.sum())
        codes = qstats.quantize(xt, qp, spec)
        assert codes.dtype == qstats.code_dtype(spec)
        assert torch.equal(qstats.dequantize(codes, qp, spec, dtype=dtype), ours), f"dequantize(quantize) for {context}"
        counts["fake_quantize"] += ours.numel()
    qmin, qmax = spec.qrange
    # torch.quantize_per_channel with float zero points and qint32 dies with SIGILL on this torch
    # build (AVX-512 CPU), so float zero points are compared on 8-bit ranges only
    fits_8_bits = -128 <= qmin and qmax <= 255 and qmax - qmin <= 255
    if qmax - qmin <= 2**16 and (spec.zero_point_domain == "int" or fits_8_bits):
        _check_quantize(kwargs, spec, qp, test_x, scale, zero_point, reference, counts)


def _check_quantize(kwargs, spec, qp, x, scale, zero_point, reference, counts):
    """torch's quantize ops round ``x * inv_scale + zero_point`` in a different order than its
    fake-quant ops (quantize_per_tensor on 8 bits: one fused multiply-add in fbgemm; the others:
    float32 ``x * inv_scale + zero_point``; fake-quant: ``round(x * inv_scale) + zero_point``), so
    near .5 ties torch's two disagree. qstats follows the fake-quant ops: its codes equal
    torch.quantize_* wherever torch agrees with itself, and torch's fake-quant codes everywhere."""
    ours = qstats.quantize(x, qp, spec).long()
    theirs = _torch_quantize(x, scale, zero_point, spec)
    per_channel = isinstance(spec.granularity, qstats.PerAxis)
    shape = (1, -1, 1) if per_channel else ()
    fake = _torch_fake_quantize(x, scale, zero_point, reference, spec)
    # codes of torch's fake-quant output (exact: |q - zero point| < 2**16, float32 relative error 2**-24)
    fake_codes = torch.round(fake.double() / scale.reshape(shape).double() + zero_point.reshape(shape).double()).long()
    assert torch.equal(ours, fake_codes), f"quantize vs torch fake-quant codes for {kwargs}"
    torch_disagrees = theirs != fake_codes
    # ... and only where x * inv_scale + zero_point is within a few float32 roundings of a .5 tie
    product = x.double() * (1.0 / scale.reshape(shape)).double()
    exact = product + zero_point.reshape(shape).double()
    distance = (exact - exact.floor() - 0.5).abs()
    magnitude = product.abs() + zero_point.reshape(shape).double().abs() + 1.0
    near_tie = distance <= 4 * torch.finfo(torch.float32).eps * magnitude
    off_ties = torch_disagrees & ~near_tie
    assert not off_ties.any(), f"torch's quantize and fake-quant disagree off the ties for {kwargs}"
    mismatch = (ours != theirs) & ~torch_disagrees
    assert not mismatch.any(), (
        f"quantize differs for {kwargs} at x={x[mismatch][:4].tolist()}: torch {theirs[mismatch][:4].tolist()} "
        f"qstats {ours[mismatch][:4].tolist()}"
    )
    counts["quantize"] += x.numel()
    counts["torch_self_disagreements"] += int(torch_disagrees.sum())


@pytest.mark.parametrize("qscheme", PER_TENSOR + PER_CHANNEL, ids=str)
def test_matches_torch_quantization_ops(qscheme):
    generator = torch.Generator().manual_seed(1)
    names = ("fake_quantize", "quantize", "ties", "torch_self_disagreements", "refused_by_torch", "clipped")
    counts = dict.fromkeys(names, 0)
    for kwargs, spec, reference in _configurations((qscheme,)):
        x = torch.randn(4, 6, 5, generator=generator) * 2.0 + 0.3
        _check(kwargs, spec, reference, x, generator, counts)
    assert counts["quantize"] > 5000 and counts["ties"] > 1000 and counts["clipped"] > 10000
    print(f"{qscheme}: {counts}")


@pytest.mark.skipif(not PER_TENSOR_SATURATES, reason="torch's per-tensor fake-quant kernel saturates from torch 2.9")
@pytest.mark.parametrize("dtype", HALF_AND_SINGLE, ids=str)  # (float64 products differ per tensor and channel)
def test_per_channel_infinities_clip_to_the_nearest_end(dtype):
    """Values beyond int64 after scaling, infinities included: qstats clamps them to the nearest
    end of the range, as torch.fake_quantize_per_tensor_affine does. (torch's per-channel kernel
    casts x / scale to int64 before clamping, so there they land on quant_min.)"""
    big = torch.tensor([float("inf"), -float("inf"), 1e30, -1e30, 1e20, -1e20, 3e4, -3e4, 0.5, -0.25]).to(dtype)
    x = big.reshape(1, -1, 1).expand(2, -1, 3).contiguous()
    scale, zero_point = 0.01, 3
    for qdtype, qscheme in ((torch.qint8, torch.per_channel_affine), (torch.quint8, torch.per_channel_symmetric)):
        spec = qstats.QuantSpec.from_torch_ao(qdtype, qscheme, ch_axis=CH_AXIS)
        if qscheme == torch.per_channel_symmetric:
            zero_point = 128
        channels = x.shape[CH_AXIS]
        qp = qstats.QParams(
            torch.full((channels,), scale),
            torch.full((channels,), zero_point, dtype=torch.int32),
            torch.ones(()),
            torch.ones(channels, dtype=torch.bool),
        )
        ours_in = x.clone().requires_grad_(True)
        ours = qstats.fake_quantize(ours_in, qp, spec)
        ours.sum().backward()
        theirs_in = x.clone().requires_grad_(True)
        qmin, qmax = spec.qrange
        theirs = torch.fake_quantize_per_tensor_affine(theirs_in, scale, zero_point, qmin, qmax)
        theirs.sum().backward()
        assert torch.equal(ours, theirs)
        assert torch.equal(ours_in.grad, theirs_in.grad)
        theirs_codes = torch.quantize_per_tensor(x.float(), scale, zero_point, qdtype).int_repr().long()
        assert torch.equal(qstats.quantize(x.float(), qp, spec).long(), theirs_codes)


@pytest.mark.parametrize("zero_point", (-1, 256, 300))
@pytest.mark.parametrize("per_channel", (False, True), ids=("tensor", "channel"))
def test_zero_points_outside_the_range_raise_like_torch(per_channel, zero_point):
    """An integer zero point outside [quant_min, quant_max]: torch's fake-quant ops raise; qstats
    used to return values off the grid (scale 1, zero point -1 on [0, 255]: +1.0 for -0.25).
    qstats raises ValueError naming the range, eagerly, under vmap and compiled (issue 22, item 5)."""
    granularity = qstats.PerAxis(0) if per_channel else qstats.PerTensor()
    spec = qstats.QuantSpec(dtype="uint8", mapping="asymmetric", granularity=granularity)
    x = torch.tensor([[-0.25, 0.5, 3.0]])
    shape = (1,) if per_channel else ()
    good = torch.zeros(shape, dtype=torch.int32)
    qp = qstats.QParams(torch.ones(shape), torch.full(shape, zero_point, dtype=torch.int32), torch.ones(()),
                        torch.ones(shape, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="zero_point"):
        if per_channel:
            torch.fake_quantize_per_channel_affine(x, qp.scale, qp.zero_point, 0, 0, 255)
        else:
            torch.fake_quantize_per_tensor_affine(x, 1.0, zero_point, 0, 255)
    for run in (
        lambda q: qstats.fake_quantize(x, q, spec),
        lambda q: qstats.quantize(x, q, spec),
        # a QParams built with four fields has minval None: vmap needs in_dim None there
        lambda q: torch.vmap(lambda p: qstats.fake_quantize(x, p, spec), in_dims=(qstats.QParams(0, 0, 0, 0, None),))(
            qstats.QParams(*(None if t is None else t[None] for t in q))),
        lambda q: torch.compile(lambda p: qstats.fake_quantize(x, p, spec), backend="aot_eager", fullgraph=True)(q),
    ):
        with pytest.raises(ValueError, match=r"zero points must lie in .* \[0, 255\]"):
            run(qp)
        ok = run(qp._replace(zero_point=good))  # the range's own zero points pass
        assert ok.shape[-1] == 3
    theirs = torch.fake_quantize_per_tensor_affine(x, 1.0, 255, 0, 255)
    assert torch.equal(qstats.fake_quantize(x, qp._replace(zero_point=good + 255), spec), theirs)


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=str)
def test_codes_past_the_input_dtype_saturate_where_torch_overflows(dtype):
    """Finite fp16/bf16 inputs whose lowest code dequantizes past the dtype: the default int8 spec
    on an fp16 tensor holding -65504 (code -128 times 513.76) is -Inf in torch's fake-quant op;
    qstats saturates at the dtype's largest value (issue 22, item 19), equals torch everywhere
    else, and passes the same gradient."""
    top = torch.finfo(dtype).max
    x = torch.tensor([-top, top, 1.0, -3.0, 0.0], dtype=dtype)
    spec = qstats.QuantSpec(dtype="int8")
    obs = qstats.minmax(spec)
    qp = qstats.compute_qparams(obs.update(obs.init(x), x), spec)
    theirs_in, ours_in = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    theirs = torch.fake_quantize_per_tensor_affine(theirs_in, float(qp.scale), int(qp.zero_point), -128, 127)
    ours = qstats.fake_quantize(ours_in, qp, spec)
    overflow = torch.isinf(theirs)
    if dtype == torch.float16:
        assert overflow.tolist() == [True, False, False, False, False]  # the case this is for
    assert torch.isfinite(ours).all() and ours.dtype == dtype
    assert torch.equal(ours[~overflow], theirs[~overflow])
    assert (ours[overflow] == -top).all()
    theirs.sum().backward()
    ours.sum().backward()
    assert torch.equal(ours_in.grad, theirs_in.grad)
    codes = torch.arange(-128, 128, dtype=torch.int8)
    assert torch.isfinite(qstats.dequantize(codes, qp, spec, dtype=dtype)).all()


@pytest.mark.parametrize(
    "fields, dtype, peak",
    [
        (dict(dtype="fp4_e2m1", scale_dtype="float16", zero_point_domain="none"), torch.float16, 65504.0),
        (dict(dtype="uint1", mapping="asymmetric"), torch.bfloat16, 3.38e38),
        (dict(dtype="int8", mapping="asymmetric", granularity=qstats.PerAxis(0)), torch.float16, 65504.0),
        (dict(dtype="int4", convention="compressed_tensors", compute_dtype="float16"), torch.float16, 65504.0),
        (dict(dtype="int8", convention="torchao", compute_dtype="bfloat16", scale_dtype="bfloat16"), torch.bfloat16, 3.38e38),
        # bfloat16 scales of one-bit targets: peak / 0.5 rounded past bfloat16's largest value to Inf
        (dict(dtype="int1", scale_dtype="bfloat16"), torch.float32, 1.7e38),
        (dict(dtype="uint1", mapping="asymmetric", scale_dtype="bfloat16"), torch.float32, 1.7e38),
    ],
)
def test_every_code_dequantizes_to_a_finite_value(fields, dtype, peak):
    """fp4 with an fp16 scale (6 x 10920 = 65520), uint1 on bf16 near 3.39e38, and the conventions
    that dequantize in the input's dtype: finite values for finite inputs."""
    spec = qstats.QuantSpec(**fields)
    x = torch.tensor([[-peak, peak, peak / 3, 1.0] * 4, [peak, -peak / 7, 0.5, 0.0] * 4]).to(dtype)
    obs = qstats.minmax(spec)
    qp = qstats.compute_qparams(obs.update(obs.init(x), x), spec)
    assert torch.isfinite(qp.scale).all() and (qp.scale > 0).all()
    out = qstats.fake_quantize(x, qp, spec)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert torch.isfinite(qstats.dequantize(qstats.quantize(x, qp, spec), qp, spec, dtype=dtype)).all()


@pytest.mark.parametrize("dtype", ["int16", "int12"])
def test_half_precision_zero_points_of_wide_targets_lie_in_the_range(dtype):
    """torchao clamps an asymmetric zero point in the input's dtype, where bfloat16 rounds quant_max
    (32767, 2047) up: an all-negative row got the zero point 32768, which compute_qparams returned
    and quantize / fake_quantize then refused. Zero points now lie in the range."""
    x = torch.tensor([[-3.0, -1.0, -2.0, -0.5], [-1.0, 2.0, 0.25, 3.0]], dtype=torch.bfloat16)
    spec = qstats.QuantSpec(dtype=dtype, mapping="asymmetric", granularity=qstats.PerToken(),
                            convention="torchao", compute_dtype="bfloat16", scale_dtype="bfloat16")
    obs = qstats.minmax(spec)
    qp = qstats.compute_qparams(obs.update(obs.init(x), x), spec)
    assert (qp.zero_point >= spec.qmin).all() and (qp.zero_point <= spec.qmax).all()
    out = qstats.fake_quantize(x, qp, spec)
    assert (out.float() - x.float()).abs().max() <= 0.02
    codes = qstats.quantize(x, qp, spec)
    assert codes.min() >= spec.qmin and codes.max() <= spec.qmax


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.bool])
def test_integer_input_is_refused_as_torch_refuses_it(dtype):
    """An integer tensor was fake-quantized and cast back: ``[1, 2, 300]`` came back as truncated
    ints, no error. torch's fake-quant ops refuse it (NotImplementedError); qstats names it."""
    x = torch.tensor([1, 2, 300]).to(dtype)
    spec = qstats.QuantSpec(dtype="int8", mapping="symmetric")
    qp = qstats.QParams(torch.tensor(0.7), torch.tensor(0, dtype=torch.int32), torch.tensor(1.0), torch.tensor(True))
    with pytest.raises(NotImplementedError):
        torch.fake_quantize_per_tensor_affine(x, 0.7, 0, -128, 127)
    for function in (qstats.fake_quantize, qstats.quantize):
        with pytest.raises(TypeError, match="floating-point"):
            function(x, qp, spec)


@pytest.mark.parametrize("spec", [None, "nvfp4", qstats.PerTensor()], ids=["None", "preset-name", "granularity"])
def test_a_spec_that_is_no_quantspec_is_a_type_error_naming_it(spec):
    """quantize / dequantize / fake_quantize failed with "'NoneType' object has no attribute
    'granularity'" (AttributeError) where compute_qparams names the argument."""
    x = torch.randn(4, 32)
    good = qstats.QuantSpec()
    qp = qstats.compute_qparams(qstats.minmax(good).update(qstats.minmax(good).init(x), x), good)
    with pytest.raises(TypeError, match="compute_qparams: spec must be a QuantSpec"):
        qstats.compute_qparams(qstats.minmax(good).update(qstats.minmax(good).init(x), x), spec)
    codes = qstats.quantize(x, qp, good)
    for where, call in (("quantize", lambda: qstats.quantize(x, qp, spec)),
                        ("dequantize", lambda: qstats.dequantize(codes, qp, spec)),
                        ("fake_quantize", lambda: qstats.fake_quantize(x, qp, spec))):
        with pytest.raises(TypeError, match=f"{where}: spec must be a QuantSpec"):
            call()
    if spec == "nvfp4":
        with pytest.raises(TypeError, match=r"qstats.preset\('nvfp4'\)"):
            qstats.fake_quantize(x, qp, spec)


def test_dequantize_codes_that_are_no_tensor_is_a_type_error_naming_them():
    spec = qstats.QuantSpec()
    qp = qstats.QParams(torch.tensor(0.5), torch.tensor(0, dtype=torch.int32), torch.tensor(1.0), torch.tensor(True))
    with pytest.raises(TypeError, match="dequantize: codes must be a tensor"):
        qstats.dequantize([1, 2, 3], qp, spec)
