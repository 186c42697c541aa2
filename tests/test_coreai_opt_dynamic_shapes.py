"""coreai_opt's "dynamic" activation calculator, whose input shape changes from call to call,
against one qstats spec built from a single shape.

Reference: Apple coreai_opt 0.4.0's ``DynamicQParamsCalculator`` (built by its
``QuantizationComponentFactory`` for ``CompressionTargetTensor.ACTIVATION``): its scale, zero
point and minval for each input, against ``compute_qparams`` of `qstats.memoryless_minmax` under
``QuantSpec.from_coreai_opt(spec, shape=build_shape, target="activation")``. A build shape with
dimensions of size 1 (one token, batch 1, 1x1 spatial) must not turn a per-token or per-block
granularity into a per-tensor one.
"""

import warnings

import pytest
import torch

import qstats

warnings.filterwarnings("ignore")

spec_lib = pytest.importorskip("coreai_opt.quantization.spec.spec")
from coreai_opt.config.spec import CompressionTargetTensor  # noqa: E402
from coreai_opt.quantization.spec.factory import QuantizationComponentFactory  # noqa: E402

QuantizationSpec = spec_lib.QuantizationSpec

# (granularity, shape the spec is built from, shapes of later inputs)
CASES = [
    ({"type": "per_block", "axis": -1, "block_size": 32}, (1, 1, 32), [(2, 6, 32), (1, 1, 32), (3, 10, 32)]),
    ({"type": "per_block", "axis": -1, "block_size": 32}, (1, 32), [(5, 32), (1, 32)]),
    ({"type": "per_block", "axis": -1, "block_size": 8}, (1, 1, 32), [(2, 6, 32), (1, 1, 32)]),
    ({"type": "per_block", "axis": 1, "block_size": 16}, (1, 16, 1, 1), [(2, 16, 3, 3), (1, 16, 1, 1)]),
    ({"type": "per_block", "axis": 1, "block_size": 2}, (2, 6, 32), [(3, 6, 8), (2, 6, 32)]),
    ({"type": "per_block", "block_size": (1, -1, 32)}, (1, 6, 32), [(3, 6, 32), (1, 6, 32)]),
    ({"type": "per_block", "block_size": (-1, 1, 32)}, (1, 6, 32), [(3, 6, 32), (2, 6, 32)]),
    ({"type": "per_channel", "axis": 1}, (1, 1, 32), [(2, 6, 32), (1, 1, 32)]),
]


@pytest.mark.parametrize("qscheme", ["symmetric", "asymmetric"])
@pytest.mark.parametrize("granularity,build_shape,shapes", CASES, ids=str)
def test_dynamic_calculator_over_changing_shapes(granularity, build_shape, shapes, qscheme):
    coreai_spec = QuantizationSpec(dtype=torch.int8, qscheme=qscheme, granularity=granularity,
                                   qparam_calculator_cls="dynamic")
    calculator = QuantizationComponentFactory.create_qparams_calculator(coreai_spec, CompressionTargetTensor.ACTIVATION)
    spec = qstats.QuantSpec.from_coreai_opt(coreai_spec, shape=build_shape, target="activation")
    obs = qstats.memoryless_minmax(spec)
    g = torch.Generator().manual_seed(0)
    for shape in shapes:
        x = torch.randn(shape, generator=g) * 2 + 0.5
        scale, zero_point, minval = calculator(x)
        qp = qstats.compute_qparams(obs.update(obs.init(x), x), spec)
        assert qp.scale.numel() == scale.numel(), (shape, spec.granularity)
        assert torch.equal(qp.scale.reshape(scale.shape), scale), shape
        assert torch.equal(qp.zero_point.reshape(zero_point.shape), zero_point), shape
        assert torch.equal(qp.minval.reshape(minval.shape), minval), shape


def test_weight_granularity_of_a_shape_with_size_one_dimensions_is_unchanged():
    """A weight's shape is fixed: one output channel keeps the granularity its shape gives."""
    coreai_spec = QuantizationSpec(dtype=torch.int4, granularity={"type": "per_block", "axis": 1, "block_size": 32})
    calculator = QuantizationComponentFactory.create_qparams_calculator(coreai_spec, CompressionTargetTensor.WEIGHT)
    w = torch.randn(1, 64, generator=torch.Generator().manual_seed(1))
    spec = qstats.QuantSpec.from_coreai_opt(coreai_spec, shape=w.shape)
    obs = qstats.memoryless_minmax(spec)
    scale, _, minval = calculator(w)
    qp = qstats.compute_qparams(obs.update(obs.init(w), w), spec)
    assert torch.equal(qp.scale.reshape(scale.shape), scale) and torch.equal(qp.minval.reshape(minval.shape), minval)
