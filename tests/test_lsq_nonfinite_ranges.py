"""Learned ranges holding NaN or Inf (a diverged training step). `qstats.lsq_qparams` raises naming
them, where torch.ao's ``_LearnableFakeQuantize.calculate_qparams`` returns a NaN scale and a NaN zero
point cast to int64's minimum; `qstats.lsq_fake_quantize` reads a -Inf scale as eps and an infinite
zero point as the range's end, as torch.ao's module (its output was NaN)."""

import pytest
import torch
from torch.ao.quantization import MovingAverageMinMaxObserver
from torch.ao.quantization._learnable_fake_quantize import _LearnableFakeQuantize

import qstats

SPEC = qstats.QuantSpec("uint8", "asymmetric")


def _torch_ao_module(scale, zero_point):
    module = _LearnableFakeQuantize(observer=MovingAverageMinMaxObserver, quant_min=0, quant_max=255,
                                    scale=1.0, zero_point=0.0, use_grad_scaling=True)
    module.toggle_qparam_learning(True)
    module.toggle_observer_update(False)
    with torch.no_grad():
        module.scale.copy_(torch.tensor(scale))
        module.zero_point.copy_(torch.tensor(zero_point))
    return module


def _torch_ao_qparams(scale, zero_point):
    return _torch_ao_module(scale, zero_point).calculate_qparams()


@pytest.mark.parametrize("scale, zero_point", [(float("nan"), 3.0), (float("inf"), 3.0), (0.1, float("nan"))])
def test_a_non_finite_learned_range_raises_where_torch_ao_returns_it(scale, zero_point):
    torch_scale, torch_zero_point = _torch_ao_qparams(scale, zero_point)
    # torch.ao hands back no usable range: a NaN/Inf scale or a zero point outside [0, 255]
    assert not bool(torch.isfinite(torch_scale).all()) or not 0 <= int(torch_zero_point) <= 255
    params = qstats.LSQParams(torch.tensor(scale), torch.tensor(zero_point))
    with pytest.raises(ValueError, match="NaN or Inf scale or zero point"):
        qstats.lsq_qparams(params, SPEC)


def test_a_finite_learned_range_equals_torch_ao_and_a_symmetric_spec_ignores_its_unused_zero_point():
    torch_scale, torch_zero_point = _torch_ao_qparams(0.05, 130.4)
    qp = qstats.lsq_qparams(qstats.LSQParams(torch.tensor(0.05), torch.tensor(130.4)), SPEC)
    assert torch.equal(qp.scale.reshape(1), torch_scale) and int(qp.zero_point) == int(torch_zero_point)
    # an infinite integer zero point clamps to the range's end, in torch.ao's module and in both of qstats' passes
    torch_scale, torch_zero_point = _torch_ao_qparams(0.05, float("inf"))
    infinite = qstats.LSQParams(torch.tensor(0.05), torch.tensor(float("inf")))
    assert int(qstats.lsq_qparams(infinite, SPEC).zero_point) == int(torch_zero_point) == 255
    x = torch.linspace(-1.0, 1.0, 9)
    assert torch.equal(qstats.lsq_fake_quantize(x, infinite, SPEC),
                       qstats.fake_quantize(x, qstats.lsq_qparams(infinite, SPEC), SPEC))
    symmetric = qstats.QuantSpec("int8")  # its zero point is fixed: a NaN there is never read
    qp = qstats.lsq_qparams(qstats.LSQParams(torch.tensor(0.05), torch.tensor(float("nan"))), symmetric)
    assert float(qp.scale) == pytest.approx(0.05) and int(qp.zero_point) == 0


def test_a_non_finite_channel_raises_under_vmap_too():
    spec = qstats.QuantSpec("uint8", "asymmetric", granularity=qstats.PerAxis(0))
    scale = torch.tensor([[0.1, 0.2], [0.1, float("nan")]])
    zero_point = torch.full((2, 2), 7.0)
    with pytest.raises(ValueError, match="NaN or Inf"):
        torch.vmap(lambda s, z: qstats.lsq_qparams(qstats.LSQParams(s, z), spec).scale)(scale, zero_point)
    fine = torch.vmap(lambda s, z: qstats.lsq_qparams(qstats.LSQParams(s, z), spec).scale)(scale[:1], zero_point[:1])
    assert torch.equal(fine, scale[:1])


@pytest.mark.parametrize("scale, zero_point", [(-float("inf"), 3.0), (0.05, float("inf")), (0.05, -float("inf"))])
def test_an_infinite_range_is_read_as_torch_aos_module_reads_it(scale, zero_point):
    x = torch.linspace(-1.5, 1.5, 13)
    module = _torch_ao_module(scale, zero_point)
    x_torch = x.clone().requires_grad_(True)
    expected = module(x_torch)
    expected.sum().backward()
    x_ours = x.clone().requires_grad_(True)
    params = qstats.LSQParams(torch.tensor(scale, requires_grad=True), torch.tensor(zero_point, requires_grad=True))
    ours = qstats.lsq_fake_quantize(x_ours, params, SPEC)
    ours.sum().backward()
    assert torch.isfinite(ours).all() and torch.equal(ours, expected.detach())
    assert torch.equal(x_ours.grad, x_torch.grad)
    assert torch.isfinite(params.scale.grad) and torch.isfinite(params.zero_point.grad)
    # a finite parameter still gets torch's gradient (an infinite one, which no step can move, gets 0)
    for ours_grad, torch_grad, value in ((params.scale.grad, module.scale.grad, scale),
                                         (params.zero_point.grad, module.zero_point.grad, zero_point)):
        if abs(value) != float("inf"):
            torch.testing.assert_close(ours_grad.reshape(1), torch_grad, rtol=1e-5, atol=1e-7)
