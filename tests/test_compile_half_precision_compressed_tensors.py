"""Compiled compute_qparams and fake_quantize of compressed-tensors specs on bf16/fp16 weights against
compressed-tensors' own ``calculate_qparams`` and ``fake_quantize``, bit for bit, without inductor's
``emulate_precision_casts``: every bf16/fp16 operation compressed-tensors rounds is rounded under
``torch.compile`` too (inductor fuses the operations in float32 and casts once otherwise)."""

from __future__ import annotations

import pytest
import torch

import qstats

ct_quantization = pytest.importorskip("compressed_tensors.quantization")
ct_forward = pytest.importorskip("compressed_tensors.quantization.lifecycle.forward")
ct_helpers = pytest.importorskip("compressed_tensors.quantization.utils.helpers")

ROWS, COLUMNS, GROUP = 16, 128, 32
ARGS = {
    "int8-channel-sym": dict(num_bits=8, type="int", symmetric=True, strategy="channel"),
    "int8-channel-asym": dict(num_bits=8, type="int", symmetric=False, strategy="channel"),
    "int4-group-sym": dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=GROUP),
    "int4-group-asym": dict(num_bits=4, type="int", symmetric=False, strategy="group", group_size=GROUP),
    "int8-group-asym": dict(num_bits=8, type="int", symmetric=False, strategy="group", group_size=GROUP),
    "fp8-channel-sym": dict(num_bits=8, type="float", symmetric=True, strategy="channel"),
}


def _weight(dtype: torch.dtype, extreme: bool) -> torch.Tensor:
    """Rows of normal values at scales from 1e-3 to 1e3; with ``extreme``, rows near the dtype's
    largest value (spans the dtype still holds), subnormals, zeros and one-sided rows."""
    generator = torch.Generator().manual_seed(7)
    w = torch.randn(ROWS, COLUMNS, generator=generator) * torch.logspace(-3, 3, ROWS)[:, None]
    if extreme:
        largest = torch.finfo(dtype).max
        w[0] = w[0].sign() * largest * 0.45  # an asymmetric span just inside the dtype
        w[1] = torch.linspace(-largest * 0.3, largest * 0.1, COLUMNS)  # a large one-sided peak
        w[2] = torch.randn(COLUMNS, generator=generator) * torch.finfo(dtype).tiny  # subnormal scales
        w[3] = 0.0
        w[4] = w[4].abs() + 1.0  # positive only: the range is widened to zero
        w[5, :GROUP] = 0.0  # one all-zero group
    return w.to(dtype)


def _reference(w: torch.Tensor, args):
    """compressed-tensors' scale, zero point and fake-quantized weight, extremes taken as
    llm-compressor's memoryless min/max does (per row, or per group of the row)."""
    view = w.reshape(ROWS, COLUMNS // GROUP, GROUP) if args.group_size else w.reshape(ROWS, 1, COLUMNS)
    scale, zero_point = ct_helpers.calculate_qparams(view.amin(-1), view.amax(-1), args)
    return scale, zero_point, ct_forward.fake_quantize(w, scale, zero_point, args)


@pytest.mark.parametrize("extreme", (False, True), ids=("random", "extreme"))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("name", list(ARGS))
def test_compiled_qparams_and_fake_quantize_equal_compressed_tensors(name, dtype, extreme):
    args = ct_quantization.QuantizationArgs(**ARGS[name])
    spec = qstats.QuantSpec.from_compressed_tensors(args, observed_dtype=dtype)
    w = _weight(dtype, extreme)
    observer = qstats.memoryless_minmax(spec)
    state = observer.update(observer.init(w), w)
    scale, zero_point, fake_quantized = _reference(w, args)
    torch._dynamo.reset()
    qparams = torch.compile(lambda s: qstats.compute_qparams(s, spec), fullgraph=True)(state)
    compiled = torch.compile(lambda x, q: qstats.fake_quantize(x, q, spec), fullgraph=True)(w, qparams)
    torch._dynamo.reset()
    assert torch.equal(qparams.scale, scale.float().reshape(qparams.scale.shape))
    assert torch.equal(qparams.zero_point.float(), zero_point.float().reshape(qparams.zero_point.shape))
    assert torch.equal(compiled, fake_quantized)
