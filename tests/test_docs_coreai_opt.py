"""docs/migrating_coreai_opt.md: ``compute_qparams`` of a `QuantSpec.from_coreai_opt` integer spec
with a bf16 ``input_dtype`` gives coreai_opt 0.4.0's ``StaticQParamsCalculator`` scales bit for bit,
eagerly and under ``torch.compile`` (its arithmetic rounds each op to bf16 itself: inductor keeps
float32 between fused ops); float64 inputs get float32 scales, a last bit off coreai_opt's in places."""

import warnings

import pytest
import torch

import qstats

spec_lib = pytest.importorskip("coreai_opt.quantization.spec.spec")
from coreai_opt.config.spec import CompressionTargetTensor  # noqa: E402
from coreai_opt.quantization.spec.factory import QuantizationComponentFactory  # noqa: E402


def test_compiled_and_eager_bf16_integer_scales_are_coreai_opts():
    coreai_spec = spec_lib.QuantizationSpec(dtype=torch.int8, qscheme="symmetric", qparam_calculator_cls="static",
                                            granularity={"type": "per_channel", "axis": 0})
    x = torch.randn(1024, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calculator = QuantizationComponentFactory.create_qparams_calculator(coreai_spec, CompressionTargetTensor.WEIGHT)
        reference = calculator(x)[0].reshape(-1).float()
    spec = qstats.QuantSpec.from_coreai_opt(coreai_spec, shape=x.shape, input_dtype=torch.bfloat16)
    obs = qstats.memoryless_minmax(spec)
    state = obs.update(obs.init(x), x)
    eager = qstats.compute_qparams(state, spec).scale
    torch.compiler.reset()
    compiled = torch.compile(lambda s: qstats.compute_qparams(s, spec), fullgraph=True)(state).scale
    assert torch.equal(eager, reference)
    assert torch.equal(compiled, reference)


def test_float64_input_scales_are_float32_a_last_bit_off_coreai_opts_in_places():
    """A float64 64x64 weight under a float32 per-channel asymmetric int8 spec: qstats' float32
    scales, coreai_opt's float64 ones; some channels differ, by a last float32 bit at most."""
    coreai_spec = spec_lib.QuantizationSpec(dtype=torch.int8, qscheme="asymmetric", qparam_calculator_cls="static",
                                            granularity={"type": "per_channel", "axis": 0})
    x = torch.randn(64, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calculator = QuantizationComponentFactory.create_qparams_calculator(coreai_spec, CompressionTargetTensor.WEIGHT)
        reference = calculator(x)[0].reshape(-1)
    spec = qstats.QuantSpec.from_coreai_opt(coreai_spec, shape=x.shape)
    obs = qstats.memoryless_minmax(spec)
    ours = qstats.compute_qparams(obs.update(obs.init(x), x), spec).scale
    assert reference.dtype == torch.float64 and ours.dtype == torch.float32
    rounded = reference.float()
    differing = int((ours != rounded).sum())
    assert 0 < differing < 64, differing
    ulp = torch.nextafter(rounded, torch.full_like(rounded, float("inf"))) - rounded
    assert bool(((ours - rounded).abs() <= ulp).all())
