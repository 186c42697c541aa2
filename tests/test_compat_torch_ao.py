"""QuantSpec.from_torch_ao + compute_qparams against torch.ao.quantization's observers, bit for bit.

Every combination torch.ao's MinMaxObserver, MovingAverageMinMaxObserver, PerChannelMinMaxObserver
and MovingAveragePerChannelMinMaxObserver accept (all their dtypes x the five qschemes x
reduce_range x default, custom and invalid ranges x eps) is run through the real observer and
through the matching qstats observer on the same batches; scales must be ``torch.equal`` and zero
points equal in value. Every combination torch.ao refuses must make ``from_torch_ao`` raise
ValueError. The two combinations qstats refuses although torch.ao constructs them are checked to be
unusable in torch.ao (an Inf, NaN or zero scale, a zero point no int32 holds, or an error in
``calculate_qparams``).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.ao.quantization import observer as ao

import qstats

F32_EPS = float(torch.finfo(torch.float32).eps)

ALLOWED_DTYPES = (
    torch.qint8,
    torch.quint8,
    torch.quint4x2,
    torch.qint32,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.float8_e5m2,
    torch.float8_e4m3fn,
    torch.uint16,
)
REFUSED_DTYPES = (torch.float16, torch.float32, torch.int64, torch.quint2x4)
PER_TENSOR = (torch.per_tensor_affine, torch.per_tensor_symmetric)
PER_CHANNEL = (torch.per_channel_affine, torch.per_channel_symmetric, torch.per_channel_affine_float_qparams)
QSCHEMES = PER_TENSOR + PER_CHANNEL

# (quant_min, quant_max): defaults, custom ranges of several widths, half-given (ignored by
# torch.ao), and invalid ones (no zero, empty, too wide for int8/int32, wider than int32).
RANGES = (
    (None, None),
    (0, 255),
    (-128, 127),
    (0, 15),
    (-8, 7),
    (-3, 4),
    (0, 3),
    (-2, 1),
    (0, 1),
    (-1, 0),
    (0, 2**16 - 1),
    (-(2**15), 2**15 - 1),
    (-(2**31), 2**31 - 1),
    (0, 1000),
    (None, 100),
    (-5, None),
    (1, 10),
    (-10, -1),
    (0, 0),
    (3, 1),
    (-300, 300),
    (0, 2**32),
    (-(2**31), 2**32),
)
EPS = (F32_EPS, 1e-3, 1e-10, 0.0)
CONSTANTS = (1.0, 0.5, 0.01, 0.0)  # 0: torch.ao keeps the first batch's range
CH_AXES = (0, 1, -1)


def _reference(kind, dtype, qscheme, reduce_range, quant_min, quant_max, eps, ch_axis=0, constant=0.01):
    kwargs = dict(
        dtype=dtype, qscheme=qscheme, reduce_range=reduce_range, quant_min=quant_min, quant_max=quant_max, eps=eps
    )
    if kind == "minmax":
        return ao.MinMaxObserver(**kwargs)
    if kind == "moving_average":
        return ao.MovingAverageMinMaxObserver(averaging_constant=constant, **kwargs)
    if kind == "histogram":
        return ao.HistogramObserver(**kwargs)
    if kind == "per_channel":
        return ao.PerChannelMinMaxObserver(ch_axis=ch_axis, **kwargs)
    return ao.MovingAveragePerChannelMinMaxObserver(averaging_constant=constant, ch_axis=ch_axis, **kwargs)


def _kinds(qscheme):
    return ("minmax", "moving_average") if qscheme in PER_TENSOR else ("per_channel", "moving_average_per_channel")


def _constructing_kinds(ref_args):
    """The min/max observer kinds of the qscheme's family that construct for ``ref_args``
    (quint8 per_tensor_symmetric with reduce_range: none, only HistogramObserver takes it)."""
    return [kind for kind in _kinds(ref_args[1]) if _refuses(lambda: _reference(kind, *ref_args)) is None]


def _acceptance_kinds(qscheme):
    """Every observer kind whose acceptance `from_torch_ao` follows (histogram: per tensor only)."""
    return _kinds(qscheme) + (("histogram",) if qscheme in PER_TENSOR else ())


def _ours(kind, spec, constant):
    if kind.startswith("moving_average"):
        return qstats.moving_average_minmax(spec, averaging_constant=constant)
    return qstats.minmax(spec)


def _inputs():
    """Named batch sequences (3-D, so every ch_axis applies): random normal at several scales and
    the edge cases. Each sequence is several batches; moving averages see them in order."""
    g = torch.Generator().manual_seed(0)

    def randn(scale, shift=0.0):
        return torch.randn(4, 6, 5, generator=g) * scale + shift

    shape = (4, 6, 5)
    wide = torch.randn(shape, generator=g) * torch.logspace(-30, 30, 120).reshape(shape)
    mixed = randn(1.0)
    mixed[:, 0] = 0.0  # a zero channel (ch_axis 1)
    mixed[:, 1] = 2.5  # a constant channel
    mixed[:, 2] = -mixed[:, 2].abs() - 0.1  # a negative channel
    mixed[:, 3] = mixed[:, 3].abs() + 0.1  # a positive channel
    return {
        "normal-1e-3": [randn(1e-3) for _ in range(3)],
        "normal-1": [randn(1.0), randn(1.0), randn(2.0, 0.5)],
        "normal-1e3": [randn(1e3) for _ in range(3)],
        "constant": [torch.full(shape, 3.0), torch.full(shape, 3.0)],
        "zeros": [torch.zeros(shape), torch.zeros(shape)],
        "negative": [-randn(1.0).abs() - 0.1, -randn(3.0).abs()],
        "positive": [randn(1.0).abs() + 0.1, randn(3.0).abs()],
        "wide": [wide, wide.flip(0)],
        "tiny": [randn(1e-38), randn(1e-42)],
        "mixed-channels": [mixed, mixed * 0.5],
        "bf16": [randn(1.0).bfloat16(), randn(2.0).bfloat16()],
        "fp16": [randn(1.0).half(), randn(2.0).half()],
    }


INPUTS = _inputs()
# torch.ao's per-channel observers need two dimensions; 1-D inputs go to per-tensor ones only.
SINGLE = {
    "single": [torch.tensor([[0.7]]), torch.tensor([[-0.2]])],
    "one-row": [torch.linspace(-2.0, 5.0, 7)[None]],
    "one-d": [torch.linspace(-2.0, 5.0, 7), torch.tensor([1e-3])],
}


def _run(kind, ref_args, spec, batches, constant, ch_axis=0):
    """(torch.ao scale, zero point), (qstats scale, zero point) after the same batches."""
    ref = _reference(kind, *ref_args, ch_axis=ch_axis, constant=constant)
    obs = _ours(kind, spec, constant)
    state = obs.init(batches[0])
    for x in batches:
        ref(x)
        state = obs.update(state, x)
    scale, zero_point = ref.calculate_qparams()
    qp = qstats.compute_qparams(state, spec)
    return (scale, _unwrapped_zero_point(ref, scale, zero_point)), qp


def _unwrapped_zero_point(ref, scale, zero_point):
    """torch.ao's affine zero point computed in int64: with int32-wide quant ranges its
    ``round(min / scale).to(torch.int)`` wraps (an all-negative range's zero point 0, not quant_max),
    which qstats does not reproduce (docs/differences.md)."""
    affine = ref.qscheme in (torch.per_tensor_affine, torch.per_channel_affine)
    if zero_point.is_floating_point() or not affine or ref.quant_max - ref.quant_min < 2**31:
        return zero_point
    codes = torch.round(torch.clamp(ref.min_val, max=0.0).reshape(scale.shape) / scale).to(torch.int64)
    return torch.clamp(ref.quant_min - codes, ref.quant_min, ref.quant_max).to(zero_point.dtype)


def _assert_bit_exact(reference, qp, context):
    scale, zero_point = reference
    assert scale.dtype == torch.float32 and qp.scale.dtype == torch.float32
    ours_scale, ours_zero_point = qp.scale.reshape(-1), qp.zero_point.reshape(-1)
    if not torch.equal(scale.reshape(-1), ours_scale):
        raise AssertionError(f"scale differs for {context}: torch.ao {scale.tolist()} qstats {ours_scale.tolist()}")
    if not torch.equal(zero_point.reshape(-1).double(), ours_zero_point.double()):
        raise AssertionError(
            f"zero point differs for {context}: torch.ao {zero_point.tolist()} qstats {ours_zero_point.tolist()}"
        )
    if zero_point.dtype.is_floating_point != ours_zero_point.dtype.is_floating_point:
        raise AssertionError(f"zero point dtype {ours_zero_point.dtype} vs torch.ao {zero_point.dtype} for {context}")


def _refuses(make):
    try:
        make()
    except (AssertionError, NotImplementedError, ValueError, TypeError) as error:  # TypeError: HistogramObserver of float8
        return error
    return None


def _unusable(make):
    """True when a torch.ao observer that constructs gives no usable parameters."""
    for x in (torch.zeros(4, 6, 5), torch.randn(4, 6, 5) * 1e3, torch.full((4, 6, 5), 3.0)):
        ref = make()
        ref(x)
        try:
            scale, zero_point = ref.calculate_qparams()
        except RuntimeError:
            return True
        if not torch.isfinite(scale).all() or (scale == 0).any():
            return True
        # compared as Python ints: an int32 tensor compared with 2**31 wraps it to -2**31 (every zero point failed)
        low, high = (int(zero_point.min()), int(zero_point.max())) if zero_point.numel() else (0, 0)
        if not zero_point.dtype.is_floating_point and not -(2**31) <= low <= high < 2**31:
            return True
        if not zero_point.dtype.is_floating_point and not ref.quant_min <= low <= high <= ref.quant_max:
            return True  # torch's fake quantization refuses such a zero point (uint16's 2**15 on a signed range)
        if zero_point.dtype.is_floating_point:
            # parameters that do not cover the data they were calibrated on: torch.ao's own fake
            # quantization moves a value of the observed range by more than half a step (a float
            # zero point puts the minimum at code 0; a signed range leaves half its codes below)
            fq = torch.fake_quantize_per_channel_affine(x, scale, zero_point, ref.ch_axis, ref.quant_min, ref.quant_max)
            step = scale.reshape(-1, *([1] * (x.dim() - 1))).movedim(0, ref.ch_axis)
            if ((fq - x).abs() > step * 0.5001).any():
                return True
    return False


# Thousands of tiny reductions: one torch thread (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("single_thread_quiet")


ACCEPTANCE_EPS = (F32_EPS, 0.0)


def _grid():
    return itertools.product(ALLOWED_DTYPES + REFUSED_DTYPES, QSCHEMES, (False, True), RANGES, ACCEPTANCE_EPS)


def test_from_torch_ao_accepts_and_refuses_what_torch_ao_does():
    checked = refused = deviations = eps_deviations = 0
    for dtype, qscheme, reduce_range, (quant_min, quant_max), eps in _grid():
        ref_args = (dtype, qscheme, reduce_range, quant_min, quant_max, eps)
        ours = _refuses(
            lambda: qstats.QuantSpec.from_torch_ao(
                dtype, qscheme, reduce_range=reduce_range, quant_min=quant_min, quant_max=quant_max, eps=eps
            )
        )
        # qstats accepts what any observer of the family accepts (quint8 per_tensor_symmetric
        # with reduce_range: HistogramObserver only), and refuses what they all refuse
        theirs = {kind: _refuses(lambda: _reference(kind, *ref_args)) for kind in _acceptance_kinds(qscheme)}
        accepting = [kind for kind, error in theirs.items() if error is None]
        checked += 1
        context = f"{accepting or list(theirs)} {ref_args}"
        if not accepting:
            refused += 1
            assert isinstance(ours, ValueError), f"torch.ao refuses {context} ({theirs!r}); qstats gave {ours!r}"
        elif ours is not None:
            deviations += 1
            eps_deviations += eps <= 0
            assert isinstance(ours, ValueError), context
            if eps <= 0 and qscheme == torch.per_channel_affine_float_qparams:
                continue  # documented: qstats needs eps > 0; here torch.ao only tests scale > 0
            for kind in accepting:
                assert _unusable(lambda: _reference(kind, *ref_args)), (
                    f"qstats refuses {context} ({ours}) but torch.ao's {kind} gives usable parameters"
                )
        # a per-channel observer refuses per-tensor qschemes and vice versa
        wrong = "per_channel" if qscheme in PER_TENSOR else "minmax"
        assert _refuses(lambda: _reference(wrong, *ref_args)) is not None
    assert checked == len(ALLOWED_DTYPES + REFUSED_DTYPES) * len(QSCHEMES) * 2 * len(RANGES) * len(ACCEPTANCE_EPS)
    assert refused > 0 and deviations > 0
    print(
        f"torch.ao acceptance: {checked} combinations, {refused} refused by both, "
        f"{deviations} refused by qstats only ({eps_deviations} of them for eps=0)"
    )


def _accepted(dtypes=ALLOWED_DTYPES, qschemes=QSCHEMES, ranges=RANGES, eps_values=EPS, ch_axis=0):
    for dtype, qscheme, reduce_range, (quant_min, quant_max), eps in itertools.product(
        dtypes, qschemes, (False, True), ranges, eps_values
    ):
        try:
            spec = qstats.QuantSpec.from_torch_ao(
                dtype, qscheme, reduce_range=reduce_range, quant_min=quant_min, quant_max=quant_max, eps=eps,
                ch_axis=ch_axis,
            )
        except ValueError:
            continue
        yield (dtype, qscheme, reduce_range, quant_min, quant_max, eps), spec


# The valid ranges worth computing with (the acceptance test covers the rest of RANGES).
QPARAM_RANGES = (
    (None, None),
    (0, 255),
    (-128, 127),
    (0, 15),
    (-3, 4),
    (0, 3),
    (0, 1),
    (-1, 0),
    (-(2**15), 2**15 - 1),
    (-(2**31), 2**31 - 1),
    (0, 1000),
    (None, 100),
)


@pytest.mark.parametrize("qscheme", QSCHEMES, ids=str)
def test_every_accepted_combination_is_bit_exact(qscheme):
    """All dtypes x reduce_range x ranges x eps for one qscheme, through both observer kinds of
    the family, each on two input sequences (rotating through all of them) and an averaging
    constant (rotating through several)."""
    count = 0
    names = list(INPUTS)
    half = len(names) // 2
    for index, (ref_args, spec) in enumerate(
        _accepted(qschemes=(qscheme,), ranges=QPARAM_RANGES, eps_values=EPS[:3], ch_axis=1)
    ):
        for kind in _constructing_kinds(ref_args):
            for name in (names[index % len(names)], names[(index + half) % len(names)]):
                constant = CONSTANTS[(index + names.index(name)) % len(CONSTANTS)]
                reference, qp = _run(kind, ref_args, spec, INPUTS[name], constant, ch_axis=1)
                _assert_bit_exact(reference, qp, f"{kind} {ref_args} input={name} c={constant}")
                count += 1
    assert count > 500
    print(f"{qscheme}: {count} bit-exact comparisons")


@pytest.mark.parametrize("qscheme", QSCHEMES, ids=str)
def test_default_ranges_on_every_input(qscheme):
    """Every dtype x reduce_range with its default range, on every input sequence, through both
    observer kinds and every averaging constant."""
    count = 0
    for ref_args, spec in _accepted(qschemes=(qscheme,), ranges=((None, None),), eps_values=(F32_EPS,), ch_axis=1):
        for kind in _constructing_kinds(ref_args):
            for name, batches in INPUTS.items():
                for constant in CONSTANTS if kind.startswith("moving") else (0.01,):
                    reference, qp = _run(kind, ref_args, spec, batches, constant, ch_axis=1)
                    _assert_bit_exact(reference, qp, f"{kind} {ref_args} input={name} c={constant}")
                    count += 1
    assert count > 200
    print(f"{qscheme} default ranges: {count} bit-exact comparisons")


@pytest.mark.parametrize("ch_axis", CH_AXES)
def test_per_channel_axes(ch_axis):
    count = 0
    names = ("mixed-channels", "wide", "normal-1", "zeros")
    for index, (ref_args, spec) in enumerate(
        _accepted(qschemes=PER_CHANNEL, ranges=QPARAM_RANGES[:4], eps_values=(F32_EPS,), ch_axis=ch_axis)
    ):
        assert spec.granularity == qstats.PerAxis(ch_axis)
        for kind in _kinds(ref_args[1]):
            for name in (names[index % 2], names[2 + index % 2]):
                constant = CONSTANTS[index % len(CONSTANTS)]
                reference, qp = _run(kind, ref_args, spec, INPUTS[name], constant, ch_axis=ch_axis)
                assert qp.scale.shape == (INPUTS[name][0].shape[ch_axis],)
                _assert_bit_exact(reference, qp, f"{kind} {ref_args} ch_axis={ch_axis} input={name}")
                count += 1
    assert count > 100
    print(f"ch_axis={ch_axis}: {count} bit-exact comparisons")


def test_single_element_and_one_dimensional_inputs():
    count = 0
    for ref_args, spec in _accepted(ranges=QPARAM_RANGES[:4], eps_values=(F32_EPS,)):
        for kind in _constructing_kinds(ref_args):
            for name, batches in SINGLE.items():
                if name == "one-d" and "per_channel" in kind:
                    continue
                reference, qp = _run(kind, ref_args, spec, batches, 0.5)
                _assert_bit_exact(reference, qp, f"{kind} {ref_args} input={name}")
                count += 1
    assert count > 100
    print(f"single element / 1-D: {count} bit-exact comparisons")


@pytest.mark.parametrize("dtype", ALLOWED_DTYPES, ids=str)
def test_uncalibrated_matches_torch_ao_default(dtype):
    """An observer that saw nothing: torch.ao returns scale 1, zero point 0; so does the spec."""
    for qscheme in QSCHEMES:
        signed_range = _reference("per_channel", dtype, torch.per_channel_affine, False, None, None, F32_EPS).quant_min < 0
        if qscheme == torch.per_channel_affine_float_qparams and signed_range:
            # signed float-qparams ranges clip half the data (the acceptance test checks torch.ao's)
            with pytest.raises(ValueError, match="zero_point_domain"):
                qstats.QuantSpec.from_torch_ao(dtype, qscheme)
            continue
        spec = qstats.QuantSpec.from_torch_ao(dtype, qscheme)
        for kind in _kinds(qscheme):
            ref = _reference(kind, dtype, qscheme, False, None, None, F32_EPS)
            ref(torch.empty(0))
            scale, zero_point = ref.calculate_qparams()
            x = torch.randn(4, 6, 5)
            qp = qstats.compute_qparams(_ours(kind, spec, 0.5).init(x), spec)
            assert torch.equal(scale.reshape(-1)[:1], qp.scale.reshape(-1)[:1])
            assert torch.equal(zero_point.reshape(-1)[:1].double(), qp.zero_point.reshape(-1)[:1].double())
            assert not bool(qp.calibrated.any())


def test_low_precision_targets_use_torch_ao_fallback_range():
    """float8 and quint4x2 observers compute with torch.ao's (0, 15) fallback range."""
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.quint4x2):
        ref = ao.MinMaxObserver(dtype=dtype)
        spec = qstats.QuantSpec.from_torch_ao(dtype)
        assert (ref.quant_min, ref.quant_max) == (0, 15) == spec.qrange


def test_refusals_name_the_problem():
    with pytest.raises(ValueError, match="dtype"):
        qstats.QuantSpec.from_torch_ao(torch.float32)
    with pytest.raises(ValueError, match="include 0"):
        qstats.QuantSpec.from_torch_ao(torch.qint8, quant_min=1, quant_max=10)
    with pytest.raises(ValueError, match="reduce range"):
        qstats.QuantSpec.from_torch_ao(torch.quint8, torch.per_channel_symmetric, reduce_range=True)
    with pytest.raises(ValueError, match="single value"):
        qstats.QuantSpec.from_torch_ao(torch.qint8, reduce_range=True, quant_min=0, quant_max=1)
    with pytest.raises(ValueError, match="int32"):
        qstats.QuantSpec.from_torch_ao(torch.quint8, quant_min=0, quant_max=2**32)
    with pytest.raises(ValueError, match="int32"):
        qstats.QuantSpec.from_torch_ao(torch.quint8, torch.per_tensor_symmetric, quant_min=0, quant_max=2**32)
    with pytest.raises(ValueError, match="eps"):
        qstats.QuantSpec.from_torch_ao(torch.qint8, eps=0.0)


@pytest.mark.parametrize("quant_range", ((None, None), (0, 255), (0, 15)))
def test_histogram_observer_quint8_symmetric_reduce_range(quant_range):
    """quint8 with per_tensor_symmetric and reduce_range, which HistogramObserver takes (torch.ao's
    own histogram tests use it) and MinMaxObserver refuses (issue 22, item 12): the range (0, 127)
    with torch.ao's fixed zero point 128 (a custom range: halved, with its lower midpoint)."""
    quant_min, quant_max = quant_range
    kwargs = dict(dtype=torch.quint8, qscheme=torch.per_tensor_symmetric, reduce_range=True,
                  quant_min=quant_min, quant_max=quant_max)
    with pytest.raises(NotImplementedError):
        ao.MinMaxObserver(**kwargs)
    spec = qstats.QuantSpec.from_torch_ao(**kwargs)
    g = torch.Generator().manual_seed(7)
    for x in (torch.randn(64, generator=g) * 3, torch.randn(64, generator=g).abs() + 0.5, torch.zeros(8)):
        reference = ao.HistogramObserver(bins=256, **kwargs)
        reference(x)
        assert (reference.quant_min, reference.quant_max) == spec.qrange
        # the histogram search's range, mapped by torch.ao and by qstats
        new_min, new_max = reference._non_linear_param_search()
        scale, zero_point = reference.calculate_qparams()
        qp = qstats.qparams_from_minmax(new_min, new_max, spec)
        assert torch.equal(qp.scale.reshape(1), scale.reshape(1))
        assert int(qp.zero_point) == int(zero_point) == spec.symmetric_zero_point
        # the observed extremes, through qstats' own observer
        obs = qstats.minmax(spec)
        qp = qstats.compute_qparams(obs.update(obs.init(x), x), spec)
        scale, zero_point = reference._calculate_qparams(reference.min_val, reference.max_val)
        assert torch.equal(qp.scale.reshape(1), scale.reshape(1))
        assert int(qp.zero_point) == int(zero_point)


@pytest.mark.parametrize("input_dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("qscheme", (torch.per_tensor_symmetric, torch.per_tensor_affine, torch.per_channel_symmetric), ids=str)
@pytest.mark.parametrize("quant_range", ((-(2**25 + 3), 2**25 + 3), (-(2**31), 2**31 - 1), (-(2**26 + 5), 2**26 + 5)))
def test_int32_range_edges_value_and_gradient(quant_range, qscheme, input_dtype):
    """qint32 ranges whose ends are not float32 numbers: values and straight-through gradients of
    ``fake_quantize`` at the codes around both ends equal torch's fake-quant ops, whose per-tensor
    kernel tests its float32 code against the ends converted to float32 (the per-channel one
    tests int64 codes exactly)."""
    qmin, qmax = quant_range
    spec = qstats.QuantSpec.from_torch_ao(torch.qint32, qscheme, quant_min=qmin, quant_max=qmax)
    calibration = torch.tensor([[-3.0, 1.0]])
    per_channel = qscheme == torch.per_channel_symmetric
    reference = (ao.PerChannelMinMaxObserver if per_channel else ao.MinMaxObserver)(
        dtype=torch.qint32, qscheme=qscheme, quant_min=qmin, quant_max=qmax
    )
    reference(calibration)
    scale, zero_point = reference.calculate_qparams()
    obs = qstats.minmax(spec)
    qp = qstats.compute_qparams(obs.update(obs.init(calibration), calibration), spec)
    assert torch.equal(qp.scale.reshape(-1), scale.reshape(-1))
    step, zp = float(scale.reshape(-1)[0]), int(zero_point.reshape(-1)[0])
    offsets = torch.arange(-8, 9, dtype=torch.float64)
    x = torch.cat([(qmin + offsets - zp) * step, (qmax + offsets - zp) * step]).to(input_dtype)[None]
    x.requires_grad_(True)
    if per_channel:
        theirs = torch.fake_quantize_per_channel_affine(x, scale, zero_point.int(), 0, qmin, qmax)
    else:
        theirs = torch.fake_quantize_per_tensor_affine(x, scale, zero_point.int(), qmin, qmax)
    ours = qstats.fake_quantize(x, qp, spec)
    assert torch.equal(ours, theirs)
    (their_grad,) = torch.autograd.grad(theirs.sum(), x)
    (our_grad,) = torch.autograd.grad(ours.sum(), x)
    assert torch.equal(our_grad, their_grad)


@pytest.mark.parametrize("constant", (0, 0.01, 1), ids=lambda c: f"c={c}")
@pytest.mark.parametrize(
    "kind, dtype, qscheme",
    (("moving_average", torch.quint8, torch.per_tensor_affine),
     ("moving_average_per_channel", torch.qint8, torch.per_channel_symmetric)),
    ids=("per_tensor", "per_channel"),
)
def test_averaging_constant_zero_to_one_equals_torch_ao_after_every_batch(kind, dtype, qscheme, constant):
    """torch.ao's moving averages take ``averaging_constant=0`` (the first batch's range stays):
    qstats takes it too (it used to raise), and its extremes and qparams equal torch.ao's after
    every batch; `torch_ao.from_observer` of a calibrated torch.ao observer continues it exactly."""
    from qstats import torch_ao

    g = torch.Generator().manual_seed(7)
    batches = [torch.randn(4, 6, 5, generator=g) * scale + shift
               for scale, shift in ((1.0, 0.0), (3.0, 1.0), (0.1, -2.0), (10.0, 0.5), (1e-3, 0.0))]
    spec = qstats.QuantSpec.from_torch_ao(dtype, qscheme, ch_axis=1)
    reference = _reference(kind, dtype, qscheme, False, None, None, F32_EPS, ch_axis=1, constant=constant)
    obs = qstats.moving_average_minmax(spec, averaging_constant=constant)
    state = obs.init(batches[0])
    for index, x in enumerate(batches):
        reference(x)
        state = obs.update(state, x)
        assert torch.equal(state.min_val, reference.min_val) and torch.equal(state.max_val, reference.max_val), index
        _assert_bit_exact(reference.calculate_qparams(), qstats.compute_qparams(state, spec), f"{kind} c={constant} batch {index}")
        if index == 1:
            imported, imported_spec, imported_state = torch_ao.from_observer(reference)
    if constant == 0:  # the first batch's range, as torch.ao keeps it
        first = obs.update(obs.init(batches[0]), batches[0])
        assert torch.equal(state.min_val, first.min_val) and torch.equal(state.max_val, first.max_val)
    for x in batches[2:]:
        imported_state = imported.update(imported_state, x)
    assert torch.equal(imported_state.min_val, reference.min_val) and torch.equal(imported_state.max_val, reference.max_val)
    _assert_bit_exact(reference.calculate_qparams(), qstats.compute_qparams(imported_state, imported_spec), "from_observer")


@pytest.mark.parametrize("bad", (-0.01, 1.5, float("nan"), True, False, "0.1", None), ids=repr)
def test_moving_average_minmax_refuses_averaging_constants_outside_zero_to_one(bad):
    with pytest.raises(ValueError, match="averaging_constant must be a number in \\[0, 1\\]"):
        qstats.moving_average_minmax(qstats.QuantSpec(), averaging_constant=bad)


def test_fused_qat_fake_quant_symmetric_scales_differ_as_documented():
    """docs/differences.md: torch.ao's fused fake-quant divides min by 128 and max by 127; its
    unfused FakeQuantize (and qstats) divide the larger magnitude by 127.5."""
    from torch.ao.quantization import FakeQuantize, FusedMovingAvgObsFakeQuantize, MovingAveragePerChannelMinMaxObserver

    x = torch.tensor([[-2.0, 1.0, 0.3], [0.5, -0.25, 1.5]])
    kwargs = dict(observer=MovingAveragePerChannelMinMaxObserver, quant_min=-128, quant_max=127, dtype=torch.qint8,
                  qscheme=torch.per_channel_symmetric, ch_axis=0)
    fused, unfused = FusedMovingAvgObsFakeQuantize(**kwargs), FakeQuantize(**kwargs)
    fused(x), unfused(x)
    spec = qstats.QuantSpec.from_torch_ao(dtype=torch.qint8, qscheme=torch.per_channel_symmetric, ch_axis=0)
    obs = qstats.minmax(spec)
    ours = qstats.compute_qparams(obs.update(obs.init(x), x), spec)
    assert torch.equal(ours.scale, unfused.scale)
    assert torch.equal(fused.scale, torch.tensor([2 / 128, 1.5 / 127]))
    assert not torch.equal(ours.scale, fused.scale)
