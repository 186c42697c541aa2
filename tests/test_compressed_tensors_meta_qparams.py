"""compressed-tensors qparams of half-precision weights on the meta device (llm-compressor's
`model_free_ptq` sizes its work on meta tensors): shapes and dtypes as on the CPU and as
compressed-tensors' own `calculate_qparams` on meta."""

import pytest
import torch

import qstats

ct = pytest.importorskip("compressed_tensors.quantization.utils")
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402


@pytest.mark.parametrize("compute", ["bfloat16", "float16"])
@pytest.mark.parametrize("target, args", [
    ("int8", dict(num_bits=8, type="int")),
    ("int4", dict(num_bits=4, type="int")),
    ("fp8_e4m3fn", dict(num_bits=8, type="float")),
])
def test_symmetric_channel_qparams_on_meta(compute, target, args):
    spec = qstats.QuantSpec(dtype=target, granularity=qstats.PerAxis(0), convention="compressed_tensors",
                            compute_dtype=compute, mapping="symmetric")
    dtype = getattr(torch, compute)
    obs = qstats.minmax(spec)
    on = {}
    for device in ("cpu", "meta"):
        w = torch.randn(8, 16, dtype=dtype, device=device)
        on[device] = qstats.compute_qparams(obs.update(obs.init(w), w), spec)
    assert on["meta"].scale.device.type == "meta"
    for field in ("scale", "zero_point"):
        cpu, meta = getattr(on["cpu"], field), getattr(on["meta"], field)
        assert (meta.shape, meta.dtype) == (cpu.shape, cpu.dtype), field

    reference_args = QuantizationArgs(strategy="channel", symmetric=True, **args)
    lo = torch.empty(8, 1, dtype=dtype, device="meta")
    scale, _ = ct.calculate_qparams(lo, lo, reference_args)
    assert scale.numel() == on["meta"].scale.numel()
