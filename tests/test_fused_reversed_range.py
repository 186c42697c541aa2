"""A fused group's shared global scale reads a reversed range (``min_val > max_val``: an entry
that saw no data) as `qstats.compute_qparams` reads it: it does not contribute to the absolute
maximum, and under ``on_uncalibrated="raise"`` it raises naming the member. References:
compressed-tensors' ``generate_gparam`` over the entries that hold a range, and
`qstats.compute_qparams` of the same state."""

from typing import NamedTuple

import pytest
import torch

import qstats
from qstats.fused import fused_amax
from qstats.observers import kit

helpers = pytest.importorskip("compressed_tensors.quantization.utils.helpers")


def _spec(policy):
    return qstats.QuantSpec(dtype="fp4_e2m1", granularity=qstats.TensorGroup(16), scale_dtype="float8_e4m3fn",
                            on_uncalibrated=policy, global_scale_formula="range_over_amax")


def _states(spec):
    """A calibrated member, and a copy whose first group holds a reversed range larger than any value."""
    obs = qstats.minmax(spec)
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(0))
    seen = obs.update(obs.init(x), x)
    reversed_min, reversed_max = seen.min_val.clone(), seen.max_val.clone()
    reversed_min[0, 0], reversed_max[0, 0] = -50.0, -60.0  # min > max: |min| = 50 would dominate
    return x, seen, seen._replace(min_val=reversed_min, max_val=reversed_max)


def test_reversed_entry_is_left_out_of_the_fused_amax_and_global_scale():
    spec = _spec("fallback")
    x, seen, reversed_range = _states(spec)
    # the reference: the entries that hold a range, (4, 2) groups of 16 less the reversed one
    groups = x.reshape(4, 2, 16)
    kept = torch.ones(4, 2, dtype=torch.bool)
    kept[0, 0] = False
    min_val = torch.where(kept, groups.amin(-1), 0.0)
    max_val = torch.where(kept, groups.amax(-1), 0.0)
    expected = helpers.generate_gparam(min_val.min(), max_val.max()).reshape(())
    assert torch.equal(fused_amax([reversed_range], spec), groups[kept].abs().max())
    assert torch.equal(qstats.fused_global_scale([reversed_range], spec), expected)
    assert torch.equal(qstats.fused_global_scale([reversed_range], spec),
                       qstats.compute_qparams(reversed_range, spec).global_scale)
    # beside a calibrated member the group's scale is that member's
    assert torch.equal(qstats.fused_global_scale([reversed_range, seen], spec),
                       qstats.compute_qparams(seen, spec).global_scale)
    for qp in qstats.fused_qparams([reversed_range, seen], spec):
        assert torch.isfinite(qp.scale).all() and (qp.scale > 0).all()


def test_reversed_entry_raises_under_the_raise_policy_as_compute_qparams():
    spec = _spec("raise")
    _, seen, reversed_range = _states(spec)
    with pytest.raises(ValueError, match="uncalibrated"):  # the reference: that member on its own
        qstats.compute_qparams(reversed_range, spec)
    with pytest.raises(ValueError, match=r"fused_global_scale: member 1 of the fused group of 2: .*uncalibrated"):
        qstats.fused_global_scale([seen, reversed_range], spec)
    with pytest.raises(ValueError, match=r"fused_qparams: member 1 of the fused group of 2"):
        qstats.fused_qparams([seen, reversed_range], spec)


class PeakState(NamedTuple):
    """A user's state whose range rule gives no ``calibrated`` (None), which `compute_qparams` reads
    as: every entry with a finite, ordered range saw data."""

    min_val: torch.Tensor
    max_val: torch.Tensor


@qstats.register_range_rule(PeakState)
def _peak_range(state, spec):
    return kit.Range(state.min_val, state.max_val, None)


def test_range_rule_without_calibrated_gives_the_global_scale_of_compute_qparams():
    spec = _spec("fallback")
    state = PeakState(torch.tensor([[-1.0, -2.0], [4.0, -7.0]]), torch.tensor([[3.0, 1.0], [-5.0, 2.0]]))
    expected = helpers.generate_gparam(torch.tensor(-7.0), torch.tensor(3.0)).reshape(())  # [1, 0] is reversed
    assert torch.equal(qstats.compute_qparams(state, spec).global_scale, expected)
    assert torch.equal(qstats.fused_global_scale([state, state], spec), expected)
