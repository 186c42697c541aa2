"""Plots of observer states (matplotlib is an optional dependency: ``pip install matplotlib``).

`histogram(state, qparams, spec, path=...)` draws a `HistogramState`'s distribution (log scale) with
the clipping range ``[(qmin - zp) * scale, (qmax - zp) * scale]`` of each set of qparams given. The
figure has its own Agg canvas: pyplot and the process's backend are left alone.
"""

from __future__ import annotations

from typing import Mapping, Optional, Union

import torch

from ._qparams import QParams
from ._formats import effective_scale
from ._spec import QuantSpec
from .observers.histogram import HistogramState
from .observers.search import _geometry as geometry

__all__ = ["histogram"]


def _figure():
    """A Figure on its own Agg canvas: no pyplot, so no backend switch and no figure kept by pyplot."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError("qstats.plot needs matplotlib: pip install matplotlib") from error
    figure = Figure(figsize=(8, 4.5))
    FigureCanvasAgg(figure)
    return figure


def _select(t: torch.Tensor, index: tuple):
    """The entry of ``t`` at ``index``; a tensor with fewer dimensions (the global scale of a stacked
    two-level state: one per expert) takes the leading components."""
    if t.dim() == 0:
        return t
    return t[index[: t.dim()]]


def _one_histogram(state: HistogramState, index) -> tuple[HistogramState, tuple]:
    shape = tuple(state.min_val.shape)
    if not shape:
        return state, ()
    if index is None:
        raise ValueError(
            f"qstats.plot.histogram: the state holds histograms of shape {shape}; choose one with index=(...)"
        )
    index = index if isinstance(index, tuple) else (index,)
    if len(index) != len(shape):
        raise ValueError(
            f"qstats.plot.histogram: index {index} must select one histogram of shape {shape} "
            f"({len(shape)} components)"
        )
    return HistogramState(*(field[index] for field in state)), index


def histogram(state, qparams: Union[QParams, Mapping[str, QParams], None], spec: QuantSpec, path=None, *,
              index=None, title: Optional[str] = None,
              plot_bins: int = 400):
    """Draws a histogram state with the clipping range of each method.

    Args:
      state: a `qstats.HistogramState`.
      qparams: one QParams, a mapping ``{label: QParams}`` (e.g. one per method), or None.
      spec: the QuantSpec the qparams were computed for (its range gives the clipping points).
      path: where to save a PNG (optional).
      index: which histogram to draw when the state holds several (per-channel, stacked): one
        component per dimension of ``state.min_val`` (an int when it has one), expert first.
      title: the figure title.
      plot_bins: linear bins drawn between the observed extremes.

    Returns:
      the matplotlib Figure.
    """

    if not isinstance(state, HistogramState):
        raise TypeError(f"qstats.plot.histogram: expected a HistogramState, got {type(state).__name__}")
    if not isinstance(spec, QuantSpec):
        raise TypeError(f"qstats.plot.histogram: spec must be a QuantSpec, got {type(spec).__name__}")
    if isinstance(qparams, QParams):
        qparams = {"qparams": qparams}
    qparams = dict(qparams or {})
    state, index = _one_histogram(state, index)
    total = int(state.counts.sum() + state.underflow.sum() + state.overflow.sum())
    if total == 0:
        raise ValueError("qstats.plot.histogram: the state saw no data")
    lo, hi = float(state.min_val), float(state.max_val)
    bins, low, _ = geometry.config(state)
    edges, window_counts = geometry.window(state, bins, low, 24)
    mom = geometry.moments(edges, window_counts)
    span = max(hi - lo, 1e-12)
    grid = torch.linspace(lo - 0.02 * span, hi + 0.02 * span, plot_bins + 1, dtype=torch.float64)
    cumulative, _, _ = geometry.cumulative(mom, grid)
    density = cumulative.diff().clamp(min=0)

    figure = _figure()
    axes = figure.subplots()
    centres = ((grid[:-1] + grid[1:]) / 2).numpy()
    axes.fill_between(centres, density.numpy(), step="mid", color="0.6", alpha=0.8, label="values")
    axes.set_yscale("log")
    axes.set_xlabel("value")
    axes.set_ylabel("count per bin")
    qmin, qmax = spec.qrange
    colours = [f"C{i}" for i in range(10)]  # the property cycle's colours
    for i, (label, qp) in enumerate(qparams.items()):
        # the element step: a two-level (TensorGroup, NVFP4) block scale under its global scale
        block_scale, global_scale = _select(qp.scale, index).double(), _select(qp.global_scale, index).double()
        scale = float(effective_scale(block_scale, global_scale, spec))
        zero_point = float(_select(qp.zero_point, index)) if spec.zero_point_domain != "none" else 0.0
        clip_lo, clip_hi = (qmin - zero_point) * scale, (qmax - zero_point) * scale
        colour = colours[i % len(colours)]
        axes.axvline(clip_lo, color=colour, linestyle="--", linewidth=1.2)
        axes.axvline(clip_hi, color=colour, linestyle="--", linewidth=1.2,
                     label=f"{label}: [{clip_lo:.3g}, {clip_hi:.3g}]")
    axes.legend(loc="upper right", fontsize=8)
    axes.set_title(title or f"{total} values, {spec.dtype} {spec.mapping}")
    figure.tight_layout()
    if path is not None:
        figure.savefig(path, format="png", dpi=100)
    return figure
