"""`qstats.fused_global_scale` on groups with members that saw no data follows the spec's
``on_uncalibrated`` policy as `qstats.compute_qparams` follows it on the same states: under "raise"
a ValueError naming the member, under "fallback" the calibrated members' global scale (1 when none)."""

import pytest
import torch

import qstats

FORMULAS = ["amax_over_range", "range_over_amax"]


def _spec(policy, formula):
    return qstats.QuantSpec(dtype="fp4_e2m1", granularity=qstats.TensorGroup(16), scale_dtype="float8_e4m3fn",
                            on_uncalibrated=policy, global_scale_formula=formula)


def _states(spec):
    """A member that saw data, one that saw none, and one whose first half of rows saw none."""
    obs = qstats.minmax(spec)
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))
    rows = torch.tensor([0.0] * 4 + [1.0] * 4)
    return {"seen": obs.update(obs.init(x), x), "unseen": obs.init(x),
            "half": obs.update(obs.init(x), 3 * x, weight=rows)}


@pytest.mark.parametrize("formula", FORMULAS)
@pytest.mark.parametrize("group", [("unseen", "unseen"), ("seen", "unseen"), ("half", "seen"), ("seen", "half")])
def test_raise_policy_raises_naming_the_member_as_compute_qparams_raises(formula, group):
    spec = _spec("raise", formula)
    states = _states(spec)
    member = next(i for i, name in enumerate(group) if name != "seen")
    with pytest.raises(ValueError, match="uncalibrated"):  # the reference: that member on its own
        qstats.compute_qparams(states[group[member]], spec)
    with pytest.raises(ValueError, match=rf"fused_global_scale: member {member} of the fused group of 2: .*uncalibrated"):
        qstats.fused_global_scale([states[name] for name in group], spec)
    with pytest.raises(ValueError, match=rf"fused_qparams: member {member} of the fused group of 2"):
        qstats.fused_qparams([states[name] for name in group], spec)
    assert torch.equal(qstats.fused_global_scale([states["seen"]] * 2, spec),
                       qstats.compute_qparams(states["seen"], spec).global_scale)


@pytest.mark.parametrize("formula", FORMULAS)
def test_fallback_policy_leaves_out_uncalibrated_entries_as_compute_qparams(formula):
    spec = _spec("fallback", formula)
    states = _states(spec)
    unseen, seen = (qstats.compute_qparams(states[name], spec) for name in ("unseen", "seen"))
    assert not unseen.calibrated.any() and torch.equal(unseen.global_scale, torch.tensor(1.0))
    assert torch.equal(qstats.fused_global_scale([states["unseen"]] * 2, spec), unseen.global_scale)
    assert torch.equal(qstats.fused_global_scale([states["unseen"], states["seen"]], spec), seen.global_scale)
    # rows that saw no data do not contribute: the half-seen member's global scale is that of its seen rows
    half = qstats.compute_qparams(states["half"], spec)
    assert torch.equal(qstats.fused_global_scale([states["half"], states["unseen"]], spec), half.global_scale)


def test_raise_policy_under_vmap_reports_an_expert_as_stacked_qparams():
    """Over a stacked group of groups (gate and up of each expert) an expert that saw no data gets
    global scale 1 under "raise" too, as `qstats.stacked_qparams` gives it (the caller reads calibrated)."""
    spec = _spec("raise", "range_over_amax")
    obs = qstats.minmax(spec)
    experts = torch.randn(3, 8, 32, generator=torch.Generator().manual_seed(1))
    routed = torch.tensor([1.0, 0.0, 1.0]).view(3, 1).expand(3, 8)  # expert 1 saw no data
    gate = torch.func.vmap(lambda x, w: obs.update(obs.init(x), x, weight=w))(experts, routed)
    fused = torch.vmap(lambda state: qstats.fused_global_scale([state, state], spec))(gate)
    assert torch.equal(fused, qstats.stacked_qparams(gate, spec).global_scale.reshape(3))
