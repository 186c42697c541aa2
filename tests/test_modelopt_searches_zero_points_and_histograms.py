"""The ModelOpt-style range searches (``"entropy"``, ``"mse"`` and the grid they share):
what a migrating user tries beyond tests/test_modelopt.py, each against the reference library.

- Float zero points: the searches' grid read a float zero point as codes, but torchao's
  (``ZeroPointDomain.FLOAT``, tinygemm) is in the input's units and compressed-tensors rounds its
  zero point to an integer: ``"mse"`` chose ranges 2x to 150x worse than the best shrink of the
  range, scored by torchao's / compressed-tensors' own quantize and dequantize.
- `entropy_amax` takes ModelOpt's numpy histograms (``HistogramCalibrator(torch_hist=False)``,
  ``np.histogram``) as ModelOpt's ``_compute_amax_entropy`` does (AttributeError before).
- ``compute_qparams(..., method="entropy", num_bits=n)`` takes every bit width the spec's own
  default does, up to 32 (``int32``: ``num_bits=17`` was refused while the default 32 ran).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import qstats

pytestmark = pytest.mark.usefixtures("single_thread_quiet")

FACTORS = [2.0 ** (-k / 32) for k in range(128)]  # the "mse" search's shrink factors


def _data(name, n=20000, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    return {"gauss": x, "skew": x.abs() * 3 - 0.5, "negskew": -(x.abs() * 3) + 0.2}[name]


def _searched(spec, x, method):
    obs = qstats.histogram(spec)
    state = obs.update(obs.init(x), x)
    return state, qstats.compute_qparams(state, spec, method=method)


def _best_shrink(state, error_of_range):
    """The least reference error over the search's candidates ``f * [min(min, 0), max(max, 0)]``."""
    lo, hi = min(float(state.min_val), 0.0), max(float(state.max_val), 0.0)
    return min(error_of_range(lo * f, hi * f) for f in FACTORS)


# ---------------------------------------------------------------------------------------------
# Float zero points: the grid of the convention's own dequantization


@pytest.mark.parametrize("method", ["mse", "l2"])
@pytest.mark.parametrize("name", ["gauss", "skew", "negskew"])
@pytest.mark.parametrize("bits", [4, 8])
def test_torchao_float_zero_point_searches_score_torchaos_grid(bits, name, method):
    qp_lib = pytest.importorskip("torchao.quantization.quant_primitives")
    target = getattr(torch, f"uint{bits}")
    qmin, qmax = qp_lib._DTYPE_TO_QVALUE_BOUNDS[target]
    asymmetric = qp_lib.MappingType.ASYMMETRIC
    spec = qstats.QuantSpec.from_torchao(target, mapping_type=asymmetric, zero_point_domain=qp_lib.ZeroPointDomain.FLOAT)
    x = _data(name)

    def error(scale, zero_point):  # torchao's tinygemm quantize / dequantize
        codes = qp_lib._quantize_affine_tinygemm_no_dtype_cast(x, x.shape, scale, zero_point, qmin, qmax)
        values = qp_lib._dequantize_affine_tinygemm_no_dtype_check(codes, x.shape, scale, zero_point, qmin, qmax,
                                                                    torch.float32)
        return float(((values - x).double() ** 2).sum())

    def error_of_range(lo, hi):
        ends = torch.tensor([lo, hi])
        scale, zero_point = qp_lib._choose_qparams_affine_tinygemm(ends, asymmetric, (2,), target,
                                                                   scale_dtype=torch.float32)
        return error(scale, zero_point)

    state, qp = _searched(spec, x, method)
    ours = error(qp.scale.reshape(1), qp.zero_point.reshape(1))
    # before: uint4 gauss 2.2x (mse) and 1.5x (l2), uint8 negskew 23000x (mse)
    assert ours <= 1.01 * _best_shrink(state, error_of_range), (ours, _best_shrink(state, error_of_range))


@pytest.mark.parametrize("method", ["mse", "l2"])
@pytest.mark.parametrize("name", ["gauss", "skew", "negskew"])
def test_compressed_tensors_float_zero_point_searches_score_its_grid(name, method):
    # compressed-tensors rounds the zero point to int8 whatever the domain: the grid is its int one
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="tensor")
    spec = qstats.QuantSpec(dtype="int4", mapping="asymmetric", convention="compressed_tensors",
                            zero_point_domain="float")
    x = _data(name)

    def error(scale, zero_point):
        return float(((fake_quantize(x, scale, zero_point, args) - x).double() ** 2).sum())

    def error_of_range(lo, hi):
        return error(*calculate_qparams(torch.tensor([lo]), torch.tensor([hi]), args))

    state, qp = _searched(spec, x, method)
    ours = error(qp.scale.reshape(1), qp.zero_point.reshape(1).to(torch.int8))
    # before: gauss 19x (mse), skew 2.1x (mse and l2)
    assert ours <= 1.01 * _best_shrink(state, error_of_range), (ours, _best_shrink(state, error_of_range))


# ---------------------------------------------------------------------------------------------
# entropy_amax on ModelOpt's numpy histograms; num_bits of any spec's width


def test_entropy_amax_takes_modelopts_numpy_histogram():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        modelopt_calib = pytest.importorskip("modelopt.torch.quantization.calib")
    x = _data("gauss") ** 3  # heavy tails: the search clips
    for bits, unsigned in ((8, False), (4, True)):
        calibrator = modelopt_calib.HistogramCalibrator(num_bits=bits, unsigned=unsigned, num_bins=512, torch_hist=False)
        calibrator.collect(x)
        assert isinstance(calibrator._calib_hist, np.ndarray)  # ModelOpt's np.histogram path
        theirs = calibrator.compute_amax("entropy")
        ours = qstats.observers.histogram.entropy_amax(calibrator._calib_hist, calibrator._calib_bin_edges, bits,
                                                       unsigned)
        # ModelOpt returns its (float64) edge as a float32 tensor
        assert torch.equal(torch.tensor(float(ours)), theirs), (bits, float(ours), float(theirs))
        assert float(ours) < float(x.abs().max()) / 2  # a clipping amax, not the last edge


@pytest.mark.parametrize("num_bits", [17, 24, 32])
def test_entropy_num_bits_past_16_as_the_specs_own_default(num_bits):
    # 2**16 levels or more on 2048 linear bins: a level per bin, so Q is P and KL is 0 only with no
    # outliers, at the last candidate: the search keeps the whole range (ModelOpt's last minimum)
    x = _data("gauss")
    spec = qstats.QuantSpec(dtype="int32", mapping="symmetric", eps=1e-30)
    obs = qstats.histogram(spec)
    state = obs.update(obs.init(x), x)
    qp = qstats.compute_qparams(state, spec, method="entropy", num_bits=num_bits)  # ValueError before
    absmax = x.abs().max()
    assert torch.equal(qp.scale, qstats.qparams_from_minmax(-absmax, absmax, spec).scale)


# ---------------------------------------------------------------------------------------------
# FP8 histogram "mse": ModelOpt's branch fails as shipped; with its call fixed, qstats' fp8 grid


@pytest.mark.parametrize("name", ["gauss", "t3"])
def test_fp8_histogram_mse_scores_as_modelopts_with_its_call_fixed(name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pytest.importorskip("modelopt.torch.quantization")
        from unittest import mock

        import modelopt.torch.quantization.calib.histogram as modelopt_histogram
        from modelopt.torch.quantization.tensor_quant import ScaledE4M3Function
    from _shared import distribution

    x = distribution(name, 40000)
    calibrator = modelopt_histogram.HistogramCalibrator(num_bits=(4, 3))
    calibrator.collect(x)
    with pytest.raises(TypeError):  # ModelOpt 0.47 passes (4, 3) as (bias, E): M is missing
        calibrator.compute_amax("mse")
    with pytest.raises(TypeError):  # no FP8 KL search: 1 << ((4, 3) - 1)
        calibrator.compute_amax("entropy")

    def fixed(inputs, amax, exponent_bits, mantissa_bits):
        return ScaledE4M3Function.apply(inputs, amax, None, exponent_bits, mantissa_bits)

    with mock.patch.object(modelopt_histogram, "scaled_e4m3", fixed):
        theirs = calibrator.compute_amax("mse")
    spec = qstats.QuantSpec(dtype="fp8_e4m3fn", zero_point_domain="none")
    _, qp = _searched(spec, x, "mse")
    ours = qp.scale.reshape(()) * 448

    def sqnr(amax):  # ModelOpt's own FP8 fake quantizer
        y = ScaledE4M3Function.apply(x, amax.float(), None, 4, 3)
        return float(10 * torch.log10((x.double() ** 2).sum() / ((x - y).double() ** 2).sum()))

    assert sqnr(ours) >= sqnr(theirs) - 0.01, (float(ours), float(theirs))
