"""qstats.qparams_from_minmax given ends or a calibrated mask whose shapes do not make one shape of
quantization parameters: ends of 3 and 4 entries raise a ValueError naming both shapes (torch's
broadcasting error named no argument), and a mask of shape (3, 1) beside (3,) ends, which broadcast
the qparams to (3, 3) silently, is refused too. Ends that broadcast (one shared minimum) still give
torch.ao's per-channel qparams."""

from __future__ import annotations

import re

import pytest
import torch

import qstats

SPEC = qstats.QuantSpec(dtype="uint8", mapping="asymmetric", granularity=qstats.PerAxis(0))


def test_ends_of_other_shapes_are_named():
    expected = "qparams_from_minmax: min_val of shape (3,), max_val (4,) do not give one shape"
    with pytest.raises(ValueError, match=re.escape(expected)):
        qstats.qparams_from_minmax(-torch.ones(3), torch.ones(4), SPEC)


def test_a_calibrated_mask_that_would_grow_the_qparams_is_refused():
    calibrated = torch.ones(3, 1, dtype=torch.bool)
    with pytest.raises(ValueError, match=re.escape("min_val of shape (3,), max_val (3,) and calibrated (3, 1)")):
        qstats.qparams_from_minmax(-torch.ones(3), torch.ones(3), SPEC, calibrated=calibrated)


def test_ends_that_broadcast_give_torch_ao_s_per_channel_qparams():
    max_val = torch.tensor([1.0, 2.5, 0.25])
    qparams = qstats.qparams_from_minmax(torch.tensor(-0.5), max_val, SPEC)
    observer = torch.ao.quantization.PerChannelMinMaxObserver(ch_axis=0, dtype=torch.quint8,
                                                              qscheme=torch.per_channel_affine)
    observer(torch.stack([torch.full((3,), -0.5), max_val], dim=1))
    scale, zero_point = observer.calculate_qparams()
    assert torch.equal(qparams.scale, scale) and torch.equal(qparams.zero_point, zero_point.to(torch.int32))
