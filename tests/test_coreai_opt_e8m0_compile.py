"""Power-of-two (e8m0) scales of `QuantSpec.from_coreai_opt` specs for bf16/fp16 inputs with one
``float_range`` end pinned, under ``torch.compile``.

Reference: Apple coreai_opt 0.4.0's ``StaticQParamsCalculator`` (the pinned end cast to the input's
dtype before ``_compute_e8m0_scale``: 1.9999999 becomes 2.0 in bf16, one exponent up), and the
same ``compute_qparams`` run eagerly. torch.compile keeps float32 between fused ops, so a rounding
written as a cast pair vanished from the compiled scale (half coreai_opt's where the end rounds up to a power of two).
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


@pytest.mark.parametrize("float_range", [(None, 1.9999999), (-1.9999999, None), (None, 0.99951)], ids=str)
@pytest.mark.parametrize("input_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("dtype,scale_dtype", [(torch.int8, torch.float8_e8m0fnu), (torch.float8_e4m3fn, torch.float8_e8m0fnu),
                                               (torch.float4_e2m1fn_x2, None)], ids=str)
def test_compiled_e8m0_scale_is_the_eager_one_and_coreai_opts(dtype, scale_dtype, input_dtype, float_range):
    extra = {} if scale_dtype is None else {"scale_dtype": scale_dtype}
    coreai_spec = QuantizationSpec(dtype=dtype, granularity={"type": "per_channel", "axis": 0}, float_range=list(float_range),
                                   qparam_calculator_cls="static", **extra)
    x = (torch.randn(16, 64, generator=torch.Generator().manual_seed(0)) * 0.25).to(input_dtype)
    scale = QuantizationComponentFactory.create_qparams_calculator(coreai_spec, CompressionTargetTensor.WEIGHT)(x)[0]
    spec = qstats.QuantSpec.from_coreai_opt(coreai_spec, shape=x.shape, input_dtype=input_dtype)
    obs = qstats.minmax(spec)
    state = obs.update(obs.init(x), x)
    eager = qstats.compute_qparams(state, spec, float_range=float_range)
    torch.compiler.reset()  # one compiled function per case (the recompile limit is per code object)
    compiled = torch.compile(lambda s: qstats.compute_qparams(s, spec, float_range=float_range), fullgraph=True)(state)
    assert torch.equal(eager.scale, scale.reshape(-1))
    assert torch.equal(compiled.scale, eager.scale)
