"""Range methods under ``preserve_zero=False`` (torchao), whose range need not hold zero: the
percentile and mean/std ranges against torchao's ``_choose_qparams_affine_dont_preserve_zero`` on
independently computed ends."""

import pytest
import torch

import qstats

qp_lib = pytest.importorskip("torchao.quantization.quant_primitives")
from torchao.quantization import granularity as tao_granularity  # noqa: E402

MappingType = qp_lib.MappingType


def _data():
    """Rows far from zero on either side (``[2, 3]``, ``[-5, -4]``) and one across it."""
    g = torch.Generator().manual_seed(0)
    x = torch.rand(3, 4096, generator=g)
    return x + torch.tensor([[2.0], [-5.0], [-0.5]])


def _torchao(lo, hi, target_dtype):
    """torchao's qparams of the ranges ``[lo, hi]`` per row (a 2-column tensor holding both ends)."""
    ends = torch.stack([lo, hi], -1).float()
    return qp_lib._choose_qparams_affine_dont_preserve_zero(
        ends, MappingType.ASYMMETRIC, (1, 2), target_dtype, scale_dtype=torch.float32)


def _spec(target_dtype):
    return qstats.QuantSpec.from_torchao(target_dtype, mapping_type=MappingType.ASYMMETRIC,
                                         granularity=tao_granularity.PerRow(), preserve_zero=False)


@pytest.mark.parametrize("target_dtype", (torch.uint8, torch.uint4), ids=str)
def test_percentile_range_of_data_away_from_zero_is_the_percentiles(target_dtype):
    """The asymmetric percentile range was widened to hold zero, under preserve_zero=False too:
    rows in [2, 3] got a scale three times torchao's for their percentiles."""
    x = _data()
    spec = _spec(target_dtype)
    obs = qstats.histogram(spec)
    qp = qstats.compute_qparams(obs.update(obs.init(x), x), spec, method="percentile", percentile=99.0)
    lo, hi = torch.quantile(x.double(), torch.tensor([0.01, 0.99], dtype=torch.float64), dim=-1)
    scale, zero_point = _torchao(lo, hi, target_dtype)
    # the histogram interpolates within buckets of 1/128 of an octave
    torch.testing.assert_close(qp.scale, scale.reshape(qp.scale.shape), rtol=2e-2, atol=0.0)
    assert (qp.zero_point.reshape(-1) - zero_point.reshape(-1)).abs().max() <= 1


@pytest.mark.parametrize("target_dtype", (torch.uint8, torch.uint4), ids=str)
def test_mean_std_range_of_data_away_from_zero_is_mean_plus_minus_k_std(target_dtype):
    """``"mean_std"`` widened ``mean +- k * std`` to hold zero under preserve_zero=False too."""
    x = _data()
    spec = _spec(target_dtype)
    obs = qstats.moments(spec)
    qp = qstats.compute_qparams(obs.update(obs.init(x), x), spec, method="mean_std", k=2.5)
    rows = x.double()
    mean, std = rows.mean(-1), rows.std(-1, correction=0)
    scale, zero_point = _torchao(mean - 2.5 * std, mean + 2.5 * std, target_dtype)
    torch.testing.assert_close(qp.scale, scale.reshape(qp.scale.shape), rtol=1e-6, atol=0.0)
    assert torch.equal(qp.zero_point.reshape(-1).to(zero_point.dtype), zero_point.reshape(-1))


def test_ranges_of_specs_that_preserve_zero_still_hold_zero():
    x = _data()
    spec = qstats.QuantSpec.from_torchao(torch.uint8, mapping_type=MappingType.ASYMMETRIC,
                                         granularity=tao_granularity.PerRow())
    hist, moments = qstats.histogram(spec), qstats.moments(spec)
    for obs, method in ((hist, "percentile"), (moments, "mean_std")):
        qp = qstats.compute_qparams(obs.update(obs.init(x), x), spec, method=method)
        codes = qstats.quantize(torch.zeros(3, 1), qp, spec)
        assert torch.equal(qstats.dequantize(codes, qp, spec), torch.zeros(3, 1)), method
