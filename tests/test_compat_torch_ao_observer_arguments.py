"""`QuantSpec.from_torch_ao` given the other arguments torch.ao's observers take: ``factory_kwargs``
and ``is_dynamic=False`` do not change the target (the spec equals the one without them, and its
qparams the observer's); ``is_dynamic=True`` and the observers' own settings (``averaging_constant``,
``bins``) raise ValueError naming them (they failed as unknown QuantSpec fields)."""

import warnings

import pytest
import torch
from torch.ao.quantization import observer as ao

import qstats

warnings.filterwarnings("ignore")


def test_factory_kwargs_and_static_observers_give_the_same_target():
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(0)) * 3
    extra = dict(factory_kwargs={"device": "cpu"}, is_dynamic=False)
    torch_ao = ao.MinMaxObserver(dtype=torch.quint8, qscheme=torch.per_tensor_affine, **extra)
    torch_ao(x)
    scale, zero_point = torch_ao.calculate_qparams()
    spec = qstats.QuantSpec.from_torch_ao(torch.quint8, torch.per_tensor_affine, **extra)
    assert spec == qstats.QuantSpec.from_torch_ao(torch.quint8, torch.per_tensor_affine)
    obs = qstats.minmax(spec)
    qp = qstats.compute_qparams(obs.update(obs.init(x), x), spec)
    assert torch.equal(qp.scale.reshape(1), scale) and torch.equal(qp.zero_point.reshape(1), zero_point.int())


@pytest.mark.parametrize(
    "observer, arguments",
    [
        (ao.MovingAverageMinMaxObserver, dict(averaging_constant=0.05)),
        (ao.HistogramObserver, dict(bins=1024)),
        (ao.MinMaxObserver, dict(is_dynamic=True)),
    ],
    ids=lambda v: getattr(v, "__name__", str(v)),
)
def test_observer_settings_are_refused_naming_them(observer, arguments):
    observer(dtype=torch.quint8, **arguments)  # torch.ao takes them
    with pytest.raises(ValueError, match=sorted(arguments)[0]):
        qstats.QuantSpec.from_torch_ao(torch.quint8, **arguments)


@pytest.mark.parametrize("qscheme", [torch.per_tensor_affine, torch.per_channel_symmetric])
def test_numpy_integer_ranges_are_taken_as_torch_ao_takes_them(qscheme):
    # a custom range read from numpy (a config, an array): torch.ao's observers take it; it was
    # refused as "QuantSpec.quant_min must be an int, got np.int64(-8)"
    np = pytest.importorskip("numpy")
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(3)) * 3
    kind = ao.PerChannelMinMaxObserver if qscheme == torch.per_channel_symmetric else ao.MinMaxObserver
    torch_ao = kind(dtype=torch.qint8, qscheme=qscheme, quant_min=np.int64(-8), quant_max=np.int64(7))
    torch_ao(x)
    scale, zero_point = torch_ao.calculate_qparams()
    spec = qstats.QuantSpec.from_torch_ao(torch.qint8, qscheme, quant_min=np.int64(-8), quant_max=np.int64(7))
    assert spec == qstats.QuantSpec.from_torch_ao(torch.qint8, qscheme, quant_min=-8, quant_max=7)
    assert type(spec.quant_min) is int and type(spec.quant_max) is int
    obs = qstats.minmax(spec)
    qp = qstats.compute_qparams(obs.update(obs.init(x), x), spec)
    assert torch.equal(qp.scale.reshape(scale.shape), scale)
    assert torch.equal(qp.zero_point.reshape(zero_point.shape).to(zero_point.dtype), zero_point)
    uint8 = qstats.QuantSpec(dtype="uint8", symmetric_zero_point=np.int32(100))
    assert uint8.zero_point_of_symmetric == 100 and type(uint8.symmetric_zero_point) is int
