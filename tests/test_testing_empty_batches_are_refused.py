"""check_all and the laws on batches holding no value: every state is then init's, so every law held
for any observer (one whose merge halves the sums, one that ignores its weight, one whose update
returns another dtype all passed check_all with ``make_x`` returning ``torch.randn(0, 16)``). Such
input is refused, naming it; the same observers fail on batches of data."""

import re
from typing import NamedTuple

import pytest
import torch

import qstats
from qstats import testing
from qstats.observers import kit

pytest.importorskip("hypothesis")

SPEC = qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0))


@kit.register_state
class EmptyBatchesSumState(NamedTuple):
    approx_fields = ("square_total",)

    square_total: torch.Tensor
    count: torch.Tensor


def _sum_of_squares(defect):
    """A sum of squares per row with one ``defect``."""

    def init_fn(x):
        shape = kit.qparam_shape(x.shape, SPEC.granularity)
        return EmptyBatchesSumState(torch.zeros(shape, dtype=torch.float64, device=x.device),
                                    torch.zeros(shape, dtype=torch.int64, device=x.device))

    def update_fn(state, x, weight=None):
        if x.numel() == 0:
            return state
        view = kit.checked_view(x, SPEC.granularity, state.count.shape, "update").double()
        keep = torch.isfinite(view)
        mask = kit.weight_view(x, weight, SPEC.granularity)
        if mask is not None and defect != "ignores_weight":
            keep = keep & (mask != 0)
        total = state.square_total + torch.where(keep, view * view, 0.0).sum(dim=(0, -1))
        return EmptyBatchesSumState(total.float() if defect == "float32_sum" else total,
                                    state.count + keep.sum(dim=(0, -1)))

    def merge_fn(a, b):
        total = a.square_total + b.square_total
        return EmptyBatchesSumState(total / 2 if defect == "halves_the_sum" else total, a.count + b.count)

    return kit.Observer(init_fn, update_fn, merge_fn, exact=True, spec=SPEC, name=defect)


DEFECTS = ["halves_the_sum", "ignores_weight", "float32_sum"]


@pytest.mark.parametrize("defect", DEFECTS)
def test_each_broken_observer_fails_on_batches_of_data(defect):
    with pytest.raises(AssertionError, match=defect):
        testing.check_all(_sum_of_squares(defect), lambda g: torch.randn(8, 16, generator=g), max_examples=3)


@pytest.mark.parametrize("shape", [(0, 16), (8, 0)])
@pytest.mark.parametrize("defect", DEFECTS)
def test_check_all_refuses_a_make_x_of_empty_batches(defect, shape):
    assert torch.randn(shape).numel() == 0
    with pytest.raises(ValueError, match=re.escape(f"make_x(generator) returned an empty tensor (shape {shape})")):
        testing.check_all(_sum_of_squares(defect), lambda g: torch.randn(shape, generator=g), max_examples=3)


@pytest.mark.parametrize("law", ["check_identity", "check_associative", "check_commutative", "check_homomorphism",
                                 "check_purity", "check_stability", "check_vmap", "check_distributed"])
def test_each_law_refuses_batches_that_are_all_empty(law):
    with pytest.raises(ValueError, match="every batch of xs is empty"):
        getattr(testing, law)(_sum_of_squares("halves_the_sum"), [torch.randn(0, 16)] * 3)
