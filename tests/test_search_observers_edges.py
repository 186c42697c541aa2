"""Edge cases of the search observers (qstats.mse, imatrix_mse, moments, the histogram searches)
against llm-compressor 0.14 (the real library) or an independent computation."""

import pytest
import torch

import qstats

pytest.importorskip("llmcompressor.observers")
from _shared import llm_compressor_imatrix_mse  # noqa: E402


def _layer(seed=0):
    torch.manual_seed(seed)
    layer = torch.nn.Linear(64, 16, bias=False)
    layer.weight.data[2, 3] = 5.0  # an outlier: the flipped candidate's scale 1 rounded it exactly
    return layer


@pytest.mark.parametrize("fields", [
    dict(num_bits=4, type="int", symmetric=False, strategy="channel"),
    dict(num_bits=8, type="float", symmetric=True, strategy="group", group_size=32),
], ids=["int4-asym-channel", "fp8-group"])
@pytest.mark.parametrize("grid", [0.5, 0.9])
def test_imatrix_mse_with_a_grid_below_one_equals_llm_compressor(fields, grid):
    # int(maxshrink * grid) + 1 steps reach i = 1 > grid: the factor 1 - 1 / grid is negative, a flipped
    # range that compressed-tensors clamps to the zero range; qstats read it as uncalibrated (scale 1)
    layer = _layer()
    xs = [torch.randn(3, 64, generator=torch.Generator().manual_seed(1))]
    args, scale, zero_point = llm_compressor_imatrix_mse(fields, layer, xs, patience=10**6, grid=grid)
    spec = qstats.QuantSpec.from_compressed_tensors(args)
    imatrix = qstats.imatrix()
    state = imatrix.update(imatrix.init(xs[0]), xs[0])
    w = layer.weight.data
    for imatrix_state in (state, None):  # weighted, and the uniform fallback
        if imatrix_state is None:
            args, scale, zero_point = llm_compressor_imatrix_mse(fields, layer, [], patience=10**6, grid=grid)
        obs = qstats.imatrix_mse(spec, w.shape, imatrix_state, grid=grid)
        qp = qstats.compute_qparams(obs.update(obs.init(w), w), spec)
        assert torch.equal(qp.scale, scale.reshape(qp.scale.shape))
        assert torch.equal(qp.zero_point.to(zero_point.dtype), zero_point.reshape(qp.zero_point.shape))


def test_shrink_factors_past_zero_are_zero():
    from qstats.observers.mse import shrink_factors

    assert shrink_factors(0.95, 0.5, steps=3) == [1.0, 0.0, 0.0]
    assert shrink_factors(0.2, 100) == [1.0 - i / 100 for i in range(20)]


@pytest.mark.parametrize("bad", [torch.full((16,), -1.0), torch.full((16,), float("nan")),
                                 torch.tensor([float("inf")] + [1.0] * 15)], ids=["negative", "nan", "inf"])
def test_mse_importance_that_is_negative_or_not_finite_raises(bad):
    # a negative weight made the search pick the candidate of largest error, a NaN one the first
    spec = qstats.QuantSpec(dtype="int4", granularity=qstats.PerAxis(0))
    w = torch.randn(4, 16)
    obs = qstats.mse(spec, importance=bad)
    with pytest.raises(ValueError, match="importance holds a negative, NaN or infinite weight"):
        obs.update(obs.init(w), w)


def test_mse_importance_of_another_shape_raises_naming_both_shapes():
    spec = qstats.QuantSpec(dtype="int4", granularity=qstats.PerAxis(0))
    w = torch.randn(4, 16)
    obs = qstats.mse(spec, importance=torch.ones(3))  # was a RuntimeError from torch's expand
    with pytest.raises(ValueError, match=r"importance of shape \(3,\) does not broadcast to the canonical view \(1, 4, 16\)"):
        obs.update(obs.init(w), w)
    with pytest.raises(ValueError, match=r"importance of shape \(2, 4, 16\)"):  # it may not enlarge the view
        qstats.mse(spec, importance=torch.ones(2, 4, 16)).update(obs.init(w), w)
    with pytest.raises(TypeError, match="importance must be a real tensor"):
        qstats.mse(spec, importance=[1.0] * 16)
    with pytest.raises(TypeError, match="importance must be a real tensor"):
        qstats.mse(spec, importance=torch.ones(16, dtype=torch.bool))


def test_mse_importance_weights_each_error_as_an_independent_search():
    # the weighted argmin, computed here with compressed-tensors' fake_quantize over the same candidates
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    g = torch.Generator().manual_seed(4)
    w = torch.randn(8, 32, generator=g)
    w[1, 2] = 6.0
    importance = torch.rand(32, generator=g) * 4
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="channel")
    spec = qstats.QuantSpec.from_compressed_tensors(args)
    obs = qstats.mse(spec, importance=importance, norm=2.0)
    qp = qstats.compute_qparams(obs.update(obs.init(w), w), spec)
    lo, hi = w.amin(1), w.amax(1)
    best, best_scale = torch.full((8,), float("inf"), dtype=torch.float64), None
    for i in range(20):
        p = 1 - i / 100
        scale, zero_point = calculate_qparams(lo * p, hi * p, args)
        fq = fake_quantize(w, scale.unsqueeze(-1), zero_point.unsqueeze(-1), args)
        error = ((fq - w).double() ** 2 * importance.double()).sum(1)
        better = error < best
        best = torch.where(better, error, best)
        best_scale = scale if best_scale is None else torch.where(better, scale, best_scale)
    assert torch.equal(qp.scale, best_scale)


def _compressed_tensors_best_error(x, args, factors):
    """The least squared error on ``x`` of compressed-tensors' fake_quantize over the ranges
    ``factor * (min(x, 0), max(x, 0))`` (an independent brute force of the histogram mse search)."""
    from compressed_tensors.quantization.lifecycle import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    lo, hi = x.min().clamp(max=0).reshape(1), x.max().clamp(min=0).reshape(1)
    errors = []
    for factor in factors:
        scale, zero_point = calculate_qparams(lo * factor, hi * factor, args)
        errors.append(float(((fake_quantize(x, scale, zero_point, args) - x) ** 2).sum()))
    return min(errors), errors[0]


@pytest.mark.parametrize("fields, spec_kwargs", [
    (dict(num_bits=8, type="float", symmetric=False, strategy="tensor"), None),  # from_compressed_tensors
    (dict(num_bits=4, type="int", symmetric=False, strategy="tensor"),
     dict(dtype="int4", mapping="asymmetric", zero_point_domain="none", convention="compressed_tensors")),
], ids=["fp8-asym", "int4-asym-domain-none"])
@pytest.mark.parametrize("seed", [0, 1])
def test_histogram_mse_and_l2_use_the_zero_point_compressed_tensors_keeps(fields, spec_kwargs, seed):
    # compressed-tensors keeps an asymmetric zero point (fp8: -448; zero_point_domain "none" too): the
    # searches scored a grid without it and kept the full range on skewed data (10-20% more error)
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle import fake_quantize

    args = QuantizationArgs(**fields)
    spec = qstats.QuantSpec.from_compressed_tensors(args) if spec_kwargs is None else qstats.QuantSpec(**spec_kwargs)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(seed)).exp() * (-1) ** seed
    best, full = _compressed_tensors_best_error(x, args, [2 ** (-k / 32) for k in range(128)])
    assert best < 0.95 * full  # the data calls for clipping
    obs = qstats.histogram(spec)
    state = obs.update(obs.init(x), x)
    for method in ("mse", "l2"):
        qp = qstats.compute_qparams(state, spec, method=method)
        zero_point = qp.zero_point.reshape(1).to(torch.float8_e4m3fn if args.type == "float" else torch.int8)
        error = float(((fake_quantize(x, qp.scale.reshape(1), zero_point, args) - x) ** 2).sum())
        assert error <= 1.01 * best, (method, error, best, full)


@pytest.mark.parametrize("option, value", [("maxshrink", None), ("grid", None), ("grid", float("inf")),
                                           ("maxshrink", float("nan")), ("norm", "3")])
def test_imatrix_mse_names_a_bad_search_option(option, value):
    # int(maxshrink * grid) ran first: a TypeError, OverflowError or int()'s ValueError of its own
    spec = qstats.QuantSpec(dtype="int4", granularity=qstats.PerAxis(0))
    with pytest.raises(ValueError, match=f"{option} must be"):
        qstats.imatrix_mse(spec, (4, 16), None, **{option: value})
    with pytest.raises(ValueError, match=f"{option} must be"):
        qstats.mse(spec, **{option: value})


def test_asymmetric_percentile_at_or_below_50_raises():
    # the 70th and 30th percentiles of x crossed: clamped to the empty range [0, 0], an eps scale that
    # quantized every value to zero, in silence
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    spec = qstats.QuantSpec(dtype="uint8", mapping="asymmetric")
    obs = qstats.histogram(spec)
    state = obs.update(obs.init(x), x)
    for percentile in (30, 50):
        with pytest.raises(ValueError, match=r"percentile must be in \(50, 100\]"):
            qstats.compute_qparams(state, spec, method="percentile", percentile=percentile)
    qp = qstats.compute_qparams(state, spec, method="percentile", percentile=60)
    lo, hi = torch.quantile(x.double(), 0.4), torch.quantile(x.double(), 0.6)  # straddling 0 for this data
    assert float(qp.scale) == pytest.approx(float(hi - lo) / 255, rel=0.02)


def _nvfp4_args(observer, **observer_kwargs):
    from compressed_tensors.quantization.quant_scheme import NVFP4

    return NVFP4["weights"].model_copy(update={"observer": observer, "observer_kwargs": observer_kwargs})


# llm-compressor's nvfp4_expanded_* defaults, given to qstats explicitly
_EXPANDED = dict(expand=1.8, maxshrink=1 - 0.8 / 1.8, grid=200)


@pytest.mark.parametrize("observer", ["memoryless_mse", "nvfp4_expanded_mse"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mse_of_an_nvfp4_weight_equals_llm_compressor(observer, dtype):
    # llm-compressor searches NVFP4 groups with float32 scales and takes the global scale from the
    # chosen ranges; qstats refused two-level specs
    from llmcompressor.observers import Observer

    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 64, generator=g)
    w[2, 3] = 30.0
    w = w.to(dtype)
    args = _nvfp4_args(observer, **({"patience": 10**6} if observer == "memoryless_mse" else {}))
    reference = Observer.load_from_registry(observer, base_name="weight", args=args)
    reference(w)
    expected = reference.get_qparams()
    spec = qstats.QuantSpec.from_compressed_tensors(args, observed_dtype=dtype)
    obs = qstats.mse(spec, **(_EXPANDED if observer == "nvfp4_expanded_mse" else {}))
    assert obs.spec == spec
    qp = qstats.compute_qparams(obs.update(obs.init(w), w), spec)
    assert torch.equal(qp.scale.float(), expected["scale"].float().reshape(qp.scale.shape))
    assert torch.equal(qp.global_scale.reshape(1), expected["global_scale"].float().reshape(1))


@pytest.mark.parametrize("observer, dtype", [("imatrix_mse", torch.float32), ("imatrix_mse", torch.bfloat16),
                                             ("nvfp4_expanded_imatrix", torch.float32)])
def test_imatrix_mse_of_an_nvfp4_weight_equals_llm_compressor(observer, dtype):
    from llmcompressor.observers import Observer

    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 16, bias=False).to(dtype)
    layer.weight.data[2, 3] = 3.0
    x = (torch.randn(3, 64) * torch.logspace(-1, 1, 64)).to(dtype)
    args = _nvfp4_args(observer, patience=10**6)
    reference = Observer.load_from_registry(observer, base_name="weight", args=args)
    reference.attach(layer)
    with torch.no_grad():
        layer(x)
    reference(layer.weight.data)
    expected = reference.get_qparams()
    reference.detach(layer)
    spec = qstats.QuantSpec.from_compressed_tensors(args, observed_dtype=dtype)
    imatrix = qstats.imatrix()
    options = dict(_EXPANDED, norm=2.4) if observer.startswith("nvfp4") else {}
    w = layer.weight.data
    obs = qstats.imatrix_mse(spec, w.shape, imatrix.update(imatrix.init(x), x), **options)
    qp = qstats.compute_qparams(obs.update(obs.init(w), w), spec)
    assert torch.equal(qp.scale.float(), expected["scale"].float().reshape(qp.scale.shape))
    assert torch.equal(qp.global_scale.reshape(1), expected["global_scale"].float().reshape(1))


def test_mse_of_an_nvfp4_spec_keeps_the_laws():
    from qstats import testing

    spec = qstats.preset("nvfp4")
    reference = (torch.full((4, 2), -3.0), torch.full((4, 2), 3.0))
    testing.check_all(qstats.mse(spec, reference=reference), lambda g: torch.randn(4, 32, generator=g),
                      max_examples=3)
