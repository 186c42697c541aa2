"""A per-channel observer's ``state_dict`` loaded into a per-tensor drop-in: torch.ao's ``MinMaxObserver``
refuses it (a size mismatch), and so does the drop-in, naming the per-channel state; loaded into a
per-channel drop-in it gives torch.ao's per-channel qparams."""

import warnings

import pytest
import torch
import torch.ao.quantization as tq
from torch.ao.quantization import load_observer_state_dict

import qstats
from qstats import torch_ao

warnings.filterwarnings("ignore")

X = torch.randn(4, 5, generator=torch.Generator().manual_seed(0))
PER_CHANNEL = {
    "torch.ao": lambda: tq.PerChannelMinMaxObserver(),
    "drop-in": lambda: torch_ao.QstatsObserver(qstats.minmax, qscheme=torch.per_channel_affine),
}
PER_TENSOR = {
    "minmax": lambda: torch_ao.QstatsObserver(qstats.minmax),
    "moving average": lambda: torch_ao.QstatsObserver(qstats.moving_average_minmax),
}


def _calibrated(make):
    observer = make()
    observer(X)
    return observer


@pytest.mark.parametrize("source", PER_CHANNEL)
@pytest.mark.parametrize("target", PER_TENSOR)
def test_per_channel_state_into_a_per_tensor_drop_in_is_refused(source, target):
    """It loaded, and the per-tensor observer returned one scale per channel."""
    state = _calibrated(PER_CHANNEL[source]).state_dict()
    with pytest.raises(RuntimeError, match="size mismatch"):
        tq.MinMaxObserver().load_state_dict(state, strict=False)
    with pytest.raises(RuntimeError, match=r"min_val of shape \(4,\) is a per-channel state"):
        PER_TENSOR[target]().load_state_dict(state, strict=False)


@pytest.mark.parametrize("source", PER_CHANNEL)
def test_load_observer_state_dict_leaves_the_per_tensor_drop_in_as_torch_ao_leaves_its_own(source):
    """torch.ao's load_observer_state_dict drops the errors: the observer keeps what it saw."""
    state = {"obs." + key: value for key, value in _calibrated(PER_CHANNEL[source]).state_dict().items()}
    ours, theirs = torch.nn.Module(), torch.nn.Module()
    ours.obs, theirs.obs = torch_ao.QstatsObserver(qstats.minmax), tq.MinMaxObserver()
    for model in (ours, theirs):
        model.obs(X[:2])
        load_observer_state_dict(model, state)
    assert all(torch.equal(a, b) for a, b in zip(ours.obs.calculate_qparams(), theirs.obs.calculate_qparams()))


@pytest.mark.parametrize("source", PER_CHANNEL)
def test_per_channel_state_into_a_per_channel_drop_in_gives_torch_aos_qparams(source):
    reference = _calibrated(tq.PerChannelMinMaxObserver)
    loaded = torch_ao.QstatsObserver(qstats.minmax, qscheme=torch.per_channel_affine)
    loaded.load_state_dict(_calibrated(PER_CHANNEL[source]).state_dict())
    assert all(torch.equal(a, b) for a, b in zip(loaded.calculate_qparams(), reference.calculate_qparams()))
