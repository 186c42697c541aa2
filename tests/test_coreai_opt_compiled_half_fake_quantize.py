"""`qstats.fake_quantize` of bf16/fp16 inputs under a `QuantSpec.from_coreai_opt` spec, qparams
and values computed inside one ``torch.compile(fullgraph=True)`` function, against coreai_opt
0.4.0's fake quantizer (its ``StaticQParamsCalculator`` in the input's dtype, the quantize and
dequantize in float32, then the input's dtype): the compiled values are coreai_opt's bit for bit."""

import warnings

import pytest
import torch

import qstats

spec_lib = pytest.importorskip("coreai_opt.quantization.spec.spec")
from coreai_opt.config.spec import CompressionTargetTensor  # noqa: E402
from coreai_opt.quantization.spec.factory import QuantizationComponentFactory  # noqa: E402

# (input dtype, target, qscheme, scale_dtype, granularity): a float target, an unsigned asymmetric
# integer one and an e8m0 integer one, in both half dtypes
CASES = [(torch.float16, torch.float8_e5m2, "symmetric", None, {"type": "per_block", "axis": 1, "block_size": 16}),
         (torch.bfloat16, torch.uint4, "asymmetric", None, {"type": "per_channel", "axis": 0}),
         (torch.float16, torch.int8, "symmetric", torch.float8_e8m0fnu, {"type": "per_block", "axis": 1, "block_size": 16})]


@pytest.mark.parametrize("input_dtype,dtype,qscheme,scale_dtype,granularity", CASES, ids=str)
def test_compiled_half_fake_quantize_is_coreai_opts(input_dtype, dtype, qscheme, scale_dtype, granularity):
    extra = {} if scale_dtype is None else {"scale_dtype": scale_dtype}
    coreai_spec = spec_lib.QuantizationSpec(dtype=dtype, qscheme=qscheme, granularity=granularity,
                                            qparam_calculator_cls="static", **extra)
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(32, 64, generator=g) * torch.rand(32, 1, generator=g) * 5).to(input_dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fake_quantizer = QuantizationComponentFactory.create_fake_quantizer(coreai_spec, CompressionTargetTensor.WEIGHT)
        expected = fake_quantizer(x)
    spec = qstats.QuantSpec.from_coreai_opt(coreai_spec, shape=x.shape, input_dtype=input_dtype)

    def fake(x):
        obs = qstats.memoryless_minmax(spec)
        qp = qstats.compute_qparams(obs.update(obs.init(x), x), spec)
        return qstats.fake_quantize(x, qp, spec)

    torch.compiler.reset()
    compiled = torch.compile(fake, fullgraph=True)(x)
    assert compiled.dtype == expected.dtype
    assert torch.equal(compiled, expected)
