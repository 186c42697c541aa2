"""A per-axis state fed a tensor of another size along its axis (activations per row, PerAxis(0),
batches of 16 then 8 rows) is refused with a hint to the per-feature axis, which the hint's
PerAxis(-1) then calibrates as torch.ao's per-channel observer on the feature axis."""

import pytest
import torch
from torch.ao.quantization import PerChannelMinMaxObserver

import qstats


def test_per_row_activations_name_the_axis_and_the_per_feature_spelling():
    batches = [torch.randn(16, 4, generator=torch.Generator().manual_seed(0)),
               torch.randn(8, 4, generator=torch.Generator().manual_seed(1))]
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    rows = qstats.QuantSpec.from_torch_ao(torch.qint8, torch.per_channel_symmetric, ch_axis=0)
    with pytest.raises(ValueError, match=r"shape \(16,\).*PerAxis\(axis=0\) holds one parameter per index of "
                                         r"dimension 0.*PerAxis\(-1\)"):
        qstats.calibrate(model, batches, qstats.Recipe([qstats.Rule("Linear", sites=("input",), spec=rows)]),
                         progress=False)
    features = qstats.QuantSpec.from_torch_ao(torch.qint8, torch.per_channel_symmetric, ch_axis=-1)
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("input",), spec=features)])
    states = qstats.calibrate(model, batches, recipe, progress=False)
    reference = PerChannelMinMaxObserver(ch_axis=1, dtype=torch.qint8, qscheme=torch.per_channel_symmetric)
    for x in batches:
        reference(x)
    scale, _ = reference.calculate_qparams()
    assert torch.equal(qstats.compute_qparams_tree(states, recipe, model)["0"]["input"].scale, scale)


def test_other_granularities_keep_the_message_without_the_hint():
    spec = qstats.QuantSpec(dtype="int4", granularity=qstats.PerGroup(4))
    obs = qstats.minmax(spec)
    state = obs.update(obs.init(torch.randn(2, 8)), torch.randn(2, 8))
    with pytest.raises(ValueError, match="but the state has shape") as raised:
        obs.update(state, torch.randn(3, 8))
    assert "holds one parameter per index" not in str(raised.value)
