"""A ``ch_axis`` given beside a per-channel ``spec=`` with the other sign than the spec's axis (PT2E's
``QuantizationSpec(ch_axis=-1)`` beside ``PerAxis(0)``): the input's rank decides whether they name
the same axis. Where they do, the observer equals torchao's ``PerChannelMinMaxObserver``; where they
do not, the first forward raises instead of quantizing along the spec's axis."""

from __future__ import annotations

import pytest
import torch

import qstats

pytest.importorskip("torchao")
from torchao.quantization.pt2e.observer import PerChannelMinMaxObserver  # noqa: E402

from qstats.torchao_pt2e import QstatsPT2EPerChannelObserver  # noqa: E402

ARGS = dict(dtype=torch.int8, quant_min=-128, quant_max=127, qscheme=torch.per_channel_symmetric)


def _spec(axis):
    return qstats.QuantSpec.from_torch_ao(torch.qint8, torch.per_channel_symmetric, ch_axis=axis)


def _built(axis, ch_axis):
    """The observer as ``prepare_pt2e`` builds it from ``QuantizationSpec(ch_axis=ch_axis)``."""
    return QstatsPT2EPerChannelObserver.with_args(spec=_spec(axis))(**ARGS, ch_axis=ch_axis)


def test_a_ch_axis_naming_the_same_axis_observes_as_torchao():
    weight = torch.randn(6, 10, generator=torch.Generator().manual_seed(0))
    ours, theirs = _built(1, -1), PerChannelMinMaxObserver(**ARGS, ch_axis=-1)
    ours(weight), theirs(weight)
    for got, expected in zip(ours.calculate_qparams(), theirs.calculate_qparams()):
        assert torch.equal(got.to(expected.dtype), expected)


@pytest.mark.parametrize("axis, ch_axis", [(0, -1), (1, -2), (-1, 0)])
def test_a_ch_axis_naming_another_axis_of_the_input_raises_at_the_first_forward(axis, ch_axis):
    weight = torch.randn(6, 10)
    observer = _built(axis, ch_axis)  # the rank is not known yet
    with pytest.raises(ValueError, match=f"ch_axis {ch_axis} given beside spec=.* along axis {axis % 2}"):
        observer(weight)
    assert observer.state is None  # nothing observed along the wrong axis
