"""qstats.tree.stack given one tree instead of a sequence of trees: a TypeError saying so, not the tree's
rows, keys or fields read as trees (a tensor came back as a copy of itself; a dict was refused for its keys
being strings; a state's fields were compared as trees and named as a mismatch at ``trees[2]``)."""

import pytest
import torch

import qstats
from qstats import tree


def _state():
    obs = qstats.memoryless_minmax(qstats.QuantSpec(granularity=qstats.PerAxis(0)))
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
    return obs.update(obs.init(x), x)


ONE_TREE = {
    "tensor": lambda: torch.randn(3, 2),
    "dict": lambda: {"a": torch.ones(2), "b": torch.ones(2)},
    "state": _state,
}


@pytest.mark.parametrize("kind", sorted(ONE_TREE))
def test_one_tree_is_refused_naming_what_stack_takes(kind):
    one = ONE_TREE[kind]()
    with pytest.raises(TypeError, match=rf"takes a sequence of trees .* got one {type(one).__name__}"):
        tree.stack(one)
    # the same tree in a list stacks as torch.stack of each leaf
    stacked = tree.stack([one, one])
    for (_, leaf), (_, got) in zip(tree.leaves_with_paths(one), tree.leaves_with_paths(stacked)):
        assert torch.equal(got, torch.stack([leaf, leaf]))
