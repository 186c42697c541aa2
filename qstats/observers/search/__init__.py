"""Range searches by name: the ``method=`` of ``qstats.compute_qparams(state, spec, method=...)``.

A search is a pure function ``search(state, spec, **options) -> Range``, registered by observer
family and name, so a new method needs no change to the observer. The histogram's searches, one
module each: ``"l2"``, ``"mse"``, ``"entropy"``, ``"percentile"`` (``"minmax"`` is beside the
observer); the moments observer registers its own. See docs/observers.md.
"""

from __future__ import annotations

import inspect
from typing import Callable

from .entropy import entropy_amax, entropy_search
from .l2 import l2_search
from .mse import mse_search
from .percentile import percentile_search

__all__ = ["register_search", "search", "searches", "check_options", "entropy_amax"]

_SEARCHES: dict[tuple[str, str], Callable] = {}


def register_search(name: str, fn: Callable, observer: str = "histogram") -> Callable:
    """Registers ``fn(state, spec, **options) -> Range`` as method ``name`` of the ``observer`` family
    (its ``Observer.name``); registering a name again replaces it. Returns ``fn``. For example::

        register_search("widest", lambda state, spec: qstats.Range(
            state.min_val, state.max_val, state.min_val <= state.max_val))
    """
    if not (isinstance(name, str) and name and isinstance(observer, str) and observer):
        raise TypeError(f"register_search: name and observer must be non-empty strings, got {name!r}, {observer!r}")
    if not callable(fn):
        raise TypeError(f"register_search: fn must be callable, got {type(fn).__name__}")
    _SEARCHES[(observer, name)] = fn
    return fn


def search(name: str, observer: str = "histogram") -> Callable:
    """The search registered as method ``name`` of ``observer``; ValueError naming the known
    methods otherwise."""
    found = _SEARCHES.get((observer, name))
    if found is None:
        raise ValueError(
            f"compute_qparams: unknown {observer} method {name!r}; known methods: {', '.join(searches(observer))}"
        )
    return found


def check_options(found: Callable, method: str, options: dict, observer: str = "histogram") -> None:
    """TypeError naming the method and the options it takes for an option the search ``found``
    does not take (the search's own error named a private function, ``mean_std_search()``,
    ``l2_search()``); a search taking ``**options`` checks its own."""
    try:
        parameters = list(inspect.signature(found).parameters.values())[2:]  # after (state, spec)
    except (TypeError, ValueError):  # a callable without a signature: its own error, if any
        return
    if any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters):
        return
    unknown = sorted(set(options) - {parameter.name for parameter in parameters})
    if unknown:
        known = [parameter.name for parameter in parameters]
        takes = f"the options {known}" if known else "no options"
        raise TypeError(f"compute_qparams: {observer} method {method!r} takes {takes}, got {unknown}")


def searches(observer: str = "histogram") -> tuple[str, ...]:
    """The method names registered for ``observer``, sorted."""
    return tuple(sorted(name for family, name in _SEARCHES if family == observer))


for _name, _search in (("l2", l2_search), ("mse", mse_search), ("entropy", entropy_search),
                       ("percentile", percentile_search)):
    register_search(_name, _search)
