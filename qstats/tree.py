"""Trees of states: stack, unstack and strict structure checks.

A tree is any nesting of dicts, lists, tuples and NamedTuples with tensor leaves, as `optree`
flattens it. `stack` gives one tree with a new leading dimension, ready for ``torch.func.vmap``, and
`unstack` undoes it; `assert_same_structure` is the strict check used before combining trees.
"""

from __future__ import annotations

import collections
import collections.abc
import numbers
from typing import Any, Sequence

import optree
import torch

__all__ = ["stack", "unstack", "assert_same_structure", "leaves_with_paths"]


def _child_path(path: str, node: Any, entry: Any) -> str:
    if isinstance(node, tuple) and hasattr(type(node), "_fields"):
        return f"{path}.{node._fields[entry]}"
    return f"{path}[{entry!r}]"


def _is_leaf(tree: Any) -> bool:
    return isinstance(tree, torch.Tensor) or optree.tree_is_leaf(tree)


def _description(tree: Any) -> str:
    """How mismatch messages name one side: a leaf by its type and value (a tensor by its shape and
    dtype), a node by its kind and size."""
    if isinstance(tree, torch.Tensor):
        return f"tensor of shape {tuple(tree.shape)} and dtype {tree.dtype}"
    kind = type(tree).__name__
    if _is_leaf(tree):
        return f"{kind} {tree!r}"
    if hasattr(type(tree), "_fields"):
        return f"{kind} (a NamedTuple)"
    if isinstance(tree, collections.defaultdict):
        kind = f"{kind}({getattr(tree.default_factory, '__name__', tree.default_factory)})"
    if isinstance(tree, dict):
        return f"{kind} with keys {sorted(map(repr, tree))}"
    if isinstance(tree, (list, tuple, collections.deque)):
        maxlen = f" (maxlen {tree.maxlen})" if isinstance(tree, collections.deque) else ""
        return f"{kind} of length {len(tree)}{maxlen}"
    return kind


def _same_value(a: Any, b: Any) -> bool:
    """Equality of two non-tensor leaves of one type: NaN equals NaN, and an elementwise ``==``
    (numpy arrays) must hold everywhere, on equal shapes."""
    if isinstance(a, numbers.Number) and a != a:  # NaN: Python, complex and NumPy scalars
        return b != b
    if getattr(a, "shape", None) != getattr(b, "shape", None):
        return False
    equal = a == b
    if isinstance(equal, bool):
        return equal
    return bool((equal | ((a != a) & (b != b))).all())  # NaN equals NaN in arrays too


def _compare(a: Any, b: Any, path: str, check_leaves: bool) -> None:
    a_leaf, b_leaf = _is_leaf(a), _is_leaf(b)
    if a_leaf or b_leaf:  # both leaves, both tensors or of one type and value, shapes and dtypes
        a_tensor, b_tensor = isinstance(a, torch.Tensor), isinstance(b, torch.Tensor)
        if (not (a_leaf and b_leaf) or a_tensor != b_tensor
                or (not a_tensor and (type(a) is not type(b) or not _same_value(a, b)))
                or (check_leaves and a_tensor and (a.shape != b.shape or a.dtype != b.dtype))):
            raise ValueError(f"tree mismatch at {path}: {_description(a)} vs {_description(b)}")
        return
    if type(a) is not type(b):
        raise ValueError(f"tree mismatch at {path}: {_description(a)} vs {_description(b)}")
    a_children, a_meta, a_entries, _ = optree.tree_flatten_one_level(a)
    b_children, b_meta, b_entries, _ = optree.tree_flatten_one_level(b)
    if isinstance(a, dict):  # keys in any order; a defaultdict's factory is part of its node, as in optree
        factories = getattr(a, "default_factory", None), getattr(b, "default_factory", None)
        if set(a_entries) != set(b_entries) or factories[0] != factories[1]:
            raise ValueError(f"tree mismatch at {path}: {_description(a)} vs {_description(b)}")
        b_by_key = dict(zip(b_entries, b_children))
        b_children = [b_by_key[entry] for entry in a_entries]  # b by a's keys
    elif len(a_children) != len(b_children) or a_entries != b_entries or a_meta != b_meta:
        raise ValueError(f"tree mismatch at {path}: {_description(a)} vs {_description(b)}")
    for entry, a_child, b_child in zip(a_entries, a_children, b_children):
        _compare(a_child, b_child, _child_path(path, a, entry), check_leaves)


def assert_same_structure(a: Any, b: Any, *, check_leaves: bool = True, name: str = "tree") -> None:
    """Raises ValueError unless ``a`` and ``b`` have the same structure.

    Strict: identical node types (NamedTuple classes included), dict keys and sequence lengths, equal
    non-tensor leaves and (``check_leaves``) tensor shapes and dtypes. The message names the path of
    the first difference and both sides.

    >>> import torch, qstats
    >>> a = {"w": torch.zeros(3)}
    >>> qstats.tree.assert_same_structure(a, {"w": torch.zeros(4)})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: tree mismatch at tree['w']: tensor of shape (3,) ... vs tensor of shape (4,) ...
    """
    _compare(a, b, name, check_leaves)


def leaves_with_paths(tree: Any, name: str = "tree") -> list[tuple[str, Any]]:
    """``[(path, leaf), ...]`` in flattening order, paths spelled as in `assert_same_structure`."""
    out: list[tuple[str, Any]] = []

    def walk(node: Any, path: str) -> None:
        if _is_leaf(node):
            out.append((path, node))
            return
        children, _, entries, _ = optree.tree_flatten_one_level(node)
        for entry, child in zip(entries, children):
            walk(child, _child_path(path, node, entry))

    walk(tree, name)
    return out


def stack(trees: Sequence[Any]) -> Any:
    """Stacks same-structure trees leaf by leaf along a new leading dimension.

    Args:
      trees: a non-empty sequence of trees with identical structure, shapes, dtypes and tensor leaves.

    Returns:
      One tree of the same structure whose leaves have shape ``(len(trees), *leaf.shape)``.

    Raises:
      TypeError: for one tree (a tensor, a dict, a state) instead of a sequence of them.
      ValueError: for an empty sequence, or naming the path of the first mismatch (structure, shape,
        dtype, or leaves on different devices).
    """
    if isinstance(trees, (torch.Tensor, collections.abc.Mapping, str, bytes)) or hasattr(type(trees), "_fields"):
        # one tree, whose rows, keys or fields list() would read as trees: stacked as such, or a mismatch named
        raise TypeError(f"tree.stack: takes a sequence of trees ([tree, tree, ...]), got one {type(trees).__name__}; "
                        "pass a list of the trees to stack")
    trees = list(trees)
    if not trees:
        raise ValueError("tree.stack: needs at least one tree")
    first = trees[0]
    for index, other in enumerate(trees[1:], start=1):
        _compare(first, other, f"trees[{index}]", True)
    for path, leaf in leaves_with_paths(first, "trees[0]"):
        if not isinstance(leaf, torch.Tensor):
            raise ValueError(f"tree.stack: leaf {path} is a {type(leaf).__name__}, not a tensor")
    treespec = optree.tree_structure(first)
    # leaves in the first tree's order, matched by key: OrderedDicts flatten in their own key order
    columns = list(zip(*(treespec.flatten_up_to(tree) for tree in trees)))
    for (path, _), column in zip(leaves_with_paths(first, "trees[0]"), columns):
        devices = sorted({str(leaf.device) for leaf in column})
        if len(devices) > 1:  # torch.stack's own error names neither the leaf nor the tree
            raise ValueError(f"tree.stack: leaf {path} is on devices {devices} across the trees; move them to one")
    return optree.tree_unflatten(treespec, [torch.stack(column) for column in columns])


def unstack(tree: Any) -> list[Any]:
    """Inverse of `stack`: splits every leaf along its leading dimension.

    Each piece owns its memory, as the trees given to `stack` did: a view of the stacked leaf would keep
    all of it alive, and ``torch.save`` of one tree would write every tree's data.

    Raises:
      ValueError: a leaf that is not a tensor or is 0-dimensional, or differing leading sizes.
    """
    paths = leaves_with_paths(tree)
    leaves, treespec = optree.tree_flatten(tree)
    if not leaves:
        raise ValueError("tree.unstack: the tree has no leaves")
    first_path, first = paths[0]  # the loop checks it before reading its size
    for path, leaf in paths:
        if not isinstance(leaf, torch.Tensor):
            raise ValueError(f"tree.unstack: leaf {path} is a {type(leaf).__name__}, not a tensor")
        if leaf.ndim == 0:
            raise ValueError(f"tree.unstack: leaf {path} is 0-dimensional; it has no leading dimension to split")
        if leaf.shape[0] != first.shape[0]:
            raise ValueError(
                f"tree.unstack: leaf {path} has leading size {leaf.shape[0]} but {first_path} has {first.shape[0]}"
            )
    columns = [[piece.clone() for piece in leaf.unbind(0)] for leaf in leaves]
    return [optree.tree_unflatten(treespec, [column[i] for column in columns]) for i in range(first.shape[0])]
