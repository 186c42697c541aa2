"""``zero_point_domain="none"`` (every zero point 0) on integer targets: refused where the mapping needs
a zero point other than 0 (the codes would clip part of the observed range), kept where 0 is the
mapping's own zero point (signed symmetric targets, and torchao's unsigned symmetric ones, which
torchao's ``ZeroPointDomain.NONE`` computes without zero point too: tests/test_compat_torchao.py))."""

import pytest
import torch

import qstats


def _fake_quantized(spec, x):
    obs = qstats.minmax(spec)
    return qstats.fake_quantize(x, qstats.compute_qparams(obs.update(obs.init(x), x), spec), spec)


@pytest.mark.parametrize("convention", ["torch_ao", "torchao", "coreai_opt"])
@pytest.mark.parametrize("dtype", ["int8", "uint8", "int4"])
def test_asymmetric_mappings_without_zero_point_are_refused(convention, dtype):
    with pytest.raises(ValueError, match=r"zero_point_domain 'none': an asymmetric mapping needs its zero point"):
        qstats.QuantSpec(dtype=dtype, mapping="asymmetric", zero_point_domain="none", convention=convention)


@pytest.mark.parametrize("dtype", ["uint8", "uint4"])
def test_torch_ao_symmetric_unsigned_targets_without_zero_point_are_refused(dtype):
    with pytest.raises(ValueError, match=rf"the symmetric mapping of '{dtype}' \(zero point \d+\) needs its zero point"):
        qstats.QuantSpec(dtype=dtype, mapping="symmetric", zero_point_domain="none")


@pytest.mark.parametrize("convention", ["torch_ao", "torchao", "coreai_opt", "compressed_tensors"])
@pytest.mark.parametrize("mapping", ["symmetric", "narrow"])
def test_signed_symmetric_targets_without_zero_point_quantize_as_with_zero_point_zero(convention, mapping):
    if convention == "compressed_tensors" and mapping == "narrow":
        pytest.skip("compressed-tensors has no narrow mapping")
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(0)) * 3 + 1
    none = qstats.QuantSpec(dtype="int8", mapping=mapping, zero_point_domain="none", convention=convention)
    assert torch.equal(_fake_quantized(none, x), _fake_quantized(none.replace(zero_point_domain="int"), x))

