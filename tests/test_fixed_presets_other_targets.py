"""sigmoid_qparams / tanh_qparams for specs other than torch.ao's quint8 preset: signed int8 against
torch's quantized sigmoid and tanh kernels (which choose qint8 constants of their own), narrower
integer codes and float formats against the interval the preset promises; fixed_qparams' zero point
of a float target."""

import warnings

import pytest
import torch

import qstats

warnings.filterwarnings("ignore")


@pytest.mark.parametrize("ours,kernel", [(qstats.sigmoid_qparams, torch.sigmoid), (qstats.tanh_qparams, torch.tanh)],
                         ids=["sigmoid", "tanh"])
@pytest.mark.parametrize("dtype", [torch.qint8, torch.quint8], ids=["qint8", "quint8"])
def test_presets_match_torch_quantized_kernels(ours, kernel, dtype):
    """torch's quantized sigmoid of a qint8 tensor has scale 1/256 and zero point -128, its tanh
    2/256 and 0; the presets gave zero point 0 for int8 (sigmoid clipped at 0.496) and refused
    tanh's 128 as outside [-128, 127]."""
    x = torch.linspace(-8, 8, 301)
    q = torch.quantize_per_tensor(x, 0.06, 0 if dtype == torch.qint8 else 128, dtype)
    expected = kernel(q)
    spec = qstats.QuantSpec.from_torch_ao(dtype, torch.per_tensor_affine)
    obs = ours(spec)
    qp = qstats.compute_qparams(obs.update(obs.init(x), x), spec)
    assert float(qp.scale) == expected.q_scale() and int(qp.zero_point) == expected.q_zero_point()
    codes = qstats.quantize(kernel(q.dequantize()), qp, spec)
    assert torch.equal(codes.to(torch.int64), expected.int_repr().to(torch.int64))


@pytest.mark.parametrize("ours,low", [(qstats.sigmoid_qparams, 0.0), (qstats.tanh_qparams, -1.0)], ids=["sigmoid", "tanh"])
@pytest.mark.parametrize("kwargs", [
    dict(dtype="int8"),
    dict(dtype="uint4", mapping="asymmetric"),
    dict(dtype="int4", granularity=qstats.PerAxis(0)),
    dict(dtype="uint8", mapping="asymmetric", reduce_range=True),
    dict(dtype="int8", zero_point_domain="none"),
    dict(dtype="uint8", mapping="asymmetric", zero_point_domain="float"),
    dict(dtype="uint8", mapping="asymmetric", zero_point_domain="float", convention="torchao"),
    dict(dtype="int8", mapping="asymmetric", zero_point_domain="float", convention="compressed_tensors"),
    dict(dtype="fp8_e4m3fn"),
    dict(dtype="fp4_e2m1"),
    dict(dtype="fp6_e3m2"),
], ids=lambda k: "-".join(str(v) for v in k.values()))
def test_presets_cover_their_interval_on_any_target(ours, low, kwargs):
    """Every value of [low, 1) fake-quantizes to its nearest grid value, none clipped: int4 and fp4
    presets held torch.ao's quint8 1/256 and clipped sigmoid at 0.06 and 0.023, a signed int8
    sigmoid at 0.496, and torchao's float zero point (in the input's units) read 128 as an offset
    of 128.0."""
    spec = qstats.QuantSpec(**kwargs)
    x = torch.linspace(low, 0.999, 4001).reshape(1, -1).expand(4, -1)
    obs = ours(spec)
    qp = qstats.compute_qparams(obs.update(obs.init(x), x), spec)
    fake = qstats.fake_quantize(x, qp, spec)
    levels = torch.unique(fake)
    # no clipping: every value lies within the widest gap between the grid values it reached (values
    # above the top code, 1 - scale for integer codes, lie within one step of it)
    assert float((fake - x).abs().max()) <= float(levels.diff().max()) + 1e-6
    assert float(levels.min()) <= low + 1e-6 and float(levels.max()) >= 1.0 - float(levels.diff().max()) - 1e-6


def test_fixed_qparams_refuses_a_zero_point_a_float_target_ignores():
    """fp8 codes have no zero point: quantize dropped a given one silently (codes of zero point 100
    equal those of 0), while QParams reported it."""
    spec = qstats.QuantSpec(dtype="fp8_e4m3fn")
    with pytest.raises(ValueError, match="zero_point must be 0 for the float target"):
        qstats.fixed_qparams(spec, 2.0 / 256.0, 100)
    qp = qstats.compute_qparams(qstats.fixed_qparams(spec, 2.0 / 256.0, 0).init(torch.zeros(3)), spec)
    assert int(qp.zero_point) == 0


def test_fixed_qparams_takes_torch_ao_per_tensor_qparams_of_shape_one():
    """torch.ao's FixedQParamsObserver holds its scale and zero point as tensors of shape [1], and
    calculate_qparams returns them so: fixed_qparams refused both for a per-tensor spec (a parameter
    shape of ()) when init met a tensor."""
    from torch.ao.quantization.observer import default_fixed_qparams_range_neg1to1_observer

    reference = default_fixed_qparams_range_neg1to1_observer()
    spec = qstats.QuantSpec.from_torch_ao(reference.dtype, reference.qscheme, quant_min=reference.quant_min,
                                          quant_max=reference.quant_max)
    x = torch.linspace(-1.2, 1.2, 97).reshape(1, -1)
    for scale, zero_point in ((reference.scale, reference.zero_point), reference.calculate_qparams()):
        assert scale.shape == (1,)
        obs = qstats.fixed_qparams(spec, scale, zero_point)
        qp = qstats.compute_qparams(obs.update(obs.init(x), x), spec)
        assert qp.scale.shape == ()
        expected = torch.fake_quantize_per_tensor_affine(x, float(scale), int(zero_point), reference.quant_min,
                                                         reference.quant_max)
        assert torch.equal(qstats.fake_quantize(x, qp, spec), expected)
