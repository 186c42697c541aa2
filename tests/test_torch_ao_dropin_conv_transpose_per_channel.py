"""Per-channel weight observers on ``ConvTranspose2d`` (docs/differences.md): torch.ao's prepare refuses
its own classes there; the drop-in passes, and the reference model's weights are the weights
fake-quantized with torch.ao's ``PerChannelMinMaxObserver`` qparams along ``ch_axis``."""

import copy
import warnings

import pytest
import torch
import torch.ao.quantization as tq
from torch.ao.quantization.quantize_fx import convert_fx, convert_to_reference_fx, prepare_fx

from qstats import torch_ao

warnings.filterwarnings("ignore")


def _prepared(weight_observer, activation_observer):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.ConvTranspose2d(4, 6, 3)).eval()
    mapping = tq.QConfigMapping().set_global(tq.QConfig(activation=activation_observer, weight=weight_observer))
    return prepare_fx(copy.deepcopy(model), mapping, example_inputs=(torch.randn(2, 4, 5, 5),)), model


@pytest.mark.parametrize("ch_axis", (0, 1))
def test_per_channel_conv_transpose_weights_quantize_along_ch_axis(ch_axis):
    arguments = dict(dtype=torch.qint8, qscheme=torch.per_channel_symmetric, ch_axis=ch_axis)
    with pytest.raises(AssertionError, match="Per channel weight observer is not supported"):
        _prepared(tq.PerChannelMinMaxObserver.with_args(**arguments), tq.default_observer)
    prepared, model = _prepared(torch_ao.QstatsObserver.with_args(**arguments), torch_ao.default_observer)
    prepared(torch.randn(2, 4, 5, 5))
    reference = convert_to_reference_fx(prepared)
    weight = model[0].weight.detach()
    observer = tq.PerChannelMinMaxObserver(**arguments)
    observer(weight)
    scale, zero_point = observer.calculate_qparams()
    expected = torch.fake_quantize_per_channel_affine(weight, scale, zero_point.int(), ch_axis, -128, 127)
    assert int(reference.get_submodule("0").weight_axis) == ch_axis
    assert torch.equal(reference.get_submodule("0").get_weight(), expected)


@pytest.fixture
def engine():
    """Sets torch.ao's quantized engine for the test, and restores it."""
    before = torch.backends.quantized.engine

    def use(name):
        if name not in torch.backends.quantized.supported_engines:
            pytest.skip(f"no {name} engine")
        torch.backends.quantized.engine = name

    yield use
    torch.backends.quantized.engine = before


def test_native_kernels_on_per_channel_conv_transpose_weights(engine):
    """qnnpack's kernel takes per-channel weights along the output channels (ch_axis 1, groups 1) and
    agrees with the reference model to one output step (integer against float accumulation, as for
    its per-tensor weights); fbgemm's refuses them."""
    arguments = dict(dtype=torch.qint8, qscheme=torch.per_channel_symmetric, ch_axis=1)
    x = torch.randn(2, 4, 5, 5, generator=torch.Generator().manual_seed(1))
    engine("qnnpack")
    prepared, _ = _prepared(torch_ao.QstatsObserver.with_args(**arguments), torch_ao.default_observer)
    prepared(x)
    native = convert_fx(copy.deepcopy(prepared))(x)
    difference = (native - convert_to_reference_fx(copy.deepcopy(prepared))(x)).abs().max()
    output_scale = float(prepared.activation_post_process_1.calculate_qparams()[0])
    assert float(difference) <= output_scale * (1 + 1e-5)
    engine("fbgemm")
    prepared, _ = _prepared(torch_ao.QstatsObserver.with_args(**arguments), torch_ao.default_observer)
    prepared(x)
    with pytest.raises(RuntimeError, match="Per Channel Quantization is currently disabled"):
        convert_fx(prepared)(x)
