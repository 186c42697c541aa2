"""torch.ao's affine observers take ``dtype=torch.uint16`` with a signed custom range (``quant_min=-8``):
``QuantSpec.from_torch_ao`` and the ``QstatsObserver`` drop-in give their qparams bit for bit, where they
raised ValueError (torch.ao's symmetric zero point 2**15, which an affine spec never reads, lay outside
the range). Symmetric qschemes on such a range keep the refusal: torch.ao's zero point 2**15 lies outside
it, which torch's fake quantization refuses.

References: torch.ao's MinMaxObserver, MovingAverageMinMaxObserver and PerChannelMinMaxObserver."""

import pytest
import torch
import torch.ao.quantization as tq

import qstats
from qstats import torch_ao

RANGES = [(-8, 7), (-1, 0), (-300, 300), (-(2**15), 2**15 - 1)]


def _batches():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(4, 6, 5, generator=g) * (1 + i) - i for i in range(3)]


@pytest.mark.parametrize("quant_range", RANGES)
@pytest.mark.parametrize("reduce_range", [False, True])
@pytest.mark.parametrize("kind", ["minmax", "moving_average", "per_channel"])
def test_uint16_signed_affine_range_equals_torch_ao(quant_range, reduce_range, kind):
    quant_min, quant_max = quant_range
    qscheme = torch.per_channel_affine if kind == "per_channel" else torch.per_tensor_affine
    args = dict(dtype=torch.uint16, qscheme=qscheme, quant_min=quant_min, quant_max=quant_max,
                reduce_range=reduce_range)
    if kind == "per_channel":
        theirs, observer = tq.PerChannelMinMaxObserver(ch_axis=1, **args), qstats.minmax
        args["ch_axis"] = 1
    elif kind == "moving_average":
        theirs, observer = tq.MovingAverageMinMaxObserver(averaging_constant=0.25, **args), qstats.moving_average_minmax
    else:
        theirs, observer = tq.MinMaxObserver(**args), qstats.minmax
    options = dict(averaging_constant=0.25) if kind == "moving_average" else {}
    drop_in = torch_ao.QstatsObserver(observer=observer, **args, **options)
    spec = drop_in.spec
    obs = observer(spec, **options)
    state = obs.init(_batches()[0])
    for x in _batches():
        theirs(x)
        drop_in(x)
        state = obs.update(state, x)
    scale, zero_point = theirs.calculate_qparams()
    assert spec.qrange == (theirs.quant_min, theirs.quant_max)
    ours = drop_in.calculate_qparams()
    assert torch.equal(ours[0], scale) and torch.equal(ours[1], zero_point) and ours[1].dtype == zero_point.dtype
    qp = qstats.compute_qparams(state, spec)
    assert torch.equal(qp.scale.reshape(-1), scale) and torch.equal(qp.zero_point.reshape(-1), zero_point)
    x = _batches()[1]
    if kind == "per_channel":
        expected = torch.fake_quantize_per_channel_affine(x, scale, zero_point, 1, theirs.quant_min, theirs.quant_max)
    else:
        expected = torch.fake_quantize_per_tensor_affine(x, scale, zero_point, theirs.quant_min, theirs.quant_max)
    assert torch.equal(qstats.fake_quantize(x, qp, spec), expected)


@pytest.mark.parametrize("qscheme", [torch.per_tensor_symmetric, torch.per_channel_symmetric])
def test_uint16_signed_symmetric_range_is_still_refused(qscheme):
    # torch.ao builds it with zero point 2**15 outside the range: torch's fake quantization refuses that
    theirs = (tq.MinMaxObserver if qscheme == torch.per_tensor_symmetric else tq.PerChannelMinMaxObserver)(
        dtype=torch.uint16, qscheme=qscheme, quant_min=-8, quant_max=7)
    theirs(torch.randn(4, 3))
    scale, zero_point = theirs.calculate_qparams()
    assert int(zero_point.reshape(-1)[0]) == 2**15 > theirs.quant_max
    with pytest.raises(ValueError, match="symmetric_zero_point 32768 lies outside the range"):
        qstats.QuantSpec.from_torch_ao(torch.uint16, qscheme, quant_min=-8, quant_max=7)
