"""coreai_opt's qparams calculators against qstats, bit for bit.

Reference: Apple coreai_opt 0.4.0, ``coreai_opt.quantization.spec.qparams_calculator``:
``StaticQParamsCalculator`` (qstats.memoryless_minmax), ``GlobalMinMaxQParamsCalculator``
(qstats.minmax) and ``MovingAverageQParamsCalculator`` (qstats.coreai_opt.moving_average_minmax),
built by coreai_opt's own factory from its ``QuantizationSpec``, against
``compute_qparams(state, QuantSpec.from_coreai_opt(spec), float_range=...)`` and
its ``QParams.minval``: scale, zero point and minval for int8/int4/uint8, every qscheme, per-tensor,
per-channel and per-block granularities, float_range pinned at neither, one or both ends, and the
e8m0 scale path (int8, fp8, fp4).
"""

import warnings

import pytest
import torch

import qstats
import qstats.coreai_opt

warnings.filterwarnings("ignore")

spec_lib = pytest.importorskip("coreai_opt.quantization.spec.spec")
from coreai_opt.config.spec import CompressionTargetTensor  # noqa: E402
from coreai_opt.quantization.spec.factory import QuantizationComponentFactory  # noqa: E402

QuantizationSpec = spec_lib.QuantizationSpec
SHAPE = (16, 64)
GRANULARITIES = {
    "per_tensor": {"type": "per_tensor"},
    "per_channel_0": {"type": "per_channel", "axis": 0},
    "per_channel_1": {"type": "per_channel", "axis": 1},
    "per_block_axis": {"type": "per_block", "axis": 1, "block_size": 16},
    "per_block_tuple": {"type": "per_block", "block_size": (4, 16)},
}
FLOAT_RANGES = [(None, None), (-1.5, None), (None, 2.0), (-1.0, 0.5)]
TARGETS = [(torch.int8, "symmetric"), (torch.int8, "asymmetric"), (torch.int8, "symmetric_with_clipping"),
           (torch.int4, "symmetric"), (torch.int4, "asymmetric"), (torch.uint8, "symmetric"),
           (torch.uint8, "asymmetric"), (torch.uint8, "symmetric_with_clipping")]


def _batches(seed=0, n=4):
    """Random batches; the third is all positive (every block's range lies above zero) and the last
    scaled up, so that moving ranges move and clamping to zero matters."""
    g = torch.Generator().manual_seed(seed)
    out = [torch.randn(SHAPE, generator=g) * (1 + i) for i in range(n)]
    out[2] = out[2].abs() + 0.25
    return out


def _calculator(kind, coreai_spec, target=CompressionTargetTensor.WEIGHT, averaging_constant=0.1):
    calc = QuantizationComponentFactory.create_qparams_calculator(
        coreai_spec.model_copy(update={"qparam_calculator_cls": kind}) if kind else coreai_spec, target)
    if hasattr(calc, "averaging_constant"):
        calc.averaging_constant = averaging_constant
    return calc


def _observer(kind, spec):
    return {"static": qstats.memoryless_minmax, "global_minmax": qstats.minmax}.get(
        kind, lambda s: qstats.coreai_opt.moving_average_minmax(s, 0.1))(spec)


def _same(ours, theirs):
    return theirs is not None and torch.equal(ours.reshape(theirs.shape), theirs)


def _coreai_spec(dtype, qscheme, granularity, float_range, kind="static", **extra):
    return QuantizationSpec(dtype=dtype, qscheme=qscheme, granularity=granularity, float_range=list(float_range),
                            qparam_calculator_cls=kind, **extra)


@pytest.mark.parametrize("float_range", FLOAT_RANGES, ids=str)
@pytest.mark.parametrize("granularity", list(GRANULARITIES), ids=str)
@pytest.mark.parametrize("dtype,qscheme", TARGETS, ids=str)
def test_calculators_bit_for_bit(dtype, qscheme, granularity, float_range):
    for kind in ("static", "global_minmax", "moving_average"):
        coreai_spec = _coreai_spec(dtype, qscheme, GRANULARITIES[granularity], float_range, kind)
        calc = _calculator(None, coreai_spec)
        spec = qstats.QuantSpec.from_coreai_opt(coreai_spec, shape=SHAPE)
        obs = _observer(kind, spec)
        state = obs.init(torch.empty(SHAPE))
        for step, x in enumerate(_batches()):
            scale, zero_point, minval = calc(x)
            state = obs.update(state, x)
            qp = qstats.compute_qparams(state, spec, float_range=float_range)
            ours_minval = qp.minval
            where = f"{kind} step {step}"
            drifted = kind == "moving_average" and (float_range[0] is None) != (float_range[1] is None)
            if drifted:
                # coreai_opt moves a pinned end by its EMA of the constant (an ulp or two, at times):
                # qstats keeps it exact. Mapping coreai_opt's own running range reproduces it bit for bit.
                pinned = calc.running_min if float_range[0] is not None else calc.running_max
                exact = pinned == (float_range[0] if float_range[0] is not None else float_range[1])
                ref = qstats.qparams_from_minmax(calc.running_min, calc.running_max, spec)
                assert torch.equal(ref.scale, scale) and torch.equal(ref.zero_point, zero_point), where
                assert torch.equal(qp.scale.reshape(scale.shape)[exact], scale[exact]), where
                assert torch.equal(qp.zero_point.reshape(scale.shape)[exact], zero_point[exact]), where
                assert torch.equal(ours_minval.reshape(scale.shape)[exact], minval[exact]), where
                continue
            assert _same(qp.scale, scale), where
            assert _same(qp.zero_point, zero_point), where
            assert _same(ours_minval, minval), where
            assert bool(qp.calibrated.all())


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2, torch.float4_e2m1fn_x2], ids=str)
@pytest.mark.parametrize("granularity", ["per_tensor", "per_channel_0", "per_block_axis"])
@pytest.mark.parametrize("float_range", FLOAT_RANGES, ids=str)
def test_e8m0_scales(dtype, granularity, float_range):
    coreai_spec = _coreai_spec(dtype, "symmetric", GRANULARITIES[granularity], float_range,
                               scale_dtype=torch.float8_e8m0fnu)
    calc = _calculator(None, coreai_spec)
    spec = qstats.QuantSpec.from_coreai_opt(coreai_spec, shape=SHAPE)
    assert spec.scale_dtype == "e8m0"
    x = _batches()[3] * 37.0
    scale, zero_point, minval = calc(x)
    state = qstats.minmax(spec).update(qstats.minmax(spec).init(x), x)
    qp = qstats.compute_qparams(state, spec, float_range=float_range)
    assert _same(qp.scale, scale)
    if dtype.is_floating_point:
        # coreai_opt's; qstats: zero_point_domain none, and minval the same range value as for integers
        assert zero_point is None and minval is None
        assert qp.minval.dtype == torch.float32 and qp.minval.shape == qp.scale.shape
        with pytest.raises(ValueError, match="has no minval"):
            qstats.compute_minval(state, spec)
    else:
        assert _same(qp.zero_point, zero_point)
        assert _same(qp.minval, minval)


def test_e8m0_all_zero_block_is_the_known_difference():
    """An all-zero block: qstats' smallest e8m0 scale is 2**-127 (biased exponent 0), coreai_opt
    clamps it to the smallest normal float32, 2**-126; every other block agrees."""
    coreai_spec = _coreai_spec(torch.int8, "symmetric", GRANULARITIES["per_block_axis"], (None, None),
                               scale_dtype=torch.float8_e8m0fnu)
    x = _batches()[0]
    x[0, :16] = 0.0
    scale, _, _ = _calculator(None, coreai_spec)(x)
    spec = qstats.QuantSpec.from_coreai_opt(coreai_spec, shape=SHAPE)
    obs = qstats.minmax(spec)
    ours = qstats.compute_qparams(obs.update(obs.init(x), x), spec).scale
    assert ours[0, 0] == 2.0**-127 and scale[0, 0] == 2.0**-126
    ours[0, 0] = scale[0, 0]
    assert torch.equal(ours, scale)


def test_float8_without_e8m0():
    coreai_spec = _coreai_spec(torch.float8_e4m3fn, "symmetric", GRANULARITIES["per_channel_0"], (-2.0, None))
    x = _batches()[1]
    scale, zero_point, minval = _calculator(None, coreai_spec)(x)
    spec = qstats.QuantSpec.from_coreai_opt(coreai_spec)
    obs = qstats.memoryless_minmax(spec)
    assert _same(qstats.compute_qparams(obs.update(obs.init(x), x), spec, float_range=(-2.0, None)).scale, scale)
    assert zero_point is None and minval is None


def test_torch_ao_moving_average_differs_where_a_batch_range_misses_zero():
    """qstats.moving_average_minmax averages the raw extremes (torch.ao), coreai_opt those clamped
    to contain zero: an all-positive batch gives different ranges; qstats.coreai_opt's observer
    equals coreai_opt's running range."""
    coreai_spec = _coreai_spec(torch.int8, "asymmetric", GRANULARITIES["per_channel_0"], (None, None), "moving_average")
    calc = _calculator(None, coreai_spec)
    spec = qstats.QuantSpec.from_coreai_opt(coreai_spec, shape=SHAPE)
    ours, torch_ao = qstats.coreai_opt.moving_average_minmax(spec, 0.1), qstats.moving_average_minmax(spec, 0.1)
    a, b = ours.init(torch.empty(SHAPE)), torch_ao.init(torch.empty(SHAPE))
    for x in _batches():
        calc(x)
        a, b = ours.update(a, x), torch_ao.update(b, x)
    assert torch.equal(a.min_val, calc.running_min.reshape(-1)) and torch.equal(a.max_val, calc.running_max.reshape(-1))
    assert not torch.equal(b.min_val, calc.running_min.reshape(-1))


def test_export_mode_is_a_state_no_longer_updated():
    """coreai_opt's set_export_mode(True) freezes qparams; in qstats the state is simply not updated
    again, and compute_qparams gives the same QParams."""
    coreai_spec = _coreai_spec(torch.int8, "asymmetric", GRANULARITIES["per_channel_0"], (None, 4.0), "global_minmax")
    calc = _calculator(None, coreai_spec)
    spec = qstats.QuantSpec.from_coreai_opt(coreai_spec, shape=SHAPE)
    obs = qstats.minmax(spec)
    batches = _batches()
    state = obs.init(batches[0])
    for x in batches[:2]:
        calc(x)
        state = obs.update(state, x)
    calc.set_export_mode(True)
    frozen = calc(batches[3] * 100)
    qp = qstats.compute_qparams(state, spec, float_range=(None, 4.0))
    assert _same(qp.scale, frozen[0]) and _same(qp.zero_point, frozen[1])
    assert _same(qp.minval, frozen[2])


def test_block_size_matches_coreai_opt():
    from coreai_opt.quantization.spec.granularity import QuantizationGranularity

    for shape in [(16, 64), (8, 32, 3, 3), (2, 8, 32)]:
        for target, ct in (("weight", CompressionTargetTensor.WEIGHT), ("activation", CompressionTargetTensor.ACTIVATION)):
            for data in [{"type": "per_tensor"}, {"type": "per_channel", "axis": -1},
                         {"type": "per_block", "axis": 1, "block_size": 8}, {"type": "per_block", "axis": -1, "block_size": 1}]:
                granularity = QuantizationGranularity.REGISTRY[data["type"]](**{k: v for k, v in data.items() if k != "type"})
                assert qstats.coreai_opt.block_size(data, shape, target) == granularity.get_block_size(shape, ct)
                assert qstats.coreai_opt.block_size(granularity, shape, target) == granularity.get_block_size(shape, ct)
    with pytest.raises(ValueError, match="does not divide"):
        qstats.coreai_opt.block_size({"type": "per_block", "axis": 1, "block_size": 8}, (4, 12))


def test_float_range_is_pure_vmappable_and_reaches_recipes():
    spec = qstats.QuantSpec.from_coreai_opt(dtype=torch.int8, qscheme="asymmetric", granularity={"type": "per_channel", "axis": 0})
    obs = qstats.minmax(spec)
    xs = torch.randn(3, *SHAPE)
    states = torch.vmap(lambda x: obs.update(obs.init(x), x))(xs)
    batched = torch.vmap(lambda s: qstats.compute_qparams(s, spec, float_range=(-0.5, None)))(states)
    minvals = batched.minval
    for i, x in enumerate(xs):
        one = obs.update(obs.init(x), x)
        qp = qstats.compute_qparams(one, spec, float_range=(-0.5, None))
        assert torch.equal(batched.scale[i], qp.scale) and torch.equal(batched.zero_point[i], qp.zero_point)
        assert torch.equal(minvals[i], torch.full_like(minvals[i], -0.5))
    # both ends pinned: the data are not read, every entry is calibrated
    empty = obs.init(xs[0])
    qp = qstats.compute_qparams(empty, spec, float_range=(-1.0, 3.0))
    assert bool(qp.calibrated.all()) and torch.equal(qp.scale, torch.full((SHAPE[0],), 4.0 / 255))
    model = torch.nn.Sequential(torch.nn.Linear(64, 16))
    rule = qstats.Rule("Linear", sites=("weight",), spec=spec, qparams_kwargs={"float_range": (None, 0.25)})
    recipe = qstats.Recipe([rule])
    states = qstats.calibrate(model, [torch.randn(2, 64)], recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    weight = model[0].weight.detach()
    expected = qstats.compute_qparams(obs.update(obs.init(weight), weight), spec, float_range=(None, 0.25))
    assert torch.equal(qparams["0"]["weight"].scale, expected.scale)


@pytest.mark.parametrize("bad,message", [
    ((0.5, None), "lo must be <= 0"), ((None, -0.5), "hi must be >= 0"), ((-1.0, -1.0), "hi must be >= 0"),
    ((0.0, 0.0), "lo < hi"), ((float("nan"), None), "finite"), ((None, float("inf")), "finite"),
    ((True, None), "finite"), ((-1.0,), "pair"), ("ab", "pair"), ((torch.tensor(-1.0), None), "finite"),
])
def test_bad_float_range(bad, message):
    spec = qstats.QuantSpec(dtype="int8")
    obs = qstats.minmax(spec)
    state = obs.update(obs.init(torch.ones(3)), torch.ones(3))
    with pytest.raises(ValueError, match=message):
        qstats.compute_qparams(state, spec, float_range=bad)


def test_scale_dtype_torch_dtypes_compare_equal_to_names():
    for dtype, name in [(torch.float8_e8m0fnu, "e8m0"), (torch.float16, "float16"), (torch.bfloat16, "bfloat16"),
                        (torch.float32, "float32"), (torch.float8_e4m3fn, "float8_e4m3fn")]:
        fields = dict(dtype="fp8_e4m3fn", zero_point_domain="none", granularity=qstats.PerGroup(32))
        a, b = qstats.QuantSpec(scale_dtype=dtype, **fields), qstats.QuantSpec(scale_dtype=name, **fields)
        assert a == b and hash(a) == hash(b) and a.scale_dtype == name
    assert qstats.QuantSpec(scale_dtype="float8_e8m0fnu", dtype="fp8_e4m3fn", zero_point_domain="none").scale_dtype == "e8m0"
    with pytest.raises(ValueError, match="scale_dtype"):
        qstats.QuantSpec(scale_dtype=torch.int8)


def test_coreai_moving_average_obeys_the_laws():
    pytest.importorskip("hypothesis")
    import qstats.testing

    spec = qstats.QuantSpec.from_coreai_opt(dtype=torch.int8, granularity={"type": "per_channel", "axis": 0})
    obs = qstats.coreai_opt.moving_average_minmax(spec, 0.1)
    assert obs.exact is False
    qstats.testing.check_all(obs, lambda g: torch.randn(4, 8, generator=g), max_examples=5)


@pytest.mark.parametrize("qscheme", ["symmetric", "asymmetric"])
def test_bfloat16_inputs(qscheme):
    """coreai_opt computes in the input's dtype (from_coreai_opt(input_dtype=torch.bfloat16)),
    except with both ends pinned, where its range and scale stay float32 (the default spec)."""
    for float_range in [(None, None), (-1.3, None), (None, 2.7), (-1.3, 0.7)]:
        coreai_spec = _coreai_spec(torch.int8, qscheme, GRANULARITIES["per_channel_0"], float_range)
        x = _batches()[1].bfloat16()
        scale, zero_point, minval = _calculator(None, coreai_spec)(x)
        both = None not in float_range
        spec = qstats.QuantSpec.from_coreai_opt(coreai_spec, shape=SHAPE, input_dtype=torch.float32 if both else torch.bfloat16)
        assert scale.dtype == (torch.float32 if both else torch.bfloat16)
        obs = qstats.memoryless_minmax(spec)
        state = obs.update(obs.init(x), x)
        qp = qstats.compute_qparams(state, spec, float_range=float_range)
        assert _same(qp.scale, scale.float()) and _same(qp.zero_point, zero_point)
        assert _same(qp.minval, minval.float())


@pytest.mark.parametrize("qscheme", ["symmetric", "asymmetric"])
def test_stacked_experts_minval_per_expert_under_vmap_and_compile(qscheme):
    """stacked_qparams (torch.vmap of compute_qparams) gives each expert coreai_opt's minval of that
    expert's tensor; an expert that saw nothing gets quant_min (both formulations dequantize alike
    under the fallback scale 1, zero point 0); torch.compile(fullgraph=True) gives the same QParams.
    Float targets keep a tensor too, so their stacks vmap."""
    coreai_spec = _coreai_spec(torch.int8, qscheme, GRANULARITIES["per_channel_0"], (None, None))
    spec = qstats.QuantSpec.from_coreai_opt(coreai_spec, shape=SHAPE)
    experts = torch.stack(_batches(seed=1)[:3])
    weight = torch.ones(3, *SHAPE)
    weight[1] = 0.0  # expert 1 saw no tokens
    obs = qstats.stacked_observer(qstats.minmax(spec), 3)
    state = obs.update(obs.init(experts), experts, weight)
    stacked = qstats.stacked_qparams(state, spec)
    for e in (0, 2):
        _, _, minval = _calculator(None, coreai_spec)(experts[e])
        assert _same(stacked.minval[e], minval), e
    assert not bool(stacked.calibrated[1].any())
    assert torch.equal(stacked.minval[1], torch.full((SHAPE[0],), -128.0))
    assert torch.equal(stacked.scale[1], torch.ones(SHAPE[0])) and not bool(stacked.zero_point[1].any())
    one = qstats.minmax(spec).update(qstats.minmax(spec).init(experts[0]), experts[0])
    compiled = torch.compile(lambda s: qstats.compute_qparams(s, spec), fullgraph=True)(one)
    eager = qstats.compute_qparams(one, spec)
    assert all(torch.equal(a, b) for a, b in zip(compiled, eager))
    assert torch.equal(qstats.compute_minval(one, spec), eager.minval)
    fp8 = qstats.QuantSpec.from_coreai_opt(_coreai_spec(torch.float8_e4m3fn, "symmetric", GRANULARITIES["per_channel_0"],
                                                        (None, None)), shape=SHAPE)
    fp8_obs = qstats.stacked_observer(qstats.minmax(fp8), 3)
    fp8_qp = qstats.stacked_qparams(fp8_obs.update(fp8_obs.init(experts), experts), fp8)
    assert torch.equal(fp8_qp.minval, -experts.abs().amax(-1))


def test_fixed_qparams_minval_is_the_value_of_quant_min():
    """A rule that gives QParams rather than a range (fixed qparams): ``minval`` makes coreai_opt's
    MINVAL formulation, ``(q - quant_min) * scale + minval``, dequantize every code as the
    zero-point one, ``(q - zero_point) * scale``."""
    spec = qstats.QuantSpec(dtype="uint8", mapping="asymmetric")
    obs = qstats.fixed_qparams(spec, scale=2.0**-8, zero_point=37)
    qp = qstats.compute_qparams(obs.init(torch.zeros(3)), spec)
    codes = torch.arange(0.0, 256.0)
    assert torch.equal((codes - 0) * qp.scale + qp.minval, (codes - 37) * qp.scale)
    assert torch.equal(qstats.compute_minval(obs.init(torch.zeros(3)), spec), qp.minval)


def test_unknown_granularity_is_named_with_or_without_a_shape():
    """An unknown granularity type is refused as unknown, not as a per-block one missing its shape."""
    bad = {"type": "per_group", "axis": 1, "block_size": 16}
    for shape in (None, SHAPE):
        with pytest.raises(ValueError, match=r"unknown granularity .*per_group"):
            qstats.QuantSpec.from_coreai_opt(dtype=torch.int8, granularity=bad, shape=shape)


def test_unknown_spec_fields_are_refused_naming_them():
    """A misspelt field (keyword or dict key) is refused, not ignored for the default int8
    symmetric; every field of coreai_opt's QuantizationSpec is accepted."""
    for bad in ({"dtyp": torch.uint8}, {"dtype": torch.uint8, "qschem": "asymmetric"}):
        with pytest.raises(ValueError, match=f"unknown QuantizationSpec field.*{sorted(bad)[-1]}"):
            qstats.QuantSpec.from_coreai_opt(**bad)
        with pytest.raises(ValueError, match="unknown QuantizationSpec field"):
            qstats.QuantSpec.from_coreai_opt(dict(bad))
    full = QuantizationSpec(dtype=torch.uint8, qscheme="asymmetric").model_dump()  # every field, derived ones too
    assert set(QuantizationSpec.model_fields) <= set(full)
    assert qstats.QuantSpec.from_coreai_opt(full) == qstats.QuantSpec.from_coreai_opt(dtype=torch.uint8, qscheme="asymmetric")


@pytest.mark.parametrize("input_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("scale_dtype", [None, torch.float8_e8m0fnu], ids=str)
@pytest.mark.parametrize("dtype,qscheme", [(torch.int8, "symmetric"), (torch.uint4, "asymmetric"),
                                           (torch.int4, "symmetric_with_clipping")], ids=str)
def test_half_moving_average_is_coreai_opts_half_ema(dtype, qscheme, scale_dtype, input_dtype):
    """coreai_opt's moving average steps its running range in the input's dtype (its buffers take
    the first batch's dtype): each product and the sum round to bf16/fp16. qstats averaged in
    float32, so scale, zero point and minval drifted from the second half-precision batch on."""
    if scale_dtype is not None and dtype != torch.int8:
        pytest.skip("e8m0 scales are int8 or float targets only")
    coreai_spec = _coreai_spec(dtype, qscheme, GRANULARITIES["per_block_axis"], (None, None), "moving_average",
                               scale_dtype=scale_dtype)
    calc = _calculator(None, coreai_spec)
    spec = qstats.QuantSpec.from_coreai_opt(coreai_spec, shape=SHAPE, input_dtype=input_dtype)
    obs = qstats.coreai_opt.moving_average_minmax(spec, 0.1)
    state = obs.init(torch.empty(SHAPE, dtype=input_dtype))
    for step, x in enumerate(_batches(seed=5)):
        x = x.to(input_dtype)
        scale, zero_point, minval = calc(x)
        state = obs.update(state, x)
        assert _same(state.min_val, calc.running_min.float()) and _same(state.max_val, calc.running_max.float()), step
        qp = qstats.compute_qparams(state, spec)
        assert _same(qp.scale, scale.float()) and _same(qp.zero_point, zero_point), step
        assert _same(qp.minval, minval.float()), step


@pytest.mark.parametrize("input_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_half_inputs_float8_scale_in_the_inputs_dtype(dtype, input_dtype):
    """coreai_opt's fp8 scale (no e8m0 scale_dtype) is torchao's ``amax / fp_max`` in the input's
    dtype, as for integers; from_coreai_opt(input_dtype=...) was ignored for float targets and
    gave float32 scales."""
    for float_range in [(None, None), (-1.3, None), (-1.3, 0.7)]:
        coreai_spec = _coreai_spec(dtype, "symmetric", GRANULARITIES["per_channel_0"], float_range)
        x = _batches()[1].to(input_dtype)
        scale, _, _ = _calculator(None, coreai_spec)(x)
        both = None not in float_range
        spec = qstats.QuantSpec.from_coreai_opt(coreai_spec, shape=SHAPE, input_dtype=torch.float32 if both else input_dtype)
        obs = qstats.memoryless_minmax(spec)
        qp = qstats.compute_qparams(obs.update(obs.init(x), x), spec, float_range=float_range)
        assert _same(qp.scale, scale.float()), float_range
        assert bool(torch.isfinite(qstats.fake_quantize(x.float(), qp, spec)).all())
