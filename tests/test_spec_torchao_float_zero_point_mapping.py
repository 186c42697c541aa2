"""QuantSpec(convention="torchao", zero_point_domain="float") is torchao's tinygemm arithmetic, which maps
asymmetric ranges onto unsigned targets only. With the default mapping ('symmetric'), 'narrow' or
'symmetric_no_clipping_err' the spec was accepted, its qparams ignored the mapping, and on a signed
target the codes started at quant_min: the upper half of every range was clipped (int4: values up to
8 steps off). Such specs are refused, naming the mapping, as ``from_torchao`` refuses
ZeroPointDomain.FLOAT without MappingType.ASYMMETRIC; the asymmetric unsigned spec still equals
torchao's tinygemm functions."""

from __future__ import annotations

import pytest
import torch

import qstats

qp_lib = pytest.importorskip("torchao.quantization.quant_primitives")


@pytest.mark.parametrize("convention", ("torchao", "coreai_opt"))
@pytest.mark.parametrize("mapping", ("symmetric", "narrow", "symmetric_no_clipping_err"))
@pytest.mark.parametrize("dtype", ("int4", "int8"))
def test_float_zero_point_without_asymmetric_mapping_is_refused_naming_it(convention, mapping, dtype):
    with pytest.raises(ValueError, match=rf"zero_point_domain 'float'.*asymmetric.*{mapping}"):
        qstats.QuantSpec(dtype=dtype, mapping=mapping, zero_point_domain="float", convention=convention,
                         granularity=qstats.PerGroup(32))


@pytest.mark.parametrize("mapping", ("SYMMETRIC", "SYMMETRIC_NO_CLIPPING_ERR"))
def test_from_torchao_refuses_the_same_arguments(mapping):
    with pytest.raises(ValueError, match="ASYMMETRIC"):
        qstats.QuantSpec.from_torchao(torch.int4, mapping_type=getattr(qp_lib.MappingType, mapping),
                                      zero_point_domain=qp_lib.ZeroPointDomain.FLOAT, granularity=qstats.PerGroup(32))


def test_asymmetric_unsigned_float_zero_point_equals_torchao_tinygemm():
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)) * 2 + 0.3
    spec = qstats.QuantSpec(dtype="uint4", mapping="asymmetric", zero_point_domain="float", convention="torchao",
                            granularity=qstats.PerGroup(32))
    obs = qstats.minmax(spec)
    qp = qstats.compute_qparams(obs.update(obs.init(x), x), spec)
    block, (qmin, qmax) = (1, 32), spec.qrange
    scale, zero_point = qp_lib._choose_qparams_affine_tinygemm(x, qp_lib.MappingType.ASYMMETRIC, block, torch.uint4)
    assert torch.equal(qp.scale, scale.reshape(qp.scale.shape))
    assert torch.equal(qp.zero_point, zero_point.reshape(qp.zero_point.shape))
    codes = qp_lib._quantize_affine_tinygemm_no_dtype_cast(x, block, scale, zero_point, qmin, qmax)
    values = qp_lib._dequantize_affine_tinygemm_no_dtype_check(codes, block, scale, zero_point, qmin, qmax, x.dtype)
    assert torch.equal(qstats.fake_quantize(x, qp, spec), values)
    # every value within half a step of its own: nothing clipped
    step = qp.scale.repeat_interleave(32, dim=-1)
    assert bool(((values - x).abs() <= step / 2 * (1 + 1e-6)).all())
