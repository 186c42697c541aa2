"""torch.ao flows with the drop-ins against the same flows with torch.ao's observers, where the other
tests do not reach: channels_last activations through a fused Conv-BN-ReLU net (eager and FX),
torch.ao's ``get_observer_state_dict`` / ``load_observer_state_dict`` in both directions, and the
Linear layers of all-MiniLM-L6-v2 through ``prepare_fx`` / ``convert_fx``. Each compares every
quantized module's scale, zero point and quantized weight (int_repr, per-channel scales and zero
points) and the converted outputs, bit for bit."""

import copy
import io
import warnings

import pytest
import torch
import torch.ao.quantization as tq
from torch.ao.quantization import QConfigMapping
from torch.ao.quantization.observer import get_observer_state_dict, load_observer_state_dict
from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

import qstats
from qstats import torch_ao

from _shared import MINILM_SENTENCES, minilm

warnings.filterwarnings("ignore", message=".*migrat")

_REFERENCE = tq.QConfig(activation=tq.MovingAverageMinMaxObserver.with_args(reduce_range=True),
                        weight=tq.default_per_channel_weight_observer)
_OURS = tq.QConfig(activation=torch_ao.QstatsObserver.with_args(observer=qstats.moving_average_minmax, reduce_range=True),
                   weight=torch_ao.default_per_channel_weight_observer)


@pytest.fixture(autouse=True)
def _engine():
    before = torch.backends.quantized.engine
    torch.backends.quantized.engine = "x86" if "x86" in torch.backends.quantized.supported_engines else "qnnpack"
    yield
    torch.backends.quantized.engine = before


def _quantized(model) -> dict:
    """``{module: {field: value}}``: activation scales and zero points, quantized weights."""
    found = {}
    for name, module in model.named_modules():
        entry = {}
        if isinstance(getattr(module, "scale", None), float):
            entry.update(scale=module.scale, zero_point=module.zero_point)
        weight = module.weight() if callable(getattr(module, "weight", None)) else None
        if isinstance(weight, torch.Tensor) and weight.is_quantized:
            entry["weight"] = weight
        entry.update({f"buffer {key}": value for key, value in module.named_buffers(recurse=False)})
        if entry:
            found[name] = entry
    return found


def _same_tensor(a, b) -> bool:
    if not a.is_quantized:
        return a.dtype == b.dtype and torch.equal(a, b)
    if a.qscheme() != b.qscheme() or a.dtype != b.dtype or not torch.equal(a.int_repr(), b.int_repr()):
        return False
    if a.qscheme() in (torch.per_tensor_affine, torch.per_tensor_symmetric):
        return a.q_scale() == b.q_scale() and a.q_zero_point() == b.q_zero_point()
    return (a.q_per_channel_axis() == b.q_per_channel_axis()
            and torch.equal(a.q_per_channel_scales(), b.q_per_channel_scales())
            and torch.equal(a.q_per_channel_zero_points(), b.q_per_channel_zero_points()))


def _assert_same_quantized(ours, reference, at_least=3):
    mine, theirs = _quantized(ours), _quantized(reference)
    assert mine.keys() == theirs.keys() and len(theirs) >= at_least
    for name, fields in theirs.items():
        assert mine[name].keys() == fields.keys(), name
        for field, value in fields.items():
            other = mine[name][field]
            assert _same_tensor(other, value) if isinstance(value, torch.Tensor) else other == value, (name, field)


class _ConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.quant, self.dequant = tq.QuantStub(), tq.DeQuantStub()
        self.conv1, self.bn1, self.relu1 = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU()
        self.conv2, self.bn2 = torch.nn.Conv2d(8, 8, 3, groups=2), torch.nn.BatchNorm2d(8)
        self.fc = torch.nn.Linear(8, 5)

    def forward(self, x):
        x = self.relu1(self.bn1(self.conv1(self.quant(x))))
        x = torch.nn.functional.adaptive_avg_pool2d(self.bn2(self.conv2(x)), 1).flatten(1)
        return self.dequant(self.fc(x))


def _net():
    torch.manual_seed(0)
    net = _ConvNet()
    for bn in (net.bn1, net.bn2):  # not the identity
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
        bn.weight.data.uniform_(0.5, 1.5)
    return net.eval()


def _batches(channels_last=False):
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(4, 3, 10, 10, generator=g) * (1 + i) for i in range(3)]
    return [b.contiguous(memory_format=torch.channels_last) for b in batches] if channels_last else batches


class _Plain(torch.nn.Module):
    """`_ConvNet` without the stubs, for FX."""

    def __init__(self, net):
        super().__init__()
        self.conv1, self.bn1, self.relu1, self.conv2, self.bn2, self.fc = (
            net.conv1, net.bn1, net.relu1, net.conv2, net.bn2, net.fc)

    def forward(self, x):
        x = self.relu1(self.bn1(self.conv1(x)))
        return self.fc(torch.nn.functional.adaptive_avg_pool2d(self.bn2(self.conv2(x)), 1).flatten(1))


def _prepare(qconfig, flow):
    net = _net()
    if flow == "fx":
        return prepare_fx(_Plain(net).eval(), QConfigMapping().set_global(qconfig), example_inputs=(_batches()[0],))
    net = tq.fuse_modules(net, [["conv1", "bn1", "relu1"], ["conv2", "bn2"]])
    net.qconfig = qconfig
    return tq.prepare(net)


def _convert(prepared, flow):
    return convert_fx(prepared) if flow == "fx" else tq.convert(prepared)


@pytest.mark.parametrize("flow", ["eager", "fx"])
def test_channels_last_activations_through_fused_conv_bn_relu(flow):
    batches = _batches(channels_last=True)
    models = []
    for qconfig in (_OURS, _REFERENCE):
        prepared = _prepare(qconfig, flow)
        for batch in batches:
            prepared(batch)
        models.append(_convert(prepared, flow))
    ours, reference = models
    _assert_same_quantized(ours, reference)
    x = batches[0] * 1.5
    assert torch.equal(ours(x), reference(x))


@pytest.mark.parametrize("flow", ["eager", "fx"])
@pytest.mark.parametrize("direction", ["torch.ao into qstats", "qstats into torch.ao"])
def test_observer_state_dict_helpers_load_across(flow, direction):
    source_qconfig, target_qconfig = (_REFERENCE, _OURS) if direction == "torch.ao into qstats" else (_OURS, _REFERENCE)
    source = _prepare(source_qconfig, flow)
    for batch in _batches():
        source(batch)
    buffer = io.BytesIO()
    torch.save(get_observer_state_dict(source), buffer)
    buffer.seek(0)
    target = _prepare(target_qconfig, flow)
    load_observer_state_dict(target, torch.load(buffer))
    reference, ours = _convert(source, flow), _convert(target, flow)
    _assert_same_quantized(ours, reference)
    x = _batches()[0]
    assert torch.equal(ours(x), reference(x))


def test_minilm_linears_through_prepare_fx():
    """Every Linear of the first encoder layer and the pooler (the whole model does not trace: its
    attention mask assigns into a Proxy), calibrated on the inputs they see on two batches."""
    model, tokenizer = minilm()
    names = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)
             and (name.startswith("encoder.layer.0.") or name.startswith("pooler"))]
    inputs = {name: [] for name in names}
    hooks = [model.get_submodule(name).register_forward_pre_hook(
        lambda module, args, name=name: inputs[name].append(args[0].detach())) for name in names]
    try:
        with torch.no_grad():
            model(**tokenizer(list(MINILM_SENTENCES[:2]), padding=True, return_tensors="pt"))
            model(**tokenizer(list(MINILM_SENTENCES[2:]), padding=True, return_tensors="pt"))
    finally:
        for hook in hooks:
            hook.remove()
    assert len(names) == 7
    for name in names:
        linear, batches = model.get_submodule(name), inputs[name]
        converted = []
        for qconfig in (_OURS, _REFERENCE):
            prepared = prepare_fx(torch.nn.Sequential(copy.deepcopy(linear)), QConfigMapping().set_global(qconfig),
                                  example_inputs=(batches[0],))
            for batch in batches:
                prepared(batch)
            converted.append(convert_fx(prepared))
        ours, reference = converted
        _assert_same_quantized(ours, reference, at_least=2)  # the input's qparams, the Linear's
        for batch in batches:
            assert torch.equal(ours(batch), reference(batch)), name
