"""The qscheme of the PT2E drop-ins where none is given, against torchao's own observers: a
``QuantizationSpec`` without a qscheme (its default None, which ``prepare_pt2e`` passes) is refused by
torchao's min/max, moving-average and histogram observers (NotImplementedError at ``prepare_pt2e``)
and accepted by its placeholder and fixed-qparams ones; ``QstatsPT2EPerChannelObserver()`` built with
no qscheme quantizes per channel, as torchao's ``PerChannelMinMaxObserver()``."""

import copy
import warnings

import pytest
import torch

import qstats

pt2e = pytest.importorskip("torchao.quantization.pt2e")
quantize_pt2e = pytest.importorskip("torchao.quantization.pt2e.quantize_pt2e")
quantizer = pytest.importorskip("torchao.quantization.pt2e.quantizer")

from qstats.torchao_pt2e import QstatsPT2EObserver, QstatsPT2EPerChannelObserver  # noqa: E402

warnings.filterwarnings("ignore", message="torch.ao.quantization is deprecated")


class _WeightQuantizer(quantizer.Quantizer):
    """The weight of every linear, int8, with the QuantizationSpec's default qscheme (None)."""

    def __init__(self, observer):
        super().__init__()
        self.observer = observer

    def annotate(self, model):
        spec = quantizer.QuantizationSpec(dtype=torch.int8, quant_min=-127, quant_max=127, ch_axis=0,
                                          observer_or_fake_quant_ctr=self.observer)
        for node in model.graph.nodes:
            if node.op == "call_function" and node.target == torch.ops.aten.linear.default:
                node.meta["quantization_annotation"] = quantizer.QuantizationAnnotation(
                    input_qspec_map={node.args[1]: spec}, _annotated=True)
        return model

    def validate(self, model):
        pass


def _prepare(observer):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4)).eval()
    x = torch.randn(2, 8)
    return quantize_pt2e.prepare_pt2e(torch.export.export(copy.deepcopy(model), (x,)).module(),
                                      _WeightQuantizer(observer))


@pytest.mark.parametrize("ours,reference", [
    (QstatsPT2EObserver, pt2e.MinMaxObserver),
    (QstatsPT2EPerChannelObserver, pt2e.PerChannelMinMaxObserver),
    (QstatsPT2EObserver.with_args(observer=qstats.moving_average_minmax), pt2e.MovingAverageMinMaxObserver),
    (QstatsPT2EObserver.with_args(observer=qstats.histogram), pt2e.HistogramObserver),
])
def test_a_quantization_spec_without_qscheme_is_refused_naming_it(ours, reference):
    with pytest.raises(NotImplementedError, match="qscheme"):
        _prepare(reference)
    with pytest.raises(ValueError, match="qscheme None"):
        _prepare(ours)


@pytest.mark.parametrize("ours,reference", [
    (QstatsPT2EObserver.with_args(observer=qstats.placeholder), pt2e.PlaceholderObserver),
    (QstatsPT2EObserver.with_args(observer=qstats.fixed_qparams, scale=1 / 256, zero_point=0),
     pt2e.FixedQParamsObserver.with_args(scale=1 / 256, zero_point=0)),
])
def test_placeholder_and_fixed_qparams_take_a_spec_without_qscheme_as_torchaos(ours, reference):
    _prepare(reference)
    _prepare(ours)



def test_per_channel_drop_in_without_qscheme_quantizes_per_channel_as_torchaos():
    x = torch.randn(4, 6) * torch.arange(1, 7)
    ours, reference = QstatsPT2EPerChannelObserver(), pt2e.PerChannelMinMaxObserver()
    ours(x), reference(x)
    assert ours.qscheme == reference.qscheme and ours.ch_axis == reference.ch_axis
    for a, b in zip(ours.calculate_qparams(), reference.calculate_qparams()):
        assert a.dtype == b.dtype and torch.equal(a, b)
