"""qstats.qat is a package whose public classes keep ``qstats.qat`` as their module: what reads a class by
its module (pickles, torch.load(weights_only=True), typing.get_type_hints) finds it and what it refers to."""

import io
import typing
from typing import Any, Dict

import torch

import qstats
from qstats.qat import BatchNormState, QATState


def _state():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                                torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 2))
    spec = qstats.QuantSpec(dtype="int8")
    qat = qstats.qat.prepare(model, qstats.minmax(spec), qstats.minmax(spec))
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    return qat.apply(qat.params(), qat.init(x), x, phase=qstats.schedule.QATPhase())[1]


def test_states_saved_with_torch_save_load_with_weights_only():
    state = _state()
    assert state.batchnorm and all(type(value) is BatchNormState for value in state.batchnorm.values())
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert type(loaded) is QATState
    assert all(torch.equal(a, b) for a, b in zip(torch.utils._pytree.tree_leaves(loaded),
                                                 torch.utils._pytree.tree_leaves(state)))


def test_get_type_hints_of_the_states_resolves_their_annotations():
    # what the annotations say, written out here (dataclass-like tools, pydantic, typeguard call get_type_hints)
    assert typing.get_type_hints(QATState) == {"weights": Dict[str, Any], "activations": Dict[str, Any],
                                               "batchnorm": Dict[str, BatchNormState]}
    assert typing.get_type_hints(BatchNormState) == dict.fromkeys(BatchNormState._fields, torch.Tensor)
    assert QATState.__module__ == BatchNormState.__module__ == "qstats.qat"
