"""torchao's XNNPACKQuantizer configurations (static and dynamic, PTQ and QAT, per tensor and per
channel) with their observers replaced by qstats' PT2E drop-ins: every q/dq node's scale and zero
point and the converted outputs equal those of torchao's own min/max observers."""

import dataclasses
import warnings

import pytest
import torch

import qstats

pt2e = pytest.importorskip("torchao.quantization.pt2e")
quantize_pt2e = pytest.importorskip("torchao.quantization.pt2e.quantize_pt2e")
xnnpack = pytest.importorskip("torchao.testing.pt2e._xnnpack_quantizer")
fake_quantize = pytest.importorskip("torchao.quantization.pt2e.fake_quantize")

from qstats.torchao_pt2e import QstatsPT2EObserver, QstatsPT2EPerChannelObserver  # noqa: E402

warnings.filterwarnings("ignore", message=".*migrat")


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8)
        self.conv2, self.fc = torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.Linear(8 * 6 * 6, 10)

    def forward(self, x):
        y = torch.relu(self.bn(self.conv(x)))
        return self.fc((y + self.conv2(y)).flatten(1))


def _batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, 3, 8, 8, generator=g) * (1 + i) for i in range(3)]


# torchao's observer classes and the qstats drop-ins (class, factory options) that stand in for them
_OURS = {
    pt2e.HistogramObserver: (QstatsPT2EObserver, {}),  # min/max in both flows: bit-exact comparisons
    pt2e.MinMaxObserver: (QstatsPT2EObserver, {}),
    pt2e.PerChannelMinMaxObserver: (QstatsPT2EPerChannelObserver, {}),
    pt2e.MovingAverageMinMaxObserver: (QstatsPT2EObserver, dict(observer=qstats.moving_average_minmax)),
    pt2e.MovingAveragePerChannelMinMaxObserver: (QstatsPT2EPerChannelObserver,
                                                 dict(observer=qstats.moving_average_minmax)),
    pt2e.PlaceholderObserver: (QstatsPT2EObserver, dict(observer=qstats.placeholder)),
}


def _observer(cls, kwargs, ours):
    if cls is pt2e.HistogramObserver and not ours:
        cls = pt2e.MinMaxObserver
    if ours:
        cls, options = _OURS[cls]
        kwargs = dict(options, **kwargs)
    return cls.with_args(**kwargs) if kwargs else cls


def _swapped(ctr, ours):
    """``ctr`` (a torchao observer or fake-quantize constructor) with the observer replaced; the fused
    fake quantize, which takes torchao's observer classes only, becomes ``FakeQuantize`` in both flows."""
    cls, kwargs = (ctr.p.func, dict(ctr.p.keywords)) if hasattr(ctr, "p") else (ctr, {})
    if cls in (fake_quantize.FakeQuantize, fake_quantize.FusedMovingAvgObsFakeQuantize):
        inner = kwargs.pop("observer", pt2e.MovingAverageMinMaxObserver)
        inner_cls, inner_kwargs = (inner.p.func, dict(inner.p.keywords)) if hasattr(inner, "p") else (inner, {})
        return fake_quantize.FakeQuantize.with_args(observer=_observer(inner_cls, inner_kwargs, ours), **kwargs)
    return _observer(cls, kwargs, ours)


def _config(config, ours):
    def replace(spec):
        return None if spec is None else dataclasses.replace(
            spec, observer_or_fake_quant_ctr=_swapped(spec.observer_or_fake_quant_ctr, ours))

    return dataclasses.replace(config, input_activation=replace(config.input_activation),
                               output_activation=replace(config.output_activation), weight=replace(config.weight))


def _qparams(model):
    def value(arg):
        return getattr(model, arg.target) if isinstance(arg, torch.fx.Node) and arg.op == "get_attr" else arg

    return [(str(n.target), [value(a) for a in n.args[1:] if not isinstance(value(a), torch.fx.Node)])
            for n in model.graph.nodes if n.op == "call_function" and "quantize_per" in str(n.target)]


@pytest.mark.parametrize("per_channel,qat,dynamic", [(True, False, False), (False, False, False),
                                                     (True, True, False), (True, False, True)])
def test_xnnpack_quantizer_with_qstats_observers(per_channel, qat, dynamic):
    config = xnnpack.get_symmetric_quantization_config(is_per_channel=per_channel, is_qat=qat, is_dynamic=dynamic)
    batches = _batches()

    def run(ours):
        torch.manual_seed(0)
        model = _Net().train(qat)
        exported = torch.export.export(model, (batches[0],)).module()
        prepare = quantize_pt2e.prepare_qat_pt2e if qat else quantize_pt2e.prepare_pt2e
        prepared = prepare(exported, xnnpack.XNNPACKQuantizer().set_global(_config(config, ours)))
        for batch in batches:
            prepared(batch)
        return quantize_pt2e.convert_pt2e(prepared)

    ours, reference = run(True), run(False)
    mine, theirs = _qparams(ours), _qparams(reference)
    assert len(theirs) >= 3 and [t for t, _ in mine] == [t for t, _ in theirs]
    for (_, a), (_, b) in zip(mine, theirs):
        for p, q in zip(a, b):
            assert torch.equal(p, q) if isinstance(q, torch.Tensor) else p == q
    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(2)) * 2
    out = ours(x)
    assert torch.equal(out, reference(x))
    torch.manual_seed(0)
    float_out = _Net().eval()(x)
    assert not torch.equal(out, float_out)  # quantized: the comparison can fail
