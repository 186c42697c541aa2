"""Plots of observer states (matplotlib is an optional dependency: ``pip install 'qstats[plot]'``).

`histogram(state, qparams, spec, path=...)` draws a `HistogramState`'s distribution (log scale) with
the clipping range of each set of qparams given: the values codes ``qmin`` and ``qmax`` dequantize to
in the spec's convention (``(q - zp) * scale``; torchao's float zero point, two-level block scales and
bf16/fp16 compute dtypes as `qstats.fake_quantize` computes them). The figure has its own Agg canvas:
pyplot and the process's backend are left alone.
"""

from __future__ import annotations

import os
from typing import Mapping, Optional, Union

import torch

from ._checks import as_index
from ._qparams import QParams
from ._quant import _dequantize_view
from ._spec import QuantSpec
from .observers.histogram import HistogramState
from .observers.search import _geometry as geometry

__all__ = ["histogram"]


def _figure():
    """A Figure on its own Agg canvas: no pyplot, so no backend switch and no figure kept by pyplot."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError("qstats.plot needs matplotlib, which qstats' 'plot' extra installs: "
                          "pip install 'qstats[plot]' (or pip install matplotlib)") from error
    figure = Figure(figsize=(8, 4.5))
    FigureCanvasAgg(figure)
    return figure


def _select(t: torch.Tensor, index: tuple):
    """The entry of ``t`` at ``index``; a tensor with fewer dimensions (the global scale of a stacked
    two-level state: one per expert) takes the leading components (a 0-dim one is itself)."""
    return t[index[: t.dim()]]


def _one_histogram(state: HistogramState, index) -> tuple[HistogramState, tuple]:
    shape = tuple(state.min_val.shape)
    if index is None and shape:
        raise ValueError(
            f"qstats.plot.histogram: the state holds histograms of shape {shape}; choose one with index=(...)"
        )
    # a state of one histogram takes no index (or ()): an index there selected nothing, in silence
    index = () if index is None else index if isinstance(index, tuple) else (index,)
    if len(index) != len(shape) or not all(_component(i, n) for i, n in zip(index, shape)):
        raise ValueError(
            f"qstats.plot.histogram: index {index} must select one histogram of shape {shape} "
            f"({len(shape)} integer components within it)"
        )
    index = tuple(as_index(i) for i in index)  # plain ints: a one-element tensor [1] kept a dimension
    return HistogramState(*(field[index] for field in state)), index


def _component(i, size: int) -> bool:
    """Whether ``i`` is an integer (Python, numpy or one-element torch; not a bool) within ``size``."""
    index = as_index(i)
    return index is not None and -size <= index < size


def _clip_range(label, qp, index: tuple, spec: QuantSpec, shape: tuple) -> tuple:
    """The values codes ``qmin`` and ``qmax`` dequantize to under the selected entry of ``qp``, in
    the spec's convention (torchao's float zero point offsets the grid's middle; a two-level block
    scale is under its global scale; bf16/fp16 compute dtypes round the ends). ``qp`` must hold one
    scale per histogram of the state (``shape``) and one global scale, shared or per leading entry."""
    if not isinstance(qp, QParams):
        raise TypeError(f"qstats.plot.histogram: qparams {label!r} is a {type(qp).__name__}, not QParams")
    global_shape = tuple(qp.global_scale.shape)
    if (tuple(qp.scale.shape) != shape or tuple(qp.zero_point.shape) != shape
            or (qp.global_scale.numel() != 1 and global_shape != shape[:len(global_shape)])):
        # another state's qparams (another expert count, channels, per-tensor) drew another range
        raise ValueError(
            f"qstats.plot.histogram: qparams {label!r} of scale shape {tuple(qp.scale.shape)} (zero point "
            f"{tuple(qp.zero_point.shape)}, global scale {global_shape}) do not fit the state's histograms of shape "
            f"{shape} (pass the QParams computed from this state)"
        )
    scale = _select(qp.scale, index).cpu()  # drawn on the host, as the state (`histogram`)
    shared = qp.global_scale.numel() == 1  # one global scale for every histogram, in any shape
    global_scale = (qp.global_scale if shared else _select(qp.global_scale, index)).cpu().reshape(())
    zero_point = _select(qp.zero_point, index).cpu()
    codes = torch.tensor([spec.qrange], dtype=torch.float32)
    # float32 scales, as `qstats.fake_quantize` passes them
    ends = _dequantize_view(codes, scale.float().reshape(1, 1), zero_point.reshape(1, 1), spec, global_scale)
    ends = ends.float()  # rounded once, as `fake_quantize` rounds a float32 tensor's values
    return float(ends[0, 0]), float(ends[0, 1])


def histogram(state, qparams: Union[QParams, Mapping[str, QParams], None], spec: QuantSpec, path=None, *,
              index=None, title: Optional[str] = None, plot_bins: int = 400):
    """Draws a histogram state with the clipping range of each method.

    Args:
      state: a `qstats.HistogramState`.
      qparams: one QParams, a mapping ``{label: QParams}`` (e.g. one per method), or None; each
        computed from ``state`` (a scale per histogram; else a ValueError naming both shapes).
      spec: the QuantSpec the qparams were computed for (its range gives the clipping points).
      path: where to save the figure (optional): in the format its suffix names (``.png``,
        ``.pdf``, ``.svg``, ...), as matplotlib's ``savefig``; else PNG.
      index: which histogram to draw when the state holds several (per-channel, stacked): one
        component per dimension of ``state.min_val`` (an int when it has one), expert first;
        None (or ``()``) for a state of one histogram.
      title: the figure title.
      plot_bins: linear bins drawn between the observed extremes (a positive int).

    Returns:
      the matplotlib Figure.
    """

    if not isinstance(state, HistogramState):
        raise TypeError(f"qstats.plot.histogram: expected a HistogramState, got {type(state).__name__}")
    if not isinstance(spec, QuantSpec):
        raise TypeError(f"qstats.plot.histogram: spec must be a QuantSpec, got {type(spec).__name__}")
    if isinstance(qparams, QParams):
        qparams = {"qparams": qparams}
    if qparams is not None and not isinstance(qparams, Mapping):
        raise TypeError(
            f"qstats.plot.histogram: qparams must be QParams, a mapping {{label: QParams}} or None, "
            f"got {type(qparams).__name__}"
        )
    qparams = dict(qparams or {})
    bins_drawn = as_index(plot_bins)
    if bins_drawn is None or bins_drawn < 1:  # 0 or fewer drew an empty figure; a float failed in linspace
        raise ValueError(f"qstats.plot.histogram: plot_bins must be a positive int, got {plot_bins!r}")
    shape = tuple(state.min_val.shape)
    state, index = _one_histogram(state, index)
    # the histogram drawn is read on the host: a GPU state met the CPU grid in torch.searchsorted
    state = HistogramState(*(field.cpu() for field in state))
    total = int(state.counts.sum() + state.underflow.sum() + state.overflow.sum())
    if total == 0:  # nothing to draw: no value seen, or only values its histogram left out
        left_out = int(state.nonfinite.sum())
        seen = (f"{left_out} value(s), all non-finite (NaN, ±inf, or float64 past float32's range), which "
                "observers leave out" if left_out else "no value (an empty or fully masked batch, or none)")
        raise ValueError(f"qstats.plot.histogram: the histogram holds no finite value to draw: it saw {seen}")
    lo, hi = float(state.min_val), float(state.max_val)
    bins, low, _ = geometry.config(state)
    edges, window_counts = geometry.window(state, bins, low, 24)
    # each bucket's values spread over its part within the observed extremes: spread over the whole
    # bucket, a constant tensor (0.7) drew ~1e-11 values per bin, an empty figure on the log scale
    mom = geometry.moments(edges.clamp(lo, hi), window_counts)
    # a window float64 splits into the bins, relative to the values (an absolute floor of 1e-12 drew
    # values of 1e-20 in two bins); 1 around an all-zero tensor
    span = max(hi - lo, 2.0**-30 * bins_drawn * max(abs(lo), abs(hi))) or 1.0
    grid = torch.linspace(lo - 0.02 * span, hi + 0.02 * span, bins_drawn + 1, dtype=torch.float64)
    cumulative, _, _ = geometry.cumulative(mom, grid)
    density = cumulative.diff().clamp(min=0)

    figure = _figure()
    axes = figure.subplots()
    centres = ((grid[:-1] + grid[1:]) / 2).numpy()
    axes.fill_between(centres, density.numpy(), step="mid", color="0.6", alpha=0.8, label="values")
    axes.set(yscale="log", xlabel="value", ylabel="count per bin")
    for i, (label, qp) in enumerate(qparams.items()):
        clip_lo, clip_hi = _clip_range(label, qp, index, spec, shape)
        colour = f"C{i % 10}"  # the property cycle's colours
        axes.axvline(clip_lo, color=colour, linestyle="--", linewidth=1.2)
        axes.axvline(clip_hi, color=colour, linestyle="--", linewidth=1.2,
                     label=f"{label}: [{clip_lo:.3g}, {clip_hi:.3g}]")
    axes.legend(loc="upper right", fontsize=8)
    axes.set_title(title or f"{total} values, {spec.dtype} {spec.mapping}")
    figure.tight_layout()
    if path is not None:
        # a bytes path as its str: matplotlib reads no suffix from bytes ("h.pdf" held PNG bytes)
        path = os.fsdecode(path) if isinstance(path, bytes) else path
        figure.savefig(path, format=_file_format(figure, path), dpi=100)
    return figure


def _file_format(figure, path) -> str:
    """The format ``path``'s suffix names where matplotlib writes it, as its ``savefig`` reads it (a
    PNG written to "h.pdf" would not open as one); else PNG (no suffix, a file object, or a dotted
    name such as "model.layers.0.mlp" whose last part names no format)."""
    if not isinstance(path, (str, os.PathLike)):
        return "png"
    suffix = os.path.splitext(os.fsdecode(path))[1][1:].lower()
    return suffix if suffix in figure.canvas.get_supported_filetypes() else "png"
