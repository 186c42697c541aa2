"""`calibrate` and `observing` refuse arguments of the wrong kind by name, before running anything:
``batches`` that cannot be iterated (None, a number), and an ``all_experts`` or ``progress`` that is
not a bool (a string "no" from a config file or command line would switch every-expert calibration,
or the progress bar, on)."""

from __future__ import annotations

import pytest
import torch

import qstats


def _model_and_recipe():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).eval()
    return model, qstats.Recipe([qstats.Rule("Linear", sites=("weight", "input"))])


def _hook_count(model):
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


@pytest.mark.parametrize("batches", [None, 3, 2.5])
def test_batches_that_cannot_be_iterated_are_named(batches):
    model, recipe = _model_and_recipe()
    with pytest.raises(TypeError, match=rf"calibrate: batches must be an iterable of batches, got {type(batches).__name__}"):
        qstats.calibrate(model, batches, recipe, progress=False)
    assert _hook_count(model) == 0


def test_a_map_style_dataset_is_still_iterated():
    """A dataset with ``__getitem__`` and ``__len__`` only (no ``__iter__``) is iterated by index,
    as a for loop iterates it: the states equal those of the same batches in a list."""

    class Batches:
        def __init__(self, items):
            self.items = items

        def __len__(self):
            return len(self.items)

        def __getitem__(self, index):
            return self.items[index]

    model, recipe = _model_and_recipe()
    items = [torch.randn(4, 8) * (1 + i) for i in range(3)]
    got = qstats.calibrate(model, Batches(items), recipe, progress=False)
    want = qstats.calibrate(model, items, recipe, progress=False)
    for path in want:
        for site in want[path]:
            assert all(torch.equal(a, b) for a, b in zip(got[path][site], want[path][site]))


@pytest.mark.parametrize("value", ["no", "false", 1, None])
def test_all_experts_must_be_a_bool(value):
    model, recipe = _model_and_recipe()
    with pytest.raises(TypeError, match=r"calibrate: all_experts must be True or False"):
        qstats.calibrate(model, [torch.randn(4, 8)], recipe, progress=False, all_experts=value)
    with pytest.raises(TypeError, match=r"observing: all_experts must be True or False"):
        with qstats.observing(model, recipe, all_experts=value):
            pass
    assert _hook_count(model) == 0


@pytest.mark.parametrize("value", ["no", "false", 0, None])
def test_progress_must_be_a_bool(value):
    model, recipe = _model_and_recipe()
    with pytest.raises(TypeError, match=rf"calibrate: progress must be True or False, got {value!r}"):
        qstats.calibrate(model, [torch.randn(4, 8)], recipe, progress=value)
    assert _hook_count(model) == 0
