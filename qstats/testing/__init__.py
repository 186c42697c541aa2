"""Law checks for observers, public so that users can test observers of their own (docs/testing.md).

Each ``check_*`` law takes an Observer and a list of input batches and raises AssertionError naming
the law, the observer and the first differing field; `check_all` runs them all on hypothesis-drawn
batches (needs ``hypothesis``, as `qstats.testing.strategies` does).

>>> import torch, qstats
>>> from qstats import testing
>>> obs = qstats.minmax(qstats.QuantSpec(granularity=qstats.PerAxis(0)))
>>> xs = [torch.randn(4, 8) for _ in range(3)]
>>> testing.check_homomorphism(obs, xs)
>>> testing.check_all(obs, lambda g: torch.randn(4, 8, generator=g))  # hypothesis-driven
"""

from ._check_all import LAWS, check_all
from ._laws import (DEFAULT_RTOL, assert_states_equal, check_associative, check_commutative, check_compile,
                    check_distributed, check_homomorphism, check_identity, check_purity, check_stability,
                    check_vmap)

__all__ = [
    "DEFAULT_RTOL",
    "LAWS",
    "assert_states_equal",
    "check_all",
    "check_associative",
    "check_commutative",
    "check_compile",
    "check_distributed",
    "check_homomorphism",
    "check_identity",
    "check_purity",
    "check_stability",
    "check_vmap",
    "strategies",
]


def __getattr__(name):
    # `strategies` imports hypothesis (a test dependency); load it on first use only.
    if name == "strategies":
        import importlib

        return importlib.import_module(".strategies", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
