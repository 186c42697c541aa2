"""A Hessian state whose sum was converted to float16/bfloat16 (to save memory) is divided by its row
count in float32, as llm-compressor divides its float32 Hessian: the division ran in the sum's dtype,
where a count past float16's 65504 is Inf, so the Hessian was zeros, every column dead and every weight
quantized to zero, silently."""

import pytest
import torch

import qstats
from qstats.observers.hessian import gptq_hessian, hessian

llmc_gptq = pytest.importorskip("llmcompressor.modifiers.gptq.gptq_quantize")
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [1000, 70000])
def test_a_half_precision_sum_gives_llm_compressor_codes_on_its_float32_copy(dtype, rows):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 32, generator=gen) * torch.linspace(0.01, 0.2, 32)
    weight = torch.randn(16, 32, generator=gen) * 0.05
    observer = hessian()
    state = observer.update(observer.init(x), x)
    state = state._replace(total=state.total.to(dtype))
    args = QuantizationArgs(num_bits=4, symmetric=True, strategy="group", group_size=16)
    spec = qstats.QuantSpec.from_compressed_tensors(args)
    minmax = qstats.minmax(spec)
    qparams = qstats.compute_qparams(minmax.update(minmax.init(weight), weight), spec)

    reference_hessian = 2.0 * state.total.float() / rows  # llm-compressor: float32 H / num_samples
    want, _, fallback = llmc_gptq.quantize_weight(weight.clone()[None], reference_hessian[None], qparams.scale[None],
                                                  qparams.zero_point[None], None, args)
    got, codes, _ = qstats.gptq(weight, state, spec, qparams=qparams)
    assert not bool(fallback[0])
    assert (codes == qstats.quantize(want[0], qparams, spec)).float().mean() >= 0.999
    assert (got != 0).float().mean() > 0.5
    assert torch.isfinite(gptq_hessian(state)).all() and gptq_hessian(state).diagonal().gt(0).all()
