"""torch.ao checkpoints of observers that save no entries (``PlaceholderObserver``, ``NoopObserver``,
``RecordingObserver``) load strictly into the qstats drop-ins that replace them, one observer or a
prepared model, as they load into torch.ao's own."""

import copy
import warnings

import pytest
import torch
import torch.ao.quantization as tq
from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

import qstats
from qstats import torch_ao

PAIRS = {
    "dynamic placeholder": (tq.default_dynamic_quant_observer, torch_ao.default_dynamic_quant_observer),
    "float placeholder": (tq.default_placeholder_observer, torch_ao.default_placeholder_observer),
    "noop": (tq.NoopObserver, torch_ao.QstatsObserver.with_args(observer=qstats.noop, dtype=torch.float16)),
    "recording": (tq.default_debug_observer, torch_ao.QstatsObserver.with_args(observer=qstats.recording)),
}


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_torch_ao_checkpoint_loads_strictly_as_into_torch_ao(name):
    theirs_ctr, ours_ctr = PAIRS[name]
    theirs = theirs_ctr()
    theirs(torch.randn(4, 3))
    checkpoint = theirs.state_dict()
    theirs_ctr().load_state_dict(checkpoint)  # torch.ao's own observer takes it strictly
    ours = ours_ctr()
    ours(torch.randn(5))  # a state before the load: torch.ao's checkpoint holds no data
    ours.load_state_dict(checkpoint)
    assert ours.state is None
    x = torch.randn(2, 3)
    ours(x)
    if name == "recording":
        assert torch.equal(qstats.recorded_values(ours.state).sort().values, x.reshape(-1).sort().values)
    else:
        assert int(ours.state.count) == x.numel()


def test_a_drop_in_checkpoint_still_needs_its_own_entries():
    """The qstats entries present but one missing is still a strict-load error."""
    other = torch_ao.QstatsObserver(observer=qstats.recording)
    other(torch.randn(3))
    partial = {key: value for key, value in other.state_dict().items() if key != "count"}
    with pytest.raises(RuntimeError, match="count"):
        other.load_state_dict(partial)


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(16, 32), torch.nn.Linear(32, 8)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def test_prepared_fx_dynamic_model_checkpoint_loads_and_converts_as_torch_ao():
    """A model prepared with torch.ao's ``default_dynamic_qconfig`` saved its checkpoint (its
    placeholders save nothing); the same model prepared with the qstats presets loads it strictly
    and converts to torch.ao's model."""
    torch.manual_seed(0)
    net = _Net().eval()
    x = torch.randn(8, 16)
    ours_qconfig = tq.QConfig(activation=torch_ao.default_dynamic_quant_observer, weight=torch_ao.default_weight_observer)

    def prepared(qconfig):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return prepare_fx(copy.deepcopy(net), tq.QConfigMapping().set_global(qconfig), example_inputs=(x,))

    theirs = prepared(tq.default_dynamic_qconfig)
    theirs(x)
    ours = prepared(ours_qconfig)
    assert any(isinstance(module, torch_ao.QstatsObserver) and module.is_dynamic for module in ours.modules())
    ours.load_state_dict(theirs.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert torch.equal(convert_fx(ours)(x), convert_fx(theirs)(x))
