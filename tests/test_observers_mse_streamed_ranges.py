"""`qstats.mse` (mode "accumulate", no ``reference``) fed a tensor batch by batch against llm-compressor
0.14's ``memoryless_mse`` searching the whole tensor at once. The state's reference range was the first
batch's: later values past it were clipped by every candidate (many tiny batches: 10.4 dB where one batch
gives 41.3; a first batch 1000 times narrower: 0.02 dB against 41.4). A batch past the reference now widens
it, and the losses of the batches before are carried to the wider candidates."""

from __future__ import annotations

import pytest
import torch

import qstats

llmc_observers = pytest.importorskip("llmcompressor.observers")
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread_quiet")

CHANNEL_ARGS = {
    "int8-sym": dict(num_bits=8, type="int", symmetric=True, strategy="channel"),
    "int4-asym": dict(num_bits=4, type="int", symmetric=False, strategy="channel"),
    "fp8": dict(num_bits=8, type="float", symmetric=True, strategy="channel"),
}


def _memoryless_mse(args, x):
    """llm-compressor's search over all of ``x`` at once (no early stop: qstats' accumulating search
    takes the argmin over every candidate)."""
    args = args.model_copy(update={"observer": "memoryless_mse", "observer_kwargs": {"patience": 10**6}})
    observer = llmc_observers.Observer.load_from_registry("memoryless_mse", base_name="weight", args=args)
    observer(x)
    qparams = observer.get_qparams()
    return qparams["scale"].reshape(-1), qparams["zero_point"].reshape(-1)


def _streamed_state(spec, batches):
    observer = qstats.mse(spec)
    state = observer.init(batches[0])
    for batch in batches:
        state = observer.update(state, batch)
    return state


def _streamed(spec, batches):
    return qstats.compute_qparams(_streamed_state(spec, batches), spec)


def _sqnr(x, scale, zero_point, args):
    """dB of ``x`` fake-quantized by compressed-tensors with these qparams (per output channel)."""
    from compressed_tensors.quantization.lifecycle import fake_quantize

    fq = fake_quantize(x, scale.reshape(-1, 1), zero_point.reshape(-1, 1).to(torch.int8), args)
    return float(10 * torch.log10(x.pow(2).sum() / (fq - x).pow(2).sum()))


def _columns(seed, count, width):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(8, width, generator=generator) for _ in range(count)]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("name", ["int8-sym", "int4-asym"])
def test_many_tiny_batches_quantize_as_one_search_over_all_data(name, seed):
    # 1000 batches of 3 values per channel: the ranges of the later ones pass the first's; the choice is
    # llm-compressor's over the whole tensor or a shrink step beside it (0.02 dB at most measured)
    args = QuantizationArgs(**CHANNEL_ARGS[name])
    spec = qstats.QuantSpec.from_compressed_tensors(args)
    x = torch.cat(_columns(seed, 1, 3000), 1)
    scale, zero_point = _memoryless_mse(args, x)
    qp = _streamed(spec, list(x.split(3, dim=1)))
    assert _sqnr(x, qp.scale, qp.zero_point, args) >= _sqnr(x, scale, zero_point, args) - 0.05


SCENARIOS = {
    "growing": lambda: [b * (i + 1) for i, b in enumerate(_columns(1, 6, 500))],
    "shifting": lambda: [b + i for i, b in enumerate(_columns(2, 6, 500))],
    "narrow first": lambda: [b * (1e-3 if i == 0 else 1.0) for i, b in enumerate(_columns(3, 4, 500))],
    "outlier last": lambda: _columns(4, 3, 500) + [torch.cat([_columns(5, 1, 499)[0], torch.full((8, 1), 30.0)], 1)],
    "relu, growing": lambda: [(b * (i + 1)).relu() for i, b in enumerate(_columns(6, 6, 500))],
    # the 30 narrow batches' carried losses stop growing where all their values round to zero
    "wide last": lambda: [b * (1000.0 if i == 30 else 1.0) for i, b in enumerate(_columns(9, 31, 100))],
}


@pytest.mark.parametrize("name", list(CHANNEL_ARGS))
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_batches_past_the_first_range_quantize_as_one_search_over_all_data(scenario, name):
    # the streamed choice is llm-compressor's over the whole tensor, or within 0.25 dB of its SQNR
    # (the losses of earlier batches at the wider candidates are modelled)
    args = QuantizationArgs(**CHANNEL_ARGS[name])
    spec = qstats.QuantSpec.from_compressed_tensors(args)
    batches = SCENARIOS[scenario]()
    x = torch.cat(batches, 1)
    scale, zero_point = _memoryless_mse(args, x)
    qp = _streamed(spec, batches)
    theirs = _sqnr(x, scale, zero_point, args)
    ours = _sqnr(x, qp.scale, qp.zero_point, args)
    assert ours >= theirs - 0.25, (ours, theirs)


def test_batches_inside_the_first_range_keep_its_candidates():
    # no batch passes the first one's range: the reference and every loss are the first range's,
    # the sum of each batch's losses over the candidates of that range (llm-compressor's search)
    args = QuantizationArgs(**CHANNEL_ARGS["int8-sym"])
    spec = qstats.QuantSpec.from_compressed_tensors(args)
    first, *rest = _columns(7, 4, 200)
    first[:, 0], first[:, 1] = 10.0, -10.0
    batches = [first] + [b.clamp(-9, 9) for b in rest]
    state = _streamed_state(spec, batches)
    assert torch.equal(state.max_val, first.amax(1)) and torch.equal(state.min_val, first.amin(1))
    fixed = qstats.mse(spec, reference=(first.amin(1), first.amax(1)))
    expected = fixed.init(first)
    for batch in batches:
        expected = fixed.update(expected, batch)
    assert torch.equal(state.loss, expected.loss)


@pytest.mark.parametrize("norm", [2.4, 8.0])
def test_a_batch_far_past_a_tiny_first_range_leaves_no_nan_loss(norm):
    # values 1e60 times wider than the first batch: the carried losses grow past float64 at norm 8
    # (0 * inf gave NaN losses); the range is the wide batch's shrunk, not the first one's
    spec = qstats.QuantSpec(dtype="int8", eps=1.2e-38)
    generator = torch.Generator().manual_seed(8)
    small, large = (torch.randn(100, generator=generator) * magnitude for magnitude in (1e-30, 1e30))
    observer = qstats.mse(spec, norm=norm)
    state = observer.update(observer.update(observer.init(small), small), large)
    assert not state.loss.isnan().any()
    amax = float(qstats.compute_qparams(state, spec).scale.double()) * 127.5
    assert 0.8 * float(large.abs().max()) * 0.99 <= amax <= float(large.abs().max()) * 1.01


def test_stacked_experts_with_channels_unset_at_first_quantize_as_one_search_over_each_expert():
    # under torch.vmap (stacked_observer), with one expert's first channel all zeros for its first
    # 100 batches (no reference until then): each expert within 0.05 dB of llm-compressor's search over
    # all its data
    args = QuantizationArgs(**CHANNEL_ARGS["int8-sym"])
    spec = qstats.QuantSpec.from_compressed_tensors(args)
    x = torch.stack([torch.cat(_columns(10 + expert, 1, 900), 1) for expert in range(2)])
    x[1, 0, :300] = 0.0
    observer = qstats.stacked_observer(qstats.mse(spec), 2)
    batches = list(x.split(3, dim=2))
    state = observer.init(batches[0])
    for batch in batches:
        state = observer.update(state, batch)
    qp = qstats.stacked_qparams(state, spec)
    for expert in range(2):
        scale, zero_point = _memoryless_mse(args, x[expert])
        ours = _sqnr(x[expert], qp.scale[expert], qp.zero_point[expert], args)
        assert ours >= _sqnr(x[expert], scale, zero_point, args) - 0.05
