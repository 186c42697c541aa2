"""qstats.testing: the stability law observes its batch holding NaN and ±inf once (the two non-finite
checks each ran ``update`` on it), with the same verdicts: numpy gives the states compared."""

from typing import NamedTuple, Optional

import numpy as np
import pytest
import torch

import qstats
from qstats import testing
from qstats.observers import kit

XS = [torch.randn(6, 8, generator=torch.Generator().manual_seed(i)) for i in range(3)]


def _counting(obs):
    """``obs`` whose update records how many times it saw a batch holding a NaN or an infinity."""
    dirty_calls = []

    def update(state, x, weight=None):
        if x.is_floating_point() and not bool(torch.isfinite(x).all()):
            dirty_calls.append(x.clone())
        return obs.update(state, x, weight)

    return obs._replace(update=update), dirty_calls


@pytest.mark.parametrize("spec", [qstats.QuantSpec(), qstats.QuantSpec(granularity=qstats.PerAxis(0))])
def test_stability_updates_with_its_batch_holding_nan_and_inf_once(spec):
    counted, dirty_calls = _counting(qstats.minmax(spec))
    testing.check_stability(counted, XS)
    assert len(dirty_calls) == 1
    dirty = dirty_calls[0]
    # that batch is XS[0] with NaN, +inf and -inf in its first three values (numpy: the values it holds)
    expected = XS[0].numpy().copy().reshape(-1)
    expected[:3] = [np.nan, np.inf, -np.inf]
    np.testing.assert_array_equal(dirty.numpy().reshape(-1), expected)
    # and the state it gives is numpy's: the min/max of the finite values of the batches seen
    state = counted.update(counted.update(counted.init(XS[0]), XS[0]), dirty)
    per_row = isinstance(spec.granularity, qstats.PerAxis)
    values = np.concatenate([XS[0].numpy(), expected.reshape(XS[0].shape)], axis=1 if per_row else 0)
    finite = np.where(np.isfinite(values), values, np.nan)
    reduce = {"axis": 1} if per_row else {}
    np.testing.assert_array_equal(state.min_val.numpy(), np.nanmin(finite, **reduce))
    np.testing.assert_array_equal(state.max_val.numpy(), np.nanmax(finite, **reduce))


@kit.register_state
class StabilityOnceAbsMaxState(NamedTuple):
    amax: torch.Tensor
    count: torch.Tensor


@kit.register_range_rule(StabilityOnceAbsMaxState)
def _absmax_rule(state, spec):
    return kit.Range(-state.amax, state.amax, state.count)


def _absmax(clean):
    """A per-tensor abs max that leaves non-finite values out (``clean="leave out"``), clamps them with
    ``torch.nan_to_num``, keeps them, or refuses them with a ValueError."""
    spec = qstats.QuantSpec()

    def init_fn(x):
        return StabilityOnceAbsMaxState(torch.zeros((), device=x.device), torch.zeros((), dtype=torch.int64,
                                                                                       device=x.device))

    def update_fn(state, x, weight: Optional[torch.Tensor] = None):
        if x.numel() == 0:
            return state
        if clean == "raise" and not bool(torch.isfinite(x).all()):
            raise ValueError("absmax: x holds NaN or Inf")
        values = torch.nan_to_num(x.float()) if clean == "nan_to_num" else x.float()
        keep = torch.isfinite(values) if clean == "leave out" else torch.ones_like(values, dtype=torch.bool)
        if weight is not None:
            keep = keep & (weight.reshape(*weight.shape, *(1,) * (x.ndim - weight.ndim)) != 0)
        kept = torch.where(keep, values.abs(), 0.0)
        return StabilityOnceAbsMaxState(torch.maximum(state.amax, kept.amax()), state.count + keep.sum())

    def merge_fn(a, b):
        return StabilityOnceAbsMaxState(torch.maximum(a.amax, b.amax), a.count + b.count)

    return kit.Observer(init_fn, update_fn, merge_fn, exact=True, spec=spec, name=f"absmax({clean})")


@pytest.mark.parametrize("clean, verdict", [
    ("leave out", None),
    ("raise", None),
    ("kept", r"absmax\(kept\): stability: update with a batch holding NaN and ±inf put 1 non-finite value\(s\) "
             r"into state.amax"),
    ("nan_to_num", r"absmax\(nan_to_num\): stability: compute_qparams of update\(s, x holding NaN and ±inf\)"),
])
def test_the_verdicts_of_the_non_finite_checks_are_unchanged(clean, verdict):
    obs = _absmax(clean)
    dirty = XS[0].clone()
    dirty.view(-1)[:3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    values = dirty.numpy()
    if clean == "leave out":  # numpy: the abs max of the finite values
        state = obs.update(obs.init(dirty), dirty)
        assert float(state.amax) == np.abs(values[np.isfinite(values)]).max()
    if clean == "nan_to_num":  # +inf read as the largest float: an absurd scale
        assert float(obs.update(obs.init(dirty), dirty).amax) == float(np.finfo(np.float32).max)
    counted, dirty_calls = _counting(obs)
    if verdict is None:
        testing.check_stability(counted, XS)
    else:
        with pytest.raises(AssertionError, match=verdict):
            testing.check_stability(counted, XS)
    assert len(dirty_calls) == 1
