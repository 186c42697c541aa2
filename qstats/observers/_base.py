"""The Observer triple and the registry of state types.

An observer is a NamedTuple of pure functions built by a factory that closes over its static
configuration (the spec, bins, averaging constant, ...)::

    obs = qstats.minmax(spec)
    state = obs.init(x)             # identity element for tensors like x
    state = obs.update(state, x)    # (state, tensor[, weight]) -> state
    state = obs.merge(state, other) # associative, commutative, init is the identity

States are NamedTuples whose fields are all tensors. Every state class is registered here by
name, so that `qstats.load` can rebuild a checkpoint without pickling code.
"""

from __future__ import annotations

import sys
from typing import Any, Generic, NamedTuple, Optional, Protocol, TypeVar

import torch

__all__ = [
    "Observer",
    "register_state",
    "state_types",
    "check_state",
    "check_field_dtype",
    "check_merge_states",
    "check_same_shapes",
    "kept_dtypes",
    "row_mask",
    "batch_weighted_mean",
]


State = TypeVar("State", bound=tuple)


class InitFn(Protocol[State]):
    def __call__(self, x: torch.Tensor) -> State: ...


class UpdateFn(Protocol[State]):
    def __call__(self, state: State, x: torch.Tensor, weight: Optional[torch.Tensor] = None) -> State: ...


class MergeFn(Protocol[State]):
    def __call__(self, a: State, b: State) -> State: ...


# Python 3.10 (which pyproject.toml supports) takes no Generic base in a NamedTuple: Observer is
# generic (``Observer[MyState]``) from 3.11 on, a plain NamedTuple of the same fields before.
_GENERIC_OBSERVER = (Generic[State],) if sys.version_info >= (3, 11) else ()


class Observer(NamedTuple, *_GENERIC_OBSERVER):
    """A stateless observer: three pure functions and their static configuration.

    Attributes:
      init: ``init(x) -> state``; reads only the shape, dtype and device of ``x``.
      update: ``update(state, x, weight=None) -> state``; never mutates, never syncs the host.
      merge: ``merge(a, b) -> state``; associative and commutative, ``init(x)`` is its identity.
      exact: True when ``update(s, cat(a, b)) == merge(update(s, a), update(init, b))`` holds
        (splitting data never changes the result); False for order-dependent observers.
      spec: the QuantSpec the observer was built for (static configuration).
      name: the factory's name, for reports and error messages.
      shared_rows: True when a masked update of rows shared by every expert of a
        `qstats.stacked_observer` costs what each expert's own rows cost (min/max reduce each row
        once, the Hessian gathers each expert's rows), so `qstats.calibrate` passes routed rows
        with the routing mask instead of dispatching them to each expert first.
      state_type: the class of ``init``'s states, or None (not declared): `compute_qparams_tree`
        refuses a state of another class at a site this observer observes (states calibrated under
        another recipe would otherwise give that observer's quantization parameters silently).
      options: ``((name, value), ...)``, the factory's options that its states do not hold (an
        averaging constant, a norm); `qstats.distributed.all_reduce` refuses ranks that differ in them.
    """

    init: InitFn[State]
    update: UpdateFn[State]
    merge: MergeFn[State]
    exact: bool
    spec: Any = None
    name: str = "observer"
    shared_rows: bool = False
    state_type: Optional[type] = None
    options: tuple = ()


_STATE_TYPES: dict[str, type] = {}

# The result types `qstats.io` also stores by class name (``io._RESULT_TYPES``): a state named like
# one would take its place in checkpoints (a QAT model's BatchNormState could no longer be saved).
_RESERVED_NAMES = frozenset({"QParams", "LSQParams", "QATState", "BatchNormState"})


def register_state(cls: type) -> type:
    """Class decorator: registers a NamedTuple state type under its class name.

    The registry lets `qstats.load` rebuild states from a checkpoint by name, and the class joins
    torch's safe globals, so ``torch.load`` reads ``torch.save``'d states. Names must be unique, and
    differ from the result types checkpoints also hold (QParams, LSQParams, QATState, BatchNormState).
    """
    if not (isinstance(cls, type) and issubclass(cls, tuple) and hasattr(cls, "_fields")):
        raise TypeError(f"register_state expects a NamedTuple class, got {cls!r}")
    _check_field_annotations(cls)
    _check_approx_fields(cls)
    if cls.__name__ in _RESERVED_NAMES:
        raise ValueError(
            f"register_state: {cls.__name__!r} is the name of a qstats type that checkpoints store by "
            "name; qstats.load finds states by class name, so rename the state"
        )
    previous = _STATE_TYPES.get(cls.__name__)
    if previous is not None and previous is not cls:
        if (previous.__module__, previous.__qualname__) != (cls.__module__, cls.__qualname__):
            raise ValueError(
                f"register_state: a state type named {cls.__name__!r} is already registered, by "
                f"{previous.__module__}.{previous.__qualname__}; qstats.load finds states by class name, so "
                "rename one of them"
            )
    _STATE_TYPES[cls.__name__] = cls
    # torch.load(weights_only=True), torch's default, reads the registered state types
    torch.serialization.add_safe_globals([cls])
    return cls


_PYTHON_SCALARS = (int, float, bool, str, "int", "float", "bool", "str")


def _check_field_annotations(cls: type) -> None:
    """TypeError for a field annotated as a Python number or string: states hold tensors only (a count
    is a 0-d int64 tensor), which checkpoints, ``all_reduce``, ``vmap`` and ``torch.compile`` need."""
    for field, annotation in getattr(cls, "__annotations__", {}).items():
        annotation = getattr(annotation, "__forward_arg__", annotation)  # NamedTuple turns "int" into ForwardRef
        if any(annotation is scalar or annotation == scalar for scalar in _PYTHON_SCALARS):
            shown = getattr(annotation, "__name__", annotation)
            raise TypeError(
                f"register_state: field {field!r} of {cls.__name__} is annotated {shown}; states hold tensors "
                "only (keep a count as an int64 tensor, torch.zeros((), dtype=torch.int64))"
            )


def _check_approx_fields(cls: type) -> None:
    """TypeError unless a declared ``approx_fields`` is a collection of field names (``("total")``
    without its comma is the string "total", whose letters the laws would read as the names), and
    ValueError naming a name that is not a field of the class (the laws would compare it bit for bit)."""
    declared = getattr(cls, "approx_fields", ())
    names = tuple(declared) if isinstance(declared, (tuple, list, set, frozenset)) else None
    if names is None or not all(isinstance(name, str) for name in names):
        raise TypeError(f"register_state: {cls.__name__}.approx_fields must be a tuple of field names, got "
                        f"{declared!r} (a one-name tuple needs its comma: ({declared!r},))")
    unknown = sorted(set(names) - set(cls._fields) - {"*"})  # "*": every float field, as the laws read it
    if unknown:
        raise ValueError(f"register_state: {cls.__name__}.approx_fields names {unknown}, which are not fields of "
                         f"{cls.__name__} {cls._fields}")


def state_types() -> dict[str, type]:
    """A copy of the registry: state class name -> class."""
    return dict(_STATE_TYPES)


def check_state(state: Any, cls: type, where: str) -> None:
    """Raises TypeError unless ``state`` is an instance of ``cls`` (names both types)."""
    if not isinstance(state, cls):
        raise TypeError(f"{where}: expected a {cls.__name__}, got {type(state).__name__}")


def check_field_dtype(state: Any, name: str, dtype: torch.dtype, where: str, meaning: str = "") -> None:
    """ValueError naming the field and what it holds unless ``state.<name>`` is a tensor of ``dtype``
    (``meaning`` follows the dtype in the message, e.g. ``" (a number of rows)"``)."""
    value = getattr(state, name)
    if not isinstance(value, torch.Tensor) or value.dtype != dtype:
        got = f"dtype {value.dtype}" if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"{where}: {type(state).__name__}.{name} must be a {dtype} tensor{meaning}, got {got}")


def check_merge_states(a: Any, b: Any, cls: type, where: str, check=None) -> None:
    """The checks of a merge's two states: ``check(state, cls, where)`` on each (`check_state` by
    default), then `check_same_shapes`."""
    check = check_state if check is None else check
    check(a, cls, where)
    check(b, cls, where)
    check_same_shapes(a, b, where)


def check_same_shapes(a: Any, b: Any, where: str) -> None:
    """Raises ValueError naming both shapes when two states' fields differ in shape (or dtype), and
    TypeError when they are not NamedTuple states of one type or a field is not a tensor. A
    NamedTuple nested in a state is checked field by field (named ``outer.inner``)."""
    _check_same_fields(a, b, where, "")


def _check_same_fields(a: Any, b: Any, where: str, prefix: str) -> None:
    if not hasattr(type(a), "_fields"):
        raise TypeError(f"{where}: expected NamedTuple states, got {type(a).__name__}")
    if type(a) is not type(b):
        raise TypeError(f"{where}: the states differ in type: {type(a).__name__} and {type(b).__name__}")
    for field, left, right in zip(a._fields, a, b):
        name = f"{prefix}{field}"
        if isinstance(left, tuple) and hasattr(type(left), "_fields"):  # a nested NamedTuple state
            _check_same_fields(left, right, where, f"{name}.")
            continue
        for which, value in (("first", left), ("second", right)):
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"{where}: field {name!r} of the {which} state is a {type(value).__name__}; "
                                "states hold tensors only")
        if left.shape != right.shape:
            raise ValueError(
                f"{where}: field {name!r} has shape {tuple(left.shape)} in the first state and "
                f"{tuple(right.shape)} in the second"
            )
        if left.dtype != right.dtype:
            raise ValueError(
                f"{where}: field {name!r} has dtype {left.dtype} in the first state and "
                f"{right.dtype} in the second"
            )


def kept_dtypes(state: Any, updated: Any, where: str) -> Any:
    """``updated``, after ValueError naming the field where it holds another dtype than ``state``, the
    state an update was given: a state converted after ``init`` (bfloat16 extremes, int32 counts) came
    back promoted (float32, int64), and then no longer merged with the state it was updated from."""
    for name, before, after in zip(state._fields, state, updated):
        if isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor) and before.dtype != after.dtype:
            raise ValueError(
                f"{where}: the state's {name} is a {before.dtype} tensor, which this update does not keep (it "
                f"computes {after.dtype}); use the dtypes init gives (or convert the state back to them)"
            )
    return updated


def row_mask(x: torch.Tensor, weight: Optional[torch.Tensor], where: str) -> Optional[torch.Tensor]:
    """The per-row keep mask ``[rows]`` of a row ``weight`` (shape a prefix of ``x.shape[:-1]``;
    zero leaves a row out) over ``x`` flattened to ``[rows, features]``, or None; ``where`` names
    the caller in the errors. The weight is a mask, as in every observer (``weight_view``): any
    nonzero value keeps its row once, NaN and negative values too (checking them would read the
    host in ``update``); `qstats.calibrate` and `qstats.observing` refuse such observation weights."""
    if weight is None:
        return None
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{where}: weight must be a tensor or None, got {type(weight).__name__}")
    if weight.ndim >= x.ndim or tuple(weight.shape) != tuple(x.shape[: weight.ndim]):
        raise ValueError(
            f"{where}: weight of shape {tuple(weight.shape)} does not match the leading (row) "
            f"dimensions of the inputs of shape {tuple(x.shape)}"
        )
    keep = weight.reshape(tuple(weight.shape) + (1,) * (x.ndim - 1 - weight.ndim)) != 0
    return keep.expand(x.shape[:-1]).reshape(-1)


def batch_weighted_mean(u: torch.Tensor, v: torch.Tensor, u_batches: torch.Tensor, v_batches: torch.Tensor):
    """Merge of two moving averages: their mean weighted by how many batches each averaged.

    Where one side averaged no batch the other side is returned as it is (so ``init`` is the
    identity); commutative bit for bit, associative up to float rounding; the shares are computed
    in the averages' dtype (float32 or wider), so float64 averages merge to float64 precision.
    """
    u_seen, v_seen = u_batches > 0, v_batches > 0
    # the shares in the averages' precision (float32 or wider): a float64 average keeps float64 shares
    dtype = torch.promote_types(torch.promote_types(u.dtype, v.dtype), torch.float32)
    total = (u_batches + v_batches).clamp(min=1).to(dtype)
    u_weight, v_weight = u_batches.to(dtype), v_batches.to(dtype)
    u0 = torch.where(u_seen, u, torch.zeros_like(u))
    v0 = torch.where(v_seen, v, torch.zeros_like(v))
    # each side times its share (at most 1): no overflow where the sum of products would overflow
    both = u0 * (u_weight / total) + v0 * (v_weight / total)
    return torch.where(u_seen, torch.where(v_seen, both, u), v)
