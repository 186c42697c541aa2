"""Observer factories by name, so recipes can be plain data: ``Rule(observer="minmax")``.

A factory is ``factory(spec, **kwargs) -> Observer``. The table is filled at import with
qstats' own observers; ``register`` adds more (a user's observer, a wrapped one):

    register("clipped_minmax", lambda spec, clip=6.0: ...)   # Rule(observer="clipped_minmax", ...)

Registering a name twice raises unless ``replace=True``; an unknown name raises a ValueError
listing the registered ones. The range searches' table (`qstats.observers.search.register_search`)
has the same shape, except that it replaces a registered name without asking.
"""

from __future__ import annotations

from typing import Callable

from ._base import Observer
from .fixed import fixed_qparams, noop, placeholder, recording, sigmoid_qparams, tanh_qparams
from .histogram import histogram
from .imatrix import imatrix, imatrix_mse
from .minmax import memoryless_minmax, minmax, moving_average_minmax
from .moments import moments
from .mse import mse

__all__ = ["register", "get", "registered", "name_of"]

_FACTORIES: dict[str, Callable] = {}


def register(name: str, factory: Callable, *, replace: bool = False) -> Callable:
    """Registers ``factory(spec, **kwargs) -> Observer`` as ``name``; returns ``factory``.

    Raises:
      ValueError: ``name`` is registered already and ``replace`` is False.
      TypeError: ``name`` is not a non-empty string or ``factory`` is not callable.
    """
    if not (isinstance(name, str) and name):
        raise TypeError(f"observers.register: name must be a non-empty string, got {name!r}")
    if isinstance(factory, Observer):  # the factory's result, not the factory
        raise TypeError(f"observers.register: {name!r} got an Observer ({factory.name}); register the factory "
                        "that builds it, factory(spec, **kwargs) -> Observer")
    if not callable(factory):
        raise TypeError(f"observers.register: factory must be callable, got {type(factory).__name__}")
    if name in _FACTORIES and not replace and _FACTORIES[name] is not factory:
        raise ValueError(f"observers.register: {name!r} is registered already; pass replace=True to replace it")
    _FACTORIES[name] = factory
    return factory


def get(name: str) -> Callable:
    """The factory registered as ``name``; ValueError listing the registered names otherwise."""
    if not isinstance(name, str):
        raise TypeError(f"observers.get: name must be a string, got {type(name).__name__}")
    found = _FACTORIES.get(name)
    if found is None:
        raise ValueError(f"unknown observer {name!r}; registered observers: {', '.join(registered())} "
                         "(add one with qstats.observers.register(name, factory))")
    return found


def registered() -> tuple[str, ...]:
    """The registered observer names, sorted."""
    return tuple(sorted(_FACTORIES))


def name_of(factory: Callable):
    """The name ``factory`` is registered under, or None: of several, the one registered first
    (qstats' own name before a user's alias; a name replaced with ``replace=True`` keeps its place)."""
    return next((name for name, registered_factory in _FACTORIES.items() if registered_factory is factory), None)


for _name, _factory in (
    ("minmax", minmax),
    ("memoryless_minmax", memoryless_minmax),
    ("moving_average_minmax", moving_average_minmax),
    ("histogram", histogram),
    ("mse", mse),
    ("moments", moments),
    ("imatrix", imatrix),  # its spec gives only the nonfinite policy (it watches the layer's input)
    ("imatrix_mse", imatrix_mse),
    ("fixed_qparams", fixed_qparams),
    ("sigmoid_qparams", sigmoid_qparams),
    ("tanh_qparams", tanh_qparams),
    ("placeholder", placeholder),
    ("noop", noop),
    ("recording", recording),
):
    register(_name, _factory)
