"""`qstats.coreai_opt.moving_average_minmax` on bf16/fp16 batches under ``torch.compile``: its
update rounds each step to the batch's dtype as coreai_opt's running range does, and compiled
(``fullgraph=True``) it gives the eager states bit for bit, and coreai_opt's qparams.

Reference: Apple coreai_opt 0.4.0's ``MovingAverageQParamsCalculator`` (its running range held in
the input's dtype), and the same update run eagerly. torch.compile keeps float32 between fused ops,
so rounding written as ``t.to(bfloat16).float()`` vanished from the compiled update (every running
value differed).
"""

import warnings

import pytest
import torch

import qstats
import qstats.coreai_opt

warnings.filterwarnings("ignore")

spec_lib = pytest.importorskip("coreai_opt.quantization.spec.spec")
from coreai_opt.config.spec import CompressionTargetTensor  # noqa: E402
from coreai_opt.quantization.spec.factory import QuantizationComponentFactory  # noqa: E402

QuantizationSpec = spec_lib.QuantizationSpec


def _batches(dtype, n=4):
    g = torch.Generator().manual_seed(0)
    out = [torch.randn(16, 64, generator=g) * (1 + i) for i in range(n)]
    out[1] = out[1] * 1e-38  # bf16 subnormal ranges; fp16 rounds them to zero
    out[2] = out[2] * 3e3  # fp16 steps near its largest values
    return [x.to(dtype) for x in out]


@pytest.mark.parametrize("input_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("qscheme", ["symmetric", "asymmetric"])
def test_compiled_update_is_the_eager_one_and_coreai_opts(qscheme, input_dtype):
    coreai_spec = QuantizationSpec(dtype=torch.int8, qscheme=qscheme, granularity={"type": "per_channel", "axis": 0},
                                   qparam_calculator_cls="moving_average")
    calculator = QuantizationComponentFactory.create_qparams_calculator(coreai_spec, CompressionTargetTensor.ACTIVATION)
    calculator.averaging_constant = 0.1
    spec = qstats.QuantSpec.from_coreai_opt(coreai_spec, target="activation", input_dtype=input_dtype)
    obs = qstats.coreai_opt.moving_average_minmax(spec, 0.1)
    compiled = torch.compile(obs.update, fullgraph=True, dynamic=False)
    batches = _batches(input_dtype)
    eager = ours = obs.init(batches[0])
    for x in batches:
        scale, zero_point, minval = calculator(x)
        eager, ours = obs.update(eager, x), compiled(ours, x)
        assert all(torch.equal(a, b) for a, b in zip(ours, eager))
        assert torch.equal(ours.min_val, calculator.running_min.reshape(-1).float())
        assert torch.equal(ours.max_val, calculator.running_max.reshape(-1).float())
        qp = qstats.compute_qparams(ours, spec)
        assert torch.equal(qp.scale, scale.reshape(-1).float()) and torch.equal(qp.minval, minval.reshape(-1).float())
