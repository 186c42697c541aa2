"""Hypothesis strategies for observer tests (needs the ``hypothesis`` package).

Tensors are drawn from a seed and a power-of-two magnitude (``2**-8`` to ``2**8`` by default), not
element by element: shrinking stays cheap and scaling by ``2**k`` is exact.

>>> from hypothesis import given
>>> from qstats.testing import strategies
>>> @given(strategies.tensors((4, 8)))
... def test_something(x):
...     assert x.shape == (4, 8)
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from hypothesis import strategies as st

from .._checks import is_integer

__all__ = ["seeds", "magnitudes", "tensors", "batches", "splits"]

_DISTRIBUTIONS = ("normal", "uniform", "laplace", "constant", "sparse")


def _check_range(where: str, low_name: str, low, high_name: str, high, minimum=None) -> None:
    """ValueError naming the arguments unless ``low`` and ``high`` are integers (not bools), ``low <= high``,
    both at least ``minimum`` where given (hypothesis' own error named its ``min_value``/``max_size``)."""
    for name, value in ((low_name, low), (high_name, high)):
        if not is_integer(value) or (minimum is not None and value < minimum):
            at_least = "" if minimum is None else f" of at least {minimum}"
            raise ValueError(f"{where}: {name} must be an int{at_least}, got {value!r}")
    if low > high:
        raise ValueError(f"{where}: {low_name} ({low}) must not exceed {high_name} ({high})")


def seeds() -> st.SearchStrategy[int]:
    """Seeds for ``torch.Generator().manual_seed``."""
    return st.integers(min_value=0, max_value=2**31 - 1)


def magnitudes(min_exponent: int = -8, max_exponent: int = 8) -> st.SearchStrategy[float]:
    """Powers of two ``2**k`` for ``k`` in ``[min_exponent, max_exponent]`` (scaling is exact)."""
    _check_range("magnitudes", "min_exponent", min_exponent, "max_exponent", max_exponent)
    return st.integers(min_exponent, max_exponent).map(lambda k: float(2.0**k))


def _sample(shape, distribution: str, generator: torch.Generator) -> torch.Tensor:
    if distribution == "normal":
        return torch.randn(shape, generator=generator)
    if distribution == "uniform":
        return torch.rand(shape, generator=generator) * 2 - 1
    if distribution == "laplace":
        u = torch.rand(shape, generator=generator).clamp(1e-6, 1 - 1e-6) - 0.5
        return -torch.sign(u) * torch.log1p(-2 * u.abs())
    if distribution == "constant":
        return torch.full(shape, float(torch.randn((), generator=generator)))
    if distribution == "sparse":
        keep = torch.rand(shape, generator=generator) < 0.1
        return torch.where(keep, torch.randn(shape, generator=generator), torch.zeros(shape))
    raise ValueError(f"unknown distribution {distribution!r}; known: {_DISTRIBUTIONS}")


def tensors(
    shape: Sequence[int],
    dtype: torch.dtype = torch.float32,
    distributions: Sequence[str] = ("normal", "uniform", "laplace"),
    min_exponent: int = -8,
    max_exponent: int = 8,
) -> st.SearchStrategy[torch.Tensor]:
    """A tensor of ``shape``: a seeded draw from one of ``distributions`` ("normal", "uniform",
    "laplace", "constant", "sparse"; a string is one of them) times a power-of-two magnitude, cast to
    ``dtype``. ValueError naming ``distributions`` for an unknown or no name."""
    # a string is one name: tuple("constant") drew 'c', refused as an unknown distribution
    _check_range("tensors", "min_exponent", min_exponent, "max_exponent", max_exponent)
    names = (distributions,) if isinstance(distributions, str) else tuple(distributions)
    unknown = [name for name in names if name not in _DISTRIBUTIONS]
    if unknown or not names:
        raise ValueError(f"tensors: distributions must name one or more of {_DISTRIBUTIONS}, got {distributions!r}")
    return _tensors(tuple(shape), dtype, names, min_exponent, max_exponent)


@st.composite
def _tensors(draw, shape: tuple, dtype: torch.dtype, distributions: tuple, min_exponent: int,
             max_exponent: int) -> torch.Tensor:
    seed = draw(seeds())
    distribution = draw(st.sampled_from(distributions))
    scale = draw(magnitudes(min_exponent, max_exponent))
    generator = torch.Generator().manual_seed(seed)
    return (_sample(shape, distribution, generator) * scale).to(dtype)


@st.composite
def batches(
    draw,
    make_x: Callable[[torch.Generator], torch.Tensor],
    min_size: int = 3,
    max_size: int = 5,
    min_exponent: int = -8,
    max_exponent: int = 8,
) -> list:
    """A list of ``min_size`` to ``max_size`` batches ``make_x(generator) * 2**k`` (one seeded
    generator, one magnitude for the list; non-float batches are not scaled)."""
    _check_range("batches", "min_size", min_size, "max_size", max_size, minimum=0)
    _check_range("batches", "min_exponent", min_exponent, "max_exponent", max_exponent)
    count = draw(st.integers(min_size, max_size))
    seed = draw(seeds())
    scale = draw(magnitudes(min_exponent, max_exponent))
    generator = torch.Generator().manual_seed(seed)
    xs = [make_x(generator) for _ in range(count)]
    return [x * scale if x.is_floating_point() else x for x in xs]


def splits(count: int, min_cuts: int = 0) -> st.SearchStrategy[list]:
    """Sorted cut points into a list of ``count`` batches (``[]`` is no split; ``[1, 3]`` splits
    into ``xs[:1], xs[1:3], xs[3:]``); at least ``min_cuts`` of them where ``count`` allows."""
    for name, value in (("count", count), ("min_cuts", min_cuts)):
        if not is_integer(value) or value < 0:  # -2 batches drew no split, 4.0 failed naming max_size
            raise ValueError(f"splits: {name} must be a non-negative int, got {value!r}")
    if count < 2:
        return st.just([])
    return st.lists(st.integers(1, count - 1), unique=True, min_size=min(min_cuts, count - 1),
                    max_size=count - 1).map(sorted)
