"""A drop-in whose data (a tensor, or one channel) was all NaN/Inf: torch.ao's own observers give
a NaN or Inf scale there; the drop-in returns torch.ao's defaults for no data (scale 1, zero point
0), and its warning must name the non-finite values, not claim that the observer never ran."""

import warnings

import pytest
import torch
import torch.ao.quantization as tq

import qstats
from qstats import torch_ao

warnings.filterwarnings("ignore", message="torch.ao.quantization is deprecated")

_CASES = {
    "minmax": (lambda: torch_ao.QstatsObserver(), tq.MinMaxObserver, (4,)),
    "moving_average": (lambda: torch_ao.QstatsObserver(observer=qstats.moving_average_minmax),
                       tq.MovingAverageMinMaxObserver, (4,)),
    "per_channel": (torch_ao.default_per_channel_weight_observer, tq.default_per_channel_weight_observer, (3, 4)),
    "fp16_overflow": (lambda: torch_ao.QstatsObserver(), tq.MinMaxObserver, None),
}


def _data(shape):
    if shape is None:  # 70000 is Inf in float16: a half-precision graph's overflow
        return torch.tensor([70000.0, -70000.0]).half()
    x = torch.randn(shape)
    x[1] = float("nan")  # the whole tensor per tensor; channel 1 per channel
    return x if len(shape) > 1 else torch.full(shape, float("nan"))


@pytest.mark.parametrize("case", sorted(_CASES))
def test_only_non_finite_values_are_named_where_torch_ao_gives_a_non_finite_scale(case):
    make_ours, make_reference, shape = _CASES[case]
    x = _data(shape)
    ours, reference = make_ours(), make_reference()
    ours(x)
    reference(x)
    reference_scale, _ = reference.calculate_qparams()
    bad = ~torch.isfinite(reference_scale)
    assert bad.any()  # torch.ao's scale is NaN or Inf where the data had no finite value
    with pytest.warns(UserWarning, match=r"only NaN/Inf values") as caught:
        scale, zero_point = ours.calculate_qparams()
    assert not any("before calculate_qparams" in str(w.message) for w in caught)
    assert torch.isfinite(scale).all() and (scale > 0).all()
    assert torch.equal(scale[bad], torch.ones_like(scale[bad])) and torch.equal(zero_point[bad], 0 * zero_point[bad])
    assert torch.equal(scale[~bad], reference_scale[~bad])  # the finite channels: torch.ao's


def test_an_observer_that_saw_nothing_still_says_so():
    ours = torch_ao.QstatsObserver()
    with pytest.warns(UserWarning, match="before calculate_qparams"):
        ours.calculate_qparams()
