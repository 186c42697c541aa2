"""A Recipe equals its copies: ``copy.deepcopy``, ``pickle`` round trips and the same config read
again compare (and hash) equal; recipes with other rules, ignore lists or shared sites do not."""

import copy
import pickle

import pytest

import qstats

pytest.importorskip("compressed_tensors")

CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
        "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}}},
    "ignore": ["lm_head", "re:.*mlp.gate$"],
    "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor"},
}


def _recipes():
    return [
        qstats.Recipe.from_compressed_tensors(CONFIG),
        qstats.Recipe.from_scheme("NVFP4", ignore=["re:.*lm_head"]),
        qstats.Recipe([qstats.Rule("Linear", sites=("weight", "input"), observer="mse")],
                      ignore=["0"], shared={"1:input": "2:input"}),
    ]


@pytest.mark.parametrize("index", range(3))
def test_copies_compare_and_hash_equal(index):
    recipe = _recipes()[index]
    for other in (pickle.loads(pickle.dumps(recipe)), copy.deepcopy(recipe), _recipes()[index]):
        assert other is not recipe
        assert other == recipe and not other != recipe
        assert hash(other) == hash(recipe)


def test_recipes_that_differ_compare_unequal():
    base = _recipes()
    assert base[0] != base[1] and base[1] != base[2]
    assert qstats.Recipe.from_compressed_tensors({**CONFIG, "ignore": ["lm_head"]}) != base[0]
    unshared = qstats.Recipe(base[2].rules, ignore=["0"])
    assert unshared != base[2]
    assert base[0] != "a recipe" and base[0] != base[0].rules


def test_a_recipe_whose_observer_kwargs_hold_a_list_hashes():
    """A list among its rule's keyword arguments: the rule hashes (by its targets and sites, as the recipe by
    theirs) and its copy hashes equal; the recipe still hashes, as before."""
    rule = qstats.Rule("Linear", sites=("input",), observer="histogram", observer_kwargs={"bins": 64},
                       qparams_kwargs={"method": "percentile", "percentile": 99.9, "extra": [1, 2]})
    assert hash(rule) == hash(copy.deepcopy(rule)) and rule == copy.deepcopy(rule)
    recipe = qstats.Recipe([rule])
    assert hash(recipe) == hash(copy.deepcopy(recipe)) and recipe == copy.deepcopy(recipe)
