"""qstats.torch_ao against torch.ao itself: converted models (eager, FX, torchao PT2E), the
default_* presets, from_observer continuation, state_dict round trips and bad input."""

import copy
import io
import warnings

import pytest
import torch
import torch.ao.quantization as tq
from torch.ao.quantization import observer as ao
from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

import qstats
from qstats import torch_ao

_ENGINE = "fbgemm" if "fbgemm" in torch.backends.quantized.supported_engines else "qnnpack"


@pytest.fixture(autouse=True)
def _engine(single_thread_quiet):
    before = torch.backends.quantized.engine
    torch.backends.quantized.engine = _ENGINE
    yield
    torch.backends.quantized.engine = before


def _batches(n=4, shape=(6, 16), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g) * (0.5 + i) + 0.3 * i for i in range(n)]


class _Stubbed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.quant, self.dequant = tq.QuantStub(), tq.DeQuantStub()
        self.fc1, self.relu, self.fc2 = torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)

    def forward(self, x):
        return self.dequant(self.fc2(self.relu(self.fc1(self.quant(x)))))


class _Plain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(16, 32), torch.nn.Linear(32, 8)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _model(cls):
    torch.manual_seed(0)
    return cls().eval()


def _eager(activation, weight, batches):
    model = _model(_Stubbed)
    model.qconfig = tq.QConfig(activation=activation, weight=weight)
    prepared = tq.prepare(model)
    for batch in batches:
        prepared(batch)
    return tq.convert(prepared)


def _fx(activation, weight, batches):
    mapping = tq.QConfigMapping().set_global(tq.QConfig(activation=activation, weight=weight))
    prepared = prepare_fx(_model(_Plain), mapping, example_inputs=(batches[0],))
    for batch in batches:
        prepared(batch)
    return convert_fx(prepared)


def _weight_qparams(weight):
    if weight.qscheme() in (torch.per_tensor_affine, torch.per_tensor_symmetric):
        return torch.tensor([weight.q_scale()]), torch.tensor([weight.q_zero_point()])
    return weight.q_per_channel_scales(), weight.q_per_channel_zero_points()


PAIRS = [
    ("default_observer", "default_per_channel_weight_observer"),
    ("default_observer", "default_weight_observer"),
    ("default_observer", "per_channel_weight_observer_range_neg_127_to_127"),
    ("default_observer", "weight_observer_range_neg_127_to_127"),
]


@pytest.mark.parametrize("activation, weight", PAIRS)
def test_eager_convert_bit_exact(activation, weight):
    batches = _batches()
    reference = _eager(getattr(ao, activation), getattr(ao, weight), batches)
    ours = _eager(getattr(torch_ao, activation), getattr(torch_ao, weight), batches)
    for name in ("fc1", "fc2"):
        ref, mine = getattr(reference, name), getattr(ours, name)
        assert isinstance(mine, torch.ao.nn.quantized.Linear)
        assert (mine.scale, mine.zero_point) == (ref.scale, ref.zero_point)
        for a, b in zip(_weight_qparams(mine.weight()), _weight_qparams(ref.weight())):
            assert torch.equal(a, b)
        assert torch.equal(mine.weight().int_repr(), ref.weight().int_repr())
    assert torch.equal(ours.quant.scale, reference.quant.scale)
    x = torch.randn(5, 16) * 2
    assert torch.equal(ours(x), reference(x))


@pytest.mark.parametrize("activation, weight", PAIRS[:2])
def test_fx_convert_bit_exact(activation, weight):
    batches = _batches()
    reference = _fx(getattr(ao, activation), getattr(ao, weight), batches)
    ours = _fx(getattr(torch_ao, activation), getattr(torch_ao, weight), batches)
    assert isinstance(ours.fc1, torch.ao.nn.quantized.Linear)
    buffers = dict(reference.named_buffers())
    for name, value in ours.named_buffers():  # the scales and zero points convert_fx stored
        assert torch.equal(value, buffers[name]), name
    for name in ("fc1", "fc2"):
        assert (getattr(ours, name).scale, getattr(ours, name).zero_point) == (
            getattr(reference, name).scale, getattr(reference, name).zero_point)
    x = torch.randn(5, 16) * 2
    assert torch.equal(ours(x), reference(x))


def test_fx_with_a_qstats_spec_and_histogram():
    """A QuantSpec given directly (torch.ao's attributes derived from it) and the histogram
    preset, through convert_fx: the same integer weights as torch.ao's per-channel observer, and
    outputs close to the float model's."""
    spec = qstats.QuantSpec(dtype="int8", mapping="symmetric", granularity=qstats.PerAxis(0))
    weight = torch_ao.QstatsObserver.with_args(observer=qstats.minmax, spec=spec)
    batches = _batches()
    ours = _fx(torch_ao.default_histogram_observer, weight, batches)
    reference = _fx(ao.default_histogram_observer, ao.default_per_channel_weight_observer, batches)
    assert torch.equal(ours.fc1.weight().int_repr(), reference.fc1.weight().int_repr())
    x = batches[1]
    float_out = _model(_Plain)(x)
    error, reference_error = (ours(x) - float_out).abs().mean(), (reference(x) - float_out).abs().mean()
    assert error <= 1.25 * reference_error, (error, reference_error)


@pytest.mark.parametrize("act_dtype", [torch.int8, torch.int16])
def test_pt2e_convert_bit_exact(act_dtype):
    """int16 activations given as spec=: the observer keeps the QuantizationSpec's torch.int16 (it
    became qint32, and convert_pt2e wrote int32 q/dq nodes)."""
    pt2e = pytest.importorskip("torchao.quantization.pt2e")
    quantize_pt2e = pytest.importorskip("torchao.quantization.pt2e.quantize_pt2e")
    quantizer_module = pytest.importorskip("torchao.quantization.pt2e.quantizer")
    if not all(hasattr(quantizer_module, n) for n in ("Quantizer", "QuantizationSpec", "QuantizationAnnotation")):
        pytest.skip("torchao's PT2E quantizer API is missing")
    from qstats.torchao_pt2e import QstatsPT2EObserver

    class LinearQuantizer(quantizer_module.Quantizer):
        def __init__(self, activation, weight):
            super().__init__()
            self.activation, self.weight = activation, weight

        def annotate(self, model):
            info = torch.iinfo(act_dtype)
            act = quantizer_module.QuantizationSpec(
                dtype=act_dtype, quant_min=info.min, quant_max=info.max, qscheme=torch.per_tensor_affine,
                observer_or_fake_quant_ctr=self.activation)
            wt = quantizer_module.QuantizationSpec(
                dtype=torch.int8, quant_min=-127, quant_max=127, qscheme=torch.per_channel_symmetric, ch_axis=0,
                observer_or_fake_quant_ctr=self.weight)
            for node in model.graph.nodes:
                if node.op == "call_function" and node.target == torch.ops.aten.linear.default:
                    node.meta["quantization_annotation"] = quantizer_module.QuantizationAnnotation(
                        input_qspec_map={node.args[0]: act, node.args[1]: wt}, output_qspec=act, _annotated=True)
            return model

        def validate(self, model):
            pass

    batches = _batches(shape=(4, 16))

    def run(activation, weight):
        exported = torch.export.export(_model(_Plain), (batches[0],)).module()
        prepared = quantize_pt2e.prepare_pt2e(exported, LinearQuantizer(activation, weight))
        for batch in batches:
            prepared(batch)
        return quantize_pt2e.convert_pt2e(prepared)

    info = torch.iinfo(act_dtype)
    reference = run(pt2e.MinMaxObserver.with_args(dtype=act_dtype, quant_min=info.min, quant_max=info.max),
                    pt2e.PerChannelMinMaxObserver.with_args(dtype=torch.int8, qscheme=torch.per_channel_symmetric))
    act_spec = qstats.QuantSpec.from_torch_ao(act_dtype, torch.per_tensor_affine, quant_min=info.min, quant_max=info.max)
    ours = run(QstatsPT2EObserver.with_args(spec=act_spec),
               QstatsPT2EObserver.with_args(dtype=torch.int8, qscheme=torch.per_channel_symmetric))
    x = torch.randn(4, 16) * 2
    assert torch.equal(ours(x), reference(x))
    dtypes = {str(a) for n in ours.graph.nodes if "quantize_per_tensor" in str(n.target) for a in n.args[1:]}
    assert str(act_dtype) in dtypes and "torch.int32" not in dtypes
    assert not torch.equal(ours(x), _model(_Plain)(x))  # quantized: the comparison can fail


# ---------------------------------------------------------------------------------------------
# Presets

PRESETS = [
    "default_observer",
    "default_weight_observer",
    "default_per_channel_weight_observer",
    "default_float_qparams_observer",
    "default_float_qparams_observer_4bit",
    "default_fixed_qparams_range_0to1_observer",
    "default_fixed_qparams_range_neg1to1_observer",
    "default_symmetric_fixed_qparams_observer",
    "default_affine_fixed_qparams_observer",
    "weight_observer_range_neg_127_to_127",
    "per_channel_weight_observer_range_neg_127_to_127",
    "default_dynamic_quant_observer",
    "default_placeholder_observer",
]


@pytest.mark.parametrize("name", PRESETS)
def test_presets_match_torch_ao(name):
    ours, reference = getattr(torch_ao, name)(), getattr(ao, name)()
    for field in ("dtype", "qscheme", "quant_min", "quant_max", "is_dynamic"):
        assert getattr(ours, field) == getattr(reference, field), field
    if hasattr(reference, "ch_axis"):
        assert ours.ch_axis == reference.ch_axis
    if getattr(reference, "eps", None) is not None:
        assert ours.eps == float(reference.eps)
    if isinstance(reference, ao.PlaceholderObserver):
        with pytest.raises(TypeError):
            ours.calculate_qparams()
        with pytest.raises(Exception):
            reference.calculate_qparams()
        return
    for batch in _batches(shape=(8, 12)):
        assert torch.equal(ours(batch), batch)
        reference(batch)
        for a, b in zip(ours.calculate_qparams(), reference.calculate_qparams()):
            assert a.dtype == b.dtype and torch.equal(a, b), (name, a, b)


def _squared_error(x, scale, zero_point, quant_max=127):
    quantized = torch.fake_quantize_per_tensor_affine(x, float(scale), int(zero_point), 0, quant_max)
    return float(((quantized - x) ** 2).sum())


@pytest.mark.parametrize("kind", ["gauss", "relu", "laplace", "student_t"])
def test_histogram_preset_against_torch_ao(kind):
    """Not bit for bit: qstats' ``l2`` search minimises torch.ao's objective over every candidate
    where torch.ao walks greedily. Stated tolerance: the scale within 25% of torch.ao's, and the
    squared quantization error of the calibration data at most 1% above torch.ao's."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 4096, generator=g)
    x = {"gauss": x, "relu": torch.relu(x) * 2, "laplace": x.sign() * torch.rand(6, 4096, generator=g).log().neg(),
         "student_t": x / (torch.randn(6, 4096, 3, generator=g).pow(2).mean(-1).sqrt())}[kind]
    ours, reference = torch_ao.default_histogram_observer(), ao.default_histogram_observer()
    for batch in x:
        ours(batch)
        reference(batch)
    (scale, zero_point), (ref_scale, ref_zero_point) = ours.calculate_qparams(), reference.calculate_qparams()
    assert (scale.shape, scale.dtype, zero_point.dtype) == (ref_scale.shape, ref_scale.dtype, ref_zero_point.dtype)
    assert abs(float(scale / ref_scale) - 1) <= 0.25
    assert _squared_error(x, scale, zero_point) <= 1.01 * _squared_error(x, ref_scale, ref_zero_point)


# ---------------------------------------------------------------------------------------------
# from_observer

OBSERVERS = [
    lambda: ao.MinMaxObserver(),
    lambda: ao.MinMaxObserver(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric, reduce_range=True),
    lambda: ao.MinMaxObserver(dtype=torch.quint8, quant_min=0, quant_max=15, reduce_range=True),
    lambda: ao.PerChannelMinMaxObserver(ch_axis=1),
    lambda: ao.PerChannelMinMaxObserver(dtype=torch.qint8, qscheme=torch.per_channel_symmetric, quant_min=-127,
                                        quant_max=127, eps=2**-12),
    lambda: ao.PerChannelMinMaxObserver(dtype=torch.quint8, qscheme=torch.per_channel_affine_float_qparams),
    lambda: ao.MovingAverageMinMaxObserver(averaging_constant=0.3),
    lambda: ao.MovingAveragePerChannelMinMaxObserver(dtype=torch.qint8, qscheme=torch.per_channel_symmetric,
                                                     ch_axis=1, averaging_constant=0.5),
]


@pytest.mark.parametrize("make", OBSERVERS)
def test_from_observer_continues_bit_exact(make):
    batches = _batches(n=6, shape=(8, 12), seed=5)
    reference = make()
    for batch in batches[:3]:
        reference(batch)
    observer, spec, state = torch_ao.from_observer(reference)
    wrapped = torch_ao.QstatsObserver(_factory_of(observer), spec, **_options_of(reference))
    wrapped.set_state(state)
    for batch in batches[3:]:
        reference(batch)
        state = observer.update(state, batch)
        wrapped(batch)
        scale, zero_point = reference.calculate_qparams()
        qp = qstats.compute_qparams(state, spec)
        assert torch.equal(qp.scale.reshape(scale.shape), scale)
        assert torch.equal(qp.zero_point.reshape(zero_point.shape).to(zero_point.dtype), zero_point)
        for a, b in zip(wrapped.calculate_qparams(), (scale, zero_point)):
            assert torch.equal(a, b)


def _factory_of(observer):
    return qstats.moving_average_minmax if observer.name == "moving_average_minmax" else qstats.minmax


def _options_of(reference):
    constant = getattr(reference, "averaging_constant", None)
    return {} if constant is None else {"averaging_constant": constant}


@pytest.mark.parametrize("bins", [2048, 256])
def test_from_observer_histogram(bins):
    """torch.ao's linear bins re-bucketed: every count kept (integers), the exact extremes, and
    qparams within 2% of qstats' own histogram of the same data (scale) and as good as torch.ao's
    on the data (1%)."""
    x = torch.cat(_batches(n=4, shape=(8, 512), seed=9))
    reference = ao.HistogramObserver(bins=bins)
    direct = torch_ao.default_histogram_observer.with_args(quant_min=None, quant_max=None)()
    for batch in x.chunk(4):
        reference(batch)
        direct(batch)
    observer, spec, state = torch_ao.from_observer(reference)
    assert observer.name == "histogram" and spec == direct.spec
    total = state.counts.sum() + state.underflow.sum() + state.overflow.sum()
    assert int(total) == round(float(reference.histogram.sum()))
    assert torch.equal(state.min_val, reference.min_val) and torch.equal(state.max_val, reference.max_val)
    qp = qstats.compute_qparams(state, spec)
    assert abs(float(qp.scale / direct.calculate_qparams()[0]) - 1) <= 0.02
    ref_scale, ref_zero_point = reference.calculate_qparams()
    assert _squared_error(x, qp.scale, qp.zero_point, 255) <= 1.01 * _squared_error(x, ref_scale, ref_zero_point, 255)
    state = observer.update(state, x[:3])  # observation continues in qstats
    assert int(state.counts.sum() + state.underflow.sum() + state.overflow.sum()) == int(total) + x[:3].numel()


@pytest.mark.parametrize("value", [-2.0, -1.5, 0.0, 2.0, 3.3])
def test_from_observer_histogram_of_a_constant_keeps_its_counts_in_the_values_bucket(value):
    """A torch.ao histogram of one repeated value (``min_val == max_val``: zero-width bins) becomes
    the state qstats' own histogram makes of the same data (every count in that value's bucket),
    with torch.ao's qparams."""
    x = torch.full((10,), value)
    reference = ao.HistogramObserver()
    reference(x)
    observer, spec, state = torch_ao.from_observer(reference)
    direct = observer.update(observer.init(x), x)
    for field in ("counts", "underflow", "overflow", "min_val", "max_val"):
        assert torch.equal(getattr(state, field), getattr(direct, field)), field
    ref_scale, ref_zero_point = reference.calculate_qparams()
    qp = qstats.compute_qparams(state, spec)
    assert torch.equal(qp.scale.reshape(1), ref_scale) and torch.equal(qp.zero_point.reshape(1), ref_zero_point)


# ---------------------------------------------------------------------------------------------
# state_dict, uncalibrated, bad input


@pytest.mark.parametrize("preset", ["default_per_channel_weight_observer", "default_histogram_observer"])
def test_state_dict_round_trip(preset):
    batches = _batches()
    calibrated = getattr(torch_ao, preset)()
    for batch in batches[:2]:
        calibrated(batch)
    buffer = io.BytesIO()
    torch.save(calibrated.state_dict(), buffer)
    buffer.seek(0)
    fresh = getattr(torch_ao, preset)()
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    for a, b in zip(fresh.calculate_qparams(), calibrated.calculate_qparams()):
        assert torch.equal(a, b)
    fresh(batches[2])
    calibrated(batches[2])
    assert all(torch.equal(a, b) for a, b in zip(fresh.state, calibrated.state))


def test_prepared_model_state_dict_round_trip():
    batches = _batches()
    model = _model(_Stubbed)
    model.qconfig = tq.QConfig(activation=torch_ao.default_observer,
                               weight=torch_ao.default_per_channel_weight_observer)
    prepared = tq.prepare(model)
    for batch in batches:
        prepared(batch)
    other = _model(_Stubbed)
    other.qconfig = model.qconfig
    other = tq.prepare(other)
    other.load_state_dict(prepared.state_dict())
    x = torch.randn(3, 16)
    assert torch.equal(tq.convert(other)(x), tq.convert(prepared)(x))


def test_uncalibrated_gives_torch_ao_defaults():
    for ours, reference in ((torch_ao.default_observer(), ao.default_observer()),
                            (torch_ao.default_per_channel_weight_observer(), ao.default_per_channel_weight_observer())):
        with pytest.warns(UserWarning, match="before calculate_qparams"):
            qparams = ours.calculate_qparams()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            expected = reference.calculate_qparams()
        for a, b in zip(qparams, expected):
            assert torch.equal(a, b.to(a.dtype))
        assert ours.state is None


def test_uncalibrated_warning_only_where_torch_ao_warns():
    """torch.ao warns for a min/max observer that saw only an empty tensor, not for a fixed-qparams
    one that saw nothing (its qparams need no data); so do the qstats modules, same qparams."""
    cases = ((torch_ao.default_observer, ao.default_observer, torch.empty(0)),
             (torch_ao.default_fixed_qparams_range_0to1_observer, ao.default_fixed_qparams_range_0to1_observer, None))
    for ours, reference, x in cases:
        ours, reference = ours(), reference()
        if x is not None:
            ours(x), reference(x)
        for observer in (ours, reference):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                qparams = observer.calculate_qparams()
            warned = any("calculate_qparams" in str(w.message) for w in caught)
            if observer is ours:
                ours_warned, ours_qparams = warned, qparams
        assert ours_warned == warned, type(reference).__name__
        for a, b in zip(ours_qparams, qparams):
            assert torch.equal(a, b.to(a.dtype))


def test_bad_input():
    with pytest.raises(TypeError, match="observer factory"):
        torch_ao.QstatsObserver(observer="minmax")
    with pytest.raises(ValueError, match=r"reduce_range.*QuantSpec\(reduce_range=True\)"):  # was ignored
        torch_ao.QstatsObserver(spec=qstats.QuantSpec(dtype="uint8", mapping="asymmetric"), reduce_range=True)
    with pytest.raises(TypeError, match=r"float dtype torch.float32 builds no QuantSpec.*minmax needs one"):
        torch_ao.QstatsObserver(dtype=torch.float32)  # torch.ao's MinMaxObserver refuses it too
    with pytest.raises(TypeError, match="QuantSpec"):
        torch_ao.QstatsObserver(spec="int8")
    with pytest.raises(ValueError, match="per tensor or per channel"):
        torch_ao.QstatsObserver(spec=qstats.QuantSpec(dtype="int8", granularity=qstats.PerGroup(16)))
    with pytest.raises(ValueError, match="integer targets"):
        torch_ao.QstatsObserver(spec=qstats.QuantSpec(dtype="fp8_e4m3fn"))
    with pytest.raises(ValueError, match="range must include 0"):
        torch_ao.QstatsObserver(dtype=torch.qint8, quant_min=5, quant_max=100)
    with pytest.raises(TypeError, match="tensor"):
        torch_ao.default_observer()([1.0, 2.0])
    per_channel = torch_ao.default_per_channel_weight_observer()
    per_channel(torch.randn(4, 8))
    with pytest.raises(ValueError, match="5"):
        per_channel(torch.randn(5, 8))
    with pytest.raises(TypeError, match="RecordingObserver"):
        torch_ao.from_observer(ao.RecordingObserver())
    with pytest.raises(ValueError, match="seen no data"):
        torch_ao.from_observer(ao.PerChannelMinMaxObserver())
    with pytest.raises(TypeError, match="fields"):
        per_channel.set_state(qstats.histogram(qstats.QuantSpec()).init(torch.zeros(3)))
    with pytest.raises(ValueError, match="bins"):
        torch_ao.buckets_per_octave_for_bins(0)


def test_buckets_per_octave_for_bins():
    assert torch_ao.buckets_per_octave_for_bins(2048) == 2048
    assert torch_ao.buckets_per_octave_for_bins(1000) == 1024
    assert torch_ao.buckets_per_octave_for_bins(10**6) == 4096


def test_fx_fixed_qparams_ops_need_torch_ao_class():
    """Documented limitation: FX's backend configuration for sigmoid/tanh accepts only torch.ao's
    FixedQParamsObserver class, and ignores a qstats fixed-qparams observer with a warning."""

    class Sigmoid(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x):
            return torch.sigmoid(self.fc(x))

    def prepared(activation):
        qconfig = tq.QConfig(activation=activation, weight=tq.default_weight_observer)
        mapping = tq.QConfigMapping().set_global(tq.default_qconfig).set_object_type(torch.sigmoid, qconfig)
        return prepare_fx(Sigmoid().eval(), mapping, example_inputs=(torch.randn(2, 4),))

    with pytest.warns(UserWarning, match="FixedQParamsObserver"):
        ours = prepared(torch_ao.default_fixed_qparams_range_0to1_observer)
    assert not any(isinstance(m, torch_ao.QstatsObserver) for m in ours.modules())
    theirs = prepared(ao.default_fixed_qparams_range_0to1_observer)
    assert any(isinstance(m, ao.FixedQParamsObserver) for m in theirs.modules())


def test_qat_fake_quantize_wrapping_qstats_observers():
    """torch.ao's QAT modules build their weight fake-quant with ``factory_kwargs=`` (FakeQuantize
    passes them on to its observer), so a qstats observer inside ``FakeQuantize`` must take them
    (it raised a TypeError in ``prepare_qat``); trained and converted, the model is torch.ao's."""

    def run(activation_observer, weight_observer):
        activation = tq.FakeQuantize.with_args(observer=activation_observer, quant_min=0, quant_max=255,
                                               dtype=torch.quint8, qscheme=torch.per_tensor_affine, reduce_range=True)
        weight = tq.FakeQuantize.with_args(observer=weight_observer, quant_min=-128, quant_max=127,
                                           dtype=torch.qint8, qscheme=torch.per_channel_symmetric)
        model = _model(_Stubbed).train()
        model.qconfig = tq.QConfig(activation=activation, weight=weight)
        prepared = tq.prepare_qat(model)
        for batch in _batches():
            prepared(batch)
        return tq.convert(prepared.eval())

    moving = torch_ao.QstatsObserver.with_args(observer=qstats.moving_average_minmax)
    ours = run(moving, moving)
    reference = run(ao.MovingAverageMinMaxObserver, ao.MovingAveragePerChannelMinMaxObserver)
    x = torch.randn(5, 16) * 2
    assert torch.equal(ours(x), reference(x))
    assert torch.equal(ours.fc1.weight().int_repr(), reference.fc1.weight().int_repr())
    observer = torch_ao.default_observer(factory_kwargs={"device": torch.device("cpu"), "dtype": None})
    assert observer.min_val.device.type == "cpu"
