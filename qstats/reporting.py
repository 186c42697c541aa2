"""Per-layer calibration reports: range, scale, clipped fraction, SQNR estimate, coverage.

`report(states, qparams, model, recipe, batches)` builds one row per (module, site); clipped
fraction and SQNR are measured over the finite values when a model and recipe (and batches, for
activations) are given, else None; ``nonfinite`` counts the NaN/Inf values left out. Text, CSV and
JSON (strict: non-finite numbers as strings) output, standard library only. See docs/calibrate_api.md.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import io
import json
import math
from typing import Any, Callable, Iterable, Mapping, Optional, Union

import torch

from ._attention import SiteHooks, attention_sites, site_weight
from ._checks import as_index, check_floating
from ._formats import effective_scale
from ._granularity import TensorGroup, broadcast_to_view, canonical_view
from ._qparams import QParams, experts_qparams
from ._quant import _codes_float, fake_quantize
from ._spec import QuantSpec
from ._sites import observe_tensor, run_model
from ._torch_features import eager
from .calibration import batch_weight, check_batches, runtime_qparams, runtime_spec, warn_training_mode
from .experts import dense_expert_rows, dense_rows_weight, rows_by_expert
from .observation import (ExpertCallHooks, capture_call, kept_rows, parameter_value, raise_renamed,
                          stop_capture, unrecognised_sites_error, warn_unfitted, weight_of)
from .recipe import Plan, Recipe, as_plan

__all__ = ["LayerReport", "Report", "report", "tensor_error"]


@dataclasses.dataclass(frozen=True)
class LayerReport:
    """One row of a report. Measured fields are None when they could not be measured;
    ``nonfinite`` counts the NaN/Inf values left out of ``clipped_fraction`` and ``sqnr_db``."""

    module: str
    site: str
    observer: str
    experts: int
    min: Optional[float]
    max: Optional[float]
    mean_scale: Optional[float]
    clipped_fraction: Optional[float]
    sqnr_db: Optional[float]
    coverage: Optional[float]
    nonfinite: Optional[int] = None

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in COLUMNS}


COLUMNS = tuple(field.name for field in dataclasses.fields(LayerReport))  # the table's columns, in order


def _format(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        text = f"{value:.4g}"  # "inf", "-inf" and "nan" as they are
        # a coverage or clipped fraction just under 1 (one uncalibrated channel in 20 000) is not "1"
        return repr(value) if text == "1" and value != 1.0 else text
    return str(value)


@dataclasses.dataclass(frozen=True)
class Report:
    """A sequence of `LayerReport` rows (``len``, indexing, iteration) with text, CSV and JSON renderings;
    prints as its table.

    Attributes:
      rows: the `LayerReport` rows.
      worst_listed: how many of the worst rows by SQNR `text` lists under the table by default.
    """

    rows: tuple
    worst_listed: int = 5

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self):
        return iter(self.rows)

    def __getitem__(self, index):
        """A row, or for a slice a Report of those rows (which prints as their table)."""
        if isinstance(index, slice):
            return Report(self.rows[index], worst_listed=0)
        return self.rows[index]

    def worst(self, count: int = 5) -> "Report":
        """The ``count`` rows with the lowest SQNR estimate, lowest first (rows without one are
        left out; a NaN estimate, e.g. from a NaN scale, counts as the worst), as a Report:
        ``print(report.worst())`` prints their table."""
        limit = as_index(count)  # any integer (numpy, a one-element tensor), not a bool, float or string
        if limit is None or limit < 0:
            raise ValueError(f"worst: count must be a non-negative int, got {count!r}")
        measured = [row for row in self.rows if row.sqnr_db is not None]
        # NaN compares false with everything: sorted() would leave such rows wherever they stood
        ordered = sorted(measured, key=lambda row: (not math.isnan(row.sqnr_db), row.sqnr_db))
        return Report(tuple(ordered[:limit]), worst_listed=0)

    def text(self, worst: Optional[int] = None) -> str:
        """A fixed-width table, followed by the ``worst`` rows by SQNR (default
        ``worst_listed``)."""
        worst = self.worst_listed if worst is None else worst
        table = [COLUMNS] + [tuple(map(_format, row.as_dict().values())) for row in self.rows]
        widths = [max(len(line[i]) for line in table) for i in range(len(COLUMNS))]
        lines = ["  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in table]
        lines.insert(1, "  ".join("-" * width for width in widths))
        worst_rows = self.worst(worst)
        if worst_rows:
            lines += ["", f"worst {len(worst_rows)} by SQNR:"]
            lines += [f"  {row.module} [{row.site}]: {row.sqnr_db:.2f} dB" for row in worst_rows]
        return "\n".join(lines)

    def to_csv(self, path=None) -> str:
        """CSV text (written to ``path`` when given); missing values are empty cells."""
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerow(COLUMNS)
        for row in self.rows:
            writer.writerow(["" if value is None else value for value in row.as_dict().values()])
        return _written(buffer.getvalue(), path)

    def to_json(self, path=None) -> str:
        """Strict JSON text, a list of row objects (written to ``path`` when given); missing values
        are null, non-finite numbers the strings ``"Infinity"``, ``"-Infinity"`` and ``"NaN"``
        (``float(value)`` reads every field back)."""
        rows = [{name: _json_number(value) for name, value in row.as_dict().items()} for row in self.rows]
        return _written(json.dumps(rows, indent=1, allow_nan=False), path)

    def __str__(self) -> str:
        return self.text()


def _written(text: str, path) -> str:
    """``text``, written to ``path`` first when one is given."""
    if path is not None:
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text)
    return text


def _json_number(value: Any) -> Any:
    """``value``, a non-finite float as a string (strict JSON has no NaN or Infinity) that Python's
    ``float()`` and JavaScript's ``Number()`` read back."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    return value


@dataclasses.dataclass
class _Error:
    """Running sums for the SQNR, clipped fraction and non-finite count of one site."""

    signal: float = 0.0
    noise: float = 0.0
    clipped: int = 0
    total: int = 0
    nonfinite: int = 0

    def add(self, *numbers) -> None:
        """Adds `tensor_error`'s ``(signal, noise, clipped, total, nonfinite)``."""
        for field, number in zip(dataclasses.fields(self), numbers, strict=True):
            setattr(self, field.name, getattr(self, field.name) + number)

    def sqnr_db(self) -> Optional[float]:
        if self.total == 0:
            return None
        if self.noise == 0.0:
            return math.inf
        if self.signal == 0.0:
            return -math.inf
        return 10.0 * math.log10(self.signal / self.noise)

    def clipped_fraction(self) -> Optional[float]:
        return None if self.total == 0 else self.clipped / self.total


def _energy(values: torch.Tensor, keep: torch.Tensor) -> float:
    """The sum of squares of the kept ``values``; redone in float64 where float32's sum overflows
    (finite values above 1.8e19, which observers take in) or may have lost its squares to underflow
    (below 2^-64: values under 2^-63 square to float32 subnormals or 0, and a layer of weights near
    1e-23 summed to 0 signal and 0 noise, an SQNR of inf however it was quantized)."""
    energy = float(torch.where(keep, values.pow(2), 0.0).sum())
    if values.dtype != torch.float64 and not 2.0**-64 <= energy < math.inf:
        energy = float(torch.where(keep, values.double().pow(2), 0.0).sum())
    return energy


def tensor_error(x: torch.Tensor, qparams, spec, mask: Optional[torch.Tensor] = None) -> tuple:
    """``(signal energy, noise energy, clipped count, finite count, non-finite count)`` of
    fake-quantizing ``x`` in its own dtype (as `fake_quantized` does: bf16/fp16 outputs are rounded
    to that dtype), measured in float32 (float64 for a float64 ``x``, whose values past float32's
    range are finite); a value is clipped when saturation changes its code: its
    rounded integer code (in ``x``'s dtype, as `fake_quantize` computes it) is outside the spec's
    range, or its scaled value rounds past a float format's maximum (`_clipped`).
    Non-finite values (NaN, +-Inf) are left out of the first four numbers and counted in the last,
    as observers leave them out of their statistics; ``mask`` leaves entries (padding) out of all
    five, though they are still quantized with the rest.
    """
    check_floating(x, "tensor_error")  # a numpy array, an int tensor: named here, not deep in torch
    if not isinstance(spec, QuantSpec):
        raise TypeError(f"tensor_error: spec must be a QuantSpec, got {type(spec).__name__}")
    if not isinstance(qparams, QParams):
        raise TypeError(f"tensor_error: qparams must be QParams (qstats.compute_qparams), got {type(qparams).__name__}")
    _check_mask(mask, x)
    x = x.detach()
    wide = torch.promote_types(x.dtype, torch.float32)  # float64 kept: a float32 copy made 1e39 an Inf
    quantized = fake_quantize(x, qparams, spec).to(wide)  # in x's dtype: a bf16 model's values round to bf16
    view = canonical_view(x, spec.granularity)
    x = x.to(wide)
    unclamped, _ = _codes_float(view, broadcast_to_view(qparams.scale.float()),
                                broadcast_to_view(qparams.zero_point), spec, qparams.global_scale)
    finite = torch.isfinite(x)
    counted = torch.ones_like(finite) if mask is None else (mask != 0).to(x.device).expand(x.shape)
    keep, left_out = finite & counted, ~finite & counted
    signal, noise = _energy(x, keep), _energy(x - quantized, keep)
    clipped = int((_clipped(unclamped, spec) & canonical_view(keep, spec.granularity)).sum())
    return signal, noise, clipped, int(keep.sum()), int(left_out.sum())


def _check_mask(mask, x: torch.Tensor) -> None:
    """ValueError naming both shapes for a ``mask`` that does not broadcast to ``x``'s shape (a
    ``[batch, tokens]`` mask of ``[batch, tokens, features]`` values failed inside ``expand``)."""
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"tensor_error: mask must be a tensor, got {type(mask).__name__}")
    try:
        fits = torch.broadcast_shapes(mask.shape, x.shape) == x.shape
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(
            f"tensor_error: a mask of shape {tuple(mask.shape)} does not broadcast to the tensor's shape "
            f"{tuple(x.shape)} (dimensions align from the last: a [batch, tokens] mask of "
            "[batch, tokens, features] values takes shape [batch, tokens, 1])"
        )


def _clipped(unclamped: torch.Tensor, spec) -> torch.Tensor:
    """Where saturation changes a value's code: an integer code (rounded) outside the spec's range;
    a float format's unrounded scaled value past the point where rounding on its grid, continued
    one step above the maximum, would leave the maximum (``max + step / 2``, a tie clipped where it
    rounds up to even): a scaled 448.0001 quantizes to fp8's 448 with or without the clamp."""
    fmt = spec.float_format
    if fmt is None:
        qmin, qmax = spec.qrange
        return (unclamped < qmin) | (unclamped > qmax)
    step = 2.0 ** (math.floor(math.log2(fmt.max)) - fmt.mantissa_bits)  # the top binade's spacing
    limit, magnitude = fmt.max + step / 2, unclamped.abs()
    ties_up = round(fmt.max / step) % 2 == 1  # an odd top mantissa rounds a tie to the next binade
    return (magnitude > limit) | ((magnitude == limit) & ties_up)


def _extreme(state, name: str, reduce) -> Optional[float]:
    value = getattr(state, name, None)
    if not isinstance(value, torch.Tensor):
        return None
    finite = value[torch.isfinite(value)]
    return float(reduce(finite)) if finite.numel() else None


def report(
    states: Mapping,
    qparams: Mapping,
    model: Optional[torch.nn.Module] = None,
    recipe: Optional[Union[Recipe, Plan]] = None,
    batches: Optional[Iterable] = None,
    observation_weight: Optional[Callable] = None,
) -> Report:
    """A per-layer report of a calibration.

    Args:
      states: the states tree from `qstats.calibrate`.
      qparams: the matching QParams tree (`qstats.compute_qparams_tree`); a site it holds that
        ``states`` lacks gets a row too, measured, with None for what its state would give.
      model, recipe: give both (or a `Plan` as ``recipe``) to measure clipping and SQNR on parameters.
      batches: with model and recipe, also measure activation sites on one float forward (those of
        stacked experts per expert, on the rows `fake_quantized` quantizes, in one row per site).
      observation_weight: as in `qstats.calibrate`, to leave padding out of the measurement.

    Returns:
      a `Report`. ``mean_scale`` is the mean step in the tensor's units over the calibrated entries
      (NVFP4: block scales under the global scale; without ``model`` and ``recipe``, the raw
      ``scale`` field); it is None for run-time-scaled activation sites and sites with no calibrated
      entry, and ``coverage`` too where their QParams are None.
    """
    if not isinstance(states, Mapping) or not isinstance(qparams, Mapping):
        raise TypeError("report expects the states and qparams trees {path: {site: ...}}")
    if not isinstance(recipe, Plan) and (model is None) != (recipe is None):
        raise ValueError("report: give both model and recipe (to measure errors), or neither")
    if batches is not None and recipe is None:  # nothing would run them: every activation row unmeasured
        raise ValueError("report: batches are measured through the model: give model and recipe (or a Plan) too")
    plan = as_plan(recipe, model, "report") if recipe is not None else None
    if batches is not None:
        check_batches(batches, "report", observation_weight)  # one batch would run the model on its rows or keys
        warn_training_mode(plan.model, "report")  # dropout would be measured as error
    for path, entry in states.items():  # checked before the measurement, which may run the model
        if not isinstance(entry, Mapping):
            raise TypeError(f"report: states[{path!r}] must be a mapping {{site: state}}, got {type(entry).__name__}")
    _check_qparams(qparams, plan, batches is not None)
    missing = next(((path, site) for path, entry in states.items() for site in entry
                    if path not in qparams or site not in qparams[path]), None)
    if missing is not None:
        raise ValueError(f"report: qparams has no entry for module {missing[0]!r} site {missing[1]!r}")
    errors: dict = {}
    if plan is not None:
        _measure_parameters(plan, qparams, errors)
        if batches is not None:
            _measure_activations(plan, qparams, batches, observation_weight, errors)
    # a row per site of either tree: the states' first, then qparams' sites that have no state (measured
    # all the same; their state's fields are None)
    sites = [(path, site) for path, entry in states.items() for site in entry]
    sites += [(path, site) for path, entry in qparams.items() for site in entry if site not in states.get(path, {})]
    rows = []
    for path, site in sites:
        found = plan.site(path, site) if plan is not None else None
        state = states.get(path, {}).get(site)
        rows.append(_row(path, site, state, qparams[path][site], found, errors.get((path, site))))
    return Report(tuple(rows))


def _check_qparams(qparams: Mapping, plan: Optional[Plan], activations: bool) -> None:
    """TypeError for an entry that is neither QParams nor None (the states tree passed as qparams),
    ValueError for a site the plan does not observe (qparams of another model: its row would go
    unmeasured), and for a None entry of a site the plan measures (parameters; activations too where
    ``activations``) whose spec needs QParams (its scales do not come at run time), as
    `fake_quantized` refuses them."""
    for path, entry in qparams.items():
        if not isinstance(entry, Mapping):
            raise TypeError(f"report: qparams[{path!r}] must be a mapping {{site: QParams}}, "
                            f"got {type(entry).__name__}")
        for site, qp in entry.items():
            if qp is not None and not isinstance(qp, QParams):
                raise TypeError(
                    f"report: qparams[{path!r}][{site!r}] is a {type(qp).__name__}, not QParams; "
                    "pass qstats.compute_qparams_tree(states, recipe, model), not the states"
                )
            found = plan.site(path, site) if plan is not None else None
            if plan is not None and found is None:  # as compute_qparams_tree and fake_quantized refuse it
                raise ValueError(f"report: the recipe observes no site {site!r} of module {path!r}")
            measured = found is not None and (activations or found.kind == "parameter")
            if qp is None and measured and not found.runtime:
                raise ValueError(f"report: qparams[{path!r}][{site!r}] is None; its spec needs QParams")


def _row(path: str, site: str, state, qp, found, error: Optional[_Error]) -> LayerReport:
    """The row of one site; ``found`` (its `Site`) and ``error`` may be None."""
    # a site whose scales come at run time has no calibrated scale to average (its QParams are
    # None, or for a two-level spec hold only the calibrated global scale)
    runtime = found is not None and found.runtime
    return LayerReport(
        module=path,
        site=site,
        observer=found.observer.name if found is not None else type(state).__name__ if state is not None else "-",
        experts=found.num_experts if found is not None else 0,
        min=_extreme(state, "min_val", torch.min),
        max=_extreme(state, "max_val", torch.max),
        mean_scale=_mean_scale(qp, found) if qp is not None and not runtime else None,
        clipped_fraction=error.clipped_fraction() if error is not None else None,
        sqnr_db=error.sqnr_db() if error is not None else None,
        coverage=float(qp.calibrated.double().mean()) if qp is not None else None,  # 19999/20000 exactly
        # None where the site saw no value at all (no batch reached it), as the other measured fields
        nonfinite=error.nonfinite if error is not None and (error.total or error.nonfinite) else None,
    )


def _mean_scale(qp, found) -> Optional[float]:
    """The mean step of ``qp`` in the tensor's own units: for a two-level (NVFP4) spec, the block
    scales under their global scale (`qstats._formats.effective_scale`, per expert for stacks);
    without the site's spec (no model and recipe) the QParams' ``scale`` field as it is, which
    for a two-level spec is in block-scale units (times 1 / the global scale). Entries marked
    uncalibrated (their fallback scale 1, e.g. experts that got no tokens) are left out; None when
    no entry is calibrated."""
    scale = qp.scale.float()
    if found is not None and isinstance(found.spec.granularity, TensorGroup):
        global_scale = qp.global_scale.float()
        global_scale = global_scale.reshape(tuple(global_scale.shape) + (1,) * (scale.ndim - global_scale.ndim))
        scale = effective_scale(scale, global_scale, found.spec)
    calibrated = qp.calibrated
    if isinstance(calibrated, torch.Tensor) and calibrated.shape == scale.shape:
        if not bool(calibrated.any()):
            return None
        scale = scale[calibrated.bool()]
    return float(scale.mean())


def _measure_parameters(plan: Plan, qparams: Mapping, errors: dict) -> None:
    """The error of fake-quantizing every parameter site of ``qparams`` (per expert for stacks)."""
    for path, entry in qparams.items():
        for site, qp in entry.items():
            found = plan.site(path, site)  # never None: `_check_qparams` refused sites the plan does not observe
            if found.kind != "parameter":
                continue
            error = errors[(path, site)] = _Error()
            value = parameter_value(plan, path, site, "report")
            parts = [(value[e], experts_qparams(qp, e)) for e in range(found.num_experts)] or [(value, qp)]
            for part, part_qp in parts:
                _add_error(error, part, part_qp, found, where=f"report: module {path!r} parameter {site!r}")


def _add_error(
    error: _Error, x: torch.Tensor, qp, found, keep: Optional[torch.Tensor] = None, where: str = "report"
) -> None:
    """Adds to ``error`` the error of fake-quantizing ``x`` under ``qp`` (each tensor's own scales
    for an activation site whose scales come at run time, as `fake_quantized` applies them);
    ``keep`` (broadcast over ``x``) leaves padding out of the measured numbers. A ValueError or
    TypeError (QParams of another shape than the tensor's) names ``where`` (module and site)."""
    spec = found.spec
    try:
        if found.kind != "parameter" and found.runtime:
            spec = runtime_spec(x, spec)
            qp = runtime_qparams(x, spec, qp)
        error.add(*tensor_error(x, qp, spec, keep))
    except (ValueError, TypeError) as failure:
        raise_renamed(failure, where)


class _ActivationError:
    """The hook measuring one activation site of `report`: the error of each tensor it sees under
    the site's qparams (each tensor's own scales for a site whose scales come at run time)."""

    def __init__(self, found, qparams, error: _Error, current_weight: list, where: str = "report",
                 attention: bool = False):
        self.found, self.qparams, self.error, self.current_weight = found, qparams, error, current_weight
        self.where = where  # "report: module 'path' site 'site'", for errors
        self.attention = attention  # a q/k/v `SiteHooks` hands in its spec's layout (`site_weight`)

    def __call__(self, x, weighted: bool = True) -> None:
        """Measures ``x``, leaving out the batch's padding where ``weighted`` (not: the key and value
        of a cross-attention call, other tokens than the batch's, as `calibrate` observes them)."""
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            return
        weight = self.current_weight[0] if weighted else None
        if weight is not None:  # as calibrate fits it
            fitted = (site_weight(x, self.found.spec, lambda view: weight_of(view, weight)) if self.attention
                      else weight_of(x, weight))
            weight = _fitted(self.current_weight, fitted)
        # padding is left out of every measured number (zero is not representable with a float
        # zero point, and its code may fall outside the range)
        keep = None if weight is None else weight.reshape(weight.shape + (1,) * (x.ndim - weight.ndim)) != 0
        _add_error(self.error, x, self.qparams, self.found, keep, self.where)


class _ExpertErrors(ExpertCallHooks):
    """The per-expert activation sites of one stacked-experts module in `report`: the input rows of
    each expert's matmul with a stacked parameter ``P``, measured under that expert's QParams of
    ``"P.input"``, or of ``"input"`` where the rows are the module's input tokens: the rows
    `fake_quantized` quantizes (`qstats.calibration._ExpertInputs`), per call and expert (run-time
    scales from each expert's rows of a call, as there). The rows are captured during the float
    forward (`ExpertInputCapture`) and measured when it ends, leaving out those of tokens whose
    observation weight is 0 (of dense per-expert rows, Llama 4's, also the rows of tokens not routed
    to the expert: `qstats.experts.dense_rows_weight`)."""

    def __init__(self, module: torch.nn.Module, path: str, sites: dict, current_weight: list):
        super().__init__(module)
        self.path, self.current_weight = path, current_weight
        self.sites = sites  # site -> (QParams or None, found, _Error)

    def start(self, module, args, kwargs) -> tuple:
        return (*capture_call(module, args, kwargs), dense_expert_rows(module, args, kwargs))

    def finish(self, module, started: tuple, output) -> None:
        capture, hooks, tokens, per_expert = started
        stop_capture(capture, hooks)
        if output is None:  # the forward raised
            return
        weight = self.current_weight[0] if tokens is not None else None
        rows = None if tokens is None else tokens.reshape(-1, tokens.shape[-1])
        if weight is not None:  # calibrate's fit: one weight per token of the experts' input
            weight = _fitted(self.current_weight, weight_of(rows if per_expert is None else rows[:per_expert],
                                                            weight, flattened=True))
        if rows is not None and per_expert is not None:  # dense rows [E * T, F]: each expert's routed rows
            weight = dense_rows_weight(rows, per_expert, weight)
        measured: set = set()
        for name, calls in capture.rows.items():
            for site in ("input", f"{name}.input"):  # both where both exist, as `fake_quantized` applies them
                if site in self.sites and calls:
                    self._measure(capture, name, site, weight)
                    if site != "input" or any(t is not None for t in capture.tokens[name]):  # rows measured
                        measured.add(site)
        missing = sorted(set(self.sites) - measured)
        if tokens is not None and missing:  # as `fake_quantized` refuses it: it could not quantize them either
            raise unrecognised_sites_error("report", missing, self.path, module, "qstats.experts.ExpertInputCapture")

    def _measure(self, capture, name: str, site: str, weight: Optional[torch.Tensor]) -> None:
        """Adds the error of every call's rows of parameter ``name`` to ``site``'s: for ``"input"``,
        of the calls whose rows are the module's input tokens only."""
        qp, found, error = self.sites[site]
        named = f"report: the rows of site {site!r} of the experts module {self.path!r}"
        kept = kept_rows(capture, name, weight, named) if weight is not None and site != "input" else None
        offset = 0
        for rows, ids, tokens in zip(capture.rows[name], capture.ids[name], capture.tokens[name]):
            start, offset = offset, offset + rows.shape[0]  # `row_tokens` holds every call's rows
            if (site == "input" and tokens is None) or not rows.is_floating_point():
                continue
            keep = None
            if weight is not None:
                keep = kept[start:offset] if site != "input" else weight.reshape(-1).to(tokens.device)[tokens]
                keep = keep.to(rows.device) != 0
            for expert, chosen in rows_by_expert(ids, found.num_experts):  # each under its own QParams
                part_keep = None if keep is None else keep[chosen][:, None]
                _add_error(error, rows[chosen], experts_qparams(qp, expert), found, part_keep, named)


def _fitted(current_weight: list, weight: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Counts an activation offered the batch's weight (and whether it fitted); returns ``weight``."""
    current_weight[1] += 1
    current_weight[2] += weight is not None
    return weight


def _measure_activations(plan: Plan, qparams: Mapping, batches, observation_weight, errors: dict) -> None:
    """The error of every activation site of ``qparams`` over ``batches``, run once through the
    float model with the hooks `qstats.calibrate` observes through (`_ExpertErrors` for the
    per-expert sites of stacked experts)."""
    current_weight: list = [None, 0, 0]  # the batch's weight, activations offered it, those it fitted
    handles = []
    attention: dict = {}  # path -> (module, {site: _ActivationError}): q/k/v of transformers attention modules
    try:
        for path, entry in qparams.items():
            expert_sites: dict = {}
            for site, qp in entry.items():
                found = plan.site(path, site)  # never None (`_check_qparams`)
                if found.kind not in ("input", "output", "projection", "parameter_input"):
                    continue
                error = errors.setdefault((path, site), _Error())
                if found.num_experts:
                    expert_sites[site] = (qp, found, error)
                else:
                    where = f"report: module {path!r} site {site!r}"
                    attending = plan.attention_argument(path, site)
                    measure = _ActivationError(found, qp, error, current_weight, where, attending)
                    if attending:
                        attention.setdefault(path, (plan.modules[path], {}))[1][site] = measure
                    else:
                        handles.append(observe_tensor(plan, path, site, measure))
            if expert_sites:
                handles.extend(_ExpertErrors(plan.modules[path], path, expert_sites, current_weight).attach())
        hooks = {path: (module, eager(SiteHooks(sites, {site: measure.found.spec for site, measure in sites.items()},
                                                {site: functools.partial(measure, weighted=False)
                                                 for site, measure in sites.items()})))
                 for path, (module, sites) in attention.items()}
        with torch.no_grad(), attention_sites(hooks, "report"):
            for batch in batches:
                current_weight[:] = [batch_weight(observation_weight, batch, "report"), 0, 0]
                run_model(plan.model, batch)
                warn_unfitted("report", *current_weight)
    finally:
        for handle in handles:
            handle.remove()
