"""qstats.histogram against torch.ao's HistogramObserver and torch.quantile on edge inputs a
migrating user tries."""

import warnings

import pytest
import torch
from torch.ao.quantization import observer as ao

import qstats
from qstats import torch_ao as qa
from qstats.observers.search import search


def test_upsample_rate_is_refused_as_torch_ao_refuses_it():
    """torch.ao 2.x's HistogramObserver has no upsample_rate argument (fixed inside); neither does the drop-in."""
    with pytest.raises(TypeError, match="upsample_rate"):
        ao.HistogramObserver(upsample_rate=16)
    with pytest.raises(TypeError, match="upsample_rate"):
        qa.QstatsObserver(observer=qstats.histogram, upsample_rate=16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mapping", ["symmetric", "asymmetric"])
def test_percentile_100_is_torch_quantiles_extremes_exactly(dtype, mapping):
    torch.manual_seed(0)
    x = (torch.randn(5000) * 3).to(dtype)
    spec = qstats.QuantSpec(dtype="int8" if mapping == "symmetric" else "uint8", mapping=mapping)
    observer = qstats.histogram(spec)
    state = observer.update(observer.init(x), x)
    found = search("percentile")(state, spec, percentile=100)
    lo, hi = float(torch.quantile(x.double(), 0.0)), float(torch.quantile(x.double(), 1.0))
    if mapping == "symmetric":
        amax = float(torch.quantile(x.double().abs(), 1.0))
        assert max(-float(found.min_val), float(found.max_val)) == amax
    else:
        assert (float(found.min_val), float(found.max_val)) == (lo, hi)


_NEGATIVE = [torch.tensor([-0.7]), torch.full((50,), -5.0), -torch.rand(500, generator=torch.Generator().manual_seed(15))]


@pytest.mark.parametrize("x", _NEGATIVE, ids=["one", "const", "rand"])
def test_negative_only_data_affine_gives_torch_aos_qparams(x):
    """Bit for bit on one value and a constant; on random data the zero point is torch.ao's (255) and
    the scale within 1% (qstats' l2 search is not torch.ao's greedy one: 2 seeds of 40 differ, by 0.5%)."""
    reference = ao.HistogramObserver(bins=2048, dtype=torch.quint8, qscheme=torch.per_tensor_affine)
    reference(x)
    ours = qa.QstatsObserver(observer=qstats.histogram, dtype=torch.quint8, qscheme=torch.per_tensor_affine)
    ours(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (ref_scale, ref_zp), (scale, zp) = reference.calculate_qparams(), ours.calculate_qparams()
    assert int(zp) == int(ref_zp)
    if x.unique().numel() == 1:
        assert torch.equal(scale, ref_scale)
    else:
        torch.testing.assert_close(scale, ref_scale, rtol=1e-2, atol=0)


@pytest.mark.parametrize("dtype, mapping", [("int8", "symmetric"), ("int4", "symmetric"), ("uint8", "asymmetric")])
def test_percentile_far_below_an_outlier_keeps_the_buckets_resolution(dtype, mapping):
    """The percentile searches saw only the 24 octaves below the largest |x| and folded smaller values
    into one bucket at zero: with an outlier 2**30 above the data the 99.9th percentile came out
    15 times torch.quantile's (0.4995 for 0.0331). Every resolved octave keeps a bucket's width."""
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(100_000, generator=g) * 1e-2, torch.tensor([1e7])])
    spec = qstats.QuantSpec(dtype=dtype, mapping=mapping)
    observer = qstats.histogram(spec)
    found = search("percentile")(observer.update(observer.init(x), x), spec, percentile=99.9)
    if mapping == "symmetric":
        got = [max(-float(found.min_val), float(found.max_val))]
        expected = [float(torch.quantile(x.double().abs(), 0.999))]
    else:
        got = [float(found.min_val), float(found.max_val)]
        expected = [float(torch.quantile(x.double(), q)) for q in (0.001, 0.999)]
    assert got == pytest.approx(expected, rel=2**-7)
