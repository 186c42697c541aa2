"""Edges of QATSchedule (against coreai-opt's QATSchedule) and stacked_observer's expert count
(numpy / tensor integers)."""

import itertools

import numpy as np
import pytest
import torch

import qstats

# ---------------------------------------------------------------- QATSchedule vs coreai-opt

_MILESTONES = [
    (observe, fake, freeze)
    for observe, fake in itertools.product(range(4), repeat=2)
    for freeze in [None, *range(5)]
]


def _coreai_schedule(observe, fake, freeze):
    """coreai-opt 0.4's QATSchedule of the same milestones, or None where it refuses them."""
    config = pytest.importorskip("coreai_opt.quantization.config.quantization_config")
    try:
        return config.QATSchedule(enable_observer=observe, enable_fake_quant=fake, disable_observer=freeze)
    except ValueError:  # pydantic's ValidationError is a ValueError
        return None


@pytest.mark.parametrize("observe, fake, freeze", _MILESTONES)
def test_schedule_refuses_what_coreai_opt_refuses(observe, fake, freeze):
    """freeze_ranges_at == observe_at (no step ever observes) was accepted and failed later, at the
    first fake-quantized step, as uncalibrated; coreai-opt refuses it when it is built. Accepted
    schedules have coreai-opt's phases."""
    theirs = _coreai_schedule(observe, fake, freeze)
    try:
        ours = qstats.QATSchedule(observe_at=observe, fake_quantize_at=fake, freeze_ranges_at=freeze)
    except ValueError:
        ours = None
    assert (ours is None) == (theirs is None)
    if ours is not None:
        for step in range(7):
            phase, state = ours(step), theirs._compute_state(step)
            assert (phase.observe, phase.fake_quantize) == (state.obs_on, state.fq_on)


def test_schedule_without_an_observing_step_names_the_fields():
    with pytest.raises(ValueError, match=r"freeze_ranges_at \(2\).*observe_at \(2\)"):
        qstats.QATSchedule(observe_at=2, fake_quantize_at=2, freeze_ranges_at=2)
    with pytest.raises(ValueError, match=r"freeze_ranges_at \(0\).*observe_at \(0\)"):
        qstats.QATSchedule.from_milestones([0, 0, 0, 5])


# ---------------------------------------------------------------- stacked_observer's expert count


@pytest.mark.parametrize("count", [np.int64(3), np.int32(3), torch.tensor(3), torch.tensor(3, dtype=torch.int16)],
                         ids=["np.int64", "np.int32", "tensor-int64", "tensor-int16"])
def test_stacked_observer_takes_any_integer(count):
    spec = qstats.QuantSpec(granularity=qstats.PerAxis(0))
    x = torch.randn(3, 5, 4, generator=torch.Generator().manual_seed(0))
    x[1, 2, 0] = float("nan")
    mask = torch.tensor([[1, 0, 1, 1, 1], [1, 1, 1, 0, 1], [0, 0, 1, 1, 1]])
    reference = qstats.stacked_observer(qstats.minmax(spec), 3)
    obs = qstats.stacked_observer(qstats.minmax(spec), count)
    expected = reference.update(reference.init(x), x, mask)
    got = obs.update(obs.init(x), x, mask)
    assert type(got) is type(expected)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert obs.name == reference.name
    with pytest.raises(ValueError, match="leading expert dimension 3"):
        obs.init(torch.zeros(4, 5))


@pytest.mark.parametrize("count", [True, np.bool_(True), torch.tensor(True), 3.0, torch.tensor(3.0), "3", None,
                                   0, np.int64(0), torch.tensor(-2)])
def test_stacked_observer_refuses_other_counts(count):
    with pytest.raises(ValueError, match="num_experts must be a positive int"):
        qstats.stacked_observer(qstats.minmax(qstats.QuantSpec()), count)
