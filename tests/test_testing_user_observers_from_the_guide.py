"""Observers a user writes from docs/write_an_observer.md, run through qstats.testing.check_all: a
verdict must name its law and be right, never crash. Each observer is first compared with an
independent computation (numpy over the concatenated batches, or torch.ao's observer of the same
kind), so that a pass is a right verdict:

- the guide's rms_range under ``QuantSpec(nonfinite="raise")``: refusing through
  ``kit.finite_aminmax`` passes every law, compile included; a Python ``if`` on the values fails the
  vmap law, naming it (the update cannot run under vmap);
- an abs max whose ``init`` cannot run on meta tensors;
- a moving-average min/max (torch.ao's MovingAverageMinMaxObserver), ``exact=False``;
- a mean of squares per feature that takes row weights only and leaves rows holding NaN/Inf out;
- a per-expert abs max written by hand, ``batch_dims=1``, and `qstats.stacked_observer` of the others;
- a histogram whose range doubles as the data grows (its bins nest, so it is exact).
"""

import math
from typing import NamedTuple

import numpy as np
import pytest
import torch
from torch.ao.quantization import MovingAverageMinMaxObserver

import qstats
from qstats import testing
from qstats.observers import kit

# A: the guide's rms_range, with nonfinite="raise" read from its spec
@kit.register_state
class GuideRMSState(NamedTuple):
    approx_fields = ("square_total",)
    square_total: torch.Tensor
    count: torch.Tensor


@kit.register_range_rule(GuideRMSState)
def _rms_rule(state, spec, k: float = 4.0):
    rms = (state.square_total / state.count.clamp(min=1)).sqrt().float()
    return kit.Range(-k * rms, k * rms, state.count)


def rms_range(spec, refuse="kit"):
    spec = kit.check_spec(spec)

    def init_fn(x):
        kit.check_observable(x, "rms_range.init")
        shape = kit.qparam_shape(x.shape, spec.granularity)
        return GuideRMSState(torch.zeros(shape, dtype=torch.float64, device=x.device),
                            torch.zeros(shape, dtype=torch.int64, device=x.device))

    def update_fn(state, x, weight=None):
        kit.check_state(state, GuideRMSState, "rms_range.update")
        kit.check_observable(x, "rms_range.update")
        if x.numel() == 0:
            return state
        view = kit.checked_view(x, spec.granularity, state.count.shape, "rms_range.update").double()
        keep = torch.isfinite(view)
        if spec.nonfinite == "raise" and refuse == "if":  # a Python if on the values
            if not bool(keep.all()):
                raise ValueError("rms_range.update: x holds NaN or Inf (nonfinite='raise')")
        elif spec.nonfinite == "raise":  # the refusal inside one op, which vmap and torch.compile take
            kit.finite_aminmax(view, None, "raise")
        mask = kit.weight_view(x, weight, spec.granularity)
        if mask is not None:
            keep = keep & (mask != 0)
        squares = torch.where(keep, view * view, 0.0)
        return GuideRMSState(state.square_total + squares.sum(dim=(0, -1)), state.count + keep.sum(dim=(0, -1)))

    def merge_fn(a, b):
        kit.check_same_shapes(a, b, "rms_range.merge")
        return GuideRMSState(a.square_total + b.square_total, a.count + b.count)

    return kit.Observer(init_fn, update_fn, merge_fn, exact=True, spec=spec, name="rms_range")


# B: an abs max whose init cannot run on meta tensors (counts from bincount of nothing)
@kit.register_state
class GuideAbsMaxState(NamedTuple):
    amax: torch.Tensor
    count: torch.Tensor


@kit.register_range_rule(GuideAbsMaxState)
def _absmax_rule(state, spec):
    return kit.Range(-state.amax, state.amax, state.count)


def bincount_absmax(spec):
    def init_fn(x):
        shape = kit.qparam_shape(x.shape, spec.granularity)
        size = math.prod(shape)
        count = torch.bincount(torch.zeros(0, dtype=torch.int64, device=x.device), minlength=size).reshape(shape)
        if x.device.type == "meta":  # what a value-reading op does on meta
            raise NotImplementedError("bincount on meta")
        return GuideAbsMaxState(torch.zeros(shape, device=x.device), count)

    def update_fn(state, x, weight=None):
        if x.numel() == 0:
            return state
        view, mask = kit.masked_view(x, weight, spec, state.count.shape, "bincount_absmax.update")
        keep = torch.isfinite(view) if mask is None else torch.isfinite(view) & mask
        values = torch.where(keep, view.float().abs(), 0.0)
        return GuideAbsMaxState(torch.maximum(state.amax, values.amax(dim=(0, -1))), state.count + keep.sum(dim=(0, -1)))

    def merge_fn(a, b):
        return GuideAbsMaxState(torch.maximum(a.amax, b.amax), a.count + b.count)

    return kit.Observer(init_fn, update_fn, merge_fn, exact=True, spec=spec, name="bincount_absmax")


# C: a moving-average min/max (torch.ao's MovingAverageMinMaxObserver), exact=False
@kit.register_state
class GuideEMAState(NamedTuple):
    min_val: torch.Tensor
    max_val: torch.Tensor
    batches: torch.Tensor


@kit.register_range_rule(GuideEMAState)
def _ema_rule(state, spec):
    return kit.Range(state.min_val, state.max_val, state.batches)


def ema_minmax(spec, c=0.01):
    def init_fn(x):
        shape = kit.qparam_shape(x.shape, spec.granularity)
        return GuideEMAState(torch.zeros(shape, device=x.device), torch.zeros(shape, device=x.device),
                            torch.zeros(shape, dtype=torch.int64, device=x.device))

    def update_fn(state, x, weight=None):
        if x.numel() == 0:
            return state
        view, mask = kit.masked_view(x, weight, spec, state.batches.shape, "ema_minmax.update")
        keep = torch.isfinite(view) if mask is None else torch.isfinite(view) & mask
        v = view.float()
        bmin = torch.where(keep, v, math.inf).amin(dim=(0, -1))
        bmax = torch.where(keep, v, -math.inf).amax(dim=(0, -1))
        seen = keep.any(dim=(0, -1))
        first = state.batches == 0
        new_min = torch.where(first, bmin, state.min_val + c * (bmin - state.min_val))
        new_max = torch.where(first, bmax, state.max_val + c * (bmax - state.max_val))
        return GuideEMAState(torch.where(seen, new_min, state.min_val), torch.where(seen, new_max, state.max_val),
                            state.batches + seen.long())

    def merge_fn(a, b):
        return GuideEMAState(kit.batch_weighted_mean(a.min_val, b.min_val, a.batches, b.batches),
                            kit.batch_weighted_mean(a.max_val, b.max_val, a.batches, b.batches),
                            a.batches + b.batches)

    return kit.Observer(init_fn, update_fn, merge_fn, exact=False, spec=spec, name="ema_minmax")


# D: an imatrix-like mean of squares per feature that takes row weights only, rows with NaN/Inf left out
@kit.register_state
class GuideRowSquaresState(NamedTuple):
    approx_fields = ("square_total",)
    square_total: torch.Tensor
    rows: torch.Tensor


@kit.register_range_rule(GuideRowSquaresState)
def _row_squares_rule(state, spec):
    rms = (state.square_total / state.rows.clamp(min=1)).sqrt().float()
    return kit.Range(-4 * rms, 4 * rms, state.rows.expand(rms.shape))


def row_squares(spec):
    def init_fn(x):
        return GuideRowSquaresState(torch.zeros(x.shape[-1], dtype=torch.float64, device=x.device),
                                   torch.zeros((), dtype=torch.int64, device=x.device))

    def update_fn(state, x, weight=None):
        if x.numel() == 0:
            return state
        rows = x.reshape(-1, x.shape[-1]).double()
        keep = kit.row_mask(x, weight, "row_squares.update")
        keep = torch.isfinite(rows).all(-1) if keep is None else keep & torch.isfinite(rows).all(-1)
        squares = torch.where(keep[:, None], rows * rows, 0.0)
        return GuideRowSquaresState(state.square_total + squares.sum(0), state.rows + keep.sum())

    def merge_fn(a, b):
        return GuideRowSquaresState(a.square_total + b.square_total, a.rows + b.rows)

    return kit.Observer(init_fn, update_fn, merge_fn, exact=True, spec=spec, name="row_squares")


# E: a stacked per-expert abs max written by hand: x [E, T, C], weight [E, T], state [E]
def expert_absmax(spec):
    def init_fn(x):
        return GuideAbsMaxState(torch.zeros(x.shape[0], device=x.device),
                               torch.zeros(x.shape[0], dtype=torch.int64, device=x.device))

    def update_fn(state, x, weight=None):
        if x.numel() == 0:
            return state
        flat = x.reshape(x.shape[0], x.shape[1], -1).float()
        keep = torch.isfinite(flat)
        if weight is not None:
            keep = keep & (weight.reshape(weight.shape[0], weight.shape[1], *(1,) * (flat.ndim - 2)) != 0)
        values = torch.where(keep, flat.abs(), 0.0)
        return GuideAbsMaxState(torch.maximum(state.amax, values.amax(dim=(1, 2))), state.count + keep.sum(dim=(1, 2)))

    def merge_fn(a, b):
        return GuideAbsMaxState(torch.maximum(a.amax, b.amax), a.count + b.count)

    return kit.Observer(init_fn, update_fn, merge_fn, exact=True, spec=spec, name="expert_absmax")


# F: a histogram whose range doubles as the data grows (bins nest: exact)
BINS = 16


@kit.register_state
class GuideHistState(NamedTuple):
    counts: torch.Tensor    # int64 [BINS] over [-2**k, 2**k)
    exponent: torch.Tensor  # int64 k


@kit.register_range_rule(GuideHistState)
def _hist_rule(state, spec):
    width = 2.0 ** state.exponent.double() * 2 / BINS
    index = torch.arange(BINS, device=state.counts.device)
    nonempty = state.counts > 0
    lo = torch.where(nonempty, index, BINS).amin()
    hi = torch.where(nonempty, index, -1).amax()
    low = (lo - BINS // 2).double() * width
    high = (hi + 1 - BINS // 2).double() * width
    seen = state.counts.sum() > 0
    return kit.Range(torch.where(seen, low, 0.0).float(), torch.where(seen, high, 0.0).float(), state.counts.sum())


def _rebin(counts, exponent, target):
    """counts over [-2**exponent, 2**exponent) rebinned to [-2**target, 2**target) (target >= exponent)."""
    index = torch.arange(BINS, device=counts.device) - BINS // 2  # floor(x / w) of each bin
    shift = (target - exponent).clamp(max=62)
    coarse = torch.div(index, 2 ** shift, rounding_mode="floor") + BINS // 2
    return torch.zeros_like(counts).index_add(0, coarse.clamp(0, BINS - 1), counts)


def doubling_histogram(spec, floor_exponent=-30):
    def init_fn(x):
        return GuideHistState(torch.zeros(BINS, dtype=torch.int64, device=x.device),
                             torch.full((), floor_exponent, dtype=torch.int64, device=x.device))

    def update_fn(state, x, weight=None):
        if x.numel() == 0:
            return state
        values = x.reshape(x.shape[0], -1).double() if x.ndim else x.reshape(1, 1).double()
        keep = torch.isfinite(values)
        if weight is not None:
            keep = keep & (weight.reshape(weight.shape[0], -1) != 0)
        amax = torch.where(keep, values.abs(), 0.0).amax()
        # the smallest k with amax < 2**k
        needed = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp(min=2.0 ** floor_exponent))).long() + 1,
                             floor_exponent)
        exponent = torch.maximum(state.exponent, needed)
        width = 2.0 ** exponent.double() * 2 / BINS
        index = (torch.floor(torch.where(keep, values, 0.0) / width).long() + BINS // 2).clamp(0, BINS - 1)
        batch = torch.zeros_like(state.counts).index_add(0, index.reshape(-1), keep.reshape(-1).long())
        return GuideHistState(_rebin(state.counts, state.exponent, exponent) + batch, exponent)

    def merge_fn(a, b):
        exponent = torch.maximum(a.exponent, b.exponent)
        return GuideHistState(_rebin(a.counts, a.exponent, exponent) + _rebin(b.counts, b.exponent, exponent), exponent)

    return kit.Observer(init_fn, update_fn, merge_fn, exact=True, spec=spec, name="doubling_histogram")


def _batches(shape, count=3):
    return [torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 2.0 ** seed for seed in range(count)]


def _fold(obs, xs):
    state = obs.init(xs[0])
    for x in xs:
        state = obs.update(state, x)
    return state


def _make(shape):
    return lambda generator: torch.randn(*shape, generator=generator)


RAISE = qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0), nonfinite="raise")


def test_rms_range_refusing_non_finite_values_through_the_kit_passes_every_law():
    obs = rms_range(RAISE)
    xs = _batches((16, 64))
    data = np.concatenate([x.double().numpy() for x in xs], axis=1)  # numpy: per row over every batch
    np.testing.assert_allclose(_fold(obs, xs).square_total.numpy(), (data ** 2).sum(axis=1), rtol=1e-12)
    dirty = xs[0].clone()
    dirty[3, 5] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        obs.update(obs.init(dirty), dirty)
    testing.check_all(obs, _make((16, 64)), max_examples=3, compile=True)


def test_rms_range_refusing_non_finite_values_with_a_python_if_fails_the_vmap_law_naming_it():
    obs = rms_range(RAISE, refuse="if")
    xs = _batches((16, 64))
    with pytest.raises(RuntimeError, match="data-dependent control flow"):  # torch's own verdict
        torch.func.vmap(obs.update)(torch.func.vmap(obs.init)(torch.stack(xs)), torch.stack(xs))
    with pytest.raises(AssertionError, match=r"rms_range: vmap\(update\) failed: RuntimeError"):
        testing.check_all(obs, _make((16, 64)), laws="vmap", max_examples=1)
    testing.check_all(obs, _make((16, 64)), laws=("identity", "homomorphism", "purity", "stability"), max_examples=3)


def test_an_abs_max_whose_init_cannot_run_on_meta_passes_every_law():
    obs = bincount_absmax(qstats.QuantSpec(granularity=qstats.PerAxis(0)))
    with pytest.raises(NotImplementedError):
        obs.init(torch.empty(6, 8, device="meta"))
    xs = _batches((6, 8))
    data = np.concatenate([x.numpy() for x in xs], axis=1)
    np.testing.assert_array_equal(_fold(obs, xs).amax.numpy(), np.abs(data).max(axis=1))
    testing.check_all(obs, _make((6, 8)), max_examples=3)


@pytest.mark.parametrize("granularity, shape", [(qstats.PerTensor(), (6, 8)), (qstats.PerAxis(-1), (2, 3, 8))])
def test_a_moving_average_min_max_equals_torch_ao_and_passes_every_law(granularity, shape):
    obs = ema_minmax(qstats.QuantSpec(granularity=granularity), c=0.01)
    xs = _batches(shape)
    if granularity == qstats.PerTensor():
        reference = MovingAverageMinMaxObserver(averaging_constant=0.01)
    else:
        reference = torch.ao.quantization.MovingAveragePerChannelMinMaxObserver(averaging_constant=0.01,
                                                                               ch_axis=len(shape) - 1)
    for x in xs:
        reference(x)
    state = _fold(obs, xs)
    torch.testing.assert_close(state.min_val, reference.min_val, rtol=1e-6, atol=0)
    torch.testing.assert_close(state.max_val, reference.max_val, rtol=1e-6, atol=0)
    testing.check_all(obs, _make(shape), max_examples=3)


def test_a_mean_of_squares_over_rows_taking_row_weights_only_passes_every_law():
    obs = row_squares(qstats.QuantSpec(granularity=qstats.PerAxis(-1)))
    xs = _batches((3, 5, 8))
    xs[1][1, 2, 4] = float("inf")  # its row is left out
    rows = np.concatenate([x.double().numpy().reshape(-1, 8) for x in xs])
    finite = rows[np.isfinite(rows).all(axis=1)]
    state = _fold(obs, xs)
    assert int(state.rows) == len(finite) == 44
    np.testing.assert_allclose(state.square_total.numpy(), (finite ** 2).sum(axis=0), rtol=1e-12)
    testing.check_all(obs, _make((3, 5, 8)), max_examples=3)


def test_a_per_expert_abs_max_written_by_hand_passes_every_law_with_batch_dims():
    obs = expert_absmax(qstats.QuantSpec())
    xs = _batches((3, 6, 8))
    data = np.concatenate([x.numpy() for x in xs], axis=1)  # [experts, tokens of every batch, 8]
    np.testing.assert_array_equal(_fold(obs, xs).amax.numpy(), np.abs(data).max(axis=(1, 2)))
    testing.check_all(obs, _make((3, 6, 8)), max_examples=3, batch_dims=1)


@pytest.mark.parametrize("factory", [lambda: bincount_absmax(qstats.QuantSpec(granularity=qstats.PerAxis(0))),
                                     lambda: row_squares(qstats.QuantSpec(granularity=qstats.PerAxis(-1))),
                                     lambda: ema_minmax(qstats.QuantSpec()),
                                     lambda: doubling_histogram(qstats.QuantSpec())])
def test_stacked_user_observers_pass_every_law(factory):
    testing.check_all(qstats.stacked_observer(factory(), 2), _make((2, 6, 8)), max_examples=2, batch_dims=1)


def test_a_histogram_whose_range_doubles_equals_numpy_and_passes_every_law():
    obs = doubling_histogram(qstats.QuantSpec())
    xs = _batches((6, 8))  # magnitudes 1, 2, 4: the range doubles twice
    state = _fold(obs, xs)
    data = np.concatenate([x.double().numpy().reshape(-1) for x in xs])
    exponent = int(np.floor(np.log2(np.abs(data).max()))) + 1  # the smallest k with max |x| < 2**k
    assert int(state.exponent) == exponent
    # numpy: the histogram of every value over [-2**k, 2**k) in BINS bins
    expected, _ = np.histogram(data, bins=BINS, range=(-2.0 ** exponent, 2.0 ** exponent))
    np.testing.assert_array_equal(state.counts.numpy(), expected)
    merged = obs.merge(_fold(obs, xs[:1]), _fold(obs, xs[1:]))
    np.testing.assert_array_equal(merged.counts.numpy(), expected)
    testing.check_all(obs, _make((6, 8)), max_examples=3)
