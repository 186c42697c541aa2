"""Bad input: empty tensors, NaN/Inf, wrong shapes, uncalibrated states, degenerate ranges,
half-precision inputs and the weight mask, for every observer of tests/observer_cases.py (and the
min/max family in detail, against independent computations and torch.ao)."""

import dataclasses

import pytest
import torch
from observer_cases import CASES

import qstats
from qstats import testing, tree

IDS = [case[0] for case in CASES]


def _case(case):
    name, factory, make_x, *rest = case
    return name, factory(), make_x, (rest[0] if rest else {})


def _approx(case_options):
    return case_options.get("approx_fields")


def _data(make_x, seed=0, count=2):
    g = torch.Generator().manual_seed(seed)
    return [make_x(g) for _ in range(count)]


def _calibrated_state(obs, make_x):
    xs = _data(make_x)
    state = obs.init(xs[0])
    for x in xs:
        state = obs.update(state, x)
    return state, xs


def _assert_good_qparams(qp, where):
    assert torch.isfinite(qp.scale).all(), f"{where}: non-finite scale {qp.scale}"
    assert (qp.scale > 0).all(), f"{where}: zero or negative scale {qp.scale}"
    assert torch.isfinite(qp.zero_point.float()).all(), f"{where}: non-finite zero point"
    assert torch.isfinite(qp.global_scale).all() and (qp.global_scale > 0).all(), f"{where}: bad global scale"


def _with_spec(obs, **changes):
    """The same observer family with a changed spec (min/max family only)."""
    spec = dataclasses.replace(obs.spec, **changes)
    factories = {
        "minmax": qstats.minmax,
        "memoryless_minmax": qstats.memoryless_minmax,
        "moving_average_minmax": lambda s: qstats.moving_average_minmax(s, 0.5),
    }
    return factories[obs.name](spec), spec


MINMAX_SPECS = [
    qstats.QuantSpec(),
    qstats.QuantSpec(granularity=qstats.PerAxis(0)),
    qstats.QuantSpec(granularity=qstats.PerAxis(-1), mapping="asymmetric", dtype="uint8"),
    qstats.QuantSpec(granularity=qstats.PerGroup(4)),
    qstats.QuantSpec(granularity=qstats.PerToken()),
]
FAMILIES = [qstats.minmax, qstats.memoryless_minmax, lambda s: qstats.moving_average_minmax(s, 0.5)]


# --- empty tensors ---------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_empty_tensor_and_all_zero_weight_leave_the_state_unchanged(case):
    name, obs, make_x, options = _case(case)
    state, xs = _calibrated_state(obs, make_x)
    empty = xs[0][:0] if xs[0].ndim else xs[0].reshape(-1)[:0]
    testing.assert_states_equal(obs.update(state, empty), state, approx_fields=(), message=f"{name}: empty tensor")
    testing.assert_states_equal(obs.update(obs.init(xs[0]), empty), obs.init(xs[0]), approx_fields=(), message=name)
    if xs[0].ndim >= 1:
        zero_weight = torch.zeros(xs[0].shape[:1])
        testing.assert_states_equal(
            obs.update(state, xs[1], zero_weight), state, approx_fields=(), message=f"{name}: all-zero weight"
        )


# --- NaN / Inf -------------------------------------------------------------------------------


def _poison(x, seed=0):
    g = torch.Generator().manual_seed(seed)
    flat = x.clone().reshape(-1)
    where = torch.randperm(flat.numel(), generator=g)[:3]
    flat[where[0]] = float("nan")
    flat[where[1]] = float("inf")
    flat[where[2]] = -float("inf")
    return flat.reshape(x.shape)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_nonfinite_values_never_reach_a_scale(case):
    name, obs, make_x, options = _case(case)
    if obs.spec is None or obs.spec.nonfinite != "ignore":
        pytest.skip("observer without the default nonfinite='ignore' policy")
    state, xs = _calibrated_state(obs, make_x)
    poisoned = obs.update(state, _poison(xs[0]))
    for path, leaf in tree.leaves_with_paths(poisoned):
        assert not torch.isnan(leaf).any() if leaf.is_floating_point() else True, f"{name}: NaN in {path}"
    spec = dataclasses.replace(obs.spec, on_uncalibrated="fallback")
    _assert_good_qparams(qstats.compute_qparams(poisoned, spec), name)


@pytest.mark.parametrize("family", FAMILIES, ids=["minmax", "memoryless", "moving_average"])
@pytest.mark.parametrize("spec", MINMAX_SPECS, ids=lambda s: type(s.granularity).__name__ + s.mapping)
def test_nonfinite_ignored_and_counted_like_the_finite_values_alone(family, spec):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 8, generator=g)
    poisoned = _poison(x, seed=5)
    obs = family(spec)
    state = obs.update(obs.init(x), poisoned)
    # independent computation: per-parameter extremes of the finite values only
    view = qstats.canonical_view(poisoned, spec.granularity)
    finite = torch.isfinite(view)
    dims = (0, view.ndim - 1)
    expected_min = torch.where(finite, view, torch.inf).amin(dim=dims)
    expected_max = torch.where(finite, view, -torch.inf).amax(dim=dims)
    assert torch.equal(state.min_val, expected_min)
    assert torch.equal(state.max_val, expected_max)
    assert torch.equal(state.count, finite.sum(dim=dims))
    assert torch.equal(state.nonfinite, (~finite).sum(dim=dims))
    assert int(state.nonfinite.sum()) == 3
    qp = qstats.compute_qparams(state, dataclasses.replace(spec, on_uncalibrated="fallback"))
    fallback = dataclasses.replace(spec, on_uncalibrated="fallback")
    clean = qstats.qparams_from_minmax(expected_min, expected_max, fallback)
    testing.assert_states_equal(qp, clean, approx_fields=())
    _assert_good_qparams(qp, "poisoned")


@pytest.mark.parametrize("family", FAMILIES, ids=["minmax", "memoryless", "moving_average"])
def test_nonfinite_raise_policy_raises(family):
    obs = family(qstats.QuantSpec(nonfinite="raise", granularity=qstats.PerAxis(0)))
    x = torch.randn(4, 5)
    state = obs.update(obs.init(x), x)  # finite data is fine
    with pytest.raises(ValueError, match="non-finite"):
        obs.update(state, _poison(x))
    with pytest.raises(ValueError, match="non-finite"):
        obs.update(state, x.masked_fill(x > 0, float("inf")))


# --- wrong shapes ----------------------------------------------------------------------------


def _other_shapes(x):
    shapes = []
    if x.ndim >= 1:
        shapes.append(torch.cat([x, x], dim=-1))
        shapes.append(torch.cat([x, x], dim=0))
    if x.ndim >= 2:
        shapes.append(torch.cat([x, x], dim=1))
    return shapes


def _first_mismatch(a, b):
    for (path, left), (_, right) in zip(tree.leaves_with_paths(a), tree.leaves_with_paths(b)):
        if left.shape != right.shape:
            return tuple(left.shape), tuple(right.shape)
    return None


def _shape_pattern(*shapes):
    return ".*".join(f"{shape}".replace("(", r"\(").replace(")", r"\)") for shape in shapes)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_wrong_shapes_raise_naming_both(case):
    name, obs, make_x, options = _case(case)
    state, xs = _calibrated_state(obs, make_x)
    checked = 0
    for other in _other_shapes(xs[0]):
        try:
            other_state = obs.init(other)
        except ValueError:
            # an observer built for one shape (a fixed reference range) refuses others at init
            checked += 1
            with pytest.raises(ValueError) as error:
                obs.update(state, other)
            assert str(tuple(other.shape)) in str(error.value) or "shape" in str(error.value), name
            continue
        mismatch = _first_mismatch(state, other_state)
        if mismatch is None:
            obs.update(state, other)  # same parameter shape: accepted
            continue
        checked += 1
        mine, theirs = mismatch
        with pytest.raises(ValueError) as error:
            obs.update(state, other)
        message = str(error.value)
        assert str(tuple(other.shape)) in message, f"{name}: update error does not name the tensor shape: {message}"
        with pytest.raises(ValueError) as error:
            obs.merge(state, other_state)
        message = str(error.value)
        named = str(mine) in message and str(theirs) in message
        assert named, f"{name}: merge error does not name both shapes: {message}"
    granularity = getattr(obs.spec, "granularity", None)
    if granularity is not None and not isinstance(granularity, qstats.PerTensor):
        assert checked, f"{name}: no shape-changing input was tried"


def test_wrong_weight_shape_raises_naming_both_shapes():
    obs = qstats.minmax(qstats.QuantSpec())
    x = torch.randn(4, 5)
    with pytest.raises(ValueError, match=_shape_pattern((3,), (4, 5))):
        obs.update(obs.init(x), x, torch.ones(3))


# --- uncalibrated states ---------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES, ids=["minmax", "memoryless", "moving_average"])
@pytest.mark.parametrize("dtype,mapping", [("int8", "symmetric"), ("uint8", "asymmetric")])
def test_masked_out_channel_is_uncalibrated_and_others_match_torch_ao(family, dtype, mapping):
    from torch.ao.quantization.observer import PerChannelMinMaxObserver

    g = torch.Generator().manual_seed(11)
    x = torch.randn(5, 7, generator=g)
    keep = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0])
    spec = qstats.QuantSpec(dtype=dtype, mapping=mapping, granularity=qstats.PerAxis(0))
    obs = family(spec)
    state = obs.update(obs.init(x), x, keep)
    with pytest.raises(ValueError, match="uncalibrated"):
        qstats.compute_qparams(state, spec)
    qp = qstats.compute_qparams(state, dataclasses.replace(spec, on_uncalibrated="fallback"))
    assert torch.equal(qp.calibrated, keep.bool())
    assert torch.equal(qp.scale[keep == 0], torch.ones(2))
    assert torch.equal(qp.zero_point[keep == 0], torch.zeros(2, dtype=qp.zero_point.dtype))
    reference = PerChannelMinMaxObserver(
        ch_axis=0,
        dtype=torch.qint8 if dtype == "int8" else torch.quint8,
        qscheme=torch.per_channel_symmetric if mapping == "symmetric" else torch.per_channel_affine,
    )
    reference(x[keep != 0])
    ref_scale, ref_zero_point = reference.calculate_qparams()
    assert torch.equal(qp.scale[keep != 0], ref_scale)
    assert torch.equal(qp.zero_point[keep != 0], ref_zero_point.to(qp.zero_point.dtype))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_init_state_raises_or_falls_back(case):
    name, obs, make_x, options = _case(case)
    if obs.spec is None:
        pytest.skip("observer without a spec")
    x = _data(make_x)[0]
    init = obs.init(x)
    qp = qstats.compute_qparams(init, dataclasses.replace(obs.spec, on_uncalibrated="fallback"))
    missing = ~qp.calibrated
    if obs.name in ("minmax", "memoryless_minmax", "moving_average_minmax"):
        assert missing.all(), name
    if missing.any():  # observers with fixed parameters are calibrated from the start
        with pytest.raises(ValueError, match="uncalibrated"):
            qstats.compute_qparams(init, dataclasses.replace(obs.spec, on_uncalibrated="raise"))
    else:
        qstats.compute_qparams(init, dataclasses.replace(obs.spec, on_uncalibrated="raise"))
    assert torch.equal(qp.scale[missing], torch.ones_like(qp.scale[missing])), name
    assert torch.equal(qp.zero_point[missing], torch.zeros_like(qp.zero_point[missing])), name
    _assert_good_qparams(qp, name)


# --- degenerate ranges -----------------------------------------------------------------------


DEGENERATE = {
    "zeros": lambda x: torch.zeros_like(x),
    "constant": lambda x: torch.full_like(x, 3.25),
    "negative_constant": lambda x: torch.full_like(x, -0.5),
    "subnormal": lambda x: torch.full_like(x, 1e-40),
    "huge": lambda x: torch.where(x > 0, 3.0e38, -3.0e38),
}


# Known issues in other modules, reported; strict, so a fix turns them into failures to remove.
KNOWN_ISSUES: dict = {}


@pytest.mark.parametrize("kind", sorted(DEGENERATE))
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_degenerate_data_never_gives_a_bad_scale(case, kind):
    name = case[0]
    if (name, kind) not in KNOWN_ISSUES:
        _check_degenerate(case, kind)
        return
    try:
        _check_degenerate(case, kind)
    except (AssertionError, ValueError):
        pytest.xfail(KNOWN_ISSUES[(name, kind)])
    pytest.fail(f"known issue fixed, remove it from KNOWN_ISSUES: {KNOWN_ISSUES[(name, kind)]}")


def _check_degenerate(case, kind):
    name, obs, make_x, options = _case(case)
    if obs.spec is None:
        pytest.skip("observer without a spec")
    x = DEGENERATE[kind](_data(make_x)[0])
    state = obs.update(obs.init(x), x)
    if kind == "huge":
        # Sums of squares of values near the float32 limit overflow: a clear ValueError is
        # allowed there (the min/max family must still give a scale; see the test below).
        try:
            qp = qstats.compute_qparams(state, obs.spec)
        except ValueError:
            assert obs.name not in ("minmax", "memoryless_minmax", "moving_average_minmax"), name
            return
    else:
        qp = qstats.compute_qparams(state, obs.spec)
    _assert_good_qparams(qp, f"{name}/{kind}")
    assert qp.calibrated.all(), f"{name}/{kind}"
    assert torch.isfinite(qstats.fake_quantize(x, qp, obs.spec)).all(), f"{name}/{kind}: non-finite fake-quant"


@pytest.mark.parametrize("kind", sorted(DEGENERATE))
@pytest.mark.parametrize(
    "spec_args",
    [
        dict(mapping=m, zero_point_domain=z, convention=c, eps=e)
        for m in ("symmetric", "asymmetric", "symmetric_no_clipping_err", "narrow")
        for z in ("int", "float", "none")
        for c in ("torch_ao", "compressed_tensors")
        for e in (float(torch.finfo(torch.float32).eps), float(torch.finfo(torch.float32).tiny))
    ],
    ids=lambda a: "-".join(str(v) for v in a.values()),
)
def test_degenerate_data_every_mapping_and_tiny_eps(spec_args, kind):
    try:
        spec = qstats.QuantSpec(**spec_args)
    except ValueError:
        pytest.skip("combination rejected by QuantSpec")
    x = DEGENERATE[kind](torch.linspace(-1, 1, 8))
    obs = qstats.minmax(spec)
    qp = qstats.compute_qparams(obs.update(obs.init(x), x), spec)
    _assert_good_qparams(qp, f"{spec_args}/{kind}")
    assert torch.isfinite(qstats.fake_quantize(x, qp, spec)).all()


def test_eps_below_the_smallest_normal_float32_is_rejected():
    with pytest.raises(ValueError, match="eps"):
        qstats.QuantSpec(eps=1e-45)


# --- half-precision inputs -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_half_precision_inputs_accumulate_in_float32(case, dtype):
    name, obs, make_x, options = _case(case)
    xs = [x.to(dtype) for x in _data(make_x, count=3)]
    reference_init = obs.init(xs[0].float())
    low, wide = obs.init(xs[0]), reference_init
    for x in xs:
        low = obs.update(low, x)
        wide = obs.update(wide, x.float())  # the same values, upcast before observing
    tree.assert_same_structure(low, reference_init)
    for path, leaf in tree.leaves_with_paths(low):
        assert leaf.dtype not in (torch.bfloat16, torch.float16), f"{name}: {path} is {leaf.dtype}"
    testing.assert_states_equal(low, wide, approx_fields=_approx(options), message=f"{name}: {dtype} vs float32")


# --- the weight mask -------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_weight_mask_equals_slicing_the_rows_out(case):
    name, obs, make_x, options = _case(case)
    state, xs = _calibrated_state(obs, make_x)
    x = xs[1]
    if x.ndim < 2 or x.shape[0] < 3:
        pytest.skip("needs at least three rows")
    weight = torch.zeros(x.shape[0])
    weight[::2] = 1.0
    weight[1] = 0.5  # any non-zero weight keeps the row
    kept = x[weight != 0]
    try:
        tree.assert_same_structure(obs.init(kept), state)
    except ValueError:
        # dim 0 carries parameters: a masked row leaves its parameters as they were
        masked = obs.update(state, x, weight)
        full = obs.update(state, x)
        for (path, m), (_, s), (_, f) in zip(
            tree.leaves_with_paths(masked), tree.leaves_with_paths(state), tree.leaves_with_paths(full)
        ):
            if m.ndim and m.shape[0] == x.shape[0]:
                dropped = weight == 0
                assert torch.equal(m[dropped], s[dropped]), f"{name}: {path} of a masked row changed"
                assert torch.equal(m[~dropped], f[~dropped]), f"{name}: {path} of a kept row differs"
        return
    testing.assert_states_equal(
        obs.update(state, x, weight),
        obs.update(state, kept),
        approx_fields=_approx(options),
        message=f"{name}: weight mask vs slicing",
    )


@pytest.mark.parametrize(
    "spec, min_val, max_val, calibrated",
    [
        # a finite range whose formula overflows in the compute dtype, marked uncalibrated (min > max)
        (qstats.QuantSpec(dtype="uint8", mapping="asymmetric", zero_point_domain="float", convention="torchao",
                          compute_dtype="float16"), [1e5, -1.0], [7e4, 1.0], None),
        # an fp16 scale overflows on the uncalibrated entry's finite garbage range
        (qstats.QuantSpec(dtype="int8", scale_dtype="float16"), [-1e7, -1.0], [1e7, 1.0], [False, True]),
        # min above max by one subnormal: not a range
        (qstats.QuantSpec(dtype="int8", mapping="asymmetric", on_uncalibrated="fallback"), [1.4e-45, -1.0], [0.0, 1.0], None),
    ],
    ids=["float16-compute", "float16-scale", "subnormal-inversion"],
)
def test_uncalibrated_entries_get_the_fallback_whatever_their_range(spec, min_val, max_val, calibrated):
    spec = dataclasses.replace(spec, on_uncalibrated="fallback")
    mask = None if calibrated is None else torch.tensor(calibrated)
    qp = qstats.qparams_from_minmax(torch.tensor(min_val), torch.tensor(max_val), spec, calibrated=mask)
    assert qp.calibrated.tolist() == [False, True]
    assert float(qp.scale[0]) == 1.0 and float(qp.zero_point[0]) == 0.0
    expected = qstats.qparams_from_minmax(torch.tensor([-1.0]), torch.tensor([1.0]), spec)
    assert torch.equal(qp.scale[1:], expected.scale) and torch.equal(qp.zero_point[1:], expected.zero_point)


def test_float16_scales_saturate_instead_of_overflowing():
    # a range beyond what a float16 scale holds (65504 * 127.5): the largest float16 scale, not Inf
    spec = qstats.QuantSpec(dtype="int8", scale_dtype="float16")
    qp = qstats.qparams_from_minmax(torch.tensor([-1e8, -1.0]), torch.tensor([1e8, 1.0]), spec)
    assert float(qp.scale[0]) == torch.finfo(torch.float16).max
    assert float(qp.scale[1]) == float(torch.tensor(1.0 / 127.5).half())


# --- specs that would give an empty range, an infinite scale or a zero point off the range ---------


@pytest.mark.parametrize("eps", [float("inf"), float("nan"), 1e39, True, -1.0, 0.0])
def test_eps_must_be_a_positive_finite_float32(eps):
    with pytest.raises(ValueError, match="eps"):
        qstats.QuantSpec(eps=eps)


@pytest.mark.parametrize(
    "fields",
    [
        dict(dtype="int1", mapping="narrow"),  # [-0, 0]
        dict(dtype="uint1", reduce_range=True),
        dict(dtype="int1", reduce_range=True),
        dict(dtype="int8", quant_min=0, quant_max=1, reduce_range=True),  # halves to [0, 0]
        dict(dtype="int8", quant_min=-1, quant_max=1, reduce_range=True, mapping="narrow"),  # [-1, 0] -> [0, 0]
    ],
)
def test_specs_whose_range_holds_fewer_than_two_values_are_rejected(fields):
    with pytest.raises(ValueError, match="range|reduce_range"):
        qstats.QuantSpec(**fields)


def test_one_bit_targets_keep_their_two_values():
    assert qstats.QuantSpec(dtype="int1", mapping="asymmetric").qrange == (-1, 0)
    assert qstats.QuantSpec(dtype="uint1", mapping="asymmetric").qrange == (0, 1)


def test_unsigned_32_bit_targets_are_rejected_at_construction():
    with pytest.raises(ValueError, match="dtype"):
        qstats.QuantSpec(dtype="uint32")
    assert qstats.QuantSpec(dtype="int32").qrange == (-(2**31), 2**31 - 1)


@pytest.mark.parametrize(
    "fields",
    [
        dict(dtype="uint8", symmetric_zero_point=1000),
        dict(dtype="uint8", symmetric_zero_point=-1),
        dict(dtype="uint8", symmetric_zero_point="3"),
        dict(dtype="uint8", symmetric_zero_point=3.0),
        dict(dtype="uint8", symmetric_zero_point=True),
        dict(dtype="uint4", symmetric_zero_point=128, convention="compressed_tensors"),
        dict(dtype="fp8_e4m3fn", symmetric_zero_point=0),
    ],
)
def test_symmetric_zero_point_must_be_an_int_in_the_range(fields):
    with pytest.raises(ValueError, match="symmetric_zero_point"):
        qstats.QuantSpec(**fields)


def test_torch_ao_fixed_zero_points_stay_where_torch_ao_keeps_them():
    """torch.ao keeps 128 (uint8) and 2**15 (uint16) for symmetric qschemes whatever the range:
    from_torch_ao must build those specs, and their qparams equal torch.ao's."""
    from torch.ao.quantization import MinMaxObserver

    x = torch.randn(64) * 3
    for dtype, kwargs in [
        (torch.uint8, dict(reduce_range=True)),
        (torch.uint16, dict(quant_min=0, quant_max=255)),
    ]:
        spec = qstats.QuantSpec.from_torch_ao(dtype, torch.per_tensor_symmetric, **kwargs)
        observer = MinMaxObserver(dtype=dtype, qscheme=torch.per_tensor_symmetric, **kwargs)
        observer(x)
        scale, zero_point = observer.calculate_qparams()
        obs = qstats.minmax(spec)
        qp = qstats.compute_qparams(obs.update(obs.init(x), x), spec)
        assert torch.equal(qp.scale.reshape(1), scale.reshape(1)), dtype
        assert int(qp.zero_point) == int(zero_point) == spec.symmetric_zero_point, dtype


def test_perblock_with_a_bare_int_raises_value_error():
    with pytest.raises(ValueError, match="block_shape"):
        qstats.PerBlock(4)


# --- scales rounded to narrow dtypes: never zero -------------------------------------------------


@pytest.mark.parametrize(
    "fields, smallest",
    [
        (dict(scale_dtype="float8_e4m3fn"), 2.0**-9),  # e4m3fn's smallest subnormal
        (dict(dtype="fp8_e4m3fn", scale_dtype="float8_e4m3fn"), 2.0**-9),
        (dict(scale_dtype="float16", eps=1e-30), 2.0**-24),  # float16's smallest subnormal
    ],
)
def test_scales_that_underflow_the_scale_dtype_get_its_smallest_positive_value(fields, smallest):
    spec = qstats.QuantSpec(**fields)
    x = torch.tensor([1e-10, 0.0, -1e-12])
    obs = qstats.minmax(spec)
    qp = qstats.compute_qparams(obs.update(obs.init(x), x), spec)
    assert float(qp.scale) == smallest
    assert torch.isfinite(qstats.fake_quantize(x, qp, spec)).all()
    # a scale the dtype holds is rounded as before: round to nearest of the float32 scale
    y = torch.tensor([-0.5, 1.0])
    qp = qstats.compute_qparams(obs.update(obs.init(y), y), spec)
    half_range = (spec.qmax - spec.qmin) / 2 if not spec.is_float else spec.qmax
    expected = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(half_range, dtype=torch.float32)
    assert float(qp.scale) == float(expected.to(getattr(torch, spec.scale_dtype)).float())


# --- states whose fields disagree -------------------------------------------------------------


@pytest.mark.parametrize("kind", ["minmax", "memoryless_minmax", "moving_average_minmax"])
def test_state_fields_of_another_shape_or_kind_raise(kind):
    obs = getattr(qstats, kind)(qstats.QuantSpec(granularity=qstats.PerAxis(0)))
    x = torch.randn(4, 8)
    state = obs.init(x)
    bad_count = state._replace(count=torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"'count'.*\(3,\).*\(4,\)"):
        obs.update(bad_count, x)
    with pytest.raises(ValueError, match=r"'count'.*\(3,\).*\(4,\)"):
        obs.merge(bad_count, state)
    with pytest.raises(ValueError, match=r"'count'.*\(3,\).*\(4,\)"):
        obs.merge(state, bad_count)
    with pytest.raises(ValueError, match="'max_val'.*dtype"):
        obs.update(state._replace(max_val=torch.zeros(4, dtype=torch.int64)), x)
    with pytest.raises(ValueError, match="'count'.*dtype"):
        obs.update(state._replace(count=torch.zeros(4)), x)


@pytest.mark.parametrize("dtype", [torch.bool, torch.complex64])
def test_bool_and_complex_tensors_are_refused_naming_the_dtype(dtype):
    obs = qstats.minmax(qstats.QuantSpec(granularity=qstats.PerAxis(0)))
    x = torch.ones(4, 8, dtype=dtype)
    with pytest.raises(TypeError, match=str(dtype)):
        obs.update(obs.init(torch.ones(4, 8)), x)
    stacked = qstats.stacked_observer(obs, 2)
    with pytest.raises(TypeError, match=str(dtype)):
        stacked.update(stacked.init(torch.ones(2, 4, 8)), torch.ones(2, 4, 8, dtype=dtype))


# --- extremes near the float32 limit ------------------------------------------------------------


def test_moving_average_never_overflows_between_finite_extremes():
    """torch.ao's ``min + c * (batch_min - min)`` overflows when the two have opposite signs near
    the float32 limit; the average itself is representable (float64 reference)."""
    spec = qstats.QuantSpec(on_uncalibrated="fallback")
    c = 0.5
    obs = qstats.moving_average_minmax(spec, c)
    a = torch.tensor([3.0e38, 3.2e38])
    state = obs.update(obs.init(a), a)
    moved = obs.update(state, -a)
    want_min = (1 - c) * float(a.min()) + c * float(-a.max())
    want_max = (1 - c) * float(a.max()) + c * float(-a.min())
    torch.testing.assert_close(moved.min_val, torch.tensor(want_min), rtol=1e-6, atol=0.0)
    torch.testing.assert_close(moved.max_val, torch.tensor(want_max), rtol=1e-6, atol=0.0)
    assert bool(qstats.compute_qparams(moved, spec).calibrated)
    # the merge of two such states: the batch-weighted mean, in float64
    other = obs.update(obs.update(obs.init(a), a * 0.9), a)
    merged = obs.merge(state, other)
    for field in ("min_val", "max_val"):
        u, v = getattr(state, field).double(), getattr(other, field).double()
        torch.testing.assert_close(getattr(merged, field).double(), (u * 1 + v * 2) / 3, rtol=1e-6, atol=0.0)
        assert torch.isfinite(getattr(obs.merge(state, state), field))
        assert torch.equal(getattr(obs.merge(state, state), field), getattr(state, field))
    # and where nothing overflows, the update is still torch.ao's, bit for bit
    from torch.ao.quantization import MovingAverageMinMaxObserver

    observer = MovingAverageMinMaxObserver(averaging_constant=c)
    xs = [torch.randn(16) * 1e3, torch.randn(16) * 1e-3 + 5, torch.randn(16)]
    state = obs.init(xs[0])
    for x in xs:
        observer(x)
        state = obs.update(state, x)
    assert torch.equal(state.min_val, observer.min_val) and torch.equal(state.max_val, observer.max_val)


def test_moments_range_past_float32_clamps_to_the_largest_float32():
    """mean +- 3 std of values near the float32 limit lies beyond float32: the range is clamped
    to float32, then (as every symmetric range) to the largest peak whose farthest code (-128)
    still dequantizes to a finite float32: scale float32max / 128, up to a margin of 2**-19."""
    spec = qstats.QuantSpec(dtype="int8", mapping="symmetric")
    big = torch.tensor([3.4e38, -3.4e38, 1.0])
    obs = qstats.moments(spec)
    qp = qstats.compute_qparams(obs.update(obs.init(big), big), spec)
    largest = torch.finfo(torch.float32).max / 128
    assert torch.isfinite(qp.scale * -128).all()
    assert 1 - 2**-19 < float(qp.scale) / largest <= 1


def test_more_observers_refuse_bool_and_complex_inputs():
    """imatrix and recording check what they observe, as the min/max family does."""
    spec = qstats.QuantSpec(dtype="int8")
    x = torch.randn(4, 8)
    for obs in (qstats.imatrix(), qstats.recording(spec)):
        state = obs.init(x)
        for bad in (x > 0, torch.complex(x, x)):
            with pytest.raises(TypeError, match="cannot observe"):
                obs.update(state, bad)


def test_mse_refusals_and_wide_expanded_ranges():
    """mse refuses merging states of other shrink factors; ``expand`` on a range near the float32
    limit keeps it within half the float32 range, so the data counts as calibrated and the scale
    is finite."""
    spec = qstats.QuantSpec(dtype="int8")
    x = torch.randn(4, 8)
    a, b = qstats.mse(spec, maxshrink=0.2, grid=100), qstats.mse(spec, maxshrink=0.4, grid=50)
    with pytest.raises(ValueError, match="shrink factors"):
        a.merge(a.update(a.init(x), x), b.update(b.init(x), x))
    wide = torch.tensor([3.0e38, -1.0, 0.5])
    for mode in ("accumulate", "moving_average"):
        obs = qstats.mse(spec, expand=2.0, mode=mode)
        state = obs.update(obs.init(wide), wide)
        qp = qstats.compute_qparams(state, spec)
        assert bool(qp.calibrated) and torch.isfinite(qp.scale).all() and (qp.scale > 0).all(), mode
        assert float(state.max_val) <= torch.finfo(torch.float32).max / 2


def test_moments_lp_rule_refuses_a_bad_order():
    obs = qstats.moments(qstats.QuantSpec(dtype="int8"), p=2.0)
    x = torch.randn(4, 8)
    state = obs.update(obs.init(x), x)
    for p in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="p must be"):
            qstats.compute_qparams(state, qstats.QuantSpec(dtype="int8"), method="lp", p=p)


@pytest.mark.parametrize("scale_dtype", ["float32", "bfloat16", "float16", "float8_e4m3fn", "float64"])
@pytest.mark.parametrize("convention", ["torch_ao", "torchao", "compressed_tensors"])
@pytest.mark.parametrize("factory", [qstats.minmax, qstats.memoryless_minmax, qstats.mse, qstats.histogram],
                         ids=lambda f: f.__name__)
def test_states_with_no_parameters_give_empty_qparams(factory, convention, scale_dtype):
    """PerAxis(0) of a [0, 32] tensor has no parameters: every scale dtype gives empty QParams, as
    float32 scales do (issue 22, item 23: narrow scale dtypes raised 'aminmax(): empty dimension')."""
    if convention == "compressed_tensors" and scale_dtype == "float64":
        return  # refused (not reproduced)
    spec = qstats.QuantSpec(granularity=qstats.PerAxis(0), scale_dtype=scale_dtype, convention=convention)
    x = torch.zeros(0, 32)
    obs = factory(spec)
    state = obs.update(obs.init(x), x)
    qp = qstats.compute_qparams(state, spec)
    assert qp.scale.shape == qp.zero_point.shape == qp.calibrated.shape == (0,)
    assert qstats.fake_quantize(x, qp, spec).shape == (0, 32)


def test_numeric_options_take_numpy_numbers_and_refuse_bools():
    """Options read from numpy (``np.float32(0.1)``) were refused by some factories and taken by
    others; ``True`` was taken as 1 by some. Now every numeric option takes a real number, never a bool."""
    np = pytest.importorskip("numpy")
    spec = qstats.QuantSpec(dtype="int8")
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(0))
    factories = {
        "moving_average_minmax": (lambda v: qstats.moving_average_minmax(spec, averaging_constant=v), 0.25),
        "mse maxshrink": (lambda v: qstats.mse(spec, maxshrink=v), 0.25),
        "moments p": (lambda v: qstats.moments(spec, p=v), 4.0),
    }
    for name, (make, value) in factories.items():
        theirs, ours = make(value), make(np.float32(value))
        a, b = theirs.update(theirs.init(x), x), ours.update(ours.init(x), x)
        for field, left, right in zip(a._fields, a, b):
            assert torch.equal(left, right), (name, field)
        with pytest.raises(ValueError):
            make(True)
    assert qstats.QuantSpec(dtype="int8", eps=np.float64(1e-6)).eps == 1e-6
    state = qstats.moments(spec).update(qstats.moments(spec).init(x), x)
    same = [qstats.compute_qparams(state, spec, method="mean_std", k=k).scale for k in (3.0, np.float32(3.0))]
    assert torch.equal(*same)
    with pytest.raises(ValueError):
        qstats.compute_qparams(state, spec, method="mean_std", k=True)
