"""QAT schedules: which phase a training step is in, as a pure function of the step.

`QATSchedule` is static configuration (coremltools' milestones: observe, fake-quantize, freeze
ranges, freeze batch norm); ``schedule(step)`` returns a `QATPhase`, of Python bools for an int
step and bool tensors for a tensor step (one compiled graph). The phase table is in docs/qat.md.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional, Sequence, Union

import torch

__all__ = ["QATPhase", "QATSchedule"]

Flag = Union[bool, torch.Tensor]


class QATPhase(NamedTuple):
    """What one QAT step does.

    Attributes:
      observe: update the observer states with this step's tensors.
      fake_quantize: fake-quantize weights and activations (otherwise they pass through in float).
      freeze_batchnorm: batch norm uses and keeps its running statistics (eval-mode arithmetic).
    """

    observe: Flag = True
    fake_quantize: Flag = True
    freeze_batchnorm: Flag = False


def _check_step_number(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"QATSchedule.{name} must be a non-negative int, got {value!r}")


@dataclasses.dataclass(frozen=True)
class QATSchedule:
    """Milestones of quantization-aware training (steps at which each phase starts; the first three
    non-decreasing, freezing batch norm at any step).

    Args:
      observe_at: first step that updates observer states.
      fake_quantize_at: first step that fake-quantizes (observers keep updating).
      freeze_ranges_at: first step with frozen ranges; activation states are merged across ranks before it.
      freeze_batchnorm_at: first step with frozen batch-norm statistics (None: never).
      sync_every: also merge activation states every ``sync_every`` observing steps (None: only before
        freezing).

    ``QATSchedule.from_milestones([a, b, c, d])`` takes coremltools' four milestones.

    >>> schedule = QATSchedule(observe_at=0, fake_quantize_at=10, freeze_ranges_at=100, freeze_batchnorm_at=150)
    >>> schedule(5)
    QATPhase(observe=True, fake_quantize=False, freeze_batchnorm=False)
    >>> schedule(120)
    QATPhase(observe=False, fake_quantize=True, freeze_batchnorm=False)
    """

    observe_at: int = 0
    fake_quantize_at: int = 0
    freeze_ranges_at: Optional[int] = None
    freeze_batchnorm_at: Optional[int] = None
    sync_every: Optional[int] = None

    def __post_init__(self) -> None:
        _check_step_number("observe_at", self.observe_at)
        _check_step_number("fake_quantize_at", self.fake_quantize_at)
        if self.fake_quantize_at < self.observe_at:
            raise ValueError(
                f"QATSchedule.fake_quantize_at ({self.fake_quantize_at}) must not come before "
                f"observe_at ({self.observe_at})"
            )
        if self.freeze_ranges_at is not None:
            _check_step_number("freeze_ranges_at", self.freeze_ranges_at)
            if self.freeze_ranges_at < self.fake_quantize_at:
                raise ValueError(
                    f"QATSchedule.freeze_ranges_at ({self.freeze_ranges_at}) must not come before "
                    f"fake_quantize_at ({self.fake_quantize_at})"
                )
        if self.freeze_batchnorm_at is not None:  # independent of the others, as in coremltools
            _check_step_number("freeze_batchnorm_at", self.freeze_batchnorm_at)
        if self.sync_every is not None and (
            not isinstance(self.sync_every, int) or isinstance(self.sync_every, bool) or self.sync_every < 1
        ):
            raise ValueError(f"QATSchedule.sync_every must be a positive int or None, got {self.sync_every!r}")

    @classmethod
    def from_milestones(cls, milestones: Sequence[int], sync_every: Optional[int] = None) -> "QATSchedule":
        """coremltools' ``milestones``: [observers on, fake quant on, observers off, batch norm frozen]."""
        milestones = list(milestones)
        if len(milestones) != 4:
            raise ValueError(f"QATSchedule.from_milestones expects 4 milestones, got {len(milestones)}")
        return cls(*milestones, sync_every=sync_every)

    def __call__(self, step: Union[int, torch.Tensor]) -> QATPhase:
        """The phase of ``step`` (an int, or an integer tensor for bool-tensor flags)."""
        if isinstance(step, torch.Tensor):
            if step.dtype.is_floating_point or step.dtype == torch.bool:
                raise TypeError(f"QATSchedule: a tensor step must hold an integer, got dtype {step.dtype}")
        elif not isinstance(step, int) or isinstance(step, bool):
            raise TypeError(f"QATSchedule: step must be an int or an integer tensor, got {type(step).__name__}")
        observing = _at_least(step, self.observe_at)
        if self.freeze_ranges_at is not None:
            observing = _and(observing, _not(_at_least(step, self.freeze_ranges_at)))
        fake_quantize = _at_least(step, self.fake_quantize_at)
        if self.freeze_batchnorm_at is None:
            frozen_bn = torch.zeros_like(step, dtype=torch.bool) if isinstance(step, torch.Tensor) else False
        else:
            frozen_bn = _at_least(step, self.freeze_batchnorm_at)
        return QATPhase(observing, fake_quantize, frozen_bn)

    def sync_at(self, step: int) -> bool:
        """True when activation states should be merged across ranks *after* ``step`` (a host-side
        decision: every rank calls the collective at the same steps). Always True for the last
        observing step before ``freeze_ranges_at``."""
        if not isinstance(step, int) or isinstance(step, bool):
            raise TypeError(f"QATSchedule.sync_at: step must be an int, got {type(step).__name__}")
        if self.freeze_ranges_at is not None and step == self.freeze_ranges_at - 1 and step >= self.observe_at:
            return True
        observing = step >= self.observe_at and (self.freeze_ranges_at is None or step < self.freeze_ranges_at)
        if self.sync_every is not None and observing:
            return (step - self.observe_at + 1) % self.sync_every == 0
        return False


def _at_least(step, milestone: int):
    if isinstance(step, torch.Tensor):
        return step >= milestone
    return step >= milestone


def _not(flag):
    if isinstance(flag, torch.Tensor):
        return ~flag
    return not flag


def _and(a, b):
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return torch.as_tensor(a) & torch.as_tensor(b)
    return a and b
