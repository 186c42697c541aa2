"""Edges of LSQ and pure QAT: the learned range as QParams, the trained model back as a float
``state_dict``, refused gradient scales.

References: torch.ao's ``_LearnableFakeQuantize.calculate_qparams`` and
``torch.fake_quantize_per_channel_affine`` (learned ranges to QParams), ``nn.BatchNorm2d``'s own
running statistics (the model's ``state_dict`` after QAT steps).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from torch.ao.quantization import MovingAveragePerChannelMinMaxObserver
from torch.ao.quantization._learnable_fake_quantize import _LearnableFakeQuantize

import qstats
from qstats import QATPhase

# scale below eps, negative, zero; zero points past both ends, a .5 tie, negative
SCALES = [-0.5, 0.0, 1e-9, 0.3, 0.02, 0.07]
ZERO_POINTS = [260.4, -3.2, 2.5, 3.5, 127.6, 0.49]


def _learnable_module(scale, zero_point):
    module = _LearnableFakeQuantize(
        MovingAveragePerChannelMinMaxObserver, quant_min=0, quant_max=255, channel_len=len(scale),
        use_grad_scaling=True, dtype=torch.quint8, qscheme=torch.per_channel_affine, ch_axis=0,
    )
    module.scale.data = torch.tensor(scale)
    module.zero_point.data = torch.tensor(zero_point)
    return module


def test_learned_range_as_qparams_is_torch_aos_calculate_qparams():
    spec = qstats.QuantSpec.from_torch_ao(torch.quint8, torch.per_channel_affine, ch_axis=0)
    params = qstats.LSQParams(torch.tensor(SCALES, requires_grad=True), torch.tensor(ZERO_POINTS, requires_grad=True))
    qparams = qstats.lsq_qparams(params, spec)
    scale, zero_point = _learnable_module(SCALES, ZERO_POINTS).calculate_qparams()
    torch.testing.assert_close(qparams.scale, scale, rtol=0, atol=0)
    torch.testing.assert_close(qparams.zero_point, zero_point.to(torch.int32), rtol=0, atol=0)
    assert not qparams.scale.requires_grad and bool(qparams.calibrated.all())
    # quantizing with them is torch's fake quant with those qparams, and LSQ's own forward
    x = torch.randn(6, 40, generator=torch.Generator().manual_seed(0)) * 3
    expected = torch.fake_quantize_per_channel_affine(x, scale, zero_point.int(), 0, 0, 255)
    torch.testing.assert_close(qstats.fake_quantize(x, qparams, spec), expected, rtol=0, atol=0)
    torch.testing.assert_close(qstats.lsq_fake_quantize(x, params, spec).detach(), expected, rtol=0, atol=0)


def test_learned_range_as_qparams_symmetric_and_float_zero_points():
    scale = torch.tensor([0.1, -1.0])
    symmetric = qstats.QuantSpec("uint8", "symmetric", granularity=qstats.PerAxis(0))
    qparams = qstats.lsq_qparams(qstats.LSQParams(scale, torch.tensor([3.7, -9.0])), symmetric)
    # the symmetric spec's fixed zero point, as its observers and torch.ao's FakeQuantize give it
    assert qparams.zero_point.tolist() == [128, 128] and qparams.zero_point.dtype == torch.int32
    floating = qstats.QuantSpec("uint4", "asymmetric", granularity=qstats.PerAxis(0), zero_point_domain="float")
    qparams = qstats.lsq_qparams(qstats.LSQParams(scale, torch.tensor([3.7, -9.0])), floating)
    assert qparams.zero_point.tolist() == pytest.approx([3.7, -9.0]) and qparams.zero_point.dtype == torch.float32
    assert qparams.scale.tolist() == pytest.approx([0.1, torch.finfo(torch.float32).eps])
    with pytest.raises(ValueError, match="shape"):
        qstats.lsq_qparams(qstats.LSQParams(scale, torch.tensor(3.0)), floating)
    with pytest.raises(TypeError, match="LSQParams"):
        qstats.lsq_qparams((scale, scale), floating)


def test_infinite_grad_scale_is_refused():
    grad_scale = math.inf
    # it was accepted: the scale gradient became Inf and the zero point's NaN (0 * Inf inside the range)
    spec = qstats.QuantSpec("uint8", "asymmetric")
    params = qstats.LSQParams(torch.tensor(0.1, requires_grad=True), torch.tensor(10.0, requires_grad=True))
    with pytest.raises(ValueError, match="finite"):
        qstats.lsq_fake_quantize(torch.randn(8), params, spec, grad_scale=grad_scale)
    with pytest.raises(ValueError, match="finite"):
        qstats.qat.prepare(nn.Sequential(nn.Linear(2, 2)), qstats.minmax(spec), grad_scale=grad_scale)


class _ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 2)
        self.head = nn.Linear(2, 2)
        self.tail = nn.Linear(2, 2)
        self.tail.weight = self.head.weight  # tied

    def forward(self, x):
        return self.tail(self.head(self.fc(self.bn(self.conv(x)).relu().mean((2, 3)))))


def test_state_dict_after_training_carries_params_and_batchnorm_statistics():
    torch.manual_seed(0)
    model = _ConvNet()
    qat = qstats.qat.prepare(model, qstats.minmax(qstats.QuantSpec("int8", granularity=qstats.PerAxis(0))),
                             qstats.minmax(qstats.QuantSpec("uint8", "asymmetric")))
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(5, 3, 6, 6, generator=g) * (1 + i) for i in range(3)]
    params = {name: p.detach() + 0.1 for name, p in qat.params().items()}  # "trained" parameters
    assert "tail.weight" not in params  # a tied parameter appears under its first name
    state = qat.init(batches[0])
    for x in batches:  # float steps: the batch norm sees what nn.BatchNorm2d sees
        _, state = qat.apply(params, state, x, phase=QATPhase(True, False))
    # reference: nn.BatchNorm2d itself, run in train mode on the same batches with the same parameters
    reference = copy.deepcopy(model).train()
    reference.load_state_dict(params, strict=False)
    with torch.no_grad():
        for x in batches:
            reference(x)
    loaded = copy.deepcopy(model)
    loaded.load_state_dict(qat.state_dict(params, state))
    for name, expected in reference.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], expected, rtol=1e-6, atol=1e-7, msg=name)
    assert loaded.tail.weight is loaded.head.weight
    assert int(loaded.bn.num_batches_tracked) == 3 and int(model.bn.num_batches_tracked) == 0
    with pytest.raises(ValueError, match="QATModel.state_dict: params names"):
        qat.state_dict({"conv.wieght": params["conv.weight"]}, state)
    with pytest.raises(TypeError, match="QATModel.state_dict: state must be a QATState"):
        qat.state_dict(params, {})


def test_learnable_ranges_of_an_unobserved_point_name_it():
    # the error was compute_qparams' alone, naming no layer
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    qat = qstats.qat.prepare(model, None, qstats.minmax(qstats.QuantSpec("uint8", "asymmetric")))
    state = qat.init(torch.randn(2, 4))  # nothing observed yet
    with pytest.raises(ValueError, match=r"learnable_ranges: the activation of '0': compute_qparams: .*uncalibrated"):
        qat.learnable_ranges(state)


def test_integer_inputs_are_refused_as_torchs_fake_quant_refuses_them():
    # they were fake-quantized and cast back to integers: [1, 2, 300] -> [0, 2, 88] (int8, scale 0.7)
    x = torch.tensor([1, 2, 300])
    spec = qstats.QuantSpec("int8")
    with pytest.raises(NotImplementedError):
        torch._fake_quantize_learnable_per_tensor_affine(x, torch.tensor([0.7]), torch.tensor([0.0]), -128, 127, 1.0)
    with pytest.raises(TypeError, match="x must be a floating-point tensor"):
        qstats.lsq_fake_quantize(x, qstats.LSQParams(torch.tensor(0.7), torch.tensor(0.0)), spec)
    observer = qstats.minmax(spec)
    for fake_quantize in (True, torch.tensor(False)):
        with pytest.raises(TypeError, match="x must be a floating-point tensor"):
            qstats.observe_fake_quantize(x, observer.init(x), observer, QATPhase(True, fake_quantize))
    y, _ = qstats.observe_fake_quantize(x, observer.init(x), observer, QATPhase(True, False))  # observing only
    assert y is x


def test_clamping_the_scale_after_each_step_trains_as_torch_aos_module():
    # docs/qat.md: torch.ao's module clamps its scale parameter to eps in place before each forward;
    # lsq_fake_quantize reads scale max(scale, eps) and leaves the tensor, so the user clamps after a step
    spec = qstats.QuantSpec.from_torch_ao(torch.quint8, torch.per_tensor_affine)
    module = _LearnableFakeQuantize(torch.ao.quantization.MovingAverageMinMaxObserver, quant_min=0, quant_max=255,
                                    use_grad_scaling=True, dtype=torch.quint8, qscheme=torch.per_tensor_affine)
    module.scale.data = torch.tensor([0.01])
    module.zero_point.data = torch.tensor([3.0])
    module.enable_param_learning()
    scale = torch.tensor(0.01, requires_grad=True)
    zero_point = torch.tensor(3.0, requires_grad=True)
    ours = torch.optim.SGD([scale, zero_point], lr=1.0)
    theirs = torch.optim.SGD([module.scale, module.zero_point], lr=1.0)
    g = torch.Generator().manual_seed(0)
    went_negative = False
    for _ in range(4):
        x = torch.rand(4, 8, generator=g) * 10 + 3  # all above the range: the scale gradient is positive
        learned = qstats.LSQParams(scale, zero_point)
        for optimizer, forward in ((theirs, module), (ours, lambda t: qstats.lsq_fake_quantize(t, learned, spec))):
            optimizer.zero_grad()
            forward(x).sum().backward()
            optimizer.step()
        went_negative |= bool(scale < 0)
        with torch.no_grad():
            scale.clamp_(min=spec.eps)
        expected = module.scale.detach().clamp(min=torch.finfo(torch.float32).eps)  # its next forward's clamp
        torch.testing.assert_close(scale.detach().reshape(1), expected, rtol=1e-6, atol=0)
        torch.testing.assert_close(zero_point.detach().reshape(1), module.zero_point.detach(), rtol=1e-6, atol=1e-6)
    assert went_negative


def test_unsigned_symmetric_keeps_its_zero_point_where_torch_aos_module_zeroes_it():
    # docs/qat.md: torch.ao's _LearnableFakeQuantize sets every symmetric scheme's zero point to 0, quint8's
    # too (its observer gives 128), so every negative value clips; qstats keeps 128 as torch.ao's FakeQuantize
    x = torch.tensor([-1.0, -0.5, 0.2, 1.0])
    module = _LearnableFakeQuantize(torch.ao.quantization.MovingAverageMinMaxObserver, quant_min=0, quant_max=255,
                                    use_grad_scaling=True, dtype=torch.quint8, qscheme=torch.per_tensor_symmetric)
    theirs = module(x).detach()
    assert module.zero_point.item() == 0 and bool((theirs[:2] == 0).all())
    spec = qstats.QuantSpec.from_torch_ao(torch.quint8, torch.per_tensor_symmetric)
    observer = qstats.moving_average_minmax(spec, 0.01)
    params = qstats.lsq_init(observer.update(observer.init(x), x), spec)
    assert params.zero_point.item() == 128
    reference = torch.ao.quantization.FakeQuantize(observer=torch.ao.quantization.MovingAverageMinMaxObserver,
                                                   quant_min=0, quant_max=255, dtype=torch.quint8,
                                                   qscheme=torch.per_tensor_symmetric)
    torch.testing.assert_close(qstats.lsq_fake_quantize(x, params, spec).detach(), reference(x), rtol=0, atol=0)


def test_a_zero_point_at_a_tie_differentiates_the_forward_and_nan_stays_nan():
    # docs/qat.md: torch's per-tensor backward reads zero point 2.5 as 3 (int(2.5 + 0.5)), its forward as 2
    spec = qstats.QuantSpec("uint8", "asymmetric")
    x = torch.randn(40, generator=torch.Generator().manual_seed(0)) * 3
    dy = torch.randn(40, generator=torch.Generator().manual_seed(1))

    def torch_grads(zero_point):
        scale, zp = torch.tensor([0.02], requires_grad=True), torch.tensor([zero_point], requires_grad=True)
        y = torch._fake_quantize_learnable_per_tensor_affine(x, scale, zp, 0, 255, 1.0)
        y.backward(dy)
        return y.detach(), scale.grad

    scale = torch.tensor(0.02, requires_grad=True)
    y = qstats.lsq_fake_quantize(x, qstats.LSQParams(scale, torch.tensor(2.5)), spec, grad_scale=None)
    y.backward(dy)
    forward, tie_grad = torch_grads(2.5)
    _, rounded_grad = torch_grads(2.0)
    torch.testing.assert_close(y.detach(), forward, rtol=0, atol=0)
    torch.testing.assert_close(scale.grad.reshape(1), rounded_grad, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(tie_grad, rounded_grad, rtol=1e-3)
    nan = torch.tensor([float("nan"), 1.0])
    theirs = torch._fake_quantize_learnable_per_tensor_affine(
        nan, torch.tensor([0.1]), torch.tensor([3.0]), 0, 255, 1.0)
    assert theirs[0].item() == pytest.approx(-0.3)  # quant_min's code
    ours = qstats.lsq_fake_quantize(nan, qstats.LSQParams(torch.tensor(0.1), torch.tensor(3.0)), spec)
    assert ours[0].isnan() and ours[1] == theirs[1]


@pytest.mark.parametrize("phase", [qstats.QATSchedule(observe_at=0, fake_quantize_at=1, freeze_ranges_at=2), None,
                                   (True, True, False, False)])
def test_apply_with_something_other_than_a_phase_raises_type_error(phase):
    # the batch norm read phase.freeze_batchnorm: AttributeError "'QATSchedule' object has no attribute ..."
    qat = qstats.qat.prepare(nn.Sequential(nn.BatchNorm1d(4), nn.Linear(4, 2)), qstats.minmax(qstats.QuantSpec("int8")))
    x = torch.randn(3, 4)
    state = qat.init(x)
    with pytest.raises(TypeError, match=r"phase must be a QATPhase \(schedule\(step\)\)"):
        qat.apply(qat.params(), state, x, phase=phase)
