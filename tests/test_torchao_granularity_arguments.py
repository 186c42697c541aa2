"""from_torchao's granularity arguments: ``granularity=`` or torchao's ``block_size=`` (with
``shape=``), each alone equal to torchao's ``choose_qparams_affine`` with that block size; both
together are refused (one of them would be ignored, whatever blocks it named)."""

import warnings

import pytest
import torch

import qstats

warnings.filterwarnings("ignore")

qp_lib = pytest.importorskip("torchao.quantization.quant_primitives")
from torchao.quantization import granularity as G  # noqa: E402

MappingType = qp_lib.MappingType


def _scale(spec, x):
    obs = qstats.minmax(spec)
    return qstats.compute_qparams(obs.update(obs.init(x), x), spec).scale


@pytest.mark.parametrize("granularity", (G.PerTensor(), qstats.PerTensor(), G.PerGroup(32)), ids=repr)
def test_granularity_and_block_size_together_are_refused(granularity):
    with pytest.raises(ValueError, match="granularity=.*or block_size=.*not both"):
        qstats.QuantSpec.from_torchao(torch.int4, granularity=granularity, block_size=(1, 16), shape=(4, 64))


@pytest.mark.parametrize("target_dtype", (torch.int4, torch.float8_e4m3fn), ids=str)
def test_block_size_alone_equals_choose_qparams_affine(target_dtype):
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(5)) * 3
    spec = qstats.QuantSpec.from_torchao(target_dtype, block_size=(1, 16), shape=x.shape)
    if target_dtype == torch.int4:
        expected, _ = qp_lib.choose_qparams_affine(x, MappingType.SYMMETRIC, (1, 16), torch.int4)
    else:
        expected = qp_lib._choose_scale_float8(x, (1, 16), torch.float8_e4m3fn)
    assert torch.equal(_scale(spec, x).reshape(expected.shape), expected)
