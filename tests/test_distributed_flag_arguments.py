"""``qstats.distributed.all_reduce`` takes ``exact``, ``check`` and ``partial`` as True or False only,
as the other options of qstats do (`qstats._checks.check_flag`): a string from a config
("False", "no") is truthy and would switch the option on."""

from __future__ import annotations

import pytest
import torch

import qstats
from qstats import distributed
from qstats._checks import check_flag


def _tree():
    obs = qstats.minmax(qstats.QuantSpec())
    x = torch.tensor([-1.0, 2.0, 0.5])
    return {"layer": {"input": obs.update(obs.init(x), x)}}, obs


@pytest.mark.parametrize("name", ["exact", "check", "partial"])
@pytest.mark.parametrize("value", ["False", "no", 0, 1, None])
def test_a_flag_that_is_not_a_bool_is_refused_as_check_flag_refuses_it(name, value):
    tree, obs = _tree()
    with pytest.raises(TypeError) as reference:
        check_flag(value, name, "all_reduce")
    with pytest.raises(TypeError, match=f"all_reduce: {name} must be True or False") as error:
        distributed.all_reduce(tree, obs, **{name: value})
    assert str(error.value) == str(reference.value)


@pytest.mark.parametrize("name", ["exact", "check", "partial"])
def test_bool_flags_still_return_the_tree_without_a_process_group(name):
    tree, obs = _tree()
    assert distributed.all_reduce(tree, obs, **{name: True, **({"check": True} if name == "partial" else {})}) is tree
    assert distributed.all_reduce(tree, obs, **{name: False}) is tree
