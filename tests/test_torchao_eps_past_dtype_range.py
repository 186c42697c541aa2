"""`QuantSpec.from_torchao` with an ``eps`` the input's (or scale's) dtype cannot hold: torchao's
``choose_qparams_affine`` raises (fp16 input) or makes every scale Inf (fp16 ``scale_dtype``);
qstats took it and saturated every scale to 65504, quantizing a weight to zeros without a word."""

import warnings

import pytest
import torch

import qstats

warnings.filterwarnings("ignore")

primitives = pytest.importorskip("torchao.quantization.quant_primitives")


def test_eps_past_the_input_dtype_is_refused_as_torchao_refuses_it():
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)).half()
    with pytest.raises(RuntimeError, match="overflow"):
        primitives.choose_qparams_affine(x, primitives.MappingType.SYMMETRIC, (1, 64), torch.int8, eps=1e6)
    with pytest.raises(ValueError, match=r"eps 1e\+06 .*torch.float16"):
        qstats.QuantSpec.from_torchao(torch.int8, eps=1e6, input_dtype=torch.float16)


def test_eps_past_the_scale_dtype_is_refused_where_torchao_makes_every_scale_inf():
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    scale, _ = primitives.choose_qparams_affine(x, primitives.MappingType.SYMMETRIC, (1, 64), torch.int8, eps=1e6,
                                                scale_dtype=torch.float16)
    assert torch.isinf(scale).all()
    with pytest.raises(ValueError, match=r"eps 1e\+06 .*torch.float16"):
        qstats.QuantSpec.from_torchao(torch.int8, eps=1e6, scale_dtype=torch.float16)


@pytest.mark.parametrize("eps", (1e-10, 60000.0), ids=str)
def test_eps_the_dtypes_hold_still_matches_torchao(eps):
    x = (torch.randn(4, 64, generator=torch.Generator().manual_seed(2)) * 1e-3).half()
    scale, zero_point = primitives.choose_qparams_affine(x, primitives.MappingType.SYMMETRIC, (1, 64), torch.int8,
                                                         eps=eps)
    spec = qstats.QuantSpec.from_torchao(torch.int8, eps=eps, input_dtype=torch.float16, granularity=qstats.PerToken())
    observer = qstats.minmax(spec)
    qp = qstats.compute_qparams(observer.update(observer.init(x), x), spec)
    assert torch.equal(qp.scale.reshape(scale.shape), scale.float())
    expected = primitives.dequantize_affine(primitives.quantize_affine(x, (1, 64), scale, zero_point, torch.int8),
                                            (1, 64), scale, zero_point, torch.int8, output_dtype=torch.float16)
    assert torch.equal(qstats.fake_quantize(x, qp, spec), expected)


def test_eps_that_is_not_a_number_is_refused_naming_it():
    with pytest.raises(ValueError, match="from_torchao: eps must be a real number, got 'a'"):
        qstats.QuantSpec.from_torchao(torch.int8, eps="a")
