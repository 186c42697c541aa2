"""`qstats.torch_ao.from_observer` of a QAT model's ``FakeQuantize`` (torch.ao's, its fused kin, torchao
PT2E's copy) imports the observer inside it: observing on in qstats gives torch.ao's qparams bit for
bit. It raised 'cannot import a FakeQuantize'."""

import warnings

import pytest
import torch
import torch.ao.quantization as tq
from torch.ao.quantization._learnable_fake_quantize import _LearnableFakeQuantize

import qstats
from qstats import torch_ao


def _batches(seed, count=3):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(6, 8, generator=generator) * (1 + i) for i in range(count)]


def _continues_bit_for_bit(fake_quantize):
    for batch in _batches(0):
        fake_quantize(batch)
    observer, spec, state = torch_ao.from_observer(fake_quantize)
    for batch in _batches(1):
        fake_quantize.activation_post_process(batch)
        state = observer.update(state, batch)
    scale, zero_point = fake_quantize.activation_post_process.calculate_qparams()
    qp = qstats.compute_qparams(state, spec)
    assert torch.equal(qp.scale.reshape(scale.shape), scale)
    assert torch.equal(qp.zero_point.reshape(zero_point.shape).to(zero_point.dtype), zero_point)


@pytest.mark.parametrize("make", [
    lambda: tq.default_qat_qconfig.activation(),
    lambda: tq.default_qat_qconfig.weight(),
    lambda: tq.default_per_channel_weight_fake_quant(),
    lambda: tq.get_default_qat_qconfig("x86").activation(),  # FusedMovingAvgObsFakeQuantize
    lambda: tq.get_default_qat_qconfig("x86").weight(),
], ids=["activation", "weight", "per_channel_weight", "fused_activation", "fused_per_channel_weight"])
def test_torch_ao_fake_quantize_imports_its_observer(make):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _continues_bit_for_bit(make())


def test_torchao_pt2e_fake_quantize_imports_its_observer():
    pt2e_fake_quantize = pytest.importorskip("torchao.quantization.pt2e.fake_quantize")
    _continues_bit_for_bit(pt2e_fake_quantize.FakeQuantize())


def test_fake_quantize_around_a_drop_in_gives_the_drop_ins_own():
    fake_quantize = tq.FakeQuantize(observer=torch_ao.QstatsObserver.with_args(observer=qstats.moving_average_minmax),
                                    quant_min=0, quant_max=255)
    for batch in _batches(0):
        fake_quantize(batch)
    observer, spec, state = torch_ao.from_observer(fake_quantize)
    assert spec is fake_quantize.activation_post_process.spec
    assert all(torch.equal(a, b) for a, b in zip(state, fake_quantize.activation_post_process.state))


def test_learnable_fake_quantize_is_still_refused():
    """Its scale is learned, not what its observer saw."""
    learnable = _LearnableFakeQuantize(observer=tq.MovingAverageMinMaxObserver, quant_min=0, quant_max=255)
    with pytest.raises(TypeError, match="cannot import a .*_LearnableFakeQuantize"):
        torch_ao.from_observer(learnable)


@pytest.mark.parametrize("make", [
    tq.default_fixed_qparams_range_0to1_fake_quant,
    tq.default_fixed_qparams_range_neg1to1_fake_quant,
    lambda: tq.FixedQParamsObserver(scale=1.0 / 128, zero_point=0, dtype=torch.qint8,
                                    qscheme=torch.per_tensor_symmetric, quant_min=-128, quant_max=127),
], ids=["sigmoid_fake_quant", "tanh_fake_quant", "qint8_symmetric_observer"])
def test_fixed_qparams_import_as_fixed_qparams(make):
    """A QAT model's sigmoid/tanh outputs carry FixedQParamsFakeQuantize: from_observer gives
    qstats.fixed_qparams of the same constants, whose fake-quantized values are torch.ao's (it raised
    'cannot import a FixedQParamsObserver')."""
    module = make()
    observer, spec, state = torch_ao.from_observer(module)
    x = torch.linspace(-1.5, 1.5, 301)
    state = observer.update(state, x)
    qp = qstats.compute_qparams(state, spec)
    fixed = module.activation_post_process if isinstance(module, tq.FakeQuantize) else module
    scale, zero_point = fixed.calculate_qparams()
    assert torch.equal(qp.scale.reshape(scale.shape), scale)
    assert torch.equal(qp.zero_point.reshape(zero_point.shape).to(zero_point.dtype), zero_point)
    expected = torch.fake_quantize_per_tensor_affine(x, float(scale), int(zero_point), fixed.quant_min, fixed.quant_max)
    assert torch.equal(qstats.fake_quantize(x, qp, spec), expected)
    assert int(state.count) == x.numel()  # torch.ao counts nothing: the import is the state before any data
