"""A last dimension that the MX block (32) does not divide, against ModelOpt 0.47's qtensors.

``MXFP8QTensor`` pads each row with zeros to whole blocks: its e8m0 scales, fp8 codes and dequantized
values are those of ``PerBlock((1, 32), partial=True)`` with RCEIL scales, bit for bit (fp32 and bf16;
``PerGroup(32)``, as torchao's ``to_mx``, refuses the shape). ``MXFP4QTensor`` instead views the flat
tensor as blocks of 32 that run across rows (a block holds the end of one row and the start of the
next), which no qstats granularity gives: its scales are checked to do so, so that a fix shows.
"""

import warnings

import pytest
import torch

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # ModelOpt warns about untested transformers versions at import
    pytest.importorskip("modelopt.torch.quantization")
    from modelopt.torch.quantization.qtensor import MXFP4QTensor, MXFP8QTensor

import qstats

MXFP8_PARTIAL = qstats.QuantSpec(dtype="fp8_e4m3fn", granularity=qstats.PerBlock((1, 32), partial=True),
                                 scale_dtype="e8m0", scale_rounding="rceil", zero_point_domain="none")


def _observe(spec, x):
    obs = qstats.minmax(spec)
    return qstats.compute_qparams(obs.update(obs.init(x), x), spec)


def _bits(t):
    return t.float().contiguous().view(torch.int32)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("columns", (40, 70, 100))
def test_mxfp8_partial_last_block_equals_modelopt(columns, dtype):
    g = torch.Generator().manual_seed(columns)
    x = (torch.randn(6, columns, generator=g) * torch.logspace(-3, 3, 6)[:, None]).to(dtype)
    x[1, -3:] = 500.0  # the partial block holds a row's maximum
    packed, exponents = MXFP8QTensor.quantize(x.clone())
    assert exponents.shape == (6, -(-columns // 32))  # ceil: the padded blocks
    qp = _observe(MXFP8_PARTIAL, x)
    assert torch.equal((torch.log2(qp.scale) + 127).to(torch.uint8), exponents)
    codes = qstats.quantize(x, qp, MXFP8_PARTIAL)
    assert torch.equal(codes.view(torch.uint8), packed._quantized_data.view(torch.uint8))
    dequantized = packed.dequantize(dtype, scale=exponents)
    assert torch.equal(_bits(qstats.fake_quantize(x, qp, MXFP8_PARTIAL)), _bits(dequantized))
    with pytest.raises(ValueError, match="does not divide"):
        _observe(qstats.preset("mxfp8", scale_rounding="rceil"), x)


def test_mxfp4_blocks_of_a_partial_last_dimension_run_across_rows():
    x = torch.zeros(4, 40)
    x[0], x[1] = 1.0, 100.0
    _, exponents = MXFP4QTensor.quantize(x.clone(), 32)
    # blocks of the flat tensor: [0, 32) in row 0; [32, 64) = the end of row 0 and the start of row 1
    flat_blocks = x.reshape(-1, 32).abs().amax(-1)
    expected = torch.where(flat_blocks > 0, torch.ceil(torch.log2(flat_blocks / 6.0)) + 127, torch.zeros(()))
    assert torch.equal(exponents.flatten().float(), expected)
    assert exponents.flatten()[1] > exponents.flatten()[0]  # row 0's last 8 ones (all 1.0) share row 1's 100s
