"""`compute_qparams` of a `QuantSpec.from_coreai_opt` spec with a bf16/fp16 ``input_dtype``, under
``torch.compile``, against coreai_opt 0.4.0's ``StaticQParamsCalculator`` (torchao's
``choose_qparams_affine_with_min_max`` in the input's dtype, each op rounded to it): inductor keeps
float32 between fused ops, so the arithmetic rounds to the input's dtype by itself; the compiled
scales and zero points are coreai_opt's bit for bit, as the eager ones."""

import warnings

import pytest
import torch

import qstats

spec_lib = pytest.importorskip("coreai_opt.quantization.spec.spec")
from coreai_opt.config.spec import CompressionTargetTensor  # noqa: E402
from coreai_opt.quantization.spec.factory import QuantizationComponentFactory  # noqa: E402

# (input dtype, target, qscheme, granularity): both half dtypes, both mappings, a clipped and an
# unsigned range, fp8, per channel and per block
CASES = [(torch.bfloat16, torch.int8, "asymmetric", {"type": "per_channel", "axis": 0}),
         (torch.bfloat16, torch.int4, "symmetric_with_clipping", {"type": "per_block", "axis": 1, "block_size": 16}),
         (torch.bfloat16, torch.float8_e4m3fn, "symmetric", {"type": "per_channel", "axis": 0}),
         (torch.float16, torch.int8, "symmetric", {"type": "per_block", "axis": 1, "block_size": 16}),
         (torch.float16, torch.uint4, "asymmetric", {"type": "per_channel", "axis": 0})]


def _coreai_qparams(coreai_spec, x):
    """coreai_opt's ``(scale, zero_point, minval)`` of weight ``x`` under ``coreai_spec``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calculator = QuantizationComponentFactory.create_qparams_calculator(coreai_spec, CompressionTargetTensor.WEIGHT)
        return calculator(x)


def _compiled_and_eager(spec, state, float_range):
    torch.compiler.reset()
    compiled = torch.compile(lambda s: qstats.compute_qparams(s, spec, float_range=float_range), fullgraph=True)
    return compiled(state), qstats.compute_qparams(state, spec, float_range=float_range)


@pytest.mark.parametrize("input_dtype,dtype,qscheme,granularity", CASES, ids=str)
def test_compiled_half_precision_qparams_are_coreai_opts(input_dtype, dtype, qscheme, granularity):
    float_range = (None, 1.5)
    coreai_spec = spec_lib.QuantizationSpec(dtype=dtype, qscheme=qscheme, granularity=granularity,
                                            qparam_calculator_cls="static", float_range=list(float_range))
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(256, 64, generator=g) * torch.rand(256, 1, generator=g) * 4).to(input_dtype)
    scale, zero_point, _ = _coreai_qparams(coreai_spec, x)
    spec = qstats.QuantSpec.from_coreai_opt(coreai_spec, shape=x.shape, input_dtype=input_dtype)
    obs = qstats.memoryless_minmax(spec)
    compiled, eager = _compiled_and_eager(spec, obs.update(obs.init(x), x), float_range)
    for qp in (eager, compiled):
        assert torch.equal(qp.scale, scale.reshape(qp.scale.shape).float())
        if zero_point is not None:  # None: a float target's
            assert torch.equal(qp.zero_point, zero_point.reshape(qp.zero_point.shape))


def test_compiled_saturated_fp16_scale_is_the_eager_one():
    """An fp16 range wider than 65504: coreai_opt's scale is Inf (docs/differences.md), qstats' the
    saturated span's, compiled as eager."""
    spec = qstats.QuantSpec.from_coreai_opt(dtype=torch.int8, qscheme="asymmetric", input_dtype=torch.float16)
    x = torch.tensor([[-40000.0, 40000.0], [-1.0, 3.0]], dtype=torch.float16)
    obs = qstats.memoryless_minmax(spec)
    compiled, eager = _compiled_and_eager(spec, obs.update(obs.init(x), x), (None, None))
    assert bool(torch.isfinite(eager.scale).all())
    assert torch.equal(compiled.scale, eager.scale) and torch.equal(compiled.zero_point, eager.zero_point)


@pytest.mark.parametrize("input_dtype,qscheme,float_range", [
    (torch.bfloat16, "symmetric", (None, 1.9999999)),
    (torch.float16, "symmetric", (-1e-5, None)),
    (torch.bfloat16, "asymmetric", (-1.9999999, None)),
], ids=str)
def test_compiled_minval_rounds_a_pinned_end_as_coreai_opt(input_dtype, qscheme, float_range):
    """A pinned ``float_range`` end the input's dtype does not hold (1.9999999 in bf16): coreai_opt's
    ``minval`` holds it rounded to that dtype, compiled as eager (inductor dropped the cast pair)."""
    coreai_spec = spec_lib.QuantizationSpec(dtype=torch.int8, qscheme=qscheme, granularity={"type": "per_channel", "axis": 0},
                                            qparam_calculator_cls="static", float_range=list(float_range))
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(16, 64, generator=g) * 0.5).to(input_dtype)
    _, _, minval = _coreai_qparams(coreai_spec, x)
    spec = qstats.QuantSpec.from_coreai_opt(coreai_spec, shape=x.shape, input_dtype=input_dtype)
    obs = qstats.memoryless_minmax(spec)
    compiled, eager = _compiled_and_eager(spec, obs.update(obs.init(x), x), float_range)
    for qp in (eager, compiled):
        assert torch.equal(qp.minval, minval.reshape(qp.minval.shape).float())
