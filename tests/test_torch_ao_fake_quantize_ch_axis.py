"""torch.ao's fake-quantize modules around a per-tensor drop-in read its ``ch_axis`` as torch.ao's
around ``MinMaxObserver``: -1, since torch.ao's per-tensor and placeholder observers have none (the
drop-in had 0, so ``FakeQuantize.ch_axis`` and its repr differed). Per-channel drop-ins keep theirs."""

import warnings

import pytest
import torch
import torch.ao.quantization as tq
from torch.ao.quantization._learnable_fake_quantize import _LearnableFakeQuantize

import qstats
from qstats import torch_ao

warnings.filterwarnings("ignore", message=".*migrat")

_PER_TENSOR = dict(quant_min=0, quant_max=255, dtype=torch.quint8, qscheme=torch.per_tensor_affine, reduce_range=True)
_PER_CHANNEL = dict(quant_min=-128, quant_max=127, dtype=torch.qint8, qscheme=torch.per_channel_symmetric, ch_axis=1)
_CASES = {
    "per tensor": (tq.MovingAverageMinMaxObserver, _PER_TENSOR),
    "per channel, axis 1": (tq.MovingAveragePerChannelMinMaxObserver, _PER_CHANNEL),
}
_OURS = torch_ao.QstatsObserver.with_args(observer=qstats.moving_average_minmax)


@pytest.mark.parametrize("case", _CASES)
def test_fake_quantize_around_a_drop_in_has_torch_ao_ch_axis_and_repr(case):
    observer, kwargs = _CASES[case]
    reference, ours = tq.FakeQuantize(observer=observer, **kwargs), tq.FakeQuantize(observer=_OURS, **kwargs)
    assert ours.ch_axis == reference.ch_axis
    assert ours.extra_repr() == reference.extra_repr()
    x = torch.randn(4, 6) * 3
    assert torch.equal(ours(x), reference(x))
    assert ours.extra_repr() == reference.extra_repr()  # the calibrated scale and zero point too


@pytest.mark.parametrize("case", _CASES)
def test_learnable_fake_quantize_around_a_drop_in_steps_as_torch_ao(case):
    observer, kwargs = _CASES[case]
    kwargs = dict(kwargs, **({"channel_len": 6} if "ch_axis" in kwargs else {}))
    reference, ours = _LearnableFakeQuantize(observer=observer, **kwargs), _LearnableFakeQuantize(observer=_OURS, **kwargs)
    assert ours.ch_axis == reference.ch_axis
    for step in range(3):  # observed, then the scale learned (observer off)
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step)) * (step + 1)
        x_ref, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
        weights = torch.arange(6.0)
        (reference(x_ref) * weights).sum().backward()
        (ours(x_ours) * weights).sum().backward()
        assert torch.equal(x_ours.grad, x_ref.grad)
        assert torch.equal(ours.scale.grad, reference.scale.grad)
        assert torch.equal(ours.scale.detach(), reference.scale.detach())
        reference.scale.grad = ours.scale.grad = None
        if step == 0:
            for module in (reference, ours):
                module.toggle_qparam_learning(True)
                module.toggle_observer_update(False)


@pytest.mark.parametrize("name", ["default_observer", "default_weight_observer", "default_per_channel_weight_observer",
                                  "default_float_qparams_observer", "default_histogram_observer",
                                  "default_fixed_qparams_range_0to1_observer", "default_dynamic_quant_observer",
                                  "default_placeholder_observer"])
def test_presets_have_ch_axis_where_torch_ao_has_it(name):
    ours, reference = getattr(torch_ao, name)(), getattr(tq, name)()
    assert hasattr(ours, "ch_axis") == hasattr(reference, "ch_axis")
    if hasattr(reference, "ch_axis"):
        assert ours.ch_axis == reference.ch_axis
