"""Observer families, one module each; `kit` holds what an observer author needs.

The factories are re-exported at the top level (``qstats.minmax``, ``qstats.histogram``, ...);
here each family's name is its module (``qstats.observers.minmax`` is the module), so the
package only re-exports the names no module shadows.
"""

from ._base import Observer as Observer
from ._base import register_state as register_state
from ._base import state_types as state_types
from .minmax import MemorylessMinMaxState as MemorylessMinMaxState
from .minmax import MinMaxState as MinMaxState
from .minmax import MovingAverageMinMaxState as MovingAverageMinMaxState
from .minmax import memoryless_minmax as memoryless_minmax
from .minmax import moving_average_minmax as moving_average_minmax
from .histogram import HistogramState as HistogramState
from .moments import MomentsState as MomentsState
from .mse import MSEState as MSEState
from .mse import MovingAverageMSEState as MovingAverageMSEState
from .imatrix import IMatrixState as IMatrixState
from .hessian import HessianState as HessianState
from .imatrix import imatrix_mse as imatrix_mse
from .imatrix import importance as importance
from .fixed import FixedQParamsState as FixedQParamsState
from .fixed import PlaceholderState as PlaceholderState
from .fixed import RecordingState as RecordingState
from .fixed import fixed_qparams as fixed_qparams
from .fixed import noop as noop
from .fixed import placeholder as placeholder
from .fixed import recorded_values as recorded_values
from .fixed import recording as recording
from .fixed import sigmoid_qparams as sigmoid_qparams
from .fixed import tanh_qparams as tanh_qparams
from . import kit as kit
from . import registry as registry
from .registry import get as get
from .registry import register as register
from .registry import registered as registered
