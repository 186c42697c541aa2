"""testing.assert_states_equal's ``rtol``: NaN (a difference > NaN is False) and inf passed any two
states, 0.01 against 1.0 of a float sum included; a negative one failed two equal states as
"differs by 0 > tolerance -1"; a string or None failed inside the arithmetic. Each is refused naming
rtol; a finite non-negative one compares as |a - b| <= rtol * the field's largest magnitude."""

import math
from typing import NamedTuple

import pytest
import torch

import qstats
from qstats import testing
from qstats.observers import kit


@kit.register_state
class RtolSumState(NamedTuple):
    approx_fields = ("total",)

    total: torch.Tensor


A, B = RtolSumState(torch.tensor([0.01, 2.0])), RtolSumState(torch.tensor([1.0, 2.0]))


@pytest.mark.parametrize("rtol", [math.nan, math.inf, -1.0, "1e-5", None, True])
def test_an_rtol_that_is_no_finite_non_negative_number_is_refused(rtol):
    with pytest.raises(ValueError, match=r"assert_states_equal: rtol must be a finite non-negative number"):
        testing.assert_states_equal(A, B, rtol=rtol)


@pytest.mark.parametrize("rtol", [0, 1e-5, 0.4, 0.5, 1])
def test_a_finite_rtol_bounds_the_difference_by_the_largest_magnitude(rtol):
    worst, largest = float((A.total - B.total).abs().max()), float(torch.maximum(A.total.abs(), B.total.abs()).max())
    if worst <= rtol * largest:  # 0.99 <= rtol * 2
        testing.assert_states_equal(A, B, rtol=rtol)
    else:
        with pytest.raises(AssertionError, match="state.total differs by"):
            testing.assert_states_equal(A, B, rtol=rtol)


def test_numpy_numbers_are_taken_as_rtol_and_batch_dims():
    numpy = pytest.importorskip("numpy")
    testing.assert_states_equal(A, A, rtol=numpy.float32(1e-5))  # a numpy float32 is no Python float
    with pytest.raises(AssertionError, match="state.total differs by"):
        testing.assert_states_equal(A, B, rtol=numpy.float32(1e-5))
    obs = qstats.minmax(qstats.QuantSpec())
    testing.check_purity(obs, [torch.randn(4, 8), torch.randn(4, 8)], batch_dims=numpy.int64(0))
