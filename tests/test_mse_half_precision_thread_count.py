"""qstats.mse on large bf16 per-tensor searches against llm-compressor's memoryless_mse: its error
sums (``torch.sum`` of a bf16 tensor on CPU) round each thread's partial sum to bf16, so its choice
depends on the thread count; qstats rounds the float32 sum once, as it does on one thread
(docs/differences.md)."""

import pytest
import torch

import qstats

llmc_observers = pytest.importorskip("llmcompressor.observers")
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402

FIELDS = dict(num_bits=8, type="int", symmetric=False, strategy="tensor")


def _llmc_scale(w, threads):
    args = QuantizationArgs(**FIELDS, observer="memoryless_mse")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        observer = llmc_observers.Observer.load_from_registry("memoryless_mse", base_name="weight", args=args)
        observer(w)
        return observer.get_qparams()["scale"].float().reshape(())
    finally:
        torch.set_num_threads(before)


def _weight(seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(128, 512, generator=g) * torch.rand(128, 1, generator=g) * 3).to(torch.bfloat16)


@pytest.mark.parametrize("seed", range(3))
def test_large_bf16_per_tensor_search_is_llm_compressors_on_one_thread(seed):
    w = _weight(seed)
    spec = qstats.QuantSpec.from_compressed_tensors(QuantizationArgs(**FIELDS), observed_dtype=torch.bfloat16)
    obs = qstats.mse(spec)
    for threads in (1, 2):  # qstats' choice does not depend on the thread count
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            qp = qstats.compute_qparams(obs.update(obs.init(w), w), spec, patience=5)
        finally:
            torch.set_num_threads(before)
        assert torch.equal(qp.scale.float(), _llmc_scale(w, 1)), (seed, threads)


def test_llm_compressors_bf16_error_sums_depend_on_the_thread_count():
    """The claim in docs/differences.md: seed 2 of the weights above, 65,536 values per tensor."""
    w = _weight(2)
    assert float(_llmc_scale(w, 1)) == 0.078125
    assert float(_llmc_scale(w, 2)) == pytest.approx(0.078613, abs=1e-6)
