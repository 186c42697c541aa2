"""Every observer the contract suite (tests/test_contract.py) runs through the laws.

Each case: (name, factory, make_x). ``factory()`` returns an Observer; ``make_x(generator)`` returns
an input tensor of a fixed shape (the contract suite draws several and splits them). Add one line
per observer configuration; keep tensors small.
"""

import torch

import qstats


def _x(shape):
    return lambda g: torch.randn(shape, generator=g)


CASES = [
    ("minmax/tensor", lambda: qstats.minmax(qstats.QuantSpec()), _x((6, 8))),
    ("minmax/axis0", lambda: qstats.minmax(qstats.QuantSpec(granularity=qstats.PerAxis(0))), _x((6, 8))),
    ("minmax/axis-1", lambda: qstats.minmax(qstats.QuantSpec(granularity=qstats.PerAxis(-1))), _x((6, 8))),
    ("minmax/group4", lambda: qstats.minmax(qstats.QuantSpec(granularity=qstats.PerGroup(4))), _x((6, 8))),
    ("minmax/block", lambda: qstats.minmax(qstats.QuantSpec(granularity=qstats.PerBlock((2, 4)))), _x((6, 8))),
    ("memoryless_minmax/axis0", lambda: qstats.memoryless_minmax(qstats.QuantSpec(granularity=qstats.PerAxis(0))), _x((6, 8))),
    ("moving_average_minmax/tensor", lambda: qstats.moving_average_minmax(qstats.QuantSpec(), 0.1), _x((6, 8))),
]
