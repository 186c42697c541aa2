"""A HessianState whose count or nonfinite does not fit its total (one count per [in, in] sum) is a
ValueError naming both shapes in update, merge, gptq_hessian and gptq; it used to broadcast
(a 2-D weight's GPTQ came back as three weights)."""

from __future__ import annotations

import pytest
import torch

import qstats
from qstats.observers.hessian import gptq_hessian, hessian


def _states():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(50, 16, generator=gen)
    one = hessian().update(hessian().init(x), x)
    stacked_observer = qstats.stacked_observer(hessian(), 3)
    shared = x.expand(3, 50, 16)
    stacked = stacked_observer.update(stacked_observer.init(shared), shared)
    return x, one, stacked


def test_well_formed_states_are_taken_as_before():
    x, one, stacked = _states()
    spec = qstats.QuantSpec(dtype="int4", granularity=qstats.PerGroup(8))
    weight = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    assert qstats.gptq(weight, one, spec)[0].shape == (8, 16)
    assert qstats.gptq(weight.expand(3, 8, 16), stacked, spec)[0].shape == (3, 8, 16)
    torch.testing.assert_close(gptq_hessian(stacked), (2.0 / 50) * (x.T @ x).expand(3, 16, 16), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("field,shape", [("count", (3,)), ("nonfinite", (2,))])
def test_a_count_of_another_shape_than_its_sum_is_refused(field, shape):
    x, one, _ = _states()
    bad = one._replace(**{field: torch.zeros(shape, dtype=torch.int64) + 50})
    spec = qstats.QuantSpec(dtype="int4", granularity=qstats.PerGroup(8))
    weight = torch.randn(8, 16)
    message = rf"HessianState.{field} of shape \({shape[0]},\) does not fit a total of shape \(16, 16\)"
    with pytest.raises(ValueError, match=message):
        qstats.gptq(weight, bad, spec)
    with pytest.raises(ValueError, match=message):
        gptq_hessian(bad)
    with pytest.raises(ValueError, match=message):
        hessian().update(bad, x)
    with pytest.raises(ValueError, match=message):
        hessian().merge(bad, bad)


def test_a_stack_of_sums_with_one_count_is_refused():
    """A stack built by hand with the experts' rows added into one count: each expert's sum needs its own."""
    _, _, stacked = _states()
    bad = stacked._replace(count=stacked.count.sum())
    spec = qstats.QuantSpec(dtype="int4", granularity=qstats.PerGroup(8))
    with pytest.raises(ValueError, match=r"count of shape \(\) does not fit a total of shape \(3, 16, 16\)"):
        qstats.gptq(torch.randn(3, 8, 16), bad, spec)


def test_a_total_that_is_not_square_is_refused():
    _, one, _ = _states()
    with pytest.raises(ValueError, match=r"square \[\.\.\., in, in\] tensor, got \(16, 8\)"):
        gptq_hessian(one._replace(total=one.total[:, :8]))
