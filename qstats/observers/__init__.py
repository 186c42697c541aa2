"""Observer families, one module each."""

from ._base import Observer as Observer
from ._base import register_state as register_state
from ._base import state_types as state_types
from .minmax import MemorylessMinMaxState as MemorylessMinMaxState
from .minmax import MinMaxState as MinMaxState
from .minmax import MovingAverageMinMaxState as MovingAverageMinMaxState
from .minmax import memoryless_minmax as memoryless_minmax
from .minmax import minmax as minmax
from .minmax import moving_average_minmax as moving_average_minmax
from .histogram import HistogramState as HistogramState
from .histogram import histogram as histogram
