"""compute_qparams given calibrate's whole states tree points to compute_qparams_tree (before: "no
range rule for dict; register one with qstats.register_range_rule", which sends a user the wrong way)."""

import pytest
import torch
from torch.ao.quantization import PerChannelMinMaxObserver

import qstats
from qstats._qparams import NoStatistics


def test_a_states_tree_is_refused_naming_compute_qparams_tree():
    model = torch.nn.Sequential(torch.nn.Linear(8, 4))
    spec = qstats.QuantSpec.from_torch_ao(torch.qint8, torch.per_channel_symmetric, ch_axis=0)
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("weight",), spec=spec)])
    states = qstats.calibrate(model, [torch.randn(3, 8)], recipe)
    with pytest.raises(NoStatistics, match=r"states tree.*qstats\.compute_qparams_tree\(states, recipe, model\)"):
        qstats.compute_qparams(states, spec)
    # the call it names gives torch.ao's scales for that weight
    reference = PerChannelMinMaxObserver(ch_axis=0, dtype=torch.qint8, qscheme=torch.per_channel_symmetric)
    reference(model[0].weight.detach())
    scale, _ = reference.calculate_qparams()
    assert torch.equal(qstats.compute_qparams_tree(states, recipe, model)["0"]["weight"].scale, scale)
