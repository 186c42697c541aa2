"""`qstats.mse` on float64 inputs holding a value past float32's range: the range reduction leaves
such a value out and counts it in ``nonfinite`` (as NaN/Inf), and the candidate losses leave it out
too, so the search is the one over the other values (computed here by hand, as torch.ao's symmetric
int4 grid quantizes them)."""

import pytest
import torch

import qstats

SPEC = qstats.QuantSpec(dtype="int4")  # torch.ao symmetric: scale = amax / 7.5, codes in [-8, 7]


def _data(outlier):
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x[5, 3] = outlier
    return x


def _losses_by_hand(values, factors, norm=2.4):
    """``sum |fake_quantize(x) - x| ** norm`` of every candidate ``p * (min, max)``, in float64."""
    amax = torch.maximum(-values.min(), values.max()).float()
    losses = []
    for p in factors:
        scale = (amax * p / 7.5).double()
        codes = torch.clamp(torch.round(values / scale), -8, 7)
        losses.append(float((codes * scale - values).abs().pow(norm).sum()))
    return torch.tensor(losses, dtype=torch.float64)


@pytest.mark.parametrize("outlier", [1e39, -1e300])
def test_a_float64_value_past_float32_is_left_out_of_the_losses(outlier):
    x = _data(outlier)
    kept = torch.cat([x.reshape(-1)[: 5 * 8 + 3], x.reshape(-1)[5 * 8 + 4 :]])
    obs = qstats.mse(SPEC)
    state = obs.update(obs.init(x), x)
    assert int(state.nonfinite) == 1 and int(state.count) == x.numel() - 1
    expected = _losses_by_hand(kept, state.factors.tolist())
    torch.testing.assert_close(state.loss, expected, rtol=1e-6, atol=0.0)  # codes from x * (1 / scale), as torch.ao
    chosen = float(state.factors[int(torch.argmin(expected))])
    amax = torch.maximum(-kept.min(), kept.max()).float()
    assert torch.equal(qstats.compute_qparams(state, SPEC).scale, amax * chosen / 7.5)


def test_moving_average_search_leaves_a_float64_value_past_float32_out():
    x = _data(1e39)
    keep = torch.ones_like(x)
    keep[5, 3] = 0
    obs = qstats.mse(SPEC, mode="moving_average")
    with_outlier = obs.update(obs.init(x), x)
    masked = obs.update(obs.init(x), x, keep)
    assert torch.equal(with_outlier.min_val, masked.min_val) and torch.equal(with_outlier.max_val, masked.max_val)
