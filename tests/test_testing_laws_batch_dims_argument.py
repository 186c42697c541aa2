"""The laws' ``batch_dims`` argument (check_homomorphism, check_purity, check_stability, check_vmap):
-1 failed inside a weight check naming no argument (an observed tensor of shape (4, 1, 4, 8)), a
count past the batches' dimensions as torch's IndexError, a bool was read as 1. Each is refused with
a ValueError naming the law and batch_dims; a stack's own batch_dims=1 still passes."""

import pytest
import torch

import qstats
from qstats import testing

OBS = qstats.minmax(qstats.QuantSpec())
LAWS = ["check_homomorphism", "check_purity", "check_stability", "check_vmap"]


def _batches(shape):
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=generator) for _ in range(3)]


@pytest.mark.parametrize("batch_dims", [-1, 2, 5, True, 1.0])
@pytest.mark.parametrize("law", LAWS)
def test_a_batch_dims_the_batches_do_not_have_is_refused_by_name(law, batch_dims):
    xs = _batches((4, 8))
    assert not (isinstance(batch_dims, int) and not isinstance(batch_dims, bool) and 0 <= batch_dims < xs[0].ndim)
    with pytest.raises(ValueError, match=rf"{law}: batch_dims must be an int from 0 to 1 .*got {batch_dims!r}"):
        getattr(testing, law)(OBS, xs, batch_dims=batch_dims)


@pytest.mark.parametrize("law", LAWS)
def test_a_stack_of_three_slices_passes_with_its_batch_dims(law):
    getattr(testing, law)(qstats.stacked_observer(OBS, 3), _batches((3, 4, 8)), batch_dims=1)
