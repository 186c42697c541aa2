"""Range methods under ``preserve_zero=False`` (torchao): torchao's integer zero point of a range
that does not hold zero is clamped into the code range, so such a one-sided range quantizes data
away from zero to one value (torchao's own ``_choose_qparams_affine_dont_preserve_zero`` +
``quantize_affine``). The percentile and mean/std ranges hold zero there, and quantize that data
within half a step, by torchao's arithmetic."""

import pytest
import torch

import qstats

qp_lib = pytest.importorskip("torchao.quantization.quant_primitives")
from torchao.quantization import granularity as tao_granularity  # noqa: E402

MappingType = qp_lib.MappingType


def _data():
    """Rows far from zero on either side (``[2, 3]``, ``[-5, -4]``) and one across it."""
    g = torch.Generator().manual_seed(0)
    x = torch.rand(3, 4096, generator=g)
    return x + torch.tensor([[2.0], [-5.0], [-0.5]])


def _torchao_round_trip(x, scale, zero_point, target_dtype):
    block = (1, x.shape[-1])
    codes = qp_lib.quantize_affine(x, block, scale, zero_point, target_dtype)
    return qp_lib.dequantize_affine(codes, block, scale, zero_point, target_dtype)


def test_torchaos_one_sided_range_without_zero_loses_the_data():
    """Why the methods below keep zero: torchao maps rows in [2, 3] to a single value."""
    x = _data()
    scale, zero_point = qp_lib._choose_qparams_affine_dont_preserve_zero(
        x, MappingType.ASYMMETRIC, (1, x.shape[-1]), torch.uint8, scale_dtype=torch.float32)
    back = _torchao_round_trip(x, scale, zero_point, torch.uint8)
    assert back[0].unique().numel() == 1 and back[1].unique().numel() == 1


@pytest.mark.parametrize("target_dtype", (torch.uint8, torch.uint4), ids=str)
@pytest.mark.parametrize("method", ("percentile", "mean_std"))
def test_ranges_hold_zero_and_keep_the_data_under_preserve_zero_false(method, target_dtype):
    x = _data()
    spec = qstats.QuantSpec.from_torchao(target_dtype, mapping_type=MappingType.ASYMMETRIC,
                                         granularity=tao_granularity.PerRow(), preserve_zero=False)
    obs = qstats.histogram(spec) if method == "percentile" else qstats.moments(spec)
    options = {"percentile": 100.0} if method == "percentile" else {"k": 4.0}
    qp = qstats.compute_qparams(obs.update(obs.init(x), x), spec, method=method, **options)
    back = _torchao_round_trip(x, qp.scale.reshape(3, 1), qp.zero_point.reshape(3, 1), target_dtype)
    assert ((back - x).abs() <= qp.scale.reshape(3, 1) * (0.5 + 1e-4)).all()
    assert torch.equal(qstats.fake_quantize(x, qp, spec), back)
