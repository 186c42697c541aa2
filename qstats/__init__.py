"""qstats: pure, mergeable, vmappable quantization statistics for PyTorch."""

from ._granularity import Granularity as Granularity
from ._granularity import PerAxis as PerAxis
from ._granularity import PerBlock as PerBlock
from ._granularity import PerGroup as PerGroup
from ._granularity import PerHead as PerHead
from ._granularity import PerRow as PerRow
from ._granularity import PerTensor as PerTensor
from ._granularity import PerToken as PerToken
from ._granularity import TensorGroup as TensorGroup
from ._granularity import canonical_view as canonical_view
from ._granularity import qparam_shape as qparam_shape
from ._qparams import QParams as QParams
from ._qparams import Range as Range
from ._qparams import compute_qparams as compute_qparams
from ._qparams import compute_minval as compute_minval
from ._qparams import qparams_from_minmax as qparams_from_minmax
from ._qparams import register_range_rule as register_range_rule
from ._quant import code_dtype as code_dtype
from ._quant import dequantize as dequantize
from ._quant import fake_quantize as fake_quantize
from ._quant import quantize as quantize
from ._spec import preset as preset
from ._formats import round_to_format as round_to_format
from .fused import fused_global_scale as fused_global_scale
from .fused import fused_qparams as fused_qparams
from ._spec import QuantSpec as QuantSpec
from .calibration import calibrate as calibrate
from .calibration import compute_qparams_tree as compute_qparams_tree
from .calibration import fake_quantized as fake_quantized
from .layerwise import calibrate_layerwise as calibrate_layerwise
from .layerwise_gptq import LayerwiseGPTQ as LayerwiseGPTQ, gptq_layerwise as gptq_layerwise
from .observation import Observing as Observing
from .observation import observing as observing
from .experts import UncalibratedWarning as UncalibratedWarning
from .stacked import stacked_observer as stacked_observer
from .stacked import stacked_qparams as stacked_qparams
from .lsq import LSQParams as LSQParams
from .lsq import lsq_fake_quantize as lsq_fake_quantize
from .lsq import lsq_grad_factor as lsq_grad_factor
from .lsq import lsq_init as lsq_init
from .lsq import lsq_qparams as lsq_qparams
from .observers import MemorylessMinMaxState as MemorylessMinMaxState
from .observers import MinMaxState as MinMaxState
from .observers import MovingAverageMinMaxState as MovingAverageMinMaxState
from .observers import HistogramState as HistogramState
from .observers import Observer as Observer
from .observers.histogram import histogram as histogram
from .observers import MomentsState as MomentsState
from .observers import MSEState as MSEState
from .observers import MovingAverageMSEState as MovingAverageMSEState
from .observers import IMatrixState as IMatrixState
from .observers import FixedQParamsState as FixedQParamsState
from .observers import PlaceholderState as PlaceholderState
from .observers import RecordingState as RecordingState
from .observers.moments import moments as moments
from .observers.mse import mse as mse
from .observers.imatrix import imatrix as imatrix
from .observers import imatrix_mse as imatrix_mse
from .observers.hessian import HessianState as HessianState
from .observers.hessian import hessian as hessian
from .observers.hessian import gptq_hessian as gptq_hessian
from .gptq_quantize import gptq as gptq
from .observers import importance as importance
from .observers import fixed_qparams as fixed_qparams
from .observers import noop as noop
from .observers import placeholder as placeholder
from .observers import recorded_values as recorded_values
from .observers import recording as recording
from .observers import sigmoid_qparams as sigmoid_qparams
from .observers import tanh_qparams as tanh_qparams
from .observers import memoryless_minmax as memoryless_minmax
from .observers.minmax import minmax as minmax
from .observers import moving_average_minmax as moving_average_minmax
from .observers import register_state as register_state
from .qat import QATState as QATState
from .qat import observe_fake_quantize as observe_fake_quantize
from .schedule import QATPhase as QATPhase
from .schedule import QATSchedule as QATSchedule
from .recipe import Plan as Plan
from .recipe import Recipe as Recipe
from .recipe import Rule as Rule
from .recipe import Site as Site
from .reporting import Report as Report
from .reporting import report as report

from . import distributed as distributed
from . import export as export
from . import qat as qat
from . import plot as plot
from . import testing as testing
from . import tree as tree
from . import torch_ao as torch_ao
from .io import load as load
from .io import save as save

__version__ = "0.1.0"

__all__ = [
    "Granularity",
    "HistogramState",
    "LSQParams",
    "MemorylessMinMaxState",
    "MinMaxState",
    "MovingAverageMinMaxState",
    "Observer",
    "PerAxis",
    "PerBlock",
    "PerGroup",
    "PerHead",
    "PerRow",
    "PerTensor",
    "PerToken",
    "QATPhase",
    "QATSchedule",
    "QATState",
    "QParams",
    "QuantSpec",
    "Plan",
    "Recipe",
    "Report",
    "Rule",
    "Site",
    "Range",
    "TensorGroup",
    "UncalibratedWarning",
    "calibrate",
    "calibrate_layerwise",
    "gptq_layerwise",
    "LayerwiseGPTQ",
    "observing",
    "Observing",
    "canonical_view",
    "code_dtype",
    "compute_qparams",
    "compute_minval",
    "compute_qparams_tree",
    "dequantize",
    "distributed",
    "export",
    "fake_quantize",
    "histogram",
    "MomentsState",
    "MSEState",
    "MovingAverageMSEState",
    "IMatrixState",
    "FixedQParamsState",
    "PlaceholderState",
    "RecordingState",
    "moments",
    "mse",
    "imatrix",
    "imatrix_mse",
    "hessian",
    "HessianState",
    "gptq_hessian",
    "gptq",
    "importance",
    "fixed_qparams",
    "noop",
    "placeholder",
    "recorded_values",
    "recording",
    "sigmoid_qparams",
    "tanh_qparams",
    "fake_quantized",
    "lsq_fake_quantize",
    "lsq_grad_factor",
    "lsq_init",
    "lsq_qparams",
    "load",
    "memoryless_minmax",
    "minmax",
    "moving_average_minmax",
    "observe_fake_quantize",
    "qat",
    "qparam_shape",
    "qparams_from_minmax",
    "preset",
    "quantize",
    "round_to_format",
    "fused_global_scale",
    "fused_qparams",
    "register_range_rule",
    "register_state",
    "report",
    "save",
    "stacked_observer",
    "stacked_qparams",
    "plot",
    "testing",
    "tree",
]
