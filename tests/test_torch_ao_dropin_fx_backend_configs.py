"""FX prepare_fx/convert_fx with torch.ao's qnnpack, fbgemm and x86 BackendConfigs and their default
QConfigMappings (qnnpack's symmetric one too, whose weights carry a 2**-12 scale minimum), every
min/max observer replaced by the qstats drop-in with the same arguments, or only some of them (a
mapping that mixes qstats and torch.ao observers): every converted tensor, scale and zero point,
the generated code and the outputs are torch.ao's. Histograms become min/max in both flows (bit-exact
comparisons); the fixed-qparams observers of sigmoid stay torch.ao's, whose class FX requires."""

import warnings

import pytest
import torch
import torch.ao.quantization as tq
from torch.ao.quantization import observer as ao
from torch.ao.quantization.backend_config import get_fbgemm_backend_config, get_qnnpack_backend_config
from torch.ao.quantization.backend_config.x86 import get_x86_backend_config
from torch.ao.quantization.qconfig_mapping import _get_symmetric_qnnpack_qconfig_mapping, get_default_qconfig_mapping
from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

import qstats
from qstats import torch_ao

warnings.filterwarnings("ignore", message="torch.ao.quantization is deprecated")


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4)
        self.fc, self.fc2 = torch.nn.Linear(4 * 6 * 6, 8), torch.nn.Linear(8, 4)

    def forward(self, x):
        y = torch.relu(self.bn(self.conv(x)))
        z = self.fc(torch.cat([y, y * 2], 1)[:, :4].flatten(1))
        return torch.sigmoid(self.fc2(torch.relu(z))) + z[:, :4]


def _swapped(ctr, ours):
    """``ctr`` with torch.ao's histogram as min/max, and as the qstats drop-in where ``ours``."""
    cls, kwargs = (ctr.p.func, dict(ctr.p.keywords)) if hasattr(ctr, "p") else (ctr, {})
    if cls in (ao.FixedQParamsObserver, ao.PlaceholderObserver):
        return ctr
    if cls is ao.HistogramObserver:
        cls = ao.MinMaxObserver
        kwargs.pop("bins", None), kwargs.pop("upsample_rate", None)
    if not ours:
        return cls.with_args(**kwargs)
    if cls in (ao.PerChannelMinMaxObserver, ao.MovingAveragePerChannelMinMaxObserver):
        kwargs.setdefault("qscheme", torch.per_channel_affine)
    if cls in (ao.MovingAverageMinMaxObserver, ao.MovingAveragePerChannelMinMaxObserver):
        kwargs["observer"] = qstats.moving_average_minmax
    return torch_ao.QstatsObserver.with_args(**kwargs)


def _mapping(mapping, ours, mixed):
    """``mapping``'s global and per-type qconfigs, swapped: all of them where ``ours``; with ``mixed``,
    the activation of every other qconfig and the weight of every third stay torch.ao's."""
    swapped, count = tq.QConfigMapping(), iter(range(1, 1000))

    def qconfig(qc):
        if qc is None:
            return None
        index = next(count)
        return tq.QConfig(activation=_swapped(qc.activation, ours and not (mixed and index % 2 == 0)),
                          weight=_swapped(qc.weight, ours and not (mixed and index % 3 == 0)))

    swapped.set_global(qconfig(mapping.global_qconfig))
    for object_type, qc in mapping.object_type_qconfigs.items():
        swapped.set_object_type(object_type, qconfig(qc))
    return swapped


_BACKENDS = {
    "qnnpack": (lambda: get_default_qconfig_mapping("qnnpack"), get_qnnpack_backend_config, "qnnpack"),
    "qnnpack_symmetric": (_get_symmetric_qnnpack_qconfig_mapping, get_qnnpack_backend_config, "qnnpack"),
    "fbgemm": (lambda: get_default_qconfig_mapping("fbgemm"), get_fbgemm_backend_config, "fbgemm"),
    "x86": (lambda: get_default_qconfig_mapping("x86"), get_x86_backend_config, "x86"),
}


@pytest.mark.parametrize("mixed", [False, True])
@pytest.mark.parametrize("backend", sorted(_BACKENDS))
def test_default_qconfig_mapping_of_each_backend_config(backend, mixed, monkeypatch):
    make_mapping, make_backend_config, engine = _BACKENDS[backend]
    if engine not in torch.backends.quantized.supported_engines:
        pytest.skip(f"no {engine} engine")
    monkeypatch.setattr(torch.backends.quantized, "engine", engine)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(2, 3, 8, 8, generator=g) * (1 + i) for i in range(3)]

    def run(ours):
        torch.manual_seed(0)
        backend_config = make_backend_config()
        prepared = prepare_fx(_Net().eval(), _mapping(make_mapping(), ours, mixed), example_inputs=(batches[0],),
                              backend_config=backend_config)
        for batch in batches:
            prepared(batch)
        return convert_fx(prepared, backend_config=backend_config)

    ours, reference = run(True), run(False)
    assert str(ours.code) == str(reference.code)
    mine, theirs = ours.state_dict(), reference.state_dict()
    assert mine.keys() == theirs.keys()
    quantized = 0
    for key, value in theirs.items():
        for a, b in zip(*(v if isinstance(v, tuple) else (v,) for v in (value, mine[key]))):
            if isinstance(a, torch.Tensor) and a.is_quantized:
                quantized += 1
                assert a.qscheme() == b.qscheme() and torch.equal(a.int_repr(), b.int_repr()), key
                assert torch.equal(a.dequantize(), b.dequantize()), key
            elif isinstance(a, torch.Tensor):
                assert a.dtype == b.dtype and torch.equal(a, b), key
    assert quantized >= 3
    if backend == "qnnpack_symmetric":  # qint8 activations: qnnpack's conv kernel takes quint8 only
        return
    x = batches[1] * 1.5
    assert torch.equal(ours(x), reference(x))
