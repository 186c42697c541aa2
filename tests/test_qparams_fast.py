"""The eager path for symmetric specs of the torch.ao and compressed-tensors conventions
(`qstats._qparams._symmetric_qparams`, fewer ops, and its native pass
`qstats._native.symmetric_scales` where the kernel is built) against the general range mapping it
short-cuts, bit for bit, on ranges no observer would produce as well as on real ones: NaN, +-Inf,
min > max, +-0.0, subnormals, ranges past half the float32 range, zero counts; and against
torch.ao's own observers on valid ranges (compressed-tensors' are in
test_compat_compressed_tensors.py, which goes through the same path)."""

import contextlib

import pytest
import torch
from _shared import bit_equal
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.ao.quantization.observer import MinMaxObserver, PerChannelMinMaxObserver

import qstats
from qstats import _native, _qparams

SETTINGS = settings(
    max_examples=400,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)

FLOAT32_MAX = torch.finfo(torch.float32).max
SPECIAL = [
    0.0, -0.0, 1e-45, -1e-45, 1e-38, -1e-38, 1.0, -1.0, 3.0, -250.0, FLOAT32_MAX, -FLOAT32_MAX,
    FLOAT32_MAX / 2, -FLOAT32_MAX / 2, 2e38, -2e38, float("inf"), float("-inf"), float("nan"),
]


def _specs():
    specs = []
    for dtype in ("int8", "uint8", "int4", "uint4", "int2", "int16", "uint16", "fp8_e4m3fn", "fp8_e5m2", "fp4_e2m1"):
        for mapping in ("symmetric", "narrow"):
            if mapping == "narrow" and dtype.startswith("u"):
                continue
            specs.append(qstats.QuantSpec(dtype=dtype, mapping=mapping))
    specs += [
        qstats.QuantSpec(dtype="int8", mapping="symmetric", reduce_range=True),
        qstats.QuantSpec(dtype="uint8", mapping="symmetric", reduce_range=True),
        qstats.QuantSpec(dtype="int8", mapping="symmetric", quant_min=-100, quant_max=100),
        qstats.QuantSpec(dtype="int8", mapping="symmetric", eps=0.5),
        qstats.QuantSpec(dtype="int8", mapping="symmetric", eps=2.0),
        qstats.QuantSpec(dtype="int8", mapping="symmetric", eps=1e-30),
        qstats.QuantSpec(dtype="int8", mapping="symmetric", eps=1e37),  # above the largest clipped scale
        qstats.QuantSpec(dtype="int16", mapping="narrow", eps=1e34),
        qstats.QuantSpec(dtype="int8", mapping="symmetric", scale_dtype="bfloat16"),
        qstats.QuantSpec(dtype="int8", mapping="symmetric", scale_dtype="float16"),
        qstats.QuantSpec(dtype="int8", mapping="symmetric", zero_point_domain="none"),
        qstats.QuantSpec(dtype="uint8", mapping="symmetric", zero_point_domain="none"),
        qstats.QuantSpec.from_torch_ao(torch.quint8, torch.per_tensor_symmetric),
        qstats.QuantSpec(dtype="int8", mapping="symmetric", convention="compressed_tensors"),
        qstats.QuantSpec(dtype="int4", mapping="symmetric", convention="compressed_tensors"),
        qstats.QuantSpec(dtype="int16", mapping="symmetric", convention="compressed_tensors"),
        qstats.QuantSpec(dtype="fp8_e4m3fn", mapping="symmetric", convention="compressed_tensors"),
        qstats.QuantSpec.from_torch_ao(torch.qint8, torch.per_channel_symmetric, reduce_range=True),
    ]
    # compressed-tensors computing in a half weight's dtype (the native pass or the general path):
    # int16's range is 65536 in bfloat16 and infinite in float16, int1's half range 0.5
    for compute in ("bfloat16", "float16"):
        for dtype in ("int8", "int4", "int16", "int1", "fp8_e4m3fn"):
            specs.append(
                qstats.QuantSpec(dtype=dtype, mapping="symmetric", convention="compressed_tensors", compute_dtype=compute)
            )
    return specs


SPECS = _specs()


def _general(min_val, max_val, spec, calibrated):
    """The general path of qparams_from_minmax, with the symmetric short cut switched off."""
    original = _qparams._symmetric_plan
    _qparams._symmetric_plan = lambda spec: False
    try:
        return qstats.qparams_from_minmax(min_val, max_val, spec, calibrated=calibrated, check_uncalibrated=False)
    finally:
        _qparams._symmetric_plan = original


@contextlib.contextmanager
def _native_pass(on: bool):
    """The native pass of the short cut as built (``on``) or switched off (the ATen short cut);
    records whether it produced the result."""
    taken = []
    original = _native.symmetric_scales

    def recording(*args, **kwargs):
        out = original(*args, **kwargs) if on else None
        taken.append(out is not None)
        return out

    _native.symmetric_scales = recording
    try:
        yield taken
    finally:
        _native.symmetric_scales = original


NATIVE = pytest.mark.parametrize("native", [True, False], ids=["native", "aten"])


def test_every_spec_takes_the_short_cut():
    assert all(_qparams._symmetric_plan(spec) for spec in SPECS)
    assert not _qparams._symmetric_plan(qstats.QuantSpec(dtype="int8", mapping="asymmetric"))
    assert not _qparams._symmetric_plan(qstats.QuantSpec(dtype="int8", mapping="symmetric", convention="torchao"))
    ct = dict(mapping="symmetric", convention="compressed_tensors")
    assert not _qparams._symmetric_plan(qstats.QuantSpec(dtype="int8", scale_dtype="bfloat16", **ct))
    # in bfloat16 arithmetic: the native pass, else the general path (no float32 short cut)
    assert _qparams._symmetric_plan(qstats.QuantSpec(dtype="int8", compute_dtype="bfloat16", **ct)).native_only


values = st.one_of(st.sampled_from(SPECIAL), st.floats(width=32, allow_nan=True, allow_infinity=True))


@SETTINGS
@given(
    spec_index=st.integers(0, len(SPECS) - 1),
    pairs=st.lists(st.tuples(values, values, st.booleans()), min_size=1, max_size=24),
    with_calibrated=st.booleans(),
)
@NATIVE
def test_short_cut_equals_general_path(native, spec_index, pairs, with_calibrated):
    spec = SPECS[spec_index]
    min_val = torch.tensor([p[0] for p in pairs], dtype=torch.float32)
    max_val = torch.tensor([p[1] for p in pairs], dtype=torch.float32)
    calibrated = torch.tensor([p[2] for p in pairs]) if with_calibrated else None
    before = [t.clone() for t in (min_val, max_val) + (() if calibrated is None else (calibrated,))]
    with _native_pass(native):
        fast = qstats.qparams_from_minmax(min_val, max_val, spec, calibrated=calibrated, check_uncalibrated=False)
    after = (min_val, max_val) + (() if calibrated is None else (calibrated,))
    assert all(bit_equal(a, b) for a, b in zip(before, after))  # intermediates only are written in place
    slow = _general(min_val, max_val, spec, calibrated)
    for name, a, b in zip(fast._fields, fast, slow):
        assert bit_equal(a, b), (name, spec, min_val, max_val, a, b)
    assert torch.isfinite(fast.scale).all() and (fast.scale > 0).all()


@SETTINGS
@given(
    spec_index=st.integers(0, len(SPECS) - 1),
    pairs=st.lists(st.tuples(values, values, st.sampled_from([0, 1, 7, 2**40])), min_size=1, max_size=24),
)
@NATIVE
def test_counts_as_calibrated_equal_the_mask(native, spec_index, pairs):
    """A range rule may give counts as ``calibrated`` (the min/max family does: the native pass
    reads them, no mask op): every path equals the general one with the mask ``count > 0``."""
    spec = SPECS[spec_index]
    min_val = torch.tensor([p[0] for p in pairs], dtype=torch.float32)
    max_val = torch.tensor([p[1] for p in pairs], dtype=torch.float32)
    counts = torch.tensor([p[2] for p in pairs], dtype=torch.int64)
    with _native_pass(native):
        got = qstats.qparams_from_minmax(min_val, max_val, spec, calibrated=counts, check_uncalibrated=False)
    expected = _general(min_val, max_val, spec, counts > 0)
    for name, a, b in zip(got._fields, got, expected):
        assert bit_equal(a, b), (name, spec, min_val, max_val, counts)


finite = st.one_of(
    st.sampled_from([v for v in SPECIAL if v == v and abs(v) != float("inf")]),
    st.floats(width=32, allow_nan=False, allow_infinity=False),
)


@SETTINGS
@given(
    spec_index=st.integers(0, len(SPECS) - 1),
    pairs=st.lists(st.tuples(finite, finite).map(sorted), min_size=1, max_size=24),
    calibrated_kind=st.sampled_from(["none", "all", "some"]),
)
@NATIVE
def test_every_entry_valid_short_cut_equals_general_path(native, spec_index, pairs, calibrated_kind):
    # The ranges observers produce (finite, min <= max): on CPU one host check of the whole range
    # replaces the validity mask and the fallback select, and one clamp the cap and the eps floor;
    # with the kernel, one native pass does all of it where it applies.
    spec = SPECS[spec_index]
    min_val = torch.tensor([p[0] for p in pairs], dtype=torch.float32)
    max_val = torch.tensor([p[1] for p in pairs], dtype=torch.float32)
    calibrated = {
        "none": None,
        "all": torch.ones(len(pairs), dtype=torch.bool),
        "some": torch.arange(len(pairs)) % 2 == 1,
    }[calibrated_kind]
    checks = []
    original = _qparams._every_entry_valid
    _qparams._every_entry_valid = lambda *args: checks.append(original(*args)) or checks[-1]
    try:
        with _native_pass(native) as taken:
            fast = qstats.qparams_from_minmax(min_val, max_val, spec, calibrated=calibrated, check_uncalibrated=False)
    finally:
        _qparams._every_entry_valid = original
    slow = _general(min_val, max_val, spec, calibrated)
    for name, a, b in zip(fast._fields, fast, slow):
        assert bit_equal(a, b), (name, spec, min_val, max_val, a, b)
    plan = _qparams._symmetric_plan(spec)
    spread_finite = bool(torch.isfinite(max_val - min_val).all())
    expected = plan.scale_cap is not None and spread_finite and calibrated_kind != "some"
    # the native pass applies to float32 scales (no rounding to another dtype) of every such
    # spec, and of compressed-tensors' (which replace a zero scale by eps instead of flooring at
    # it, and have no ATen short cut), where the kernel is built
    native_taken = (
        native and plan.native is not None and spread_finite and calibrated_kind != "some" and _native.available()
    )
    assert (plan.native is not None) == (
        spec.scale_dtype == "float32" and (plan.scale_cap is not None or spec.convention == "compressed_tensors")
    )
    assert (True in taken) == native_taken, (taken, spec, min_val, max_val)
    # the short cut is taken exactly where it applies (eps above the cap, an overflowing spread
    # or an uncalibrated entry send it to the general test)
    assert (checks == [True]) == (expected and not native_taken), (checks, spec, min_val, max_val)


def test_every_entry_valid_short_cut_stays_off_under_vmap_and_on_other_inputs():
    spec = qstats.QuantSpec(dtype="int8", mapping="symmetric")
    lo, hi = torch.tensor([[-1.0, -2.0], [0.5, -3.0]]), torch.tensor([[2.0, 1.0], [4.0, 3.0]])
    assert _qparams._host_checkable(lo, hi, None)
    torch.vmap(lambda a, b: _qparams._symmetric_qparams(a, b, spec, None, False))(lo, hi)  # no host read
    assert not _qparams._host_checkable(torch.empty(2, device="meta"))
    assert not _qparams._every_entry_valid(lo, hi, torch.tensor([[True, False], [True, True]]))
    assert not _qparams._every_entry_valid(torch.tensor([-3e38]), torch.tensor([3e38]), None)  # spread overflows
    assert not _qparams._every_entry_valid(torch.tensor([1.0]), torch.tensor([float("nan")]), None)


@SETTINGS
@given(
    spec_index=st.integers(0, len(SPECS) - 1),
    data=st.lists(st.floats(-1e6, 1e6, width=32), min_size=1, max_size=64),
    shape=st.sampled_from([(), (4,), (3, 5)]),
)
def test_short_cut_through_compute_qparams_under_vmap(spec_index, data, shape):
    """compute_qparams of observed states, eager and under vmap, against the general path."""
    spec = SPECS[spec_index]
    g = torch.Generator().manual_seed(len(data))
    need = 8 * torch.Size(shape).numel()
    x = torch.tensor(data).repeat(need // len(data) + 1)[:need]
    x = x[torch.randperm(need, generator=g)].reshape(8, *shape)
    spec = spec.replace(granularity=qstats.PerAxis(0) if shape else qstats.PerTensor())
    obs = qstats.minmax(spec)
    state = obs.update(obs.init(x[0]), x[0])
    expected = _general(state.min_val, state.max_val, spec, state.count > 0)
    got = qstats.compute_qparams(state, spec)
    for name, a, b in zip(got._fields, got, expected):
        assert bit_equal(a, b), name
    stacked = torch.vmap(lambda w: obs.update(obs.init(w), w))(x)
    under_vmap = torch.vmap(lambda s: qstats.compute_qparams(s, spec))(stacked)
    for e in range(x.shape[0]):
        one = type(stacked)(*(t[e] for t in stacked))
        expected = _general(one.min_val, one.max_val, spec, one.count > 0)
        for name, a, b in zip(expected._fields, under_vmap, expected):
            assert bit_equal(a[e], b), (name, e)


@pytest.mark.parametrize("dtype", [torch.qint8, torch.quint8])
@pytest.mark.parametrize("reduce_range", [False, True])
@pytest.mark.parametrize("per_channel", [False, True])
def test_short_cut_equals_torch_ao(dtype, reduce_range, per_channel):
    """Through from_torch_ao, the short cut gives torch.ao's calculate_qparams on data with a
    constant, an all-zero, an all-negative, an all-positive and a very wide channel."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 32, generator=g)
    w[1] = 0.5
    w[2] = 0.0
    w[3] = -w[3].abs()
    w[4] = w[4].abs() + 1e-3
    w[5] = w[5] * 1e30
    qscheme = torch.per_channel_symmetric if per_channel else torch.per_tensor_symmetric
    if reduce_range and dtype == torch.quint8:  # torch.ao refuses it, and so do we
        with pytest.raises(ValueError, match="reduce range"):
            qstats.QuantSpec.from_torch_ao(dtype, qscheme, reduce_range=reduce_range)
        return
    spec = qstats.QuantSpec.from_torch_ao(dtype, qscheme, reduce_range=reduce_range)
    assert _qparams._symmetric_plan(spec)
    for rows in (slice(0, 6), slice(1, 2), slice(2, 3), slice(3, 4)):
        data = w[rows]
        if not per_channel:
            ref = MinMaxObserver(dtype=dtype, qscheme=qscheme, reduce_range=reduce_range)
        else:
            ref = PerChannelMinMaxObserver(ch_axis=0, dtype=dtype, qscheme=qscheme, reduce_range=reduce_range)
        ref(data)
        scale, zero_point = ref.calculate_qparams()
        obs = qstats.minmax(spec)
        got = qstats.compute_qparams(obs.update(obs.init(data), data), spec)
        assert torch.equal(got.scale.reshape(scale.shape), scale)
        assert torch.equal(got.zero_point.to(zero_point.dtype).reshape(zero_point.shape), zero_point)


@pytest.mark.parametrize("shapes", [((), (2,), None), ((2,), (), None), ((), (), (2,)), ((3, 1), (1, 2), (3, 2))])
def test_short_cut_broadcasts_as_the_general_path(shapes):
    """min, max and calibrated of different (broadcastable) shapes."""
    lo_shape, hi_shape, cal_shape = shapes
    spec = qstats.QuantSpec(dtype="int8", mapping="symmetric")
    g = torch.Generator().manual_seed(0)
    lo = -torch.rand(lo_shape, generator=g)
    hi = torch.rand(hi_shape, generator=g)
    calibrated = None if cal_shape is None else torch.rand(cal_shape, generator=g) > 0.3
    fast = qstats.qparams_from_minmax(lo, hi, spec, calibrated=calibrated, check_uncalibrated=False)
    slow = _general(lo, hi, spec, calibrated)
    for name, a, b in zip(fast._fields, fast, slow):
        assert bit_equal(a, b), name


def test_short_cut_under_vmap_gives_dense_batched_outputs():
    """Under vmap every QParams field but the global scale comes out batched (no stride-0 zero
    points that refuse in-place writes)."""
    spec = qstats.QuantSpec(dtype="int8", mapping="symmetric", granularity=qstats.PerAxis(0))
    obs = qstats.minmax(spec)
    x = torch.randn(4, 6, 5)
    q = torch.vmap(lambda w: qstats.compute_qparams(obs.update(obs.init(w), w), spec))(x)
    for name in ("scale", "zero_point", "calibrated"):
        field = getattr(q, name)
        assert field.shape == (4, 6) and 0 not in field.stride(), (name, field.stride())


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda s: s._replace(max_val=s.max_val.amax()), r"'max_val' .* shape \(\), but min_val has shape \(4,\)"),
        (lambda s: s._replace(max_val=s.max_val[:3]), r"'max_val' .* shape \(3,\), but min_val has shape \(4,\)"),
        (lambda s: s._replace(max_val=s.max_val.int()), r"'max_val' .* dtype torch.int32"),
        (lambda s: s._replace(count=s.count.float()), r"'count'"),
    ],
    ids=["0-dim max", "short max", "int max", "float count"],
)
@pytest.mark.parametrize("kind", ["minmax", "memoryless_minmax", "moving_average_minmax"])
def test_compute_qparams_refuses_a_state_whose_fields_disagree(corrupt, message, kind):
    """compute_qparams checks a min/max state as update and merge do (a 0-dim max_val broadcast
    to per-channel scales nobody observed; mismatched lengths gave a bare RuntimeError)."""
    spec = qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0))
    obs = getattr(qstats, kind)(spec)
    x = torch.randn(4, 8)
    state = obs.update(obs.init(x), x)
    qstats.compute_qparams(state, spec)
    with pytest.raises(ValueError, match=message):
        qstats.compute_qparams(corrupt(state), spec)


@pytest.mark.skipif(not _native.available(), reason="no native kernel on this machine")
@pytest.mark.parametrize("compute", ["bfloat16", "float16"])
def test_half_precision_native_pass_equals_general_path_on_every_exponent_and_tie(compute):
    """compressed-tensors computing in bfloat16/float16: the native pass rounds the peak and the
    quotient as ATen does (nearest even), over 130K random ranges across every float32 exponent
    (float16's subnormals and overflow, bfloat16's subnormals), every float16 value and every
    bfloat16 value below half the float32 range with the ties between neighbours, for int8, int4,
    int16 (its range 65536 in bfloat16, infinite in float16), int1 (half range 0.5) and fp8 targets:
    bit for bit the general path, every scale finite and positive."""
    g = torch.Generator().manual_seed(0)
    n = 1 << 17
    exponent = torch.randint(-149, 127, (n,), generator=g).float()
    peaks = ((torch.rand(n, generator=g) + 1) * torch.pow(2.0, exponent)).clamp(max=1.7e38)
    halves = torch.arange(0, 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    halves = halves[torch.isfinite(halves)]
    brains = (torch.arange(0, 1 << 15, dtype=torch.int32) << 16).view(torch.float32)
    brains = brains[brains < 1.7e38]
    peaks = torch.cat([peaks, halves, (halves[:-1] + halves[1:]) / 2, brains, (brains[:-1] + brains[1:]) / 2])
    negative = torch.rand(peaks.shape, generator=g) < 0.5
    min_val = torch.where(negative, -peaks, 0.0)
    max_val = torch.where(negative, peaks * torch.rand(peaks.shape, generator=g), peaks)
    for dtype in ("int8", "int4", "int16", "int1", "fp8_e4m3fn"):
        spec = qstats.QuantSpec(dtype=dtype, mapping="symmetric", convention="compressed_tensors", compute_dtype=compute)
        with _native_pass(True) as taken:
            fast = qstats.qparams_from_minmax(min_val, max_val, spec, check_uncalibrated=False)
        assert taken == [True], dtype
        slow = _general(min_val, max_val, spec, None)
        for name, a, b in zip(fast._fields, fast, slow):
            assert bit_equal(a, b), (dtype, name)
        assert torch.isfinite(fast.scale).all() and (fast.scale > 0).all()
