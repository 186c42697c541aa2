"""qstats.tree: stack / unstack / assert_same_structure."""

import pytest
import torch

import qstats
from qstats import tree

SPEC = qstats.QuantSpec(granularity=qstats.PerAxis(0))


def _observers():
    return {
        "minmax": qstats.minmax(SPEC),
        "moving": qstats.moving_average_minmax(SPEC, 0.25),
    }


def _states(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 6, generator=g)
    return {name: obs.update(obs.init(x), x) for name, obs in _observers().items()}, x


def test_stack_and_unstack_round_trip_nested_trees():
    trees = []
    for seed in range(3):
        states, x = _states(seed)
        trees.append({"layer": [states["minmax"], (states["moving"], x)], "scale": torch.tensor(float(seed))})
    stacked = tree.stack(trees)
    assert type(stacked["layer"][0]) is qstats.MinMaxState
    assert type(stacked["layer"][1][0]) is qstats.MovingAverageMinMaxState
    assert stacked["layer"][0].min_val.shape == (3, 4)
    assert stacked["scale"].shape == (3,)
    back = tree.unstack(stacked)
    assert len(back) == 3
    for original, restored in zip(trees, back):
        tree.assert_same_structure(original, restored)
        for (path, a), (_, b) in zip(tree.leaves_with_paths(original), tree.leaves_with_paths(restored)):
            assert torch.equal(a, b), path


def test_stack_aligns_dicts_by_key_not_insertion_order():
    a, _ = _states(0)
    b, _ = _states(1)
    stacked = tree.stack([{"x": a["minmax"], "y": a["moving"]}, {"y": b["moving"], "x": b["minmax"]}])
    assert list(stacked) == ["x", "y"]
    assert torch.equal(stacked["x"].max_val[1], b["minmax"].max_val)
    assert torch.equal(stacked["y"].max_val[1], b["moving"].max_val)


def test_vmap_over_stacked_trees_equals_the_loop():
    observers = _observers()
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(4, 6, generator=g) for _ in range(5)]
    trees = [{name: obs.init(x) for name, obs in observers.items()} for x in xs]

    def update_all(states, x, weight):
        return {name: obs.update(states[name], x, weight) for name, obs in observers.items()}

    weights = [(torch.rand(4, generator=g) > 0.3).float() for _ in xs]
    batched = torch.func.vmap(update_all)(tree.stack(trees), torch.stack(xs), torch.stack(weights))
    looped = [update_all(t, x, w) for t, x, w in zip(trees, xs, weights)]
    for got, expected in zip(tree.unstack(batched), looped):
        tree.assert_same_structure(got, expected)
        for (path, a), (_, b) in zip(tree.leaves_with_paths(got), tree.leaves_with_paths(expected)):
            assert torch.equal(a, b), path
    # and the per-row min computed independently of qstats
    for got, x, w in zip(tree.unstack(batched), xs, weights):
        kept = x[w != 0]
        expected_min = torch.where(w != 0, x.amin(dim=1), torch.inf)
        assert torch.equal(got["minmax"].min_val, expected_min)
        assert int(got["minmax"].count.sum()) == kept.numel()


def test_assert_same_structure_names_the_path_and_both_shapes():
    a, _ = _states(0)
    bad = a["minmax"]._replace(count=a["minmax"].count[:3])
    with pytest.raises(ValueError, match=r"tree\['layers'\]\[1\]\.count.*shape \(4,\).*shape \(3,\)"):
        tree.assert_same_structure({"layers": [a["moving"], a["minmax"]]}, {"layers": [a["moving"], bad]})


def test_assert_same_structure_is_strict_about_types_keys_lengths_and_dtypes():
    a, _ = _states(0)
    state = a["minmax"]
    same_fields_other_type = qstats.MemorylessMinMaxState(*state)
    with pytest.raises(ValueError, match="MinMaxState.*MemorylessMinMaxState"):
        tree.assert_same_structure(state, same_fields_other_type)
    with pytest.raises(ValueError, match="keys"):
        tree.assert_same_structure({"a": state}, {"b": state})
    with pytest.raises(ValueError, match="length"):
        tree.assert_same_structure([state], [state, state])
    with pytest.raises(ValueError, match="list.*tuple"):
        tree.assert_same_structure([state], (state,))
    with pytest.raises(ValueError, match=r"\.min_val.*float32.*float64"):
        tree.assert_same_structure(state, state._replace(min_val=state.min_val.double()))
    tree.assert_same_structure(state, state._replace(min_val=state.min_val.double()), check_leaves=False)
    tree.assert_same_structure({"a": state, "b": [state]}, {"b": [state], "a": state})


def test_stack_rejects_mismatches_and_empty_input():
    a, _ = _states(0)
    state = a["minmax"]
    with pytest.raises(ValueError, match="at least one"):
        tree.stack([])
    with pytest.raises(ValueError, match=r"trees\[1\]\.max_val.*\(4,\).*\(2,\)"):
        tree.stack([state, state._replace(max_val=state.max_val[:2])])
    with pytest.raises(ValueError, match="not a tensor"):
        tree.stack([{"a": 1}, {"a": 1}])


def test_unstack_rejects_ragged_and_scalar_leaves():
    with pytest.raises(ValueError, match=r"leading size 2.*has 3"):
        tree.unstack({"a": torch.zeros(3), "b": torch.zeros(2)})
    with pytest.raises(ValueError, match="0-dimensional"):
        tree.unstack({"a": torch.zeros(())})
    with pytest.raises(ValueError, match="no leaves"):
        tree.unstack({})


def test_stack_matches_ordered_dicts_by_key():
    """optree flattens an OrderedDict in its own key order: stacking two OrderedDicts with the keys in
    different orders stacked a's "a" with b's "b". The reference is a plain loop over the keys."""
    from collections import OrderedDict

    first = OrderedDict(a=torch.tensor([1.0]), b=torch.tensor([2.0]), c={"x": torch.tensor([3.0])})
    second = OrderedDict(c={"x": torch.tensor([30.0])}, b=torch.tensor([20.0]), a=torch.tensor([10.0]))
    stacked = tree.stack([first, second])
    assert list(stacked) == ["a", "b", "c"]
    for key in ("a", "b"):
        assert torch.equal(stacked[key], torch.stack([first[key], second[key]]))
    assert torch.equal(stacked["c"]["x"], torch.stack([first["c"]["x"], second["c"]["x"]]))


def test_a_defaultdicts_factory_is_part_of_its_structure_as_in_optree():
    """optree's structures of two defaultdicts differ by their factories; assert_same_structure and
    stack took them as the same (stack kept the first tree's factory in silence). A deque's maxlen
    (optree's node data too) is named in the message."""
    import collections

    import optree

    a = collections.defaultdict(list, w=torch.zeros(2))
    b = collections.defaultdict(dict, w=torch.ones(2))
    assert optree.tree_structure(a) != optree.tree_structure(b)
    with pytest.raises(ValueError, match=r"tree mismatch at tree: defaultdict\(list\).*vs defaultdict\(dict\)"):
        tree.assert_same_structure(a, b)
    with pytest.raises(ValueError, match=r"trees\[1\]: defaultdict\(list\)"):
        tree.stack([a, b])
    same = collections.defaultdict(list, w=torch.ones(2))
    assert optree.tree_structure(a) == optree.tree_structure(same)
    assert torch.equal(tree.stack([a, same])["w"], torch.stack([a["w"], same["w"]]))
    with pytest.raises(ValueError, match=r"deque of length 1 \(maxlen None\) vs deque of length 1 \(maxlen 3\)"):
        tree.assert_same_structure(collections.deque([torch.zeros(1)]), collections.deque([torch.zeros(1)], maxlen=3))


@pytest.mark.parametrize("values", [[float("nan")], [1.0, float("nan"), 3.0], [[float("nan"), 2.0]]], ids=str)
def test_numpy_leaves_holding_nan_compare_as_numpy_array_equal_with_equal_nan(values):
    """NaN equals NaN in numpy leaves as in float ones (numpy.array_equal(..., equal_nan=True)): equal
    arrays holding a NaN were a mismatch whose message showed the same array on both sides."""
    import numpy as np

    a, b = np.array(values), np.array(values)
    assert np.array_equal(a, b, equal_nan=True)
    tree.assert_same_structure({"a": a}, {"a": b})
    other = np.nan_to_num(b, nan=5.0)
    assert not np.array_equal(a, other, equal_nan=True)
    with pytest.raises(ValueError, match=r"tree mismatch at tree\['a'\]"):
        tree.assert_same_structure({"a": a}, {"a": other})
