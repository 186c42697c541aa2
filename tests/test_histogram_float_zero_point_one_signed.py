"""Histogram searches for specs whose ranges need not hold zero (a float zero point: torch.ao's
``per_channel_affine_float_qparams``, torchao's tinygemm) on rows of one sign, against torch.ao's
``PerChannelMinMaxObserver`` with that qscheme.

The searches clamped every range to hold zero, so a row in [1.7, 2.3] was quantized over [0, 2.3]:
through the drop-in, 15 and 22 times the squared error of torch.ao's min/max qparams. Its own end
is kept now; the observed range is a candidate, so no search quantizes worse than it."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.ao.quantization import observer as ao

import qstats
from qstats import torch_ao as qa

pytestmark = pytest.mark.usefixtures("single_thread_quiet")


def _rows():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 256, generator=g) * 0.1
    w[0] += 2.0  # positive
    w[1] -= 3.0  # negative
    w[2] = w[2].abs() + 0.5  # positive, skewed
    return w  # rows 3-5 straddle zero


def _squared_error(scale, zero_point, w):
    dequantized = torch.quantize_per_channel(w, scale, zero_point, 0, torch.quint8).dequantize()
    return ((dequantized - w) ** 2).sum(1)


def test_drop_in_histogram_is_no_worse_than_torch_aos_min_max_per_row():
    w = _rows()
    reference = ao.PerChannelMinMaxObserver(ch_axis=0, dtype=torch.quint8, qscheme=torch.per_channel_affine_float_qparams)
    ours = qa.QstatsObserver(observer=qstats.histogram, ch_axis=0, dtype=torch.quint8,
                             qscheme=torch.per_channel_affine_float_qparams)
    reference(w)
    ours(w)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = _squared_error(*reference.calculate_qparams(), w)
        mine = _squared_error(*ours.calculate_qparams(), w)
    assert bool((mine <= theirs * (1 + 1e-6)).all()), (mine / theirs).tolist()


@pytest.mark.parametrize("method", ["l2", "mse", "percentile"])
def test_every_search_keeps_one_signed_rows_own_end(method):
    w = _rows()
    spec = qstats.QuantSpec.from_torch_ao(torch.quint8, torch.per_channel_affine_float_qparams, ch_axis=0)
    reference = ao.PerChannelMinMaxObserver(ch_axis=0, dtype=torch.quint8, qscheme=torch.per_channel_affine_float_qparams)
    reference(w)
    observer = qstats.histogram(spec)
    qparams = qstats.compute_qparams(observer.update(observer.init(w), w), spec, method=method)
    mine = _squared_error(qparams.scale, qparams.zero_point, w)
    theirs = _squared_error(*reference.calculate_qparams(), w)
    # percentile clips the tails it is asked to; the searches rank the observed range too
    bound = 1.5 if method == "percentile" else 1 + 1e-6
    assert bool((mine[:3] <= theirs[:3] * bound).all()), (mine / theirs).tolist()


def test_moments_mean_std_range_of_a_float_zero_point_is_mean_plus_minus_k_std():
    """``"mean_std"`` widened ``[mean - k std, mean + k std]`` to hold zero too: for rows in [1.7, 2.3]
    the range [0, 2.4] instead of [1.6, 2.4] (k=3). Against that range computed with torch and mapped
    by torch.ao's float-qparams ``calculate_qparams``."""
    w = _rows()
    spec = qstats.QuantSpec.from_torch_ao(torch.quint8, torch.per_channel_affine_float_qparams, ch_axis=0)
    observer = qstats.moments(spec)
    qparams = qstats.compute_qparams(observer.update(observer.init(w), w), spec, method="mean_std", k=3.0)
    mean, std = w.double().mean(1), w.double().std(1, unbiased=False)
    reference = ao.PerChannelMinMaxObserver(ch_axis=0, dtype=torch.quint8, qscheme=torch.per_channel_affine_float_qparams)
    reference.min_val, reference.max_val = (mean - 3 * std).float(), (mean + 3 * std).float()
    scale, zero_point = reference.calculate_qparams()
    torch.testing.assert_close(qparams.scale, scale, rtol=1e-6, atol=0)
    torch.testing.assert_close(qparams.zero_point, zero_point, rtol=1e-5, atol=1e-3)
