"""qstats.llmcompressor's ``sync_activation_stats`` when only some ranks saw data (an MoE expert whose
tokens were routed on some ranks' shards only): every rank must end with the merge of the holders'
states, equal to one process that observed the union of the data (and to llm-compressor's own
observer over it where it has one), and an observer no rank saw stays without statistics."""

import os
from datetime import timedelta

import pytest
import torch

pytest.importorskip("llmcompressor")

from compressed_tensors.quantization import QuantizationArgs  # noqa: E402
from compressed_tensors.quantization.quant_scheme import NVFP4  # noqa: E402
from llmcompressor.observers import Observer  # noqa: E402

from qstats.llmcompressor import QstatsObserver  # noqa: E402  (registers the drop-ins)
from tests._shared import bit_equal, fork_ranks, gloo_group, nvfp4_input_global_scale  # noqa: E402

TENSOR = QuantizationArgs(num_bits=8, symmetric=False, strategy="tensor")
# (case, drop-in, args, holders: {rank: number of batches} on 3 ranks, llm-compressor's observer or None)
CASES = [
    ("static_rank0", "qstats_static_minmax", TENSOR, {0: 2}, "static_minmax"),
    ("static_ranks02", "qstats_static_minmax", TENSOR, {0: 1, 2: 3}, "static_minmax"),
    ("histogram_ranks12", "qstats_histogram", TENSOR, {1: 2, 2: 1}, None),
    ("mse_ranks01", "qstats_mse", TENSOR, {0: 3, 1: 1}, None),
    ("minmax_rank1", "qstats_minmax", TENSOR, {1: 3}, "minmax"),
    ("memoryless_rank2", "qstats_memoryless_minmax", TENSOR, {2: 2}, "memoryless_minmax"),
    ("nvfp4_static_rank0", "qstats_static_minmax", NVFP4["input_activations"], {0: 2}, "static_minmax"),
    ("nvfp4_minmax_rank2", "qstats_minmax", NVFP4["input_activations"], {2: 2}, "minmax"),
    ("nvfp4_static_ranks01", "qstats_static_minmax", NVFP4["input_activations"], {0: 1, 1: 2}, "static_minmax"),
    # every rank saw data, each wider than the last: mse.merge carries each state's losses to the union's
    # range by a model (exact only with a fixed `reference`), as one process carries them when a batch
    # widens it; the scale chosen may then be a candidate away (a 1% step of the default grid)
    ("mse_all", "qstats_mse", TENSOR, {0: 1, 1: 2, 2: 1}, None),
    ("nvfp4_static_all", "qstats_static_minmax", NVFP4["input_activations"], {0: 2, 1: 1, 2: 1}, "static_minmax"),
    ("nobody", "qstats_static_minmax", TENSOR, {}, None),
]
# several holders where one process over the union is not the reference (checked below)
MERGED_CASES = [
    ("memoryless_ranks12", "qstats_memoryless_minmax", TENSOR, {1: 2, 2: 3}, "memoryless_minmax"),
    ("minmax_ranks02", "qstats_minmax", TENSOR, {0: 2, 2: 2}, "minmax"),
]
WORLD = 3


def _batches(case: str, rank: int, count: int) -> list:
    g = torch.Generator().manual_seed(10 * sum(map(ord, case)) + rank)
    return [torch.randn(2, 5, 32, generator=g) * (1 + rank + i) for i in range(count)]


def _union(case: str, holders: dict) -> list:
    return [x for rank in sorted(holders) for x in _batches(case, rank, holders[rank])]


def _observer(name: str, args: QuantizationArgs):
    observer = Observer.load_from_registry(name, base_name="input", args=args.model_copy(deep=True))
    assert isinstance(observer, QstatsObserver) == name.startswith("qstats_")
    return observer


def _rank(rank: int, port: int, out: str):
    """One rank: each case's observer sees this rank's batches (if any), syncs, records its qparams."""
    with gloo_group(rank, port, world=WORLD, timeout=timedelta(seconds=60)):
        results = {}
        for case, name, args, holders, _ in CASES + MERGED_CASES:
            observer = _observer(name, args)
            for x in _batches(case, rank, holders.get(rank, 0)):
                observer(x)
            try:
                assert observer.sync_activation_stats() == []
                results[case] = observer.get_qparams() if observer.has_statistics else None
            except Exception as error:  # recorded, so that the parent names it
                results[case] = f"{type(error).__name__}: {error}"
        torch.save(results, os.path.join(out, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def synced(tmp_path_factory):
    out = tmp_path_factory.mktemp("sync_partial")
    codes = fork_ranks(_rank, str(out), world=WORLD, timeout=150)
    assert codes == [0] * WORLD, f"exit codes {codes} (None: a rank hung)"
    return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(WORLD)]


@pytest.mark.parametrize("case, name, args, holders, theirs", CASES, ids=[c[0] for c in CASES])
def test_every_rank_gets_the_merge_of_the_ranks_that_saw_data(synced, case, name, args, holders, theirs):
    union = _union(case, holders)
    if not union:  # no rank saw it: no statistics anywhere, no error
        assert [results[case] for results in synced] == [None] * WORLD
        return
    one_process = _observer(name, args)
    for x in union:
        one_process(x)
    want = one_process.get_qparams()
    if theirs is not None and len(holders) == 1 or theirs == "static_minmax":  # llm-compressor over the union
        reference = _observer(theirs, args)
        for x in union:
            reference(x)
        reference = reference.get_qparams()
        keys = ["global_scale"] if args.strategy == "tensor_group" else ["scale", "zero_point"]
        for key in keys:
            assert bit_equal(want[key], reference[key]), (case, key)
    for rank, results in enumerate(synced):
        got = results[case]
        assert isinstance(got, dict), (case, rank, got)
        for key in ("scale", "zero_point", "global_scale"):
            if want[key] is None:
                assert got[key] is None, (case, rank, key)
            elif case == "mse_all":
                assert torch.allclose(got[key].float(), want[key].float(), rtol=0.011, atol=1), (case, rank, key)
            else:
                assert bit_equal(got[key], want[key]), (case, rank, key, got[key], want[key])


def test_nvfp4_global_scale_equals_llmcompressors_over_the_union(synced):
    union = _union("nvfp4_static_ranks01", {0: 1, 1: 2})
    want = nvfp4_input_global_scale("static_minmax", {}, union)
    for results in synced:
        assert bit_equal(results["nvfp4_static_ranks01"]["global_scale"], want)


def _dtype_rank(rank: int, port: int, out: str, dtypes: list):
    """One rank observing a batch in ``dtypes[rank]`` (None: no batch), then syncing; records what it raised."""
    with gloo_group(rank, port, world=len(dtypes), timeout=timedelta(seconds=60)):
        observer = _observer("qstats_static_minmax", TENSOR)
        if dtypes[rank] is not None:
            observer(torch.randn(2, 5, 32, dtype=dtypes[rank]))
        try:
            observer.sync_activation_stats()
            message = "no error"
        except ValueError as error:
            message = str(error)
        with open(os.path.join(out, f"rank{rank}.txt"), "w") as file:
            file.write(message)


@pytest.mark.parametrize("dtypes", [[torch.bfloat16, torch.float32, None], [None, torch.float32, torch.bfloat16]])
def test_ranks_that_observed_other_dtypes_raise_on_every_rank(tmp_path, dtypes):
    """Holders whose observed dtypes differ (their specs' compute dtypes) cannot be merged: a ValueError
    on every rank, the one without data too, and no rank hangs."""
    codes = fork_ranks(_dtype_rank, str(tmp_path), dtypes, world=len(dtypes), timeout=120)
    assert codes == [0] * len(dtypes), f"exit codes {codes} (None: a rank hung)"
    for rank in range(len(dtypes)):
        message = (tmp_path / f"rank{rank}.txt").read_text()
        assert "different state trees" in message and "compute_dtype='bfloat16'" in message, (rank, message)


def _theirs(case: str, name: str, batches: list) -> Observer:
    observer = _observer(name, TENSOR)
    for x in batches:
        observer(x)
    return observer


def test_memoryless_minmax_merges_the_ranks_latest_batches(synced):
    """``qstats_memoryless_minmax`` keeps the latest batch: across ranks, the last step's global batch,
    the ranks' latest batches together (llm-compressor's ``memoryless_minmax`` does not sync: each rank
    would keep its own). Reference: llm-compressor's observer over their concatenation."""
    case, _, _, holders, theirs = MERGED_CASES[0]
    last_step = torch.cat([_batches(case, rank, count)[-1] for rank, count in sorted(holders.items())])
    want = _theirs(case, theirs, [last_step]).get_qparams()
    for results in synced:
        assert bit_equal(results[case]["scale"], want["scale"]) and bit_equal(results[case]["zero_point"],
                                                                              want["zero_point"])


def test_moving_average_minmax_of_ranks_with_as_many_batches_is_the_mean_of_their_averages(synced):
    """Two holders with as many batches each: the mean of llm-compressor's ``minmax`` averages of each
    (what its ``AVG`` all_reduce gives where every rank holds data), on the third rank too."""
    case, _, _, holders, theirs = MERGED_CASES[1]
    observers = [_theirs(case, theirs, _batches(case, rank, count)) for rank, count in sorted(holders.items())]
    reference = observers[0]
    reference.min_vals = (observers[0].min_vals + observers[1].min_vals) / 2
    reference.max_vals = (observers[0].max_vals + observers[1].max_vals) / 2
    want = reference.get_qparams()
    for results in synced:
        assert torch.allclose(results[case]["scale"], want["scale"], rtol=1e-6), (results[case], want)
        assert torch.equal(results[case]["zero_point"], want["zero_point"])


def _other_observer_rank(rank: int, port: int, out: str):
    """Rank 0: ``qstats_static_minmax`` with a batch; rank 1: ``qstats_histogram`` without (another recipe)."""
    with gloo_group(rank, port, world=2, timeout=timedelta(seconds=60)):
        observer = _observer(["qstats_static_minmax", "qstats_histogram"][rank], TENSOR)
        if rank == 0:
            observer(torch.randn(2, 5, 32))
        try:
            observer.sync_activation_stats()
            message = f"no error; statistics {type(observer.qstats_state).__name__}"
        except ValueError as error:
            message = str(error)
        with open(os.path.join(out, f"rank{rank}.txt"), "w") as file:
            file.write(message)


def test_a_rank_without_data_whose_observer_differs_raises_on_every_rank(tmp_path):
    """The rank without data would take rank 0's MinMaxState into its histogram observer (and compute
    another observer's qparams) in silence: a ValueError naming both observers on both ranks instead."""
    codes = fork_ranks(_other_observer_rank, str(tmp_path), world=2, timeout=120)
    assert codes == [0, 0], f"exit codes {codes} (None: a rank hung)"
    for rank in range(2):
        message = (tmp_path / f"rank{rank}.txt").read_text()
        assert "QstatsStaticMinmaxObserver" in message and "QstatsHistogramObserver" in message, (rank, message)
