"""compute_qparams refuses a state whose ranges cannot be the spec's (a state of another spec's
observer) instead of returning qparams of the state's shape under the spec's name."""
import re

import pytest
import torch
from torch.ao.quantization.observer import MinMaxObserver, PerChannelMinMaxObserver

import qstats

PER_TENSOR = qstats.QuantSpec(dtype=torch.int8, granularity=qstats.PerTensor())
PER_CHANNEL = qstats.QuantSpec(dtype=torch.int8, granularity=qstats.PerAxis(0))


def _state(spec, w):
    obs = qstats.minmax(spec)
    return obs.update(obs.init(w), w)


@pytest.mark.parametrize("observed, asked, shape", [(PER_CHANNEL, PER_TENSOR, "(8,)"), (PER_TENSOR, PER_CHANNEL, "()")])
def test_state_of_another_granularity_is_refused(observed, asked, shape):
    w = torch.randn(8, 16)
    with pytest.raises(ValueError, match=rf"ranges of shape {re.escape(shape)}.*{type(asked.granularity).__name__}"):
        qstats.compute_qparams(_state(observed, w), asked)


def test_matching_specs_still_give_torch_ao_scales():
    w = torch.randn(8, 16)
    ao = MinMaxObserver(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric)
    ao(w)
    assert torch.equal(qstats.compute_qparams(_state(PER_TENSOR, w), PER_TENSOR).scale, ao.calculate_qparams()[0][0])
    ao = PerChannelMinMaxObserver(ch_axis=0, dtype=torch.qint8, qscheme=torch.per_channel_symmetric)
    ao(w)
    assert torch.equal(qstats.compute_qparams(_state(PER_CHANNEL, w), PER_CHANNEL).scale, ao.calculate_qparams()[0])


def test_stacked_states_are_checked_per_expert():
    w = torch.randn(4, 8, 16)
    stacked = qstats.stacked_observer(qstats.minmax(PER_CHANNEL), 4)
    state = stacked.update(stacked.init(w), w)
    assert qstats.stacked_qparams(state, PER_CHANNEL).scale.shape == (4, 8)
    with pytest.raises(ValueError, match="does not fit"):
        qstats.stacked_qparams(state, PER_TENSOR)
