"""kit.row_mask refuses the observation weights calibrate refuses (check_observation_weight, the
reference): NaN, infinite or negative values, with an error naming the caller; 0/1, bool and
fractional weights keep the rows a plain ``weight != 0`` keeps, eagerly and under vmap."""

import pytest
import torch

import qstats
from qstats.observation import check_observation_weight
from qstats.observers import kit

torch.set_num_threads(1)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_row_mask_refuses_what_calibrate_refuses(bad):
    x = torch.randn(3, 4)
    weight = torch.tensor([1.0, bad, 0.0])
    with pytest.raises(ValueError, match="negative, NaN or infinite"):  # the reference
        check_observation_weight(weight, "calibrate")
    with pytest.raises(ValueError, match="my_observer.update: .*negative, NaN or infinite"):
        kit.row_mask(x, weight, "my_observer.update")
    with pytest.raises(ValueError, match="hessian.update"):
        obs = qstats.hessian()
        obs.update(obs.init(x), x, weight)
    with pytest.raises(ValueError, match="vmapped.update"):
        torch.func.vmap(lambda w: kit.row_mask(x, w, "vmapped.update"))(torch.stack([weight.abs().nan_to_num(1), weight]))


@pytest.mark.parametrize("weight", [torch.tensor([1.0, 0.0, 0.25]), torch.tensor([True, False, True]),
                                    torch.tensor([2, 0, 1])])
def test_row_mask_keeps_the_nonzero_rows_eagerly_and_under_vmap(weight):
    x = torch.randn(3, 2, 4)
    expected = (weight != 0).repeat_interleave(2)  # a plain reference: each row's two tokens
    assert torch.equal(kit.row_mask(x, weight, "u"), expected)
    stacked = torch.stack([weight, torch.zeros_like(weight)])
    batched = torch.func.vmap(lambda w: kit.row_mask(x, w, "u"))(stacked)
    assert torch.equal(batched, torch.stack([expected, torch.zeros_like(expected)]))
