"""qstats.plot.histogram of a state holding no finite value: a ValueError saying so, and how many
non-finite values (counted here from the batch) the observer left out; it said "the state saw no
data" of a state that had seen them."""

import math

import pytest
import torch

import qstats

pytest.importorskip("matplotlib")
from qstats import plot  # noqa: E402

SPEC = qstats.QuantSpec(dtype="int8")


def _state(x):
    observer = qstats.histogram(SPEC)
    return observer.update(observer.init(x), x)


@pytest.mark.parametrize("x", [
    torch.tensor([math.nan, math.inf, -math.inf, math.nan]),
    torch.full((7,), 1e300, dtype=torch.float64),  # past float32's range: left out as non-finite
])
def test_a_state_of_non_finite_values_names_how_many_were_left_out(x):
    left_out = int((~torch.isfinite(x.float())).sum())
    with pytest.raises(ValueError, match=rf"no finite value to draw: it saw {left_out} value\(s\), all non-finite"):
        plot.histogram(_state(x), None, SPEC)


@pytest.mark.parametrize("x, weight", [(torch.zeros(0), None), (torch.randn(3, 4), torch.zeros(3))])
def test_a_state_that_saw_no_value_says_so(x, weight):
    observer = qstats.histogram(SPEC)
    state = observer.update(observer.init(x), x, weight)
    with pytest.raises(ValueError, match="no finite value to draw: it saw no value"):
        plot.histogram(state, None, SPEC)
