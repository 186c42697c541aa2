"""`dequantize` of fp8 specs takes the spec's own float8 dtype (or float values): the codes of another
8-bit float format are refused, as integer codes are; they were decoded by their own format, a value
other than the one the spec's code holds (an e4m3fn code read as e4m3fnuz is half its value)."""

import warnings

import pytest
import torch

import qstats

warnings.filterwarnings("ignore")

FP8 = {"fp8_e4m3fn": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
       "fp8_e4m3fnuz": torch.float8_e4m3fnuz, "fp8_e5m2fnuz": torch.float8_e5m2fnuz}


def _codes(name):
    spec = qstats.QuantSpec(dtype=name, zero_point_domain="none", granularity=qstats.PerAxis(0))
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(0))
    obs = qstats.minmax(spec)
    qp = qstats.compute_qparams(obs.update(obs.init(x), x), spec)
    return spec, qp, qstats.quantize(x, qp, spec)


@pytest.mark.parametrize("name", sorted(FP8))
def test_own_codes_and_values_equal_torch_dequantization(name):
    spec, qp, codes = _codes(name)
    assert codes.dtype == FP8[name]
    expected = codes.float() * qp.scale.unsqueeze(-1)
    for given in (codes, codes.float(), codes.bfloat16()):
        assert torch.equal(qstats.dequantize(given, qp, spec), expected)


@pytest.mark.parametrize("name", sorted(FP8))
@pytest.mark.parametrize("other", sorted(FP8))
def test_codes_of_another_float8_format_are_refused(name, other):
    if other == name:
        return
    spec, qp, codes = _codes(name)
    misread = codes.view(FP8[other])
    # the bytes mean other values in the other format: dequantizing them gave a silently wrong tensor
    assert not torch.equal(misread.float(), codes.float())
    with pytest.raises(TypeError, match=f"another format, {FP8[other]}"):
        qstats.dequantize(misread, qp, spec)
