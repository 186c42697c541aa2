"""The histogram's resolved span (docs/observers.md): data inside 2**-24 .. 2**24 (the default 48
octaves) gets the same searched range at every scale; beyond it the values share the end buckets and
the "l2" search falls back to the observed extremes, until more octaves resolve them."""

import pytest
import torch

import qstats


def _sqnr(x, spec, method, octaves):
    obs = qstats.histogram(spec, octaves=octaves)
    qp = qstats.compute_qparams(obs.update(obs.init(x), x), spec, method=method)
    error = qstats.fake_quantize(x, qp, spec) - x
    return float(10 * torch.log10(x.pow(2).sum() / error.pow(2).sum()))


@pytest.mark.parametrize("std", [1e8, 1e-8])
def test_l2_outside_the_resolved_octaves_falls_back_to_minmax_and_more_octaves_resolve_it(std):
    spec = qstats.QuantSpec(dtype="int8", eps=1e-30)  # no scale floor: the data's own resolution
    base = torch.randn(65536, generator=torch.Generator().manual_seed(0))
    inside = _sqnr(base, spec, "l2", 48)
    assert inside > _sqnr(base, spec, "minmax", 48) + 0.5  # the search gains inside the span
    x = base * std
    assert _sqnr(x, spec, "l2", 48) == pytest.approx(_sqnr(x, spec, "minmax", 48), abs=0.01)
    assert _sqnr(x, spec, "l2", 64) == pytest.approx(inside, abs=0.01)


def test_power_of_two_scalings_inside_the_span_scale_the_searched_ranges_exactly():
    spec = qstats.QuantSpec(dtype="uint8", mapping="asymmetric", eps=1e-30)
    obs = qstats.histogram(spec)
    x = torch.randn(4096, generator=torch.Generator().manual_seed(1))
    for method in ("l2", "mse", "entropy", "percentile"):
        base = qstats.compute_qparams(obs.update(obs.init(x), x), spec, method=method)
        for k in (-16, 16):
            y = x * 2.0**k
            scaled = qstats.compute_qparams(obs.update(obs.init(y), y), spec, method=method)
            assert torch.equal(scaled.scale, base.scale * 2.0**k), (method, k)
            assert torch.equal(scaled.zero_point, base.zero_point), (method, k)
