"""`mse(spec, mode="moving_average")` on a stacked ``gate_up_proj [E, 2I, H]`` against llm-compressor 0.14's
``mse`` observer (its moving average of per-batch searches) on each Linear its ``linearize_moe`` makes of
it (``gate_proj`` = rows ``:I``, ``up_proj`` = rows ``I:``). The moving-average search, early stop
included, runs in ``update``: on the whole stack one stop covered gate and up together (2 of 16 halves
picked another scale at patience 1, int4 groups of 32); `searched_per_part` runs it per half, as
llm-compressor's two Linears."""

from __future__ import annotations

import pytest
import torch

import qstats
from qstats.observers.mse import MovingAverageMSEState, searched_per_part

llmc_observers = pytest.importorskip("llmcompressor.observers")
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402

E, I, H = 8, 64, 128


def _args(strategy: str, patience: int, constant: float = 0.01, bits: int = 4):
    group = {"group_size": 32} if strategy == "group" else {}
    return QuantizationArgs(num_bits=bits, type="int", symmetric=True, strategy=strategy, observer="mse",
                            observer_kwargs={"patience": patience, "averaging_constant": constant}, **group)


def _theirs(args, batches, base_name="weight"):
    # a weight observer keeps its first batch: several batches are averaged by an input observer
    observer = llmc_observers.Observer.load_from_registry(args.observer, base_name=base_name, args=args)
    for batch in batches:
        observer(batch)
    return observer.get_qparams()["scale"]


def _differing(scale, args, batches, blocks=False, base_name="weight"):
    """The halves whose scale is not llm-compressor's on that half's Linear (``blocks``: ``scale`` is
    ``[E, 2, 1]``, one per half)."""
    differing = []
    for expert in range(E):
        for half, (name, rows) in enumerate((("gate_proj", slice(0, I)), ("up_proj", slice(I, 2 * I)))):
            theirs = _theirs(args, [batch[expert, rows] for batch in batches], base_name)
            ours = scale[expert, half] if blocks else scale[expert, rows]
            if not torch.equal(ours.reshape(theirs.shape), theirs):
                differing.append(f"{expert}.{name}")
    return differing


def _weights(seed: int, count: int = 1):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(E, 2 * I, H, generator=generator) * 0.02 * (1 + k) for k in range(count)]


def _stacked_scale(observer, spec, batches):
    state = observer.init(batches[0])
    for batch in batches:
        state = observer.update(state, batch)
    return qstats.stacked_qparams(state, spec).scale


# seed 2: where one stop of gate and up together picked another scale (2 of 16 group halves, 1 of 16
# per-channel halves at patience 1)
@pytest.mark.parametrize("strategy", ["group", "channel"])
def test_moving_average_mse_stops_each_half_on_its_own(single_thread_quiet, strategy):
    args = _args(strategy, patience=1)
    spec = qstats.QuantSpec.from_compressed_tensors(args)
    batches = _weights(2)
    observer = qstats.stacked_observer(searched_per_part(qstats.mse(spec, mode="moving_average", patience=1), 2), E)
    assert _differing(_stacked_scale(observer, spec, batches), args, batches) == []


def test_whole_stack_stops_gate_and_up_together(single_thread_quiet):
    """The defect `searched_per_part` fixes, kept as the reference of the test above: without it the
    stacked search stops gate and up together and some halves differ from llm-compressor's."""
    args = _args("group", patience=1)
    spec = qstats.QuantSpec.from_compressed_tensors(args)
    batches = _weights(2)
    observer = qstats.stacked_observer(qstats.mse(spec, mode="moving_average", patience=1), E)
    assert _differing(_stacked_scale(observer, spec, batches), args, batches) != []


def test_moving_average_of_several_batches_per_half(single_thread_quiet):
    """Three batches averaged with constant 0.5, one range per half (llm-compressor's per-tensor input
    observer on each half): each half's moving average is its Linear's."""
    args = _args("tensor", patience=1, constant=0.5, bits=8)
    spec = qstats.QuantSpec.from_compressed_tensors(args).replace(granularity=qstats.PerBlock((I, H)))
    batches = _weights(2, count=3)  # 4 of 16 halves differed with one stop for both
    observer = qstats.stacked_observer(
        searched_per_part(qstats.mse(spec, mode="moving_average", patience=1, averaging_constant=0.5), 2), E)
    assert _differing(_stacked_scale(observer, spec, batches), args, batches, blocks=True, base_name="input") == []


def test_per_tensor_halves_as_blocks(single_thread_quiet):
    """A per-tensor scheme on fused experts is one block per half (`PerBlock((I, H))`, as a Recipe makes it):
    each half's scale is llm-compressor's per-tensor Linear's."""
    args = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="tensor", observer="mse",
                            observer_kwargs={"patience": 1})
    spec = qstats.QuantSpec.from_compressed_tensors(args).replace(granularity=qstats.PerBlock((I, H)))
    batches = _weights(0)  # 2 of 16 halves differed with one stop for both
    observer = qstats.stacked_observer(searched_per_part(qstats.mse(spec, mode="moving_average", patience=1), 2), E)
    assert _differing(_stacked_scale(observer, spec, batches), args, batches, blocks=True) == []


def test_other_states_and_refusals():
    spec = qstats.QuantSpec(dtype="int4", granularity=qstats.PerAxis(0))
    w = torch.randn(6, 8)
    accumulate = qstats.mse(spec, grid=10)
    wrapped = searched_per_part(accumulate, 2)
    state = wrapped.update(wrapped.init(w), w)
    assert all(torch.equal(a, b) for a, b in zip(state, accumulate.update(accumulate.init(w), w)))
    moving = searched_per_part(qstats.mse(spec, grid=10, mode="moving_average"), 2)
    halves = [qstats.mse(spec, grid=10, mode="moving_average") for _ in range(2)]
    state = moving.update(moving.init(w), w)
    assert isinstance(state, MovingAverageMSEState)
    expected = [h.update(h.init(w[rows]), w[rows]) for h, rows in zip(halves, (slice(0, 3), slice(3, 6)))]
    assert all(torch.equal(field, torch.cat(parts)) for field, parts in zip(state, zip(*expected)))
    columns = searched_per_part(qstats.mse(qstats.QuantSpec(granularity=qstats.PerAxis(1)), mode="moving_average"), 2)
    with pytest.raises(ValueError, match="do not split into 2 parts"):
        columns.update(columns.init(w), w)
    with pytest.raises(ValueError, match="do not split into 4 parts"):
        odd = searched_per_part(qstats.mse(spec, grid=10, mode="moving_average"), 4)
        odd.update(odd.init(w), w)
    with pytest.raises(ValueError, match="parts must be a positive int"):
        searched_per_part(accumulate, 0)
