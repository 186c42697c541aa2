"""Where qstats' QAT fake quantization departs from torchao's fake quantizers (docs/differences.md):
the forward is torchao's bit for bit, the backward is the exact straight-through gradient, and an
asymmetric range keeps its zero point."""

import warnings

import pytest
import torch

import qstats

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from torchao.quantization import PerRow
    from torchao.quantization.granularity import PerGroup, PerToken
    from torchao.quantization.qat import Float8FakeQuantizeConfig, IntxFakeQuantizeConfig
    from torchao.quantization.qat.fake_quantizer import Float8FakeQuantizer, IntxFakeQuantizer
    from torchao.quantization.quant_primitives import MappingType


def _ours(x, spec, g):
    """qstats' fake quantization of ``x`` with its own range, and the gradient for ``g``."""
    obs = qstats.memoryless_minmax(spec)
    x = x.detach().clone().requires_grad_(True)
    y = qstats.fake_quantize(x, qstats.compute_qparams(obs.update(obs.init(x), x.detach()), spec), spec)
    y.backward(g)
    return y.detach(), x.grad


def _theirs(x, quantizer, g):
    x = x.detach().clone().requires_grad_(True)
    y = quantizer(x)
    y.backward(g)
    return y.detach(), x.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kind", ["per_token", "group32"])
def test_straight_through_gradient_is_exact_where_torchaos_is_within_an_ulp(kind, dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(256, 64, generator=g) * 3).to(dtype)
    upstream = (torch.randn(256, 64, generator=g) * 100).to(dtype)
    if kind == "per_token":
        config = IntxFakeQuantizeConfig(torch.int8, "per_token", is_symmetric=False, scale_precision=None)
        spec = qstats.QuantSpec.from_torchao(torch.int8, mapping_type=MappingType.ASYMMETRIC, granularity=PerToken(),
                                             input_dtype=dtype)
    else:
        config = IntxFakeQuantizeConfig(torch.int4, group_size=32, scale_precision=None)
        spec = qstats.QuantSpec.from_torchao(torch.int4, mapping_type=MappingType.SYMMETRIC, granularity=PerGroup(32),
                                             input_dtype=dtype)
    ours, our_grad = _ours(x, spec, upstream)
    theirs, their_grad = _theirs(x, IntxFakeQuantizer(config), upstream)
    assert torch.equal(ours, theirs)
    assert torch.equal(our_grad, torch.where(their_grad != 0, upstream, 0))  # the upstream gradient, exactly
    # torchao's backward multiplies by the scale and by its reciprocal: one ulp of the dtype off
    torch.testing.assert_close(their_grad, our_grad, rtol=torch.finfo(dtype).eps, atol=0)
    assert not torch.equal(their_grad, our_grad)


def test_float8_gradient_is_straight_through_where_torchaos_is_rounded_to_float8():
    g = torch.Generator().manual_seed(0)
    x, upstream = torch.randn(16, 64, generator=g), torch.randn(16, 64, generator=g)
    spec = qstats.QuantSpec.from_torchao(torch.float8_e4m3fn, granularity=PerRow())
    ours, our_grad = _ours(x, spec, upstream)
    theirs, their_grad = _theirs(x, Float8FakeQuantizer(Float8FakeQuantizeConfig(granularity=PerRow())), upstream)
    assert torch.equal(ours, theirs)
    scale = x.abs().amax(-1, keepdim=True) / 448
    inside = (x / scale).abs() <= 448  # both clamp x / scale (a row's amax may divide to 448.00003)
    assert torch.equal(our_grad, torch.where(inside, upstream, 0))
    # torchao: the gradient of its codes is float8 (upstream * scale rounded to e4m3, small ones
    # flushed to 0), and its amax scale is differentiated too (the elements holding each row's amax)
    rounded = (upstream * scale).to(torch.float8_e4m3fn).float() / scale
    at_amax = x.abs() == x.abs().amax(-1, keepdim=True)
    assert torch.equal(their_grad[~at_amax], rounded[~at_amax])
    assert (their_grad[~at_amax] == 0).sum() > 0 and (our_grad[~at_amax] != 0).all()


@pytest.mark.parametrize("granularity", ["per_channel", "per_group"])
def test_asymmetric_weight_ranges_keep_their_zero_point_where_torchao_truncates_it(granularity):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 128, generator=g)
    group = {"group_size": 32} if granularity == "per_group" else {}
    config = IntxFakeQuantizeConfig(torch.int4, granularity, is_symmetric=False, **group)
    quantizer = IntxFakeQuantizer(config)
    theirs = quantizer(w)
    # torchao computes tinygemm's unsigned range and float zero point, then casts that zero point to int32
    # and fake-quantizes with the signed range: values past the shifted range clip
    their_steps = quantizer.scale.repeat_interleave(w.shape[1] // quantizer.scale.shape[1], 1)
    assert ((theirs - w).abs() > their_steps).any()
    ours_granularity = qstats.PerGroup(32) if group else qstats.PerAxis(0)
    spec = qstats.QuantSpec.from_torchao(torch.int4, mapping_type=MappingType.ASYMMETRIC, granularity=ours_granularity)
    obs = qstats.minmax(spec)
    qp = qstats.compute_qparams(obs.update(obs.init(w), w), spec)
    ours = qstats.fake_quantize(w, qp, spec)
    steps = qp.scale.repeat_interleave(w.shape[1] // qp.scale.shape[-1], -1) if group else qp.scale[:, None]
    assert ((ours - w).abs() <= steps / 2 * (1 + 1e-6)).all()  # nothing clipped: half a step at most


def test_a_negative_learned_scale_is_read_as_eps_where_torchao_mirrors_the_grid():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 64, generator=g)
    config = IntxFakeQuantizeConfig(torch.int4, group_size=32, is_dynamic=False, range_learning=True)
    quantizer = IntxFakeQuantizer(config)
    quantizer._initialized = True
    quantizer(w)  # initialises the learned scale from w
    scale = quantizer.scale.detach().clone()
    with torch.no_grad():
        quantizer.scale.neg_()  # as a large optimizer step leaves it
    theirs = quantizer(w).detach()
    step = -scale.repeat_interleave(32, 1)
    assert torch.equal(theirs, torch.clamp(torch.round(w * (1.0 / step)), -8, 7) * step)  # the raw negative scale
    assert theirs.max() > 7 * -step.min()  # codes -8..7 of a negative scale: the grid mirrored, up to 8 |s|
    spec = qstats.QuantSpec.from_torchao(torch.int4, mapping_type=MappingType.SYMMETRIC, granularity=PerGroup(32))
    ours = qstats.lsq_fake_quantize(w, qstats.LSQParams(-scale, torch.zeros_like(scale)), spec)
    assert (ours.abs() <= 8 * spec.eps).all()  # as torch.ao's _LearnableFakeQuantize, which clamps to eps


@pytest.mark.parametrize("value", [float("inf"), float("nan")], ids=["inf", "nan"])
def test_a_non_finite_value_leaves_the_rest_of_its_token_finite_where_torchaos_row_is_nan(value):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 64, generator=g)
    x[1, 5] = value
    config = IntxFakeQuantizeConfig(torch.int8, "per_token", is_symmetric=False)
    theirs = IntxFakeQuantizer(config)(x)
    assert torch.isnan(theirs[1]).all() and torch.isfinite(theirs[[0, 2, 3]]).all()
    spec = qstats.QuantSpec.from_torchao(torch.int8, mapping_type=MappingType.ASYMMETRIC, granularity=PerToken())
    ours, _ = _ours(x, spec, torch.ones_like(x))
    assert torch.equal(ours[[0, 2, 3]], theirs[[0, 2, 3]])
    others = torch.ones(64, dtype=torch.bool)
    others[5] = False
    assert torch.isfinite(ours[1, others]).all()  # the row's range is that of its finite values
    assert torch.isnan(ours[1, 5]) if value != value else ours[1, 5] == ours[1].max()  # Inf saturates
