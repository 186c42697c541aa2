"""QAT schedules: which phase a training step is in, as a pure function of the step.

`QATSchedule` is static configuration (coremltools' milestones: observe, fake-quantize, freeze
ranges, freeze batch norm); ``schedule(step)`` returns a `QATPhase`, of Python bools for an int
step and bool tensors for a tensor step (one compiled graph). The phase table is in docs/qat.md.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional, Sequence, Union

import torch

from ._checks import is_integer

__all__ = ["QATPhase", "QATSchedule"]

Flag = Union[bool, torch.Tensor]
_INT64_MAX = torch.iinfo(torch.int64).max


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


_MILESTONE_ORDER = (("observe_at", None), ("fake_quantize_at", "observe_at"),
                    ("freeze_ranges_at", "fake_quantize_at"), ("freeze_batchnorm_at", None))


def _is_int(value, minimum=None) -> bool:
    """``value`` is a Python or numpy integer (not a bool), at least ``minimum`` if given."""
    return is_integer(value) and (minimum is None or value >= minimum)


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
        # each milestone, and the one it must not come before (freezing batch norm is independent of the
        # others, as in coremltools); the freezes may be None
        for name, earlier in _MILESTONE_ORDER:
            value = getattr(self, name)
            if value is None and name.startswith("freeze"):
                continue
            if not _is_int(value, 0):
                raise ValueError(f"QATSchedule.{name} must be a non-negative int, got {value!r}")
            if earlier is not None and value < getattr(self, earlier):
                raise ValueError(
                    f"QATSchedule.{name} ({value}) must not come before {earlier} ({getattr(self, earlier)})"
                )
        if self.sync_every is not None and not _is_int(self.sync_every, 1):
            raise ValueError(f"QATSchedule.sync_every must be a positive int or None, got {self.sync_every!r}")
        for field in dataclasses.fields(self):  # numpy integers (a config's, np.arange's) kept as Python ints
            if getattr(self, field.name) is not None:
                object.__setattr__(self, field.name, int(getattr(self, field.name)))

    @classmethod
    def from_milestones(cls, milestones: Optional[Sequence[int]], sync_every: Optional[int] = None) -> "QATSchedule":
        """coremltools' ``milestones``: [observers on, fake quant on, observers off, batch norm frozen];
        None (its default) observes and fake-quantizes from the first step and never freezes."""
        if milestones is None:
            return cls(sync_every=sync_every)
        if isinstance(milestones, (str, bytes)) or not hasattr(milestones, "__iter__"):  # list(5), list("0123")
            raise TypeError(f"QATSchedule.from_milestones expects a sequence of 4 milestones (coremltools' [observers "
                            f"on, fake quant on, observers off, batch norm frozen]) or None, got {milestones!r}")
        milestones = list(milestones)
        if len(milestones) != 4:
            raise ValueError(f"QATSchedule.from_milestones expects 4 milestones, got {len(milestones)}")
        return cls(*milestones, sync_every=sync_every)

    def __call__(self, step: Union[int, torch.Tensor]) -> QATPhase:
        """The phase of ``step`` (an int, or an integer tensor for bool-tensor flags)."""
        if isinstance(step, torch.Tensor):
            if step.dtype.is_floating_point or step.dtype.is_complex or step.dtype == torch.bool:
                raise TypeError(f"QATSchedule: a tensor step must hold an integer, got dtype {step.dtype}")
            step = step.long()  # compared in its own dtype, an int8 step wrapped milestone 300 to 44
        elif not _is_int(step):
            raise TypeError(f"QATSchedule: step must be an int or an integer tensor, got {type(step).__name__}")
        else:
            step = int(step)  # a numpy step too, whose comparisons gave numpy bools, not Python bools

        def reached(milestone):
            # step >= milestone; None: never, nor a milestone past int64 for a tensor step (not converted to it)
            if not isinstance(step, torch.Tensor):
                return milestone is not None and step >= milestone
            if milestone is None or milestone > _INT64_MAX:
                return torch.zeros_like(step, dtype=torch.bool)
            return step >= milestone

        frozen_ranges = reached(self.freeze_ranges_at)
        not_frozen = ~frozen_ranges if isinstance(step, torch.Tensor) else not frozen_ranges
        return QATPhase(reached(self.observe_at) & not_frozen, reached(self.fake_quantize_at),
                        reached(self.freeze_batchnorm_at))

    def sync_at(self, step: int) -> bool:
        """True when activation states should be merged across ranks *after* ``step`` (a host-side
        decision: every rank calls the collective at the same steps). Always True for the last
        observing step before ``freeze_ranges_at``."""
        if not _is_int(step):
            raise TypeError(f"QATSchedule.sync_at: step must be an int, got {type(step).__name__}")
        step = int(step)
        last = self.freeze_ranges_at is not None and step == self.freeze_ranges_at - 1
        every = self.sync_every is not None and (step - self.observe_at + 1) % self.sync_every == 0
        return self(step).observe and (last or every)

