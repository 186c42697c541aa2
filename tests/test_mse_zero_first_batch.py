"""qstats.mse (accumulating) after a first batch of zeros: the reference range comes from the first
batch with a nonzero range, so the choice equals llm-compressor's memoryless_mse over all the data."""

import pytest
import torch

import qstats

llmc_observers = pytest.importorskip("llmcompressor.observers")
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402


def _memoryless_mse(fields, base_name, x):
    args = QuantizationArgs(**fields, observer="memoryless_mse", observer_kwargs={"patience": 10**6})
    observer = llmc_observers.Observer.load_from_registry("memoryless_mse", base_name=base_name, args=args)
    observer(x)
    return args, observer.get_qparams()


@pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric", "asymmetric"])
def test_per_tensor_zero_first_batch_equals_one_search_over_all_data(symmetric):
    g = torch.Generator().manual_seed(5)
    batches = [torch.zeros(2, 8, 32), torch.randn(2, 8, 32, generator=g) * 2]
    fields = dict(num_bits=4, type="int", symmetric=symmetric, strategy="tensor")
    args, want = _memoryless_mse(fields, "input", torch.cat(batches))
    spec = qstats.QuantSpec.from_compressed_tensors(args)
    obs = qstats.mse(spec)
    state = obs.init(batches[0])
    for x in batches:
        state = obs.update(state, x)
    qp = qstats.compute_qparams(state, spec)
    assert torch.equal(qp.scale, want["scale"].float().reshape(()))
    assert int(qp.zero_point) == int(want["zero_point"].reshape(()))


def test_channels_zero_in_the_first_columns_equal_one_search_over_the_weight():
    """A weight observed in two column chunks: rows 0-7 are zero in the first chunk (their
    reference comes from the second), rows 8-15 hold their extremes in the first."""
    g = torch.Generator().manual_seed(6)
    w = torch.randn(16, 64, generator=g) * torch.rand(16, 1, generator=g) * 3
    w[:8, :32] = 0.0
    w[8:, 32:] = w[8:, :32] * 0.5
    fields = dict(num_bits=4, type="int", symmetric=True, strategy="channel")
    args, want = _memoryless_mse(fields, "weight", w)
    spec = qstats.QuantSpec.from_compressed_tensors(args)
    obs = qstats.mse(spec)
    state = obs.init(w)
    for chunk in w.split(32, dim=1):
        state = obs.update(state, chunk)
    qp = qstats.compute_qparams(state, spec)
    assert torch.equal(qp.scale, want["scale"].float().reshape(qp.scale.shape))


def test_a_given_zero_reference_is_kept():
    """A reference passed to the factory fixes the candidates: a zero one stays (and merges stay exact)."""
    spec = qstats.QuantSpec(dtype="int8", mapping="asymmetric")
    x = torch.randn(4, 16)
    obs = qstats.mse(spec, reference=(torch.tensor(0.0), torch.tensor(0.0)))
    state = obs.update(obs.init(x), x)
    assert float(state.min_val) == 0.0 and float(state.max_val) == 0.0
