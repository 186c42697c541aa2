"""`QATSchedule.from_milestones` against coremltools' ``LinearQuantizer`` procedure, written out on
torch.ao's own switches: ``prepare`` turns observers and fake quantization off, and its ``step()``
applies milestone ``i`` at the call that counts ``milestones[i]`` (from 0; ``disable_observer``,
``enable_fake_quant``, ... on torch.ao's ``FakeQuantize``; ``freeze_bn_stats`` puts batch norm in
eval mode). ``schedule(step)`` is coremltools' phase once ``step()`` has been called ``step + 1``
times; a loop calling it after each training step, as coremltools' own example, runs one step later."""

import pytest
from torch import nn
from torch.ao.quantization import FakeQuantize, disable_fake_quant, disable_observer, enable_fake_quant, enable_observer

import qstats


class _CoremltoolsQuantizer:
    """coremltools' LinearQuantizer.prepare / step on one FakeQuantize and one batch norm."""

    def __init__(self, milestones):
        self.milestones, self.count = milestones, 0
        self.fake_quant, self.batchnorm = FakeQuantize(), nn.BatchNorm1d(2)
        if milestones is not None:  # None (the default): prepare leaves everything on, step does nothing
            self.fake_quant.apply(disable_observer)
            self.fake_quant.apply(disable_fake_quant)

    def step(self):
        if self.milestones is None:
            return
        switches = (enable_observer, enable_fake_quant, disable_observer, None)
        for milestone, switch in zip(self.milestones, switches):
            if self.count == milestone:
                if switch is None:
                    self.batchnorm.eval()  # torch.ao.nn.intrinsic.qat.freeze_bn_stats: bn.training = False
                else:
                    self.fake_quant.apply(switch)
        self.count += 1

    def phase(self):
        return qstats.QATPhase(bool(self.fake_quant.observer_enabled), bool(self.fake_quant.fake_quant_enabled),
                               not self.batchnorm.training)


@pytest.mark.parametrize("milestones", [[0, 3, 6, 4], [2, 2, 5, 9], [0, 0, 4, 0], [1, 4, 4, 7]])
def test_schedule_is_coremltools_phase_after_step_plus_one_calls(milestones):
    schedule = qstats.QATSchedule.from_milestones(milestones)
    before, after = _CoremltoolsQuantizer(milestones), _CoremltoolsQuantizer(milestones)
    one_later = qstats.QATSchedule.from_milestones([m + 1 for m in milestones])
    for step in range(12):
        before.step()  # quantizer.step() before the training step's forward
        assert schedule(step) == before.phase(), step
        assert one_later(step) == after.phase(), step  # quantizer.step() after it (coremltools' example)
        after.step()


def test_coremltools_default_milestones_none_observe_and_fake_quantize_from_the_first_step():
    """coremltools' ``milestones=None`` (its default) was a TypeError ('NoneType' is not iterable)."""
    schedule = qstats.QATSchedule.from_milestones(None)
    quantizer = _CoremltoolsQuantizer(None)
    for step in range(5):
        quantizer.step()
        assert schedule(step) == quantizer.phase(), step
