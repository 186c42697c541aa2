"""Migrating checkpoints between torch.ao's observers and qstats' drop-ins (`qstats.torch_ao`).

Every expected value comes from torch.ao itself: a torch.ao observer's ``state_dict`` loads into
the drop-in, which then gives (and keeps giving) the torch.ao observer's qparams; a drop-in's
``state_dict`` loads into a torch.ao observer, which then gives the qparams of a torch.ao observer
that saw the same data.
"""

import copy
import warnings

import pytest
import torch
import torch.ao.quantization as tq
from torch.ao.quantization import observer as ao
from torch.ao.quantization.fake_quantize import FakeQuantize
from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

import qstats
from qstats import torch_ao

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore:.*migrat", "ignore:.*must run")

PAIRS = [  # (torch.ao observer, the drop-in built with the same arguments)
    (lambda: ao.MinMaxObserver(), lambda: torch_ao.QstatsObserver()),
    (lambda: ao.MinMaxObserver(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric, eps=2**-12),
     lambda: torch_ao.QstatsObserver(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric, eps=2**-12)),
    (lambda: ao.PerChannelMinMaxObserver(dtype=torch.qint8, qscheme=torch.per_channel_symmetric),
     torch_ao.default_per_channel_weight_observer),
    (lambda: ao.MovingAverageMinMaxObserver(averaging_constant=0.2),
     lambda: torch_ao.QstatsObserver(observer=qstats.moving_average_minmax, averaging_constant=0.2)),
    (lambda: ao.MovingAveragePerChannelMinMaxObserver(ch_axis=1, averaging_constant=0.3),
     lambda: torch_ao.QstatsObserver(observer=qstats.moving_average_minmax, averaging_constant=0.3,
                                     qscheme=torch.per_channel_affine, ch_axis=1)),
]


def _batches(n=4):
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(4, 6, generator=generator) * (1 + i) for i in range(n)]


def _equal(theirs, ours):
    return all(a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b) for a, b in zip(theirs, ours))


@pytest.mark.parametrize("pair", range(len(PAIRS)))
def test_torch_ao_state_dict_loads_into_the_drop_in(pair):
    make_theirs, make_ours = PAIRS[pair]
    theirs, ours = make_theirs(), make_ours()
    batches = _batches()
    for batch in batches[:2]:
        theirs(batch)
    ours.load_state_dict(theirs.state_dict())  # strict: torch.ao's keys (eps included) are understood
    assert _equal(theirs.calculate_qparams(), ours.calculate_qparams())
    for batch in batches[2:]:  # and it calibrates on as torch.ao does
        theirs(batch)
        ours(batch)
    assert _equal(theirs.calculate_qparams(), ours.calculate_qparams())


@pytest.mark.parametrize("pair", range(len(PAIRS)))
def test_uncalibrated_torch_ao_state_dict_loads_empty(pair):
    make_theirs, make_ours = PAIRS[pair]
    theirs, ours = make_theirs(), make_ours()
    ours.load_state_dict(theirs.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert _equal(theirs.calculate_qparams(), ours.calculate_qparams())  # torch.ao's ([1.], [0])
    for batch in _batches(2):
        theirs(batch)
        ours(batch)
    assert _equal(theirs.calculate_qparams(), ours.calculate_qparams())


def test_torch_ao_eps_differing_from_the_drop_ins_is_an_error():
    theirs = ao.MinMaxObserver(eps=2**-12)
    theirs(torch.randn(8))
    with pytest.raises(RuntimeError, match="eps .* differs"):
        torch_ao.QstatsObserver().load_state_dict(theirs.state_dict())


@pytest.mark.parametrize("pair", range(len(PAIRS)))
def test_drop_in_state_dict_loads_into_torch_ao(pair):
    make_theirs, make_ours = PAIRS[pair]
    ours, direct, loaded = make_ours(), make_theirs(), make_theirs()
    for batch in _batches():
        ours(batch)
        direct(batch)
    # strict=False: torch.ao has no counts, and the drop-in keeps eps in its spec, not a buffer
    loaded.load_state_dict(ours.state_dict(), strict=False)
    assert torch.equal(loaded.eps, direct.eps)  # not reset to float32's eps as for a version-1 state_dict
    assert _equal(direct.calculate_qparams(), loaded.calculate_qparams())


def test_torch_ao_histogram_state_dict_loads_into_the_drop_in():
    theirs, ours = tq.default_histogram_observer(), torch_ao.default_histogram_observer()
    data = torch.randn(4, 4096, generator=torch.Generator().manual_seed(1)) * torch.tensor([[1.0], [2], [0.5], [3]])
    for batch in data:
        theirs(batch)
    ours.load_state_dict(theirs.state_dict())
    state = ours.state
    total = state.counts.sum() + state.underflow.sum() + state.overflow.sum()
    assert int(total) == int(theirs.histogram.sum())
    assert torch.equal(state.min_val, theirs.min_val) and torch.equal(state.max_val, theirs.max_val)
    scale, _ = ours.calculate_qparams()
    reference, _ = theirs.calculate_qparams()
    assert abs(float(scale / reference) - 1) <= 0.25  # the histogram preset's documented tolerance


def test_torch_ao_qat_checkpoint_loads_into_qstats_fake_quantize():
    theirs = FakeQuantize(observer=ao.MovingAverageMinMaxObserver, quant_min=0, quant_max=255)
    ours = FakeQuantize(observer=torch_ao.QstatsObserver.with_args(observer=qstats.moving_average_minmax),
                        quant_min=0, quant_max=255)
    batches = _batches(6)
    for batch in batches[:3]:
        theirs(batch)
    ours.load_state_dict(theirs.state_dict())
    for batch in batches[3:]:
        assert torch.equal(ours(batch), theirs(batch))
    assert torch.equal(ours.scale, theirs.scale) and torch.equal(ours.zero_point, theirs.zero_point)


class _Conv(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.fc = torch.nn.Conv2d(3, 4, 3), torch.nn.Linear(4 * 4 * 4, 5)

    def forward(self, x):
        return self.fc(torch.flatten(torch.relu(self.conv(x)), 1))


def test_fx_prepared_torch_ao_checkpoint_loads_into_a_qstats_prepared_model():
    torch.manual_seed(0)
    model = _Conv().eval()
    batches = [torch.randn(2, 3, 6, 6) * (1 + i) for i in range(3)]

    def prepared(activation, weight):
        mapping = tq.QConfigMapping().set_global(tq.QConfig(activation=activation, weight=weight))
        return prepare_fx(copy.deepcopy(model), mapping, example_inputs=(batches[0],))

    theirs = prepared(ao.MinMaxObserver.with_args(reduce_range=True), ao.default_per_channel_weight_observer)
    for batch in batches:
        theirs(batch)
    ours = prepared(torch_ao.QstatsObserver.with_args(reduce_range=True), torch_ao.default_per_channel_weight_observer)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(3, 3, 6, 6)
    assert torch.equal(convert_fx(ours)(x), convert_fx(theirs)(x))


class _Stubbed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.quant, self.dequant, self.fc = tq.QuantStub(), tq.DeQuantStub(), torch.nn.Linear(6, 4)

    def forward(self, x):
        return self.dequant(self.fc(self.quant(x)))


def test_torch_ao_load_observer_state_dict_into_eager_drop_ins():
    torch.manual_seed(0)
    model = _Stubbed().eval()

    def prepared(activation, weight):
        copied = copy.deepcopy(model)
        copied.qconfig = tq.QConfig(activation=activation, weight=weight)
        return tq.prepare(copied)

    theirs = prepared(ao.MinMaxObserver, ao.default_per_channel_weight_observer)
    for batch in _batches():
        theirs(batch)
    ours = prepared(torch_ao.QstatsObserver, torch_ao.default_per_channel_weight_observer)
    ao.load_observer_state_dict(ours, ao.get_observer_state_dict(theirs))  # torch.ao's own checkpoint helpers
    x = torch.randn(3, 6)
    assert torch.equal(tq.convert(ours)(x), tq.convert(theirs)(x))
