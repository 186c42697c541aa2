"""LSQ / LSQ+ learnable ranges against torch.ao's learnable fake quant.

References: ``torch._fake_quantize_learnable_per_tensor_affine`` / ``_per_channel_affine`` (the
kernels) and ``torch.ao.quantization._learnable_fake_quantize._LearnableFakeQuantize`` (the module,
with ``use_grad_scaling=True``). Forward values and the gradients with respect to x, scale and
zero point must agree to 1e-6.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from torch.ao.quantization import MovingAverageMinMaxObserver, MovingAveragePerChannelMinMaxObserver
from torch.ao.quantization._learnable_fake_quantize import _LearnableFakeQuantize

import qstats

TOL = dict(rtol=1e-6, atol=1e-6)


def _grads_qstats(x, scale, zero_point, spec, dy, grad_scale="torch_ao"):
    x = x.clone().requires_grad_(True)
    scale = scale.clone().requires_grad_(True)
    zero_point = zero_point.clone().requires_grad_(True)
    y = qstats.lsq_fake_quantize(x, qstats.LSQParams(scale, zero_point), spec, grad_scale=grad_scale)
    y.backward(dy)
    zero_grad = zero_point.grad if zero_point.grad is not None else torch.zeros_like(zero_point)
    return y.detach(), x.grad, scale.grad, zero_grad


def _grads_torch(x, scale, zero_point, qmin, qmax, factor, dy, axis=None):
    x = x.clone().requires_grad_(True)
    scale = scale.clone().reshape(-1).requires_grad_(True)
    zero_point = zero_point.clone().reshape(-1).requires_grad_(True)
    if axis is None:
        y = torch._fake_quantize_learnable_per_tensor_affine(x, scale, zero_point, qmin, qmax, factor)
    else:
        y = torch._fake_quantize_learnable_per_channel_affine(x, scale, zero_point, axis, qmin, qmax, factor)
    y.backward(dy)
    return y.detach(), x.grad, scale.grad, zero_point.grad


@settings(max_examples=25, deadline=None)
# torch's CPU kernel forms (codes - zero_point) * scale - x with one rounding (a fused multiply-add),
# qstats rounds the product first: the unscaled scale gradients are 1.1e-5 apart here
@example(seed=0, dtype="uint8", spread=6.15625, scale_value=0.1333371773222041, zero_fraction=0.5, scaled=False)
@given(
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from(["uint8", "uint4"]),
    spread=st.floats(0.5, 8.0),
    scale_value=st.floats(0.005, 0.2),
    zero_fraction=st.floats(0.05, 0.95),
    scaled=st.booleans(),
)
def test_per_tensor_lsq_plus_matches_torch(seed, dtype, spread, scale_value, zero_fraction, scaled):
    g = torch.Generator().manual_seed(seed)
    spec = qstats.QuantSpec(dtype=dtype, mapping="asymmetric")
    qmin, qmax = spec.qrange
    x = torch.randn(5, 7, generator=g) * spread
    dy = torch.randn(5, 7, generator=g)
    scale = torch.tensor(scale_value)
    # Non-negative, non-half zero points: torch's backward rounds them like its forward there.
    zero_point = torch.tensor(round(zero_fraction * qmax) + 0.3)
    factor = 1.0 / (x.numel() * qmax) ** 0.5 if scaled else 1.0
    # torch's scale gradient tests clipping at x / scale + zero_point + 0.5 (its backward adds 0.5
    # to the zero point instead of rounding it), its forward at round(x / scale) + round(zero_point):
    # where the two disagree (seed 609: 254.85 inside for the forward, clipped for the gradient)
    # torch's kernel contradicts itself, and qstats follows the forward
    unscaled = x * (1.0 / scale)
    torch_clipped = ((unscaled + (zero_point + 0.5)) > qmax) | ((unscaled + (zero_point + 0.5)) < qmin)
    codes = torch.round(unscaled + torch.round(zero_point))
    assume(torch.equal(torch_clipped, (codes > qmax) | (codes < qmin)))
    ours = _grads_qstats(x, scale, zero_point, spec, dy, "torch_ao" if scaled else None)
    ref = _grads_torch(x, scale, zero_point, qmin, qmax, factor, dy)
    # With LSQ's gradient scale the range gradients are O(0.1) and agree to 1e-6. Unscaled, they
    # are sums of 35 terms of O(1), added in another order (and each term's product associated
    # differently) than torch's kernel: float32 rounding then allows a few 1e-6 relative.
    # The product's rounding differs by at most an ulp of |codes - zero_point| * scale, divided by
    # scale for each element's scale gradient: at most qmax * 2**-23 * sum |dy| in all.
    tol = TOL if scaled else dict(rtol=1e-5, atol=1e-5)
    fused = dict(rtol=1e-5, atol=max(1e-5, qmax * 2.0**-23 * float(dy.abs().sum())))
    for index, (a, b) in enumerate(zip(ours, ref)):
        torch.testing.assert_close(a.reshape(b.shape), b, **(fused if index == 2 and not scaled else tol))


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_per_tensor_lsq_symmetric_matches_torch(dtype):
    g = torch.Generator().manual_seed(0)
    spec = qstats.QuantSpec(dtype=dtype, mapping="symmetric")
    qmin, qmax = spec.qrange
    x = torch.randn(64, generator=g) * 2
    dy = torch.randn(64, generator=g)
    scale = torch.tensor(3.0 / qmax)  # clips the tails of x
    zero_point = torch.tensor(0.0)
    factor = 1.0 / (x.numel() * qmax) ** 0.5
    y, dx, dscale, dzero = _grads_qstats(x, scale, zero_point, spec, dy)
    ry, rdx, rdscale, _ = _grads_torch(x, scale, zero_point, qmin, qmax, factor, dy)
    torch.testing.assert_close(y, ry, **TOL)
    torch.testing.assert_close(dx, rdx, **TOL)
    torch.testing.assert_close(dscale.reshape(1), rdscale, **TOL)
    # LSQ: the zero point of a symmetric spec is fixed, so it gets no gradient.
    assert float(dzero.abs().sum()) == 0.0
    assert bool((dx == 0).any()) and bool((dx == dy).any())  # both sides of the range exercised


@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("dtype,mapping", [("uint8", "asymmetric"), ("int8", "asymmetric"), ("int4", "symmetric")])
def test_per_channel_matches_torch(axis, dtype, mapping):
    g = torch.Generator().manual_seed(axis + 7)
    spec = qstats.QuantSpec(dtype=dtype, mapping=mapping, granularity=qstats.PerAxis(axis))
    qmin, qmax = spec.qrange
    x = torch.randn(4, 6, 5, generator=g) * 3
    dy = torch.randn(4, 6, 5, generator=g)
    channels = x.shape[axis]
    scale = torch.rand(channels, generator=g) * 0.05 + 0.01
    if mapping == "asymmetric":
        zero_point = torch.rand(channels, generator=g) * (qmax - qmin) * 0.8 + qmin + 0.1 * (qmax - qmin)
    else:
        zero_point = torch.zeros(channels)
    factor = 1.0 / (x.numel() * qmax) ** 0.5
    ours = _grads_qstats(x, scale, zero_point, spec, dy)
    ref = _grads_torch(x, scale, zero_point, qmin, qmax, factor, dy, axis=axis % x.ndim)
    for name, a, b in zip(("y", "dx", "dscale"), ours[:3], ref[:3]):
        torch.testing.assert_close(a, b, **TOL, msg=name)
    if mapping == "asymmetric":
        torch.testing.assert_close(ours[3], ref[3], **TOL)


@pytest.mark.parametrize("per_channel", [False, True])
def test_matches_learnable_fake_quantize_module(per_channel):
    """The whole torch.ao module: static estimate from its observer, then learning with grad scaling."""
    torch.manual_seed(3)
    w = torch.randn(6, 10) * 0.5
    if per_channel:
        module = _LearnableFakeQuantize(
            MovingAveragePerChannelMinMaxObserver, quant_min=0, quant_max=255, channel_len=6,
            use_grad_scaling=True, dtype=torch.quint8, qscheme=torch.per_channel_affine, ch_axis=0,
        )
        spec = qstats.QuantSpec.from_torch_ao(torch.quint8, torch.per_channel_affine, ch_axis=0)
        observer = qstats.moving_average_minmax(spec, 0.01)
    else:
        module = _LearnableFakeQuantize(
            MovingAverageMinMaxObserver, quant_min=0, quant_max=255, use_grad_scaling=True,
            dtype=torch.quint8, qscheme=torch.per_tensor_affine,
        )
        spec = qstats.QuantSpec.from_torch_ao(torch.quint8, torch.per_tensor_affine)
        observer = qstats.moving_average_minmax(spec, 0.01)
    # Static estimate (observer on): both initialise the range from the same observed data.
    module.enable_static_estimate()
    module(w)
    state = observer.update(observer.init(w), w)
    params = qstats.lsq_init(state, spec)
    torch.testing.assert_close(params.scale.reshape(-1), module.scale.detach(), rtol=0, atol=0)
    torch.testing.assert_close(params.zero_point.reshape(-1), module.zero_point.detach(), rtol=0, atol=0)
    # Learning: gradients of the same loss.
    module.enable_param_learning()
    x = torch.randn(6, 10) * 0.7
    dy = torch.randn(6, 10)
    xr = x.clone().requires_grad_(True)
    module(xr).backward(dy)
    scale = params.scale.clone().requires_grad_(True)
    zero_point = params.zero_point.clone().requires_grad_(True)
    xq = x.clone().requires_grad_(True)
    qstats.lsq_fake_quantize(xq, qstats.LSQParams(scale, zero_point), spec).backward(dy)
    torch.testing.assert_close(xq.grad, xr.grad, **TOL)
    torch.testing.assert_close(scale.grad.reshape(-1), module.scale.grad, **TOL)
    torch.testing.assert_close(zero_point.grad.reshape(-1), module.zero_point.grad, **TOL)


def test_lsq_init_from_any_observer_state():
    spec = qstats.QuantSpec(dtype="int4", mapping="asymmetric", granularity=qstats.PerAxis(0))
    x = torch.randn(3, 16)
    for observer in (qstats.minmax(spec), qstats.moving_average_minmax(spec, 0.1), qstats.memoryless_minmax(spec)):
        state = observer.update(observer.init(x), x)
        params = qstats.lsq_init(state, spec)
        qp = qstats.compute_qparams(state, spec)
        assert params.scale.dtype == params.zero_point.dtype == torch.float32
        torch.testing.assert_close(params.scale, qp.scale)
        torch.testing.assert_close(params.zero_point, qp.zero_point.float())
        # Initialised from the observer, LSQ's forward is the observer's fake quant.
        torch.testing.assert_close(qstats.lsq_fake_quantize(x, params, spec), qstats.fake_quantize(x, qp, spec))


def test_grad_scale_options():
    spec = qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0))
    assert qstats.lsq_grad_factor(400, 4, spec, "torch_ao") == pytest.approx(1 / (400 * 127) ** 0.5)
    assert qstats.lsq_grad_factor(400, 4, spec, "per_parameter") == pytest.approx(1 / (100 * 127) ** 0.5)
    assert qstats.lsq_grad_factor(400, 4, spec, None) == 1.0
    assert qstats.lsq_grad_factor(400, 4, spec, 0.25) == 0.25
    with pytest.raises(ValueError, match="grad_scale"):
        qstats.lsq_grad_factor(400, 4, spec, "sqrt")


def test_composes_with_func_grad_vmap_and_compile():
    spec = qstats.QuantSpec(dtype="uint8", mapping="asymmetric")
    x = torch.randn(4, 32)
    scales = torch.rand(4) * 0.02 + 0.01
    zeros = torch.full((4,), 120.2)

    def loss(scale, zero_point, row):
        return (qstats.lsq_fake_quantize(row, qstats.LSQParams(scale, zero_point), spec) ** 2).sum()

    batched = torch.func.vmap(torch.func.grad(loss, argnums=(0, 1)))(scales, zeros, x)
    for i in range(4):
        s = scales[i].clone().requires_grad_(True)
        z = zeros[i].clone().requires_grad_(True)
        loss(s, z, x[i]).backward()
        torch.testing.assert_close(batched[0][i], s.grad)
        torch.testing.assert_close(batched[1][i], z.grad)
    compiled = torch.compile(torch.func.grad(loss, argnums=(0, 1)), fullgraph=True, backend="aot_eager")
    got = compiled(scales[0], zeros[0], x[0])
    torch.testing.assert_close(got[0], batched[0][0])
    torch.testing.assert_close(got[1], batched[1][0])


def test_tiny_scale_is_floored_not_zero():
    spec = qstats.QuantSpec(dtype="int8")
    scale = torch.tensor(0.0, requires_grad=True)
    y = qstats.lsq_fake_quantize(torch.tensor([1e-9, -3.0]), qstats.LSQParams(scale, torch.tensor(0.0)), spec)
    assert bool(torch.isfinite(y).all())
    y.sum().backward()
    assert bool(torch.isfinite(scale.grad))


def test_bad_input():
    spec = qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0))
    x = torch.randn(3, 4)
    with pytest.raises(ValueError, match="params.scale has shape"):
        qstats.lsq_fake_quantize(x, qstats.LSQParams(torch.ones(4), torch.zeros(4)), spec)
    with pytest.raises(TypeError, match="LSQParams"):
        qstats.lsq_fake_quantize(x, (torch.ones(3), torch.zeros(3)), spec)
    with pytest.raises(ValueError, match="integer target"):
        qstats.lsq_fake_quantize(x, qstats.LSQParams(torch.ones(3), torch.zeros(3)), qstats.QuantSpec(dtype="fp8_e4m3fn"))


def test_empty_tensor_is_returned_empty():
    # An empty batch (a MoE expert that got no tokens) once raised ZeroDivisionError in the
    # gradient scale 1 / sqrt(numel * qmax).
    spec = qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(1))
    scale = torch.full((4,), 0.1, requires_grad=True)
    params = qstats.LSQParams(scale, torch.zeros(4))
    for grad_scale in ("torch_ao", "per_parameter", None):
        x = torch.empty(0, 4, requires_grad=True)
        y = qstats.lsq_fake_quantize(x, params, spec, grad_scale=grad_scale)
        assert y.shape == (0, 4)
        y.sum().backward()
        torch.testing.assert_close(scale.grad, torch.zeros(4))


def test_grad_scale_of_a_range_without_positive_codes_raises_value_error():
    spec = qstats.QuantSpec(dtype="int1")  # qrange (-1, 0): 1 / sqrt(numel * 0)
    with pytest.raises(ValueError, match="qmax"):
        qstats.lsq_grad_factor(10, 1, spec, "torch_ao")
    assert qstats.lsq_grad_factor(10, 1, spec, None) == 1.0
    assert qstats.lsq_grad_factor(10, 1, spec, 0.5) == 0.5


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(dtype="uint8", mapping="asymmetric", convention="compressed_tensors"),  # zero point -31 of (-128, 127)
        dict(dtype="uint4", mapping="symmetric", convention="compressed_tensors"),
        dict(dtype="int4", mapping="narrow", convention="compressed_tensors"),  # clamps to -8, not -7
        dict(dtype="int8", mapping="asymmetric", zero_point_domain="none", convention="compressed_tensors"),
        dict(dtype="uint8", mapping="asymmetric", zero_point_domain="float", convention="torchao"),  # input units
    ],
)
def test_specs_whose_parameters_lsq_reads_differently_are_refused(kwargs):
    # lsq_init used to hand these specs' qparams to LSQ's torch.ao arithmetic, which reads them
    # differently: the first forward was far from the observer's fake quant (errors of several units).
    # compressed-tensors specs whose codes compressed-tensors cannot express are refused earlier,
    # at construction
    if kwargs["convention"] == "compressed_tensors" and kwargs["dtype"] != "int8":
        with pytest.raises(ValueError, match="compressed-tensors"):
            qstats.QuantSpec(**kwargs)
        return
    spec = qstats.QuantSpec(**kwargs)
    x = torch.randn(6, 32) * 3 + 1
    observer = qstats.minmax(spec)
    state = observer.update(observer.init(x), x)
    with pytest.raises(ValueError, match="lsq:"):
        qstats.lsq_init(state, spec)
    with pytest.raises(ValueError, match="lsq:"):
        qstats.lsq_fake_quantize(x, qstats.LSQParams(torch.tensor(0.1), torch.tensor(0.0)), spec)


def test_signed_compressed_tensors_specs_are_read_as_torch_reads_them():
    spec = qstats.QuantSpec(dtype="int8", mapping="asymmetric", convention="compressed_tensors")
    x = torch.randn(6, 32) * 3 + 1
    observer = qstats.minmax(spec)
    params = qstats.lsq_init(observer.update(observer.init(x), x), spec)
    expected = torch.fake_quantize_per_tensor_affine(x, params.scale, params.zero_point.int(), -128, 127)
    torch.testing.assert_close(qstats.lsq_fake_quantize(x, params, spec), expected, **TOL)


@pytest.mark.parametrize("zero_point", [-2.0, -4.0, -100.0, -128.0])
def test_negative_zero_points_differentiate_the_forward(zero_point):
    """torch's per-tensor backward rounds the zero point as trunc(z + 0.5), its forward as
    round(z): for negative integers the backward reads z + 1. qstats' gradient is that of its
    forward: it equals torch's at z - 0.5, where both of torch's roundings give z (round half to
    even of an odd half lands on the even z), and differs from torch's at z itself."""
    g = torch.Generator().manual_seed(int(-zero_point))
    spec = qstats.QuantSpec(dtype="int8", mapping="asymmetric")
    qmin, qmax = spec.qrange
    x = torch.rand(6, 9, generator=g) * 6.2 - 0.2  # mostly positive, and wide enough that some codes clip
    dy = torch.randn(6, 9, generator=g)
    scale = torch.tensor(0.02)
    factor = 1.0 / (x.numel() * qmax) ** 0.5
    assert torch.round(torch.tensor(zero_point - 0.5)) == zero_point == torch.trunc(torch.tensor(zero_point))
    ours = _grads_qstats(x, scale, torch.tensor(zero_point), spec, dy)
    agreeing = _grads_torch(x, scale, torch.tensor(zero_point - 0.5), qmin, qmax, factor, dy)
    for a, b in zip(ours, agreeing):
        torch.testing.assert_close(a.reshape(b.shape), b, **TOL)
    at_z = _grads_torch(x, scale, torch.tensor(zero_point), qmin, qmax, factor, dy)
    assert torch.equal(ours[0], at_z[0].reshape(ours[0].shape))  # the same forward
    assert not torch.allclose(ours[2].reshape(-1), at_z[2].reshape(-1), rtol=1e-4, atol=1e-6)  # another backward


def _blockwise_torch(x, scale, zero_point, block, qmin, qmax, factor, dy):
    """torch's learnable per-tensor kernel on each block of ``x`` sliced out on its own (the edge
    blocks smaller, nothing padded), the outputs put back in place: forward and gradients."""
    x = x.clone().requires_grad_(True)
    scale = scale.clone().requires_grad_(True)
    zero_point = zero_point.clone().requires_grad_(True)
    rows, cols = block
    where = torch.arange(x.numel()).reshape(x.shape)
    positions, values = [], []
    for index in itertools.product(*[range(n) for n in scale.shape]):
        *lead, i, j = index
        part = (*lead, slice(i * rows, (i + 1) * rows), slice(j * cols, (j + 1) * cols))
        y = torch._fake_quantize_learnable_per_tensor_affine(
            x[part], scale[index].reshape(1), zero_point[index].reshape(1), qmin, qmax, factor)
        positions.append(where[part].reshape(-1))
        values.append(y.reshape(-1))
    out = torch.zeros(x.numel()).index_put((torch.cat(positions),), torch.cat(values)).reshape(x.shape)
    assert torch.equal(torch.cat(positions).sort().values, torch.arange(x.numel()))  # every value once
    out.backward(dy)
    return out.detach(), x.grad, scale.grad, zero_point.grad


@pytest.mark.parametrize("shape,block", [((10, 13), (4, 5)), ((2, 7, 9), (3, 4)), ((6, 8), (3, 4))],
                         ids=["2d-edges", "3d-lead-edges", "divides"])
@pytest.mark.parametrize("mapping,dtype", [("asymmetric", "uint8"), ("symmetric", "int8"), ("asymmetric", "uint4")])
@pytest.mark.parametrize("grad_scale", ["torch_ao", None])
def test_partial_blocks_match_torch_per_block(shape, block, mapping, dtype, grad_scale):
    """PerBlock(partial=True), whose edge blocks are smaller: forward and the gradients of x, the
    scales and zero points equal torch's learnable per-tensor fake quant run on each block alone
    (the padding LSQ's view adds is not a value: it moves no output, no scale or zero-point gradient)."""
    g = torch.Generator().manual_seed(sum(shape) + len(dtype))
    spec = qstats.QuantSpec(dtype=dtype, mapping=mapping, granularity=qstats.PerBlock(block, partial=True))
    qmin, qmax = spec.qrange
    x = torch.randn(shape, generator=g) * 3 + 0.5
    dy = torch.randn(shape, generator=g)
    params_shape = qstats.qparam_shape(shape, spec.granularity)
    assert params_shape[-2:] == tuple(-(-s // b) for s, b in zip(shape[-2:], block))
    scale = torch.rand(params_shape, generator=g) * 0.05 + 0.01  # small scales: some values clip
    if mapping == "asymmetric":  # integer zero points in range: torch's backward rounds them as its forward
        zero_point = torch.randint(qmin, qmax + 1, params_shape, generator=g).float()
    else:
        zero_point = torch.full(params_shape, float(spec.zero_point_of_symmetric))
    factor = 1.0 / (x.numel() * qmax) ** 0.5 if grad_scale == "torch_ao" else 1.0
    ours = _grads_qstats(x, scale, zero_point, spec, dy, grad_scale)
    ref = _blockwise_torch(x, scale, zero_point, block, qmin, qmax, factor, dy)
    for name, a, b in zip(("forward", "x.grad", "scale.grad", "zero_point.grad"), ours, ref):
        if name == "zero_point.grad" and mapping == "symmetric":
            assert not a.any(), name  # a symmetric spec fixes its zero point
            continue
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


def test_partial_blocks_with_float_zero_points_the_padding_would_clip():
    """A float-domain zero point below qmin makes the zeros a partial PerBlock's view pads with
    clip (code round(zero_point) < qmin), which would give them a scale and zero-point gradient:
    the gradients still equal plain torch's LSQ+ on each (smaller) edge block alone."""
    spec = qstats.QuantSpec(dtype="uint4", mapping="asymmetric", zero_point_domain="float",
                            granularity=qstats.PerBlock((4, 5), partial=True))
    g = torch.Generator().manual_seed(5)
    x, dy = torch.randn(10, 13, generator=g), torch.randn(10, 13, generator=g)
    scale = torch.rand(3, 3, generator=g) * 0.1 + 0.05
    zero_point = -3.7 - torch.rand(3, 3, generator=g)
    out, x_grad, scale_grad, zero_grad = _grads_qstats(x, scale, zero_point, spec, dy, None)
    want = [torch.zeros(10, 13), torch.zeros(10, 13), torch.zeros(3, 3), torch.zeros(3, 3)]
    for i, j in itertools.product(range(3), range(3)):
        part = (slice(4 * i, 4 * i + 4), slice(5 * j, 5 * j + 5))
        v, d, s, z = x[part].double(), dy[part].double(), float(scale[i, j]), float(zero_point[i, j])
        unclamped = torch.round(v / s + z)
        inside = (unclamped >= 0) & (unclamped <= 15)
        fq = (unclamped.clamp(0, 15) - z) * s
        want[0][part], want[1][part] = fq.float(), torch.where(inside, d, 0.0).float()
        want[2][i, j] = (d * torch.where(inside, (fq - v) / s, unclamped.clamp(0, 15) - z)).sum()
        want[3][i, j] = (d * torch.where(inside, 0.0, -s)).sum()
    for name, got, expected in zip(("forward", "x.grad", "scale.grad", "zero_point.grad"),
                                   (out, x_grad, scale_grad, zero_grad), want):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=name)
