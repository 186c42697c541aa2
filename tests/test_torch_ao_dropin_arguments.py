"""qstats.torch_ao drop-in observers against torch.ao.quantization: torch.ao arguments given beside
``spec=`` (FakeQuantize passes its quant_min/quant_max/dtype to the observer) and torch.ao's
HistogramObserver at magnitudes where its own search overflows (docs/migrating_torch_ao.md)."""

import warnings

import pytest
import torch
import torch.ao.quantization as tq
from torch.ao.quantization.fake_quantize import FakeQuantize

import qstats
from qstats import torch_ao

warnings.filterwarnings("ignore", message=".*(migrat|reduce_range).*")


def _batches():
    generator = torch.Generator().manual_seed(3)
    return [torch.randn(4, 6, generator=generator) * (1 + i) for i in range(3)]


def test_fake_quantize_range_beside_a_spec_is_refused_not_dropped():
    """FakeQuantize(quant_min=0, quant_max=15) around a uint8 spec: the observer kept 0..255 and
    fake-quantized to 256 levels where torch.ao's FakeQuantize uses 16; now a ValueError, and the
    agreeing spec gives torch.ao's FakeQuantize bit for bit."""
    observer = torch_ao.QstatsObserver.with_args(observer=qstats.moving_average_minmax,
                                                 spec=qstats.QuantSpec.from_torch_ao(torch.quint8))
    with pytest.raises(ValueError, match="quant_max 15 .the spec: 255."):
        FakeQuantize.with_args(observer=observer, quant_min=0, quant_max=15, dtype=torch.quint8)()
    reference = FakeQuantize.with_args(observer=tq.MovingAverageMinMaxObserver, quant_min=0, quant_max=15,
                                       dtype=torch.quint8)()
    agreeing = torch_ao.QstatsObserver.with_args(
        observer=qstats.moving_average_minmax,
        spec=qstats.QuantSpec.from_torch_ao(torch.quint8, quant_min=0, quant_max=15))
    ours = FakeQuantize.with_args(observer=agreeing, quant_min=0, quant_max=15, dtype=torch.quint8)()
    assert (ours.quant_min, ours.quant_max) == (reference.quant_min, reference.quant_max) == (0, 15)
    for batch in _batches():
        assert torch.equal(ours(batch), reference(batch))
    assert torch.equal(ours.scale, reference.scale) and torch.equal(ours.zero_point, reference.zero_point)


@pytest.mark.parametrize("given, named", [
    (dict(dtype=torch.qint8), "dtype torch.qint8"),
    (dict(quant_min=-8, quant_max=7), "quant_min -8"),
    (dict(qscheme=torch.per_channel_symmetric), "per_channel True"),
])
def test_torch_ao_arguments_the_per_tensor_spec_does_not_quantize_to_are_refused(given, named):
    """A uint8 per-tensor spec with a signed dtype, another range or a per-channel qscheme: the
    arguments were dropped silently (the observer reported quint8, 0..255, per_tensor_affine)."""
    spec = qstats.QuantSpec.from_torch_ao(torch.quint8)
    reference = tq.MinMaxObserver(**{"dtype": torch.quint8, **given}) if "qscheme" not in given else None
    if reference is not None:  # torch.ao quantizes to what was given, not to the spec
        assert (reference.dtype, reference.quant_min, reference.quant_max) != (torch.quint8, 0, 255)
    with pytest.raises(ValueError, match=named):
        torch_ao.QstatsObserver(spec=spec, **given)


def test_ch_axis_beside_a_per_channel_spec_must_agree():
    """ch_axis=1 beside a PerAxis(0) spec was dropped (the observer reduced along axis 0, torch.ao's
    PerChannelMinMaxObserver(ch_axis=1) along 1); agreeing arguments give torch.ao's qparams."""
    spec = qstats.QuantSpec.from_torch_ao(torch.qint8, torch.per_channel_symmetric, ch_axis=0)
    with pytest.raises(ValueError, match="ch_axis 1"):
        torch_ao.QstatsObserver(spec=spec, ch_axis=1, qscheme=torch.per_channel_symmetric)
    ours = torch_ao.QstatsObserver(spec=spec, ch_axis=0, qscheme=torch.per_channel_symmetric, dtype=torch.qint8,
                                   quant_min=-128, quant_max=127)
    reference = tq.PerChannelMinMaxObserver(ch_axis=0, qscheme=torch.per_channel_symmetric, dtype=torch.qint8)
    for batch in _batches():
        ours(batch)
        reference(batch)
    for mine, theirs in zip(ours.calculate_qparams(), reference.calculate_qparams()):
        assert torch.equal(mine, theirs) and mine.dtype == theirs.dtype


def test_torch_ao_histogram_observer_overflows_where_qstats_does_not():
    """docs/migrating_torch_ao.md: from about 1e14 torch.ao's l2 search overflows float32 and its
    default_histogram_observer puts the zero point at 127, clipping every positive value; the
    drop-in keeps the data's range. Squared errors computed with torch's fake quantization."""
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 1e15
    ours, theirs = torch_ao.default_histogram_observer(), tq.default_histogram_observer()
    ours(x)
    theirs(x)

    def squared_error(scale, zero_point):
        quantized = torch.fake_quantize_per_tensor_affine(x, float(scale), int(zero_point), 0, 127)
        return float(((quantized.double() - x.double()) ** 2).sum())

    assert int(theirs.calculate_qparams()[1]) == 127 and int(ours.calculate_qparams()[1]) < 127
    assert squared_error(*ours.calculate_qparams()) < 0.01 * squared_error(*theirs.calculate_qparams())


@pytest.mark.parametrize("pair", [
    (lambda: tq.MinMaxObserver(), lambda: torch_ao.QstatsObserver()),
    (lambda: tq.MinMaxObserver(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric),
     lambda: torch_ao.QstatsObserver(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric)),
    (lambda: tq.MovingAverageMinMaxObserver(averaging_constant=0.2),
     lambda: torch_ao.QstatsObserver(observer=qstats.moving_average_minmax, averaging_constant=0.2)),
], ids=("minmax", "symmetric", "moving_average"))
@pytest.mark.parametrize("reset", [False, True])
def test_uncalibrated_drop_in_state_dict_loads_into_torch_ao(pair, reset):
    """A per-tensor drop-in before data (or after reset_min_max_vals) saved empty buffers, which
    torch.ao's observers (min_val/max_val of shape ()) refused with a size mismatch; now it saves
    torch.ao's no-data extremes, and the loaded torch.ao observer calibrates as a fresh one."""
    make_theirs, make_ours = pair
    ours, loaded, fresh = make_ours(), make_theirs(), make_theirs()
    if reset:
        ours(torch.randn(5))
        ours.reset_min_max_vals()
    result = loaded.load_state_dict(ours.state_dict(), strict=False)
    assert not result.missing_keys or result.missing_keys == ["eps"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert all(torch.equal(a, b) for a, b in zip(loaded.calculate_qparams(), fresh.calculate_qparams()))
    again = make_ours()  # and back into a drop-in: it calibrates as torch.ao
    again.load_state_dict(ours.state_dict())
    for batch in _batches():
        loaded(batch)
        fresh(batch)
        again(batch)
    for a, b, c in zip(loaded.calculate_qparams(), fresh.calculate_qparams(), again.calculate_qparams()):
        assert torch.equal(a, b) and torch.equal(c, b) and c.dtype == b.dtype


def test_prepared_model_with_an_unused_observer_loads_into_torch_ao():
    """A qstats-prepared model whose one branch never ran: its checkpoint loads into the same
    model prepared with torch.ao's observers (strict=False: no counts), which converts as torch.ao's
    calibrated on the same data."""
    class TwoBranches(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.quant, self.dequant = tq.QuantStub(), tq.DeQuantStub()
            self.used, self.unused = torch.nn.Linear(6, 4), torch.nn.Linear(6, 4)

        def forward(self, x):
            return self.dequant(self.used(self.quant(x)))

    def prepare(activation):
        torch.manual_seed(0)
        model = TwoBranches().eval()
        model.qconfig = tq.QConfig(activation=activation, weight=tq.default_weight_observer)
        return tq.prepare(model)

    ours, theirs, direct = prepare(torch_ao.default_observer), prepare(tq.default_observer), prepare(tq.default_observer)
    for batch in _batches():
        ours(batch)
        direct(batch)
    theirs.load_state_dict(ours.state_dict(), strict=False)
    x = torch.randn(3, 6)
    assert torch.equal(tq.convert(theirs)(x), tq.convert(direct)(x))


@pytest.mark.parametrize("spec_qscheme, given", [
    (torch.per_tensor_affine, torch.per_tensor_symmetric),
    (torch.per_channel_symmetric, torch.per_channel_affine),
    (torch.per_channel_affine_float_qparams, torch.per_channel_affine),
])
def test_a_symmetric_or_affine_qscheme_beside_a_spec_must_agree(spec_qscheme, given):
    """``qscheme=per_tensor_symmetric`` beside an affine spec was dropped: the observer gave the
    spec's affine qparams where torch.ao's observer with that qscheme gives others. Now refused;
    the agreeing qscheme gives torch.ao's qparams."""
    per_channel = given in (torch.per_channel_affine, torch.per_channel_symmetric)
    spec = qstats.QuantSpec.from_torch_ao(torch.quint8, spec_qscheme)
    Reference = tq.PerChannelMinMaxObserver if per_channel else tq.MinMaxObserver
    batch = next(iter(_batches())) + 0.5  # off-centre, so symmetric and affine qparams differ
    disagreeing, agreeing = Reference(qscheme=given), Reference(qscheme=spec_qscheme)
    disagreeing(batch), agreeing(batch)
    assert not all(torch.equal(a, b) for a, b in zip(disagreeing.calculate_qparams(), agreeing.calculate_qparams()))
    with pytest.raises(ValueError, match=f"qscheme {given}"):
        torch_ao.QstatsObserver(spec=spec, qscheme=given)
    ours = torch_ao.QstatsObserver(spec=spec, qscheme=spec_qscheme)
    ours(batch)
    for mine, theirs in zip(ours.calculate_qparams(), agreeing.calculate_qparams()):
        assert torch.equal(mine, theirs)
