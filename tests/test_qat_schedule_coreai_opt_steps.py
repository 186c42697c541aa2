"""`QATSchedule(observe_at=a, fake_quantize_at=b, freeze_ranges_at=c)` against coreai_opt's own
``QATSchedule(enable_observer=a, enable_fake_quant=b, disable_observer=c)``: with ``quantizer.step()``
after each training step (its documented loop), its fake quantizers' switches at training step ``t``
are ``schedule(t)``'s phase (docs/qat.md)."""

import warnings

import pytest
import torch
from torch import nn

import qstats

pytest.importorskip("coreai_opt")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from coreai_opt.quantization import ExecutionMode, ModuleQuantizerConfig, Quantizer, QuantizerConfig
    from coreai_opt.quantization.config import QATSchedule
    from coreai_opt.quantization.spec.fake_quantize import FakeQuantizeImplBase


@pytest.mark.parametrize("milestones", [(0, 0, None), (0, 2, 5), (1, 3, 4), (2, 2, 3)], ids=str)
def test_phases_are_coreai_opts_switches_step_for_step(milestones, single_thread_quiet):
    a, b, c = milestones
    schedule = QATSchedule(enable_observer=a, enable_fake_quant=b, disable_observer=c)
    config = QuantizerConfig(global_config=ModuleQuantizerConfig(qat_schedule=schedule),
                             execution_mode=ExecutionMode.EAGER)
    quantizer = Quantizer(nn.Sequential(nn.Linear(8, 4)), config)
    prepared = quantizer.prepare((torch.randn(2, 8),))
    fake_quantizers = [m for m in prepared.modules() if isinstance(m, FakeQuantizeImplBase)]
    assert fake_quantizers
    ours = qstats.QATSchedule(observe_at=a, fake_quantize_at=b, freeze_ranges_at=c)
    with quantizer.training_mode():
        for step in range(8):
            prepared(torch.randn(2, 8))  # the training step
            phase = ours(step)
            assert {bool(m.observer_enabled[0]) for m in fake_quantizers} == {phase.observe}
            assert {bool(m.fake_quant_enabled[0]) for m in fake_quantizers} == {phase.fake_quantize}
            quantizer.step()
