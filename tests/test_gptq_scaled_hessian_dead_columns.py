"""qstats.gptq of a float64 Hessian past float32's Cholesky range (inputs of 1e-20, 1e20) with dead
input columns, against llm-compressor 0.14's quantize_weight computed in float64 on the same,
unscaled Hessian. gptq scales such a Hessian by a power of 4 into float32's range; a dead column's
diagonal (llm-compressor's 1, which enters the dampening through the mean diagonal) must scale with
it for the codes to stay those of the unscaled Hessian."""

from __future__ import annotations

import pytest
import torch

import qstats
from qstats.observers.hessian import hessian

llmc_gptq = pytest.importorskip("llmcompressor.modifiers.gptq.gptq_quantize")
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402

IN, OUT, ROWS, DEAD = 64, 32, 48, 8


def _data():
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(OUT, IN, generator=gen, dtype=torch.float64) * 0.05).float()
    x = torch.randn(ROWS, IN, generator=gen, dtype=torch.float64) * torch.linspace(0.05, 2.0, IN, dtype=torch.float64)
    x[:, :DEAD] = 0.0  # inputs that never fire: zero Hessian diagonal
    return weight, x


@pytest.mark.parametrize("actorder", [None, "static"])
@pytest.mark.parametrize("magnitude", [2.0**-66, 2.0**66])
def test_codes_equal_float64_llm_compressor_on_the_unscaled_hessian(monkeypatch, magnitude, actorder):
    monkeypatch.setattr(llmc_gptq, "GPTQ_PRECISION", torch.float64)  # its column loop in float64
    weight, x = _data()
    x = x * magnitude  # a power of 2: the sums are those of the unscaled rows times magnitude^2, exactly
    args = QuantizationArgs(num_bits=4, symmetric=True, strategy="group", group_size=32, actorder=actorder)
    spec = qstats.QuantSpec.from_compressed_tensors(args)
    observer = qstats.minmax(spec)
    qparams = qstats.compute_qparams(observer.update(observer.init(weight), weight), spec)
    obs = hessian(dtype=torch.float64)
    state = obs.update(obs.init(x), x)
    want, _, fallback = llmc_gptq.quantize_weight(
        weight.double()[None], (2.0 * x.T @ x / ROWS)[None], qparams.scale[None], qparams.zero_point[None], None,
        args, blocksize=128, percdamp=0.01)
    assert not bool(fallback[0])
    _, codes, _ = qstats.gptq(weight, state, spec, actorder=actorder, qparams=qparams)
    # the rest: float64 against float32 rounding of values next to a half step
    assert (codes == qstats.quantize(want[0].float(), qparams, spec)).float().mean() >= 0.99

