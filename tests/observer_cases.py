"""Every observer the contract suite (tests/test_contract.py) runs through the laws.

Each case: (name, factory, make_x). ``factory()`` returns an Observer; ``make_x(generator)`` returns
an input tensor of a fixed shape (the contract suite draws several and splits them). Add one line
per observer configuration; keep tensors small.

A case may carry a fourth element, a dict of `qstats.testing.check_all` keywords:
``{"accumulates": False}`` for observers that keep only the latest batch (their ``merge`` combines
shards of one batch), ``{"approx_fields": ("sum",)}`` for float sums compared to tolerance (or set
``approx_fields`` on the state class).
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
    ("memoryless_minmax/axis0", lambda: qstats.memoryless_minmax(qstats.QuantSpec(granularity=qstats.PerAxis(0))), _x((6, 8)), {"accumulates": False}),
    ("memoryless_minmax/tensor", lambda: qstats.memoryless_minmax(qstats.QuantSpec()), _x((6, 8)), {"accumulates": False}),
    ("minmax/token-3d", lambda: qstats.minmax(qstats.QuantSpec(granularity=qstats.PerToken())), _x((3, 2, 8))),
    ("minmax/uint8-asym-axis1-3d", lambda: qstats.minmax(qstats.QuantSpec(dtype="uint8", mapping="asymmetric", granularity=qstats.PerAxis(1))), _x((3, 4, 8))),
    ("minmax/fp8-tensor", lambda: qstats.minmax(qstats.QuantSpec(dtype="fp8_e4m3fn")), _x((6, 8))),
    ("minmax/nvfp4-tensor-group", lambda: qstats.minmax(qstats.preset("nvfp4")), _x((6, 32))),
    ("minmax/mxfp4", lambda: qstats.minmax(qstats.preset("mxfp4")), _x((6, 64))),
    ("moving_average_minmax/tensor", lambda: qstats.moving_average_minmax(qstats.QuantSpec(), 0.1), _x((6, 8))),
    ("moving_average_minmax/axis0", lambda: qstats.moving_average_minmax(qstats.QuantSpec(granularity=qstats.PerAxis(0)), 0.5), _x((6, 8))),
    ("histogram/tensor", lambda: qstats.histogram(qstats.QuantSpec(), buckets_per_octave=16, octaves=20), _x((6, 8))),
    ("histogram/axis0", lambda: qstats.histogram(qstats.QuantSpec(granularity=qstats.PerAxis(0)), buckets_per_octave=8, octaves=12), _x((6, 8))),
    ("histogram/group4", lambda: qstats.histogram(qstats.QuantSpec(granularity=qstats.PerGroup(4)), buckets_per_octave=4, octaves=10), _x((6, 8))),
    ("moments/tensor", lambda: qstats.moments(qstats.QuantSpec()), _x((6, 8))),
    ("moments/axis0", lambda: qstats.moments(qstats.QuantSpec(granularity=qstats.PerAxis(0)), p=3.0), _x((6, 8))),
    ("mse/tensor", lambda: qstats.mse(qstats.QuantSpec(dtype="int4"), grid=20), _x((6, 8))),
    ("mse/axis0-reference", lambda: qstats.mse(qstats.QuantSpec(dtype="int4", granularity=qstats.PerAxis(0)), grid=20, reference=(-torch.ones(6), torch.ones(6))), _x((6, 8))),
    ("mse/moving_average", lambda: qstats.mse(qstats.QuantSpec(dtype="int4"), grid=20, mode="moving_average", averaging_constant=0.5), _x((6, 8))),
    ("imatrix", lambda: qstats.imatrix(), _x((6, 8))),
    ("hessian", lambda: qstats.hessian(), _x((6, 8))),
    ("imatrix_mse/axis0", lambda: qstats.imatrix_mse(qstats.QuantSpec(dtype="int4", granularity=qstats.PerAxis(0)), (6, 8), reference=(-torch.ones(6), torch.ones(6))), _x((6, 8))),
    ("fixed_qparams/sigmoid", lambda: qstats.sigmoid_qparams(), _x((6, 8))),
    ("placeholder", lambda: qstats.placeholder(), _x((6, 8))),
    ("noop", lambda: qstats.noop(), _x((6, 8))),
    ("recording", lambda: qstats.recording(capacity=16), _x((6, 8))),
]
