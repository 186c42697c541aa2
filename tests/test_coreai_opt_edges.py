"""coreai_opt's own fake quantization against qstats', with the qparams of `QuantSpec.from_coreai_opt`.

Reference: Apple coreai_opt 0.4.0's ``QuantizationComponentFactory.create_fake_quantizer`` (its
``_DefaultFakeQuantizeImpl``: forward, gradient, ``quantize``, ``dequantize``), for integer
targets of 2 to 8 bits, every qscheme, per-tensor/channel/block granularities, float32, bf16 and
fp16 inputs, float_range pinned or not, both formulations (``"zp"``: `qstats.fake_quantize`,
``"minval"``: `qstats.coreai_opt.fake_quantize_minval`), and float targets (fp8, fp4, e8m0).
The qparams themselves are tests/test_coreai_opt.py's.
"""

import warnings

import pytest
import torch

import qstats
import qstats.coreai_opt

warnings.filterwarnings("ignore")

spec_lib = pytest.importorskip("coreai_opt.quantization.spec.spec")
from coreai_opt.config.spec import CompressionTargetTensor  # noqa: E402
from coreai_opt.quantization.spec.factory import QuantizationComponentFactory  # noqa: E402

QuantizationSpec = spec_lib.QuantizationSpec
INTEGERS = [(torch.int8, "symmetric"), (torch.uint8, "symmetric_with_clipping"), (torch.uint4, "asymmetric"),
            (torch.int4, "symmetric_with_clipping"), (torch.int2, "symmetric"), (torch.int6, "asymmetric")]
GRANULARITIES = {
    "per_tensor": ({"type": "per_tensor"}, (16, 64), "weight"),
    "per_channel": ({"type": "per_channel", "axis": 0}, (16, 64), "weight"),
    "per_block": ({"type": "per_block", "axis": 1, "block_size": 16}, (16, 64), "weight"),
    "per_block_activation": ({"type": "per_block", "axis": -1, "block_size": 8}, (2, 6, 32), "activation"),
}
INPUTS = [torch.float32, torch.bfloat16, torch.float16]


def _fake_quantizer(dtype, qscheme, granularity, target, float_range=(None, None), **fields):
    coreai_spec = QuantizationSpec(dtype=dtype, qscheme=qscheme, granularity=granularity, float_range=list(float_range),
                                   qparam_calculator_cls="static", **fields)
    ct = CompressionTargetTensor.WEIGHT if target == "weight" else CompressionTargetTensor.ACTIVATION
    return coreai_spec, QuantizationComponentFactory.create_fake_quantizer(coreai_spec, ct)


def _ours(coreai_spec, x, target, float_range):
    # coreai_opt computes in the input's dtype, except with both float_range ends pinned
    input_dtype = torch.float32 if None not in float_range else x.dtype
    spec = qstats.QuantSpec.from_coreai_opt(coreai_spec, shape=x.shape, target=target, input_dtype=input_dtype)
    obs = qstats.memoryless_minmax(spec)
    return spec, qstats.compute_qparams(obs.update(obs.init(x), x), spec, float_range=float_range)


def _input(shape, dtype, seed):
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)


def _forward_and_grad(fn, x):
    x = x.detach().clone().requires_grad_()
    out = fn(x)
    (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
    return out.detach(), x.grad


@pytest.mark.parametrize("float_range", [(None, None), (-1.0, 2.0), (None, 1.5)], ids=str)
@pytest.mark.parametrize("input_dtype", INPUTS, ids=str)
@pytest.mark.parametrize("granularity", list(GRANULARITIES))
@pytest.mark.parametrize("dtype,qscheme", INTEGERS, ids=str)
def test_fake_quantize_is_coreai_opts(dtype, qscheme, granularity, input_dtype, float_range):
    """coreai_opt divides by the scale in float32 (``round(x / scale) + zero_point``); qstats
    followed torchao (``x * (1 / scale)``, in the input's dtype): a code apart at ties (a channel's
    -max_abs under symmetric qschemes) and throughout bf16/fp16 inputs."""
    granularity, shape, target = GRANULARITIES[granularity]
    coreai_spec, fq = _fake_quantizer(dtype, qscheme, granularity, target, float_range)
    x = _input(shape, input_dtype, seed=len(shape))
    ref, ref_grad = _forward_and_grad(fq, x)
    spec, qp = _ours(coreai_spec, x, target, float_range)
    ours, our_grad = _forward_and_grad(lambda t: qstats.fake_quantize(t, qp, spec), x)
    assert ours.dtype == ref.dtype and torch.equal(ours, ref)
    assert torch.equal(our_grad, ref_grad)
    scale, zero_point, minval = fq.calculate_qparams()
    codes = fq.quantize(x, scale, zero_point, minval)
    assert torch.equal(qstats.quantize(x, qp, spec), codes.to(qstats.code_dtype(spec)))
    assert torch.equal(qstats.dequantize(qstats.quantize(x, qp, spec), qp, spec),
                       fq.dequantize(codes, scale, zero_point, minval))


def test_symmetric_tie_is_a_code_apart_in_torchao():
    """The element at -max_abs of a symmetric int8 channel divides to -127.5 exactly, which rounds to
    -128 (coreai_opt, qstats); torchao's reciprocal gives -127.49999 and code -127."""
    coreai_spec, fq = _fake_quantizer(torch.int8, "symmetric", {"type": "per_channel", "axis": 0}, "weight")
    x = _input((16, 64), torch.float32, seed=2)
    ref = fq(x)
    scale = fq.calculate_qparams()[0]
    ties = (x / scale == -127.5) & (x * (1 / scale) != -127.5)
    assert bool(ties.any())
    spec, qp = _ours(coreai_spec, x, "weight", (None, None))
    assert torch.equal(qstats.fake_quantize(x, qp, spec), ref)
    assert torch.equal(ref[ties], (-128 * scale).expand_as(x)[ties])


@pytest.mark.parametrize("float_range", [(None, None), (-1.0, 2.0), (None, 0.5)], ids=str)
@pytest.mark.parametrize("input_dtype", INPUTS, ids=str)
@pytest.mark.parametrize("granularity", list(GRANULARITIES))
@pytest.mark.parametrize("dtype,qscheme", INTEGERS, ids=str)
def test_fake_quantize_minval_is_coreai_opts_minval_formulation(dtype, qscheme, granularity, input_dtype, float_range):
    """``qformulation="minval"``: codes ``round((x - minval) / scale) + quant_min``; a symmetric
    range puts its grid half a step from the zero-point one, so `qstats.fake_quantize` differed
    from coreai_opt in nearly every element, with no qstats function for it."""
    granularity, shape, target = GRANULARITIES[granularity]
    coreai_spec, fq = _fake_quantizer(dtype, qscheme, granularity, target, float_range, qformulation="minval")
    x = _input(shape, input_dtype, seed=3)
    ref, ref_grad = _forward_and_grad(fq, x)
    spec, qp = _ours(coreai_spec, x, target, float_range)
    ours, our_grad = _forward_and_grad(lambda t: qstats.coreai_opt.fake_quantize_minval(t, qp, spec), x)
    assert ours.dtype == ref.dtype and torch.equal(ours, ref)
    assert torch.equal(our_grad, ref_grad)


@pytest.mark.parametrize("dtype,qscheme", [(torch.int8, "symmetric"), (torch.uint4, "symmetric"),
                                          (torch.int4, "symmetric_with_clipping")], ids=str)
def test_fake_quantize_minval_saturates_at_a_half_precision_inputs_largest_value(dtype, qscheme):
    """An fp16 row reaching 65504: the minval grid's top code lies past it (``minval + (quant_max -
    quant_min) * scale``), which coreai_opt casts to +Inf; qstats saturates at 65504, as
    `qstats.fake_quantize` does, with coreai_opt's values elsewhere and its gradient."""
    granularity, shape, target = GRANULARITIES["per_channel"]
    coreai_spec, fq = _fake_quantizer(dtype, qscheme, granularity, target, qformulation="minval")
    x = _input(shape, torch.float16, seed=3)
    x[0, :4] = torch.tensor([65504.0, -65504.0, 1.0, 0.0])
    ref, ref_grad = _forward_and_grad(fq, x)
    assert ref.isinf().any()
    spec, qp = _ours(coreai_spec, x, target, (None, None))
    ours, our_grad = _forward_and_grad(lambda t: qstats.coreai_opt.fake_quantize_minval(t, qp, spec), x)
    assert ours.dtype == ref.dtype and torch.equal(ours, ref.clamp(-65504, 65504))
    assert torch.equal(our_grad, ref_grad)


@pytest.mark.parametrize("input_dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("dtype,qscheme", [(torch.int8, "symmetric"), (torch.uint8, "asymmetric"),
                                          (torch.int4, "symmetric_with_clipping")], ids=str)
def test_fake_quantize_minval_of_a_range_spanning_past_float32(dtype, qscheme, input_dtype):
    """Rows whose range spans more than float32's largest value (peaks near 3e38): ``x - minval`` and
    the top codes' ``(q - quant_min) * scale`` pass it, where coreai_opt's values are Inf or NaN
    (its scales are too). qstats' are the formula's on its qparams, in float64, in ``x``'s dtype
    (bf16; float32: to float32's roundings of the two-term sum); they were finite but wrong
    (3.39e38 fake-quantized to 1.3e36)."""
    g = torch.Generator().manual_seed(5)
    x = (torch.rand(4, 64, generator=g) * 2 - 1) * torch.tensor([[3.3e38], [3.0e38], [1.8e38], [1.0]])
    x = x.to(input_dtype)
    coreai_spec = QuantizationSpec(dtype=dtype, qscheme=qscheme, granularity={"type": "per_channel", "axis": 0},
                                   qformulation="minval")
    spec, qp = _ours(coreai_spec, x, "weight", (None, None))
    ours = qstats.coreai_opt.fake_quantize_minval(x, qp, spec)
    qmin, qmax = spec.qrange
    scale, minval = qp.scale.double()[:, None], qp.minval.double()[:, None]
    codes = (torch.round((x.double() - minval) / scale) + qmin).clamp(qmin, qmax)
    expected = ((codes - qmin) * scale + minval).clamp(-torch.finfo(input_dtype).max, torch.finfo(input_dtype).max)
    if input_dtype == torch.bfloat16:
        assert torch.equal(ours, expected.to(input_dtype))
    else:  # coreai_opt's float32 product and sum round twice
        assert ((ours.double() - expected).abs() <= 2 ** -22 * (expected.abs() + minval.abs())).all()
    assert torch.equal(ours[3], qstats.coreai_opt.fake_quantize_minval(x[3:], _ours(coreai_spec, x[3:], "weight",
                                                                                    (None, None))[1], spec)[0])


def test_fake_quantize_minval_refuses_float_targets_and_old_qparams():
    spec = qstats.QuantSpec.from_coreai_opt(dtype=torch.float8_e4m3fn)
    x = torch.randn(4, 8)
    qp = qstats.compute_qparams(qstats.minmax(spec).update(qstats.minmax(spec).init(x), x), spec)
    with pytest.raises(ValueError, match="integer target"):
        qstats.coreai_opt.fake_quantize_minval(x, qp, spec)
    spec = qstats.QuantSpec.from_coreai_opt(dtype=torch.int8)
    qp = qstats.compute_qparams(qstats.minmax(spec).update(qstats.minmax(spec).init(x), x), spec)
    with pytest.raises(ValueError, match="minval None"):
        qstats.coreai_opt.fake_quantize_minval(x, qp._replace(minval=None), spec)


@pytest.mark.parametrize("input_dtype", INPUTS, ids=str)
@pytest.mark.parametrize("dtype,scale_dtype", [(torch.float8_e4m3fn, None), (torch.float8_e5m2, None),
                                               (torch.float8_e4m3fn, torch.float8_e8m0fnu),
                                               (torch.float4_e2m1fn_x2, None), (torch.int8, torch.float8_e8m0fnu)],
                         ids=str)
def test_float_targets_and_e8m0_fake_quantize_is_coreai_opts(dtype, scale_dtype, input_dtype):
    granularity, shape, target = GRANULARITIES["per_block"]
    coreai_spec, fq = _fake_quantizer(dtype, "symmetric", granularity, target, scale_dtype=scale_dtype)
    x = _input(shape, input_dtype, seed=4)
    ref, ref_grad = _forward_and_grad(fq, x)
    spec, qp = _ours(coreai_spec, x, target, (None, None))
    ours, our_grad = _forward_and_grad(lambda t: qstats.fake_quantize(t, qp, spec), x)
    assert torch.equal(ours, ref) and torch.equal(our_grad, ref_grad)


def test_coreai_opt_specs_vmap_compile_and_pickle():
    """The spec's convention (coreai_opt's arithmetic) composes like the library ones."""
    import pickle

    spec = qstats.QuantSpec.from_coreai_opt(dtype=torch.int8, qscheme="asymmetric",
                                            granularity={"type": "per_channel", "axis": 0})
    assert spec.convention == "coreai_opt" and pickle.loads(pickle.dumps(spec)) == spec
    assert spec.replace(convention="torchao") != spec  # torchao's arithmetic, by name as the others
    assert spec.replace(convention="torchao").replace(convention="coreai_opt") == spec
    obs = qstats.minmax(spec)

    def fake(x):
        return qstats.fake_quantize(x, qstats.compute_qparams(obs.update(obs.init(x), x), spec), spec)

    xs = _input((3, 8, 32), torch.float32, seed=5)
    eager = torch.stack([fake(x) for x in xs])
    assert torch.equal(torch.vmap(fake)(xs), eager)
    assert torch.equal(torch.compile(fake, fullgraph=True)(xs[0]), eager[0])


def test_presets_axis_none_is_refused_naming_what_to_give():
    """coreai_opt's presets (QuantizerConfig.presets.w8, w4_per_block) leave the axis None for its
    prepare to resolve; from_coreai_opt says so instead of only 'needs an int axis'."""
    from coreai_opt.quantization.config.quantization_config import QuantizerConfig

    for preset in (QuantizerConfig.presets.w8(), QuantizerConfig.presets.w4_per_block()):
        weight_spec = preset.global_config.op_state_spec["weight"]
        assert weight_spec.granularity.axis is None
        with pytest.raises(ValueError, match="resolves axis None per module type"):
            qstats.QuantSpec.from_coreai_opt(weight_spec, shape=(16, 64))


def test_a_float_range_past_float32_is_named_and_a_half_precision_minval_saturates():
    """``float_range`` past float32's range raised torch's bare "cannot be converted to type float
    without overflow"; a pinned end past float16's range gave minval -inf (coreai_opt's too),
    while the scale saturates: fake_quantize_minval then gave NaN. minval saturates like the scale,
    at float16's lowest finite value."""
    spec = qstats.QuantSpec.from_coreai_opt(dtype=torch.int8, qscheme="asymmetric", input_dtype=torch.float16)
    x = _input((4, 8), torch.float16, seed=3)
    obs = qstats.minmax(spec)
    state = obs.update(obs.init(x), x)
    with pytest.raises(ValueError, match="float_range lo"):
        qstats.compute_qparams(state, spec, float_range=(-1e39, None))
    qp = qstats.compute_qparams(state, spec, float_range=(-1e5, None))
    assert qp.minval.item() == torch.finfo(torch.float16).min
    assert torch.isfinite(qp.scale).all()
    assert torch.isfinite(qstats.coreai_opt.fake_quantize_minval(x, qp, spec)).all()


def test_minval_fake_quantization_refuses_integer_input():
    """``fake_quantize_minval`` cast integer input to float and back: truncated ints, no error,
    where coreai_opt's fake quantizer (torch's) and `qstats.fake_quantize` refuse it."""
    spec = qstats.QuantSpec.from_coreai_opt({"dtype": "int8", "qscheme": "asymmetric",
                                             "granularity": {"type": "per_tensor"}})
    x = torch.tensor([-3.0, 1.0, 7.0])
    obs = qstats.minmax(spec)
    qp = qstats.compute_qparams(obs.update(obs.init(x), x), spec)
    for fake in (qstats.fake_quantize, qstats.coreai_opt.fake_quantize_minval):
        with pytest.raises(TypeError, match="floating-point"):
            fake(torch.tensor([-3, 1, 7]), qp, spec)
