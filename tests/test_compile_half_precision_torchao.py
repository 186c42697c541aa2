"""Compiled compute_qparams and fake_quantize of torchao specs with a bf16/fp16 ``input_dtype`` against
torchao's own ``choose_qparams_affine`` / ``quantize_affine`` / ``dequantize_affine`` (and the tinygemm
and float8 variants), bit for bit, without inductor's ``emulate_precision_casts``: every bf16/fp16
operation torchao rounds is rounded under ``torch.compile`` too."""

from __future__ import annotations

import warnings

import pytest
import torch

import qstats

warnings.filterwarnings("ignore")
qp_lib = pytest.importorskip("torchao.quantization.quant_primitives")

MappingType, ZeroPointDomain = qp_lib.MappingType, qp_lib.ZeroPointDomain
ROWS, COLUMNS, GROUP = 16, 128, 32
# name: (target dtype, mapping, zero point domain, block size, qstats granularity)
AFFINE = {
    "int8-channel-sym": (torch.int8, "SYMMETRIC", "INT", (1, COLUMNS), qstats.PerAxis(0)),
    "int8-channel-asym": (torch.int8, "ASYMMETRIC", "INT", (1, COLUMNS), qstats.PerAxis(0)),
    "int4-group-sym": (torch.int4, "SYMMETRIC", "INT", (1, GROUP), qstats.PerGroup(GROUP)),
    "int4-group-asym": (torch.int4, "ASYMMETRIC", "INT", (1, GROUP), qstats.PerGroup(GROUP)),
    "int8-group-no-clipping-err": (torch.int8, "SYMMETRIC_NO_CLIPPING_ERR", "INT", (1, GROUP), qstats.PerGroup(GROUP)),
    "uint4-group-tinygemm": (torch.uint4, "ASYMMETRIC", "FLOAT", (1, GROUP), qstats.PerGroup(GROUP)),
}


def _weight(dtype: torch.dtype, extreme: bool) -> torch.Tensor:
    """Rows of normal values at scales from 1e-3 to 1e3; with ``extreme``, rows near the dtype's
    largest value (spans the dtype still holds), subnormals, zeros and one-sided rows."""
    generator = torch.Generator().manual_seed(7)
    w = torch.randn(ROWS, COLUMNS, generator=generator) * torch.logspace(-3, 3, ROWS)[:, None]
    if extreme:
        largest = torch.finfo(dtype).max
        w[0] = w[0].sign() * largest * 0.45
        w[1] = torch.linspace(-largest * 0.3, largest * 0.1, COLUMNS)
        w[2] = torch.randn(COLUMNS, generator=generator) * torch.finfo(dtype).tiny
        w[3] = 0.0
        w[4] = w[4].abs() + 1.0
        w[5, :GROUP] = 0.0
    return w.to(dtype)


def _compiled(spec, w):
    """qparams and fake-quantized ``w``, each compiled with fullgraph=True."""
    observer = qstats.minmax(spec)
    state = observer.update(observer.init(w), w)
    torch._dynamo.reset()
    qparams = torch.compile(lambda s: qstats.compute_qparams(s, spec), fullgraph=True)(state)
    values = torch.compile(lambda x, q: qstats.fake_quantize(x, q, spec), fullgraph=True)(w, qparams)
    torch._dynamo.reset()
    return qparams, values


def _affine_reference(w, target, mapping, domain, block_size):
    qmin, qmax = qp_lib._DTYPE_TO_QVALUE_BOUNDS[target]
    mapping = getattr(MappingType, mapping)
    if domain == "FLOAT":
        scale, zero_point = qp_lib._choose_qparams_affine_tinygemm(w, mapping, block_size, target)
        codes = qp_lib._quantize_affine_tinygemm_no_dtype_cast(w, block_size, scale, zero_point, qmin, qmax)
        values = qp_lib._dequantize_affine_tinygemm_no_dtype_check(codes, block_size, scale, zero_point, qmin, qmax,
                                                                   w.dtype)
        return scale, zero_point, values
    scale, zero_point = qp_lib.choose_qparams_affine(w, mapping, block_size, target)
    codes = qp_lib._quantize_affine_no_dtype_cast(w, block_size, scale, zero_point, qmin, qmax)
    values = qp_lib._dequantize_affine_no_dtype_check(codes, block_size, scale, zero_point, qmin, qmax, w.dtype)
    return scale, zero_point, values


@pytest.mark.parametrize("extreme", (False, True), ids=("random", "extreme"))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("name", list(AFFINE))
def test_compiled_affine_qparams_and_fake_quantize_equal_torchao(name, dtype, extreme):
    target, mapping, domain, block_size, granularity = AFFINE[name]
    spec = qstats.QuantSpec.from_torchao(target, mapping_type=mapping, zero_point_domain=domain,
                                         granularity=granularity, input_dtype=dtype)
    w = _weight(dtype, extreme)
    scale, zero_point, values = _affine_reference(w, target, mapping, domain, block_size)
    qparams, compiled = _compiled(spec, w)
    assert torch.equal(qparams.scale, scale.float().reshape(qparams.scale.shape))
    assert torch.equal(qparams.zero_point.to(zero_point.dtype), zero_point.reshape(qparams.zero_point.shape))
    assert torch.equal(compiled, values)


@pytest.mark.parametrize("extreme", (False, True), ids=("random", "extreme"))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
def test_compiled_float8_qparams_and_fake_quantize_equal_torchao(dtype, extreme):
    spec = qstats.QuantSpec.from_torchao(torch.float8_e4m3fn, granularity=qstats.PerAxis(0), input_dtype=dtype)
    w = _weight(dtype, extreme)
    # without the zero and subnormal rows: qstats floors their scale at float32's smallest normal,
    # where torchao's is 0 or subnormal (docs/differences.md)
    w[2:4] = w[8:10]
    scale = qp_lib._choose_scale_float8(w, [1, COLUMNS], torch.float8_e4m3fn)
    codes = qp_lib._quantize_affine_float8(w, scale, torch.float8_e4m3fn)
    values = qp_lib._dequantize_affine_float8(codes, scale, dtype)
    qparams, compiled = _compiled(spec, w)
    assert torch.equal(qparams.scale, scale.float().reshape(qparams.scale.shape))
    assert torch.equal(compiled, values)
