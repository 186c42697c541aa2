"""qstats.gptq against llm-compressor 0.14's quantize_weight on Hessians that are singular or nearly
so: a rank-deficient or nearly singular Hessian without dampening (both flag the layer and round it
to nearest), and one whose Cholesky factor exists in float32 but whose inverse's does not:
llm-compressor raises torch's LinAlgError from ``factorize_hessian``'s second
``torch.linalg.cholesky``, qstats rounds to nearest with the same warning as the first case."""

from __future__ import annotations

import pytest
import torch

import qstats
from qstats.observers.hessian import HessianState, gptq_hessian, hessian

llmc_gptq = pytest.importorskip("llmcompressor.modifiers.gptq.gptq_quantize")
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402

ARGS = QuantizationArgs(num_bits=4, symmetric=True, strategy="group", group_size=32)
SPEC = qstats.QuantSpec.from_compressed_tensors(ARGS)


def _weight_and_qparams(seed=0):
    weight = torch.randn(32, 64, generator=torch.Generator().manual_seed(seed)) * 0.05
    observer = qstats.minmax(SPEC)
    return weight, qstats.compute_qparams(observer.update(observer.init(weight), weight), SPEC)


def _conditioned_state(decades: float, seed: int = 0) -> HessianState:
    """A float32 Hessian (``gptq_hessian`` of the state, bit for bit) with eigenvalues 1 to 10^-decades."""
    gen = torch.Generator().manual_seed(seed)
    basis, _ = torch.linalg.qr(torch.randn(64, 64, generator=gen, dtype=torch.float64))
    matrix = ((basis * torch.logspace(0, -decades, 64, dtype=torch.float64)) @ basis.T).float()
    return HessianState((matrix + matrix.T) / 2, torch.tensor(2), torch.tensor(0))


def _llm_compressor(weight, hessian_matrix, qparams, dampening):
    quantized, _, fallback = llmc_gptq.quantize_weight(weight.clone()[None], hessian_matrix.clone()[None],
                                                       qparams.scale[None], qparams.zero_point[None], None, ARGS,
                                                       percdamp=dampening)
    return quantized[0], bool(fallback[0])


@pytest.mark.parametrize("case", ["10 rows of 64 columns", "a duplicated column", "eigenvalues down to 1e-12"])
def test_undampened_singular_hessians_round_to_nearest_as_llm_compressor(case):
    weight, qparams = _weight_and_qparams()
    gen = torch.Generator().manual_seed(1)
    if case == "eigenvalues down to 1e-12":
        state = _conditioned_state(12)
    else:
        x = torch.randn(10 if case.startswith("10") else 200, 64, generator=gen)
        x[:, 5] = x[:, 6]
        state = hessian().update(hessian().init(x), x)
    want, fallback = _llm_compressor(weight, gptq_hessian(state), qparams, dampening=0.0)
    assert fallback
    with pytest.warns(UserWarning, match="the layer is not positive definite"):
        got, codes, _ = qstats.gptq(weight, state, SPEC, dampening=0.0, qparams=qparams)
    assert torch.equal(got, want) and torch.equal(got, qstats.fake_quantize(weight, qparams, SPEC))


def _factoring_with_unfactorable_inverse(weight, qparams, seed):
    """A state whose float32 Hessian factors while llm-compressor's factor of its inverse fails: where
    that border lies (about 8.5 decades) moves with the machine's LAPACK kernels, so the first of a few
    condition numbers around it that does so here."""
    for decades in (8.5, 8.25, 8.75, 8.0, 9.0, 7.75, 9.25):
        state = _conditioned_state(decades, seed)
        if int(torch.linalg.cholesky_ex(gptq_hessian(state))[1]) != 0:  # the Hessian itself must factor
            continue
        try:
            _llm_compressor(weight, gptq_hessian(state), qparams, dampening=0.0)
        except torch.linalg.LinAlgError:
            return state
    raise AssertionError("no condition number from 7.75 to 9.25 decades gives a Hessian that factors and an "
                         "inverse that does not")


@pytest.mark.parametrize("seed", [0, 1])
def test_a_hessian_whose_inverse_has_no_float32_factor_rounds_to_nearest_where_llm_compressor_raises(seed):
    weight, qparams = _weight_and_qparams(seed)
    state = _factoring_with_unfactorable_inverse(weight, qparams, seed)
    with pytest.raises(torch.linalg.LinAlgError, match="not positive-definite"):
        _llm_compressor(weight, gptq_hessian(state), qparams, dampening=0.0)
    with pytest.warns(UserWarning, match="not positive definite, or too ill-conditioned to invert, in float32"):
        got, _, _ = qstats.gptq(weight, state, SPEC, dampening=0.0, qparams=qparams)
    assert torch.equal(got, qstats.fake_quantize(weight, qparams, SPEC))
    # dampened as by default, both factor it and agree
    want, fallback = _llm_compressor(weight, gptq_hessian(state), qparams, dampening=0.01)
    _, codes, _ = qstats.gptq(weight, state, SPEC, qparams=qparams)
    assert not fallback and torch.equal(codes, qstats.quantize(want, qparams, SPEC))
