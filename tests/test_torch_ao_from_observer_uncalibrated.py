"""`qstats.torch_ao.from_observer` of observers that saw no data: a drop-in gives what the torch.ao
observer it replaces gives, a state that calibrates on to torch.ao's qparams (per tensor), or a
ValueError (per channel, whose channel count comes from data)."""

import warnings

import pytest
import torch
import torch.ao.quantization as tq

import qstats
from qstats import torch_ao

warnings.filterwarnings("ignore")

PAIRS = {  # torch.ao observer, its drop-in
    "minmax": (lambda: tq.MinMaxObserver(dtype=torch.qint8), lambda: torch_ao.QstatsObserver(dtype=torch.qint8)),
    "moving_average": (
        lambda: tq.MovingAverageMinMaxObserver(averaging_constant=0.25),
        lambda: torch_ao.QstatsObserver(observer=qstats.moving_average_minmax, averaging_constant=0.25),
    ),
    "symmetric_preset": (tq.default_weight_observer, torch_ao.default_weight_observer),
}


@pytest.mark.parametrize("pair", list(PAIRS))
def test_uncalibrated_drop_in_calibrates_on_to_torch_aos_qparams(pair):
    make_reference, make_drop_in = PAIRS[pair]
    reference = make_reference()
    observer, spec, state = torch_ao.from_observer(make_drop_in())
    for i in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i)) * (i + 1) + 0.5 * i
        reference(x)
        state = observer.update(state, x)
    scale, zero_point = reference.calculate_qparams()
    qp = qstats.compute_qparams(state, spec)
    assert torch.equal(qp.scale.reshape(1), scale)
    assert torch.equal(qp.zero_point.reshape(1).to(zero_point.dtype), zero_point)


def test_uncalibrated_histogram_drop_in_gives_the_state_of_no_data():
    observer, spec, state = torch_ao.from_observer(torch_ao.QstatsObserver(observer=qstats.histogram))
    x = torch.randn(64, generator=torch.Generator().manual_seed(0))
    assert state is not None
    direct = observer.update(observer.init(x), x)
    continued = observer.update(state, x)
    assert all(torch.equal(a, b) for a, b in zip(continued, direct))


def test_uncalibrated_per_channel_drop_in_is_refused_as_torch_aos():
    with pytest.raises(ValueError, match="seen no data"):
        torch_ao.from_observer(tq.PerChannelMinMaxObserver())
    with pytest.raises(ValueError, match="seen no data"):
        torch_ao.from_observer(torch_ao.default_per_channel_weight_observer())
