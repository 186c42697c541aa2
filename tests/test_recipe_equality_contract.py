"""`Recipe.__eq__` / `__hash__` (value equality since 8da33a1): Python's contract that equal objects hash
equal, and that a copy compares equal (the docstring's promise) whatever its rules' keyword arguments hold.

- ``shared`` is a dict: equality ignores its order, but the hash read ``tuple(shared.items())``, so the
  same recipe written with its shared sites in another order compared equal and hashed differently (two
  entries in a set). Fix: ``frozenset(self.shared.items())`` in ``__hash__``.
- A rule whose ``observer_kwargs`` hold tensors (``qstats.mse``'s ``reference=(lo, hi)``): comparing a
  recipe with its deepcopy raised ``RuntimeError: Boolean value of Tensor ... is ambiguous`` (the rules'
  dataclass equality compares the tensors with ``==``), where the identity comparison before gave False.
"""

from __future__ import annotations

import copy

import torch

import qstats

RULE = qstats.Rule(targets="Linear", sites=("input",), spec=qstats.QuantSpec())


def test_equal_recipes_hash_equal_whatever_the_order_of_their_shared_sites():
    a = qstats.Recipe([RULE], shared={"l.k:input": "l.q:input", "l.v:input": "l.q:input"})
    b = qstats.Recipe([RULE], shared={"l.v:input": "l.q:input", "l.k:input": "l.q:input"})
    assert a == b
    assert hash(a) == hash(b) and len({a, b}) == 1


def test_a_copy_of_a_recipe_whose_observer_kwargs_hold_tensors_compares_equal():
    spec = qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0))
    reference = (-torch.ones(4), torch.ones(4))
    recipe = qstats.Recipe([qstats.Rule(targets="Linear", sites=("weight",), spec=spec, observer=qstats.mse,
                                        observer_kwargs={"reference": reference})])
    assert recipe == copy.deepcopy(recipe)
    other = qstats.Recipe([qstats.Rule(targets="Linear", sites=("weight",), spec=spec, observer=qstats.mse,
                                       observer_kwargs={"reference": (-torch.ones(4), 2 * torch.ones(4))})])
    assert recipe != other


def test_a_copy_of_a_rule_whose_observer_kwargs_hold_tensors_compares_and_hashes_equal():
    """`Rule` (public, a frozen dataclass) compared its fields as a tuple: a rule and its deepcopy raised
    'Boolean value of Tensor is ambiguous', and hashing one whose observer_kwargs hold a list raised TypeError.
    Reference: the tensors' own values (torch.equal) and Python's equality of the other fields."""
    spec = qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0))
    rule = qstats.Rule(targets="Linear", sites=("weight",), spec=spec, observer=qstats.mse,
                       observer_kwargs={"reference": (-torch.ones(4), torch.ones(4))})
    copied = copy.deepcopy(rule)
    assert rule == copied and hash(rule) == hash(copied) and len({rule, copied}) == 1
    assert rule != qstats.Rule(targets="Linear", sites=("weight",), spec=spec, observer=qstats.mse,
                               observer_kwargs={"reference": (-torch.ones(4), 2 * torch.ones(4))})
    listed = qstats.Rule(targets="Linear", observer_kwargs={"grid": [1, 2]})
    assert hash(listed) == hash(copy.deepcopy(listed))


def test_a_recipe_is_equal_to_itself_and_its_shallow_copy_as_python_containers_are():
    """Python's containers compare an object with itself as equal (``[x] == [x]`` for a NaN): a recipe
    holding a NaN reference compared unequal to itself."""
    nan = (torch.full((4,), float("nan")), torch.ones(4))
    recipe = qstats.Recipe([qstats.Rule(targets="Linear", sites=("weight",), observer=qstats.mse,
                                        observer_kwargs={"reference": nan})])
    assert [nan] == [nan]  # the reference semantics
    assert recipe == recipe and recipe == copy.copy(recipe)
