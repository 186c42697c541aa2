"""qstats.torch_ao at torch.ao's edges: memoryless moving averages (dynamic QAT, eager prepare's
input observation), fixed-qparams zero points and checkpoints, torch.jit.script. Every expected
value comes from torch.ao itself."""

import pytest
import torch
import torch.ao.nn.qat.dynamic as nnqatd
import torch.ao.nn.quantized.dynamic as nnqd
import torch.ao.quantization as tq
from torch.ao.quantization import observer as ao
from torch.ao.quantization.quantize_fx import prepare_fx

import qstats
from qstats import torch_ao

pytestmark = pytest.mark.usefixtures("quantized_engine")


def _batches(n=4, shape=(6, 4), seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g) * (1 + i) + 0.2 * i for i in range(n)]


class _Linear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(x)


class _Stubbed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.quant, self.dequant, self.fc = tq.QuantStub(), tq.DeQuantStub(), torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.dequant(self.fc(self.quant(x)))


def _swap_fake_quant(fake_quant):
    """torch.ao's FakeQuantize partial with its moving-average observer replaced by qstats'."""
    keywords = dict(fake_quant.p.keywords)
    observer = keywords.pop("observer")
    cls, options = (observer.p.func, dict(observer.p.keywords)) if hasattr(observer, "p") else (observer, {})
    if cls is ao.MovingAveragePerChannelMinMaxObserver:
        options.setdefault("qscheme", torch.per_channel_affine)
    keywords["observer"] = torch_ao.QstatsObserver.with_args(observer=qstats.moving_average_minmax, **options)
    return tq.FakeQuantize.with_args(**keywords)


def test_dynamic_qat_takes_a_memoryless_qstats_moving_average():
    """torch.ao's dynamic QAT Linear demands a memoryless activation observer, which it recognises
    by ``averaging_constant == 1``: default_dynamic_qat_qconfig with qstats' moving averages was
    refused (ValueError 'Dynamic QAT requires a memoryless observer'); trained and converted it is
    torch.ao's model."""
    reference_qconfig = tq.default_dynamic_qat_qconfig
    qconfig = tq.QConfig(activation=_swap_fake_quant(reference_qconfig.activation),
                         weight=_swap_fake_quant(reference_qconfig.weight))
    assert tq.qconfig._activation_is_memoryless(qconfig)

    def run(qconfig):
        torch.manual_seed(0)
        model = _Linear().train()
        model.qconfig = qconfig
        prepared = tq.prepare_qat(model, mapping={torch.nn.Linear: nnqatd.Linear})
        optimizer = torch.optim.SGD(prepared.parameters(), lr=0.1)
        for batch in _batches():
            optimizer.zero_grad()
            (prepared(batch) ** 2).mean().backward()
            optimizer.step()
        return tq.convert(prepared.eval(), mapping={nnqatd.Linear: nnqd.Linear})

    ours, reference = run(qconfig), run(reference_qconfig)
    x = torch.randn(5, 4) * 2
    assert torch.equal(ours(x), reference(x))
    assert torch.equal(ours.fc.weight().int_repr(), reference.fc.weight().int_repr())


@pytest.mark.parametrize("observer, options", [(qstats.moving_average_minmax, {"averaging_constant": 1}),
                                               (qstats.memoryless_minmax, {})])
def test_eager_prepare_observes_the_input_of_a_memoryless_observer_as_torch_ao(observer, options):
    """torch.ao's eager prepare puts a memoryless activation observer on the module's input
    (a forward pre-hook); a qstats one observed the output instead: another scale, another model."""
    def run(activation):
        torch.manual_seed(0)
        model = _Stubbed().eval()
        model.qconfig = tq.QConfig(activation=activation, weight=ao.default_weight_observer)
        prepared = tq.prepare(model)
        for batch in _batches():
            prepared(batch)
        return tq.convert(prepared)

    ours = run(torch_ao.QstatsObserver.with_args(observer=observer, **options))
    reference = run(ao.MovingAverageMinMaxObserver.with_args(averaging_constant=1))
    assert (ours.fc.scale, ours.fc.zero_point) == (reference.fc.scale, reference.fc.zero_point)
    x = torch.randn(5, 4) * 3
    assert torch.equal(ours(x), reference(x))


def test_averaging_constant_attribute_only_where_the_observer_averages():
    assert torch_ao.QstatsObserver(observer=qstats.moving_average_minmax).averaging_constant == \
        ao.MovingAverageMinMaxObserver().averaging_constant
    assert not tq.qconfig._activation_is_memoryless(tq.QConfig(activation=torch_ao.default_observer,
                                                                weight=torch_ao.default_weight_observer))
    assert not hasattr(torch_ao.QstatsObserver(observer=qstats.mse), "averaging_constant")
    with pytest.raises(ValueError, match="averaging_constant applies to mode='moving_average'"):  # not ignored
        torch_ao.QstatsObserver(observer=qstats.mse, averaging_constant=1.0)


@pytest.mark.parametrize("kwargs", [
    dict(scale=2.0 / 256.0, zero_point=0, dtype=torch.qint8, quant_min=-128, quant_max=127,
         qscheme=torch.per_tensor_symmetric),
    dict(scale=1.0 / 256.0, zero_point=0, dtype=torch.quint8, qscheme=torch.per_tensor_symmetric),
])
def test_fixed_qparams_zero_point_is_int32_for_every_qscheme(kwargs):
    """torch.ao's FixedQParamsObserver returns its int32 zero_point buffer whatever the qscheme;
    a symmetric fixed-qparams QstatsObserver returned int64."""
    reference = ao.FixedQParamsObserver(**kwargs).calculate_qparams()
    ours = torch_ao.QstatsObserver(observer=qstats.fixed_qparams, **kwargs).calculate_qparams()
    for a, b in zip(ours, reference):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_torch_ao_fixed_qparams_checkpoint_loads_into_the_drop_in():
    """A FixedQParamsObserver's state_dict (scale, zero_point, no count) failed with 'Missing
    key count'; it loads (the drop-in then gives torch.ao's qparams), and one of other constants
    is an error naming them. A FixedQParamsFakeQuantize QAT checkpoint loads into FakeQuantize
    around the drop-in, which then fake-quantizes as torch.ao's."""
    theirs = ao.default_fixed_qparams_range_neg1to1_observer()
    theirs(torch.randn(4))
    ours = torch_ao.default_fixed_qparams_range_neg1to1_observer()
    ours(torch.randn(3))
    ours.load_state_dict(theirs.state_dict())
    for a, b in zip(ours.calculate_qparams(), theirs.calculate_qparams()):
        assert a.dtype == b.dtype and torch.equal(a, b)
    with pytest.raises(RuntimeError, match="scale .* differs"):
        torch_ao.default_fixed_qparams_range_0to1_observer().load_state_dict(theirs.state_dict())

    x = torch.rand(64, generator=torch.Generator().manual_seed(0)) * 2.4 - 1.2
    reference = tq.default_fixed_qparams_range_neg1to1_fake_quant()
    reference(x)
    wrapped = tq.FakeQuantize(observer=torch_ao.default_fixed_qparams_range_neg1to1_observer)
    wrapped.load_state_dict(reference.state_dict())
    assert torch.equal(wrapped(x), reference(x))


def test_torch_jit_script_refuses_with_a_clear_error():
    """torch.ao's FX-prepared models script; qstats observers are Python functions, which
    TorchScript cannot compile: a TypeError naming the observer and what to script instead (it was
    NotSupportedError 'keyword-arg expansion' from inside torch.jit)."""
    mapping = tq.QConfigMapping().set_global(tq.QConfig(activation=torch_ao.default_observer,
                                                        weight=torch_ao.default_weight_observer))
    prepared = prepare_fx(_Linear().eval(), mapping, example_inputs=(torch.randn(2, 4),))
    with pytest.raises(TypeError, match="QstatsObserver: torch.jit.script .* converted model"):
        torch.jit.script(prepared)
    with pytest.raises(TypeError, match="QstatsObserver: torch.jit.script"):
        torch.jit.script(torch_ao.default_observer())


@pytest.mark.parametrize("cast", [torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_casting_a_prepared_model_keeps_the_state_dtypes(cast):
    """``model.to(dtype)`` cast the state buffers: the float32 extremes were rounded (another scale
    than torch.ao's float32 observer of the same data), and a float64 histogram state broke the
    search (RuntimeError 'expanded size'). The state keeps its dtypes; the device follows."""
    batches = _batches(shape=(5, 8))
    reference = ao.default_per_channel_weight_observer()
    ours = torch_ao.default_per_channel_weight_observer()
    for batch in batches[:2]:
        reference(batch)
        ours(batch)
    ours.to(cast)
    for batch in batches[2:]:
        reference(batch)
        ours(batch)
    assert ours.state.min_val.dtype == torch.float32 and ours.state.count.dtype == torch.int64
    for a, b in zip(ours.calculate_qparams(), reference.calculate_qparams()):
        assert a.dtype == b.dtype and torch.equal(a, b)

    histogram, uncast = torch_ao.default_histogram_observer(), torch_ao.default_histogram_observer()
    for batch in batches:
        histogram(batch)
        uncast(batch)
        histogram.to(cast)
    assert all(torch.equal(a, b) for a, b in zip(histogram.calculate_qparams(), uncast.calculate_qparams()))
    assert torch_ao.default_observer().to("meta").min_val.device.type == "meta"
