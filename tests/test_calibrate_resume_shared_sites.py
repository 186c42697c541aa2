"""Resuming a calibration whose recipe shares one state between sites (torch.ao's ReuseInputObserver)
from saved or rank-merged states continues that one state.

`qstats.save` writes a shared state once per key and `qstats.load` gives equal copies back (as a
merge across ranks does); each observation of the group must still count once, as one observer
instance fed each tensor of the group in call order counts it (computed independently below).
"""

from __future__ import annotations

import copy

import pytest
import torch

import qstats


class Reshape(torch.nn.Module):
    def forward(self, x):
        return x.reshape(x.shape[0], -1, 2) * 3


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 6), Reshape()).eval()


def _recipe(observer, qparams_kwargs=()):
    spec = qstats.QuantSpec.from_torch_ao(torch.quint8, torch.per_tensor_affine)
    rule = qstats.Rule(("0", "1"), sites=("output",), observer=observer, spec=spec, qparams_kwargs=qparams_kwargs)
    return qstats.Recipe([rule], shared={"1:output": "0:output"}), spec


def _one_observer(model, batches, observer, spec):
    """One observer instance fed the Linear's output, then the reshaped one, batch after batch."""
    obs = getattr(qstats, observer)(spec)
    state = None
    with torch.no_grad():
        for x in batches:
            first = model[0](x)
            for y in (first, model[1](first)):
                state = obs.update(obs.init(y) if state is None else state, y)
    return state


def _saved_and_loaded(states, tmp_path):
    qstats.save(tmp_path / "states.safetensors", states)
    return qstats.load(tmp_path / "states.safetensors")


def _rank_merged(states, tmp_path):
    """Each key's state a state of its own, as `qstats.distributed` merges every key across ranks."""
    return {path: {site: copy.deepcopy(state) for site, state in entry.items()} for path, entry in states.items()}


@pytest.mark.parametrize("observer", ["minmax", "histogram", "moving_average_minmax"])
@pytest.mark.parametrize("reload", [_saved_and_loaded, _rank_merged])
def test_resumed_shared_state_counts_each_observation_once(observer, reload, tmp_path):
    model = _model()
    recipe, spec = _recipe(observer)
    first = [torch.randn(16, 8) for _ in range(2)]
    more = [torch.randn(16, 8) * 5 for _ in range(2)]
    loaded = reload(qstats.calibrate(model, first, recipe, progress=False), tmp_path)
    assert loaded["0"]["output"] is not loaded["1"]["output"]  # copies, as a file or a merge gives them

    resumed = qstats.calibrate(model, more, recipe, states=loaded, progress=False)
    want = _one_observer(model, first + more, observer, spec)
    for site in (("0", "output"), ("1", "output")):
        got = resumed[site[0]][site[1]]
        for field, value in zip(got._fields, got):
            assert torch.equal(value, getattr(want, field)), (site, field)
    assert resumed["0"]["output"] is resumed["1"]["output"]


def test_resumed_shared_histogram_gives_the_uninterrupted_scale(tmp_path):
    """With an MSE search over the histogram, counting the first batches twice moves the scale."""
    model = _model()
    recipe, spec = _recipe("histogram", {"method": "mse"})
    generator = torch.Generator().manual_seed(0)
    first = [torch.randn(256, 8, generator=generator) for _ in range(4)]
    more = [torch.randn(256, 8, generator=generator) * 8]  # counted against the first batches' counts
    loaded = _saved_and_loaded(qstats.calibrate(model, first, recipe, progress=False), tmp_path)
    resumed = qstats.calibrate(model, more, recipe, states=loaded, progress=False)
    want = qstats.compute_qparams(_one_observer(model, first + more, "histogram", spec), spec, method="mse")
    got = qstats.compute_qparams_tree(resumed, recipe, model)
    for path in ("0", "1"):
        assert torch.equal(got[path]["output"].scale, want.scale)
        assert torch.equal(got[path]["output"].zero_point, want.zero_point)


def test_separate_states_of_a_group_are_still_merged():
    """States of a calibration without the sharing (different per site) are merged into one, as
    `Plan.share_states` documents: the copies of one state are the only ones kept as they are."""
    model = _model()
    recipe, spec = _recipe("minmax")
    unshared = qstats.Recipe([qstats.Rule(("0", "1"), sites=("output",), observer="minmax", spec=spec)])
    first = [torch.randn(16, 8)]
    more = [torch.randn(16, 8)]
    separate = qstats.calibrate(model, first, unshared, progress=False)
    resumed = qstats.calibrate(model, more, recipe, states=separate, progress=False)
    want = _one_observer(model, first + more, "minmax", spec)
    got = resumed["0"]["output"]
    assert torch.equal(got.min_val, want.min_val) and torch.equal(got.max_val, want.max_val)
    assert torch.equal(got.count, want.count)
