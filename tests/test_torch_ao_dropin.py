"""qstats.torch_ao against torch.ao itself: converted models (eager, FX, torchao PT2E), the
default_* presets, from_observer continuation, state_dict round trips and bad input."""

import io
import warnings

import pytest
import torch
import torch.ao.quantization as tq
from torch.ao.quantization import observer as ao
from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx, prepare_qat_fx

import qstats
from qstats import torch_ao

pytestmark = pytest.mark.usefixtures("quantized_engine")


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
        if field == "qscheme" and ours.spec is None:  # float dtype: None, so FX skips it as torch.ao's placeholder
            assert ours.qscheme is None and isinstance(reference, ao.PlaceholderObserver)
            continue
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
    """torch.ao's ``(tensor([1.]), tensor([0]))``: an int64 zero point whatever the qscheme (it
    was int32 for affine observers), shape (1,) also per channel."""
    cases = ((torch_ao.default_observer(), ao.default_observer()),
             (torch_ao.default_per_channel_weight_observer(), ao.default_per_channel_weight_observer()),
             (torch_ao.default_float_qparams_observer(), ao.default_float_qparams_observer()),
             (torch_ao.default_histogram_observer(), ao.default_histogram_observer()),
             (torch_ao.QstatsObserver(observer=qstats.moving_average_minmax, qscheme=torch.per_channel_affine),
              ao.MovingAveragePerChannelMinMaxObserver()))
    for ours, reference in cases:
        with pytest.warns(UserWarning, match="before calculate_qparams"):
            qparams = ours.calculate_qparams()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            expected = reference.calculate_qparams()
        for a, b in zip(qparams, expected):
            assert a.dtype == b.dtype and torch.equal(a, b), (type(reference).__name__, a, b)
        assert ours.state is None


def test_uncalibrated_on_meta_keeps_the_device():
    """Before data the qparams come on the observer's device (they were CPU tensors for a ``meta``
    observer); calibrated on ``meta``, the qparams have torch.ao's shapes and dtypes (torch.ao's
    own observers cannot read meta values)."""
    ours = torch_ao.default_per_channel_weight_observer().to("meta")
    scale, zero_point = ours.calculate_qparams()  # no warning: meta has no values to read
    assert scale.device.type == zero_point.device.type == "meta"
    reference = ao.default_per_channel_weight_observer()
    reference(torch.randn(4, 3))
    ours(torch.randn(4, 3, device="meta"))
    for a, b in zip(ours.calculate_qparams(), reference.calculate_qparams()):
        assert (a.device.type, a.shape, a.dtype) == ("meta", b.shape, b.dtype)


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


# ---------------------------------------------------------------------------------------------
# torch.ao's default qconfigs with every observer replaced by its qstats preset


class _ConvNet(torch.nn.Module):
    """Conv, ReLU, add, cat and a shared Linear (eager: FloatFunctional and QuantStubs)."""

    def __init__(self):
        super().__init__()
        self.quant, self.dequant = tq.QuantStub(), tq.DeQuantStub()
        self.conv, self.relu, self.conv2 = torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Conv2d(4, 4, 1)
        self.add, self.cat = torch.ao.nn.quantized.FloatFunctional(), torch.ao.nn.quantized.FloatFunctional()
        self.shared, self.fc = torch.nn.Linear(6, 6), torch.nn.Linear(8 * 6 * 6, 5)

    def forward(self, x):
        a = self.relu(self.conv(self.quant(x)))
        c = self.cat.cat([self.add.add(a, self.conv2(a)), a], 1)
        return self.dequant(self.fc(self.shared(self.shared(c)).flatten(1)))


def _images(n=3):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(2, 3, 8, 8, generator=g) * (1 + i) + 0.2 * i for i in range(n)]


def _assert_same_quantized_state(ours, reference):
    """Every buffer, packed weight, scale and zero point of two converted models, bit for bit."""
    mine, theirs = ours.state_dict(), reference.state_dict()
    assert mine.keys() == theirs.keys()
    for key, value in theirs.items():
        other = mine[key]
        pairs = zip(value, other) if isinstance(value, tuple) else [(value, other)]
        for a, b in pairs:
            if isinstance(a, torch.Tensor) and a.is_quantized:
                assert a.qscheme() == b.qscheme() and torch.equal(a.int_repr(), b.int_repr()), key
                assert torch.equal(a.dequantize(), b.dequantize()), key  # scales and zero points
            elif isinstance(a, torch.Tensor):
                assert a.dtype == b.dtype and torch.equal(a, b), key
            elif not isinstance(a, torch._C.ScriptObject):
                assert a == b, key


def _with_qstats_observers(qconfig):
    """torch.ao's qconfig with each observer replaced by the qstats preset of the same name."""
    presets = {getattr(ao, name): getattr(torch_ao, name) for name in PRESETS}
    return tq.QConfig(activation=presets[qconfig.activation], weight=presets[qconfig.weight])


@pytest.mark.parametrize("fuse", [False, True])
def test_default_qconfig_eager_and_fx_on_conv_add_cat_shared(fuse):
    """torch.ao's default_qconfig, and its per-channel variant, in eager prepare/convert (convs
    fused with their ReLU or not) and FX prepare_fx/convert_fx: the converted models are torch.ao's."""
    def eager(qconfig):
        model = _model(_ConvNet)
        model.qconfig = qconfig
        prepared = tq.prepare(tq.fuse_modules(model, [["conv", "relu"]]) if fuse else model)
        for batch in _images():
            prepared(batch)
        return tq.convert(prepared)

    def fx(qconfig):
        prepared = prepare_fx(_model(_Plain4D), tq.QConfigMapping().set_global(qconfig), example_inputs=(_images()[0],))
        for batch in _images():
            prepared(batch)
        return convert_fx(prepared)

    per_channel = tq.QConfig(activation=ao.default_observer, weight=ao.default_per_channel_weight_observer)
    x = torch.randn(2, 3, 8, 8) * 3
    for qconfig in (tq.default_qconfig, per_channel):
        for flow in (eager, fx):
            ours, reference = flow(_with_qstats_observers(qconfig)), flow(qconfig)
            _assert_same_quantized_state(ours, reference)
            assert torch.equal(ours(x), reference(x))


class _Plain4D(torch.nn.Module):
    """_ConvNet without stubs, for FX and PT2E (a functional add and cat)."""

    def __init__(self):
        super().__init__()
        self.conv, self.conv2 = torch.nn.Conv2d(3, 4, 3), torch.nn.Conv2d(4, 4, 1)
        self.shared, self.fc = torch.nn.Linear(6, 6), torch.nn.Linear(8 * 6 * 6, 5)

    def forward(self, x):
        a = torch.relu(self.conv(x))
        c = torch.cat([a + self.conv2(a), a], 1)
        return self.fc(self.shared(self.shared(c)).flatten(1))


class _Recurrent(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.bag = torch.nn.Embedding(20, 8), torch.nn.EmbeddingBag(20, 8, mode="sum")
        self.lstm, self.fc = torch.nn.LSTM(8, 12, batch_first=True), torch.nn.Linear(12, 4)

    def forward(self, i):
        return self.fc(self.lstm(self.emb(i))[0]).sum(1) + self.bag(i)[:, :4]


@pytest.mark.parametrize("dynamic", ["per_channel_dynamic_qconfig", "default_dynamic_qconfig"])
def test_dynamic_qconfigs_lstm_linear_embedding(dynamic):
    """quantize_dynamic with torch.ao's dynamic qconfig (LSTM, Linear) and
    float_qparams_weight_only_qconfig (Embedding, EmbeddingBag): torch.ao's packed weights."""
    def run(qconfig, embedding):
        spec = {torch.nn.LSTM: qconfig, torch.nn.Linear: qconfig, torch.nn.Embedding: embedding,
                torch.nn.EmbeddingBag: embedding}
        return tq.quantize_dynamic(_model(_Recurrent), spec, dtype=torch.qint8)

    qconfig, embedding = getattr(tq, dynamic), tq.float_qparams_weight_only_qconfig
    ours = run(_with_qstats_observers(qconfig), _with_qstats_observers(embedding))
    reference = run(qconfig, embedding)
    _assert_same_quantized_state(ours, reference)
    for part in ("weight", "bias"):
        for name, value in reference.lstm._weight_bias()[part].items():
            other = ours.lstm._weight_bias()[part][name]
            assert torch.equal(other.dequantize() if other.is_quantized else other,
                               value.dequantize() if value.is_quantized else value), name
    i = torch.randint(0, 20, (3, 5))
    assert torch.equal(ours(i), reference(i))


def test_float16_dynamic_qconfig_in_fx():
    """float16_dynamic_qconfig with qstats placeholders through convert_fx: a float-dtype
    observer has qscheme None, so torch.ao's get_qparam_dict skips it as its PlaceholderObserver
    (calculate_qparams was called and raised a TypeError)."""
    def run(qconfig):
        prepared = prepare_fx(_model(_Plain), tq.QConfigMapping().set_global(qconfig), example_inputs=(x,))
        prepared(x)
        return convert_fx(prepared)

    x = torch.randn(4, 16)
    placeholder = torch_ao.default_placeholder_observer
    ours = run(tq.QConfig(activation=placeholder.with_args(dtype=torch.float16, is_dynamic=True),
                          weight=placeholder.with_args(dtype=torch.float16)))
    reference = run(tq.float16_dynamic_qconfig)
    assert str(ours.code) == str(reference.code)
    assert type(ours.fc1) is type(reference.fc1) and torch.equal(ours(x), reference(x))


def test_fx_equalization_resets_the_weight_observer():
    """FX's input-weight equalization calls the weight observer's ``reset_min_max_vals`` (an
    AttributeError before) and writes the input observer's min_val/max_val: torch.ao's model."""
    from torch.ao.quantization.fx._equalize import default_equalization_qconfig

    class Functional(torch.nn.Module):  # weights as buffers: torch.ao's equalization reassigns them
        def __init__(self):
            super().__init__()
            for name, shape in (("w1", (32, 16)), ("b1", (32,)), ("w2", (8, 32))):
                self.register_buffer(name, torch.randn(*shape))

        def forward(self, x):
            return torch.nn.functional.linear(torch.nn.functional.linear(x, self.w1, self.b1), self.w2)

    batches = [b * torch.linspace(0.1, 5, 16) for b in _batches(n=3)]

    def run(qconfig):
        prepared = prepare_fx(_model(Functional), tq.QConfigMapping().set_global(qconfig), example_inputs=(batches[0],),
                              _equalization_config=tq.QConfigMapping().set_global(default_equalization_qconfig))
        for batch in batches:
            prepared(batch)
        return convert_fx(prepared)

    ours, reference = run(_with_qstats_observers(tq.default_qconfig)), run(tq.default_qconfig)
    _assert_same_quantized_state(ours, reference)
    assert torch.equal(ours(batches[1]), reference(batches[1]))
    observer = torch_ao.default_observer()
    observer(torch.randn(5))
    observer.reset_min_max_vals()
    assert observer.state is None


def test_default_qat_qconfig_eager_and_fx():
    """default_qat_qconfig with the moving averages inside torch.ao's FakeQuantize replaced by
    qstats.moving_average_minmax; trained a few SGD steps (prepare_qat, prepare_qat_fx), converted:
    torch.ao's models. (FusedMovingAvgObsFakeQuantize accepts only torch.ao's classes.)"""
    def swap(fake_quant):
        keywords = dict(fake_quant.p.keywords, observer=torch_ao.QstatsObserver.with_args(
            observer=qstats.moving_average_minmax))
        return tq.FakeQuantize.with_args(**keywords)

    def train(prepared):
        optimizer = torch.optim.SGD(prepared.parameters(), lr=0.01)
        for batch in _images():
            optimizer.zero_grad()
            (prepared(batch) ** 2).mean().backward()
            optimizer.step()
        return prepared.eval()

    def eager(qconfig):
        model = _model(_ConvNet).train()
        model.qconfig = qconfig
        return tq.convert(train(tq.prepare_qat(tq.fuse_modules_qat(model, [["conv", "relu"]]))))

    def fx(qconfig):
        mapping = tq.QConfigMapping().set_global(qconfig)
        return convert_fx(train(prepare_qat_fx(_model(_Plain4D).train(), mapping, example_inputs=(_images()[0],))))

    reference_qconfig = tq.default_qat_qconfig
    qconfig = tq.QConfig(activation=swap(reference_qconfig.activation), weight=swap(reference_qconfig.weight))
    x = torch.randn(2, 3, 8, 8)
    for flow in (eager, fx):
        ours, reference = flow(qconfig), flow(reference_qconfig)
        _assert_same_quantized_state(ours, reference)
        assert torch.equal(ours(x), reference(x))


def test_pt2e_x86_inductor_quantizer_with_qstats_observers():
    """torchao's X86InductorQuantizer config (conv, add, cat, linear) with its observers replaced:
    MinMaxObserver/PerChannelMinMaxObserver by QstatsPT2EObserver; every q/dq node's scale and zero
    point, and the outputs, are those of torchao's observers."""
    import dataclasses

    pt2e = pytest.importorskip("torchao.quantization.pt2e")
    quantize_pt2e = pytest.importorskip("torchao.quantization.pt2e.quantize_pt2e")
    x86 = pytest.importorskip("torchao.quantization.pt2e.quantizer.x86_inductor_quantizer")
    from qstats.torchao_pt2e import QstatsPT2EObserver

    def swapped(activation, weight):
        config = x86.get_default_x86_inductor_quantization_config()
        replace = lambda spec, ctr: None if spec is None else dataclasses.replace(spec, observer_or_fake_quant_ctr=ctr)
        return dataclasses.replace(config, input_activation=replace(config.input_activation, activation),
                                   output_activation=replace(config.output_activation, activation),
                                   weight=replace(config.weight, weight))

    def run(config):
        exported = torch.export.export(_model(_Plain4D), (_images()[0],)).module()
        prepared = quantize_pt2e.prepare_pt2e(exported, x86.X86InductorQuantizer().set_global(config))
        for batch in _images():
            prepared(batch)
        return quantize_pt2e.convert_pt2e(prepared)

    def qparams(model):
        def value(arg):
            return getattr(model, arg.target) if isinstance(arg, torch.fx.Node) and arg.op == "get_attr" else arg
        return [(str(n.target), [value(a) for a in n.args[1:] if not isinstance(value(a), torch.fx.Node)])
                for n in model.graph.nodes if n.op == "call_function" and "quantize_per" in str(n.target)]

    ours = run(swapped(QstatsPT2EObserver, QstatsPT2EObserver))
    reference = run(swapped(pt2e.MinMaxObserver, pt2e.PerChannelMinMaxObserver))
    mine, theirs = qparams(ours), qparams(reference)
    assert len(theirs) > 10 and [t for t, _ in mine] == [t for t, _ in theirs]
    for (_, a), (_, b) in zip(mine, theirs):
        for p, q in zip(a, b):
            assert torch.equal(p, q) if isinstance(q, torch.Tensor) else p == q
    x = torch.randn(2, 3, 8, 8) * 2
    assert torch.equal(ours(x), reference(x))
