"""A torch.ao drop-in: qstats observers as ``torch.ao.quantization`` observer modules.

`QstatsObserver` wraps a qstats observer factory and `QuantSpec` in an ``ObserverBase``; the
``default_*`` names mirror torch.ao's presets; `from_observer` imports a calibrated torch.ao
observer. For torchao's PT2E flow use `qstats.torchao_pt2e.QstatsPT2EObserver`. See
docs/migrating_torch_ao.md.
"""

from __future__ import annotations

import inspect
import sys
from types import SimpleNamespace
from typing import Any, Callable, Optional

import torch
from torch.ao.quantization import fake_quantize as ao_fake_quantize
from torch.ao.quantization import observer as ao

from ._formats import integer_dtype_holds
from ._granularity import PerAxis, PerTensor
from ._qparams import compute_qparams
from ._torch_features import capturing_graph
from ._spec import QuantSpec
from .conventions import TorchaoConvention
from .conventions.torch_ao import PER_CHANNEL_QSCHEMES
from .observers.fixed import FixedQParamsState, PlaceholderState, RecordingState, fixed_qparams, placeholder
from .observers.histogram import HistogramState, histogram, histogram_edges
from .observers.minmax import MinMaxState, MovingAverageMinMaxState, memoryless_minmax, minmax, moving_average_minmax
from ._warn import warn

__all__ = [
    "QstatsObserver",
    "buckets_per_octave_for_bins",
    "from_observer",
    "torch_ao_fields",
    "default_observer",
    "default_weight_observer",
    "default_per_channel_weight_observer",
    "default_histogram_observer",
    "default_float_qparams_observer",
    "default_float_qparams_observer_4bit",
    "default_fixed_qparams_range_0to1_observer",
    "default_fixed_qparams_range_neg1to1_observer",
    "default_symmetric_fixed_qparams_observer",
    "default_affine_fixed_qparams_observer",
    "weight_observer_range_neg_127_to_127",
    "per_channel_weight_observer_range_neg_127_to_127",
    "default_dynamic_quant_observer",
    "default_placeholder_observer",
]

_FLOAT32_EPS = float(torch.finfo(torch.float32).eps)
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def torch_ao_fields(spec: QuantSpec) -> dict:
    """The torch.ao observer attributes (``dtype``, ``qscheme``, ``quant_min``, ``quant_max``,
    ``ch_axis``, ``eps``) that describe ``spec`` to torch.ao's ``convert``; ValueError for a spec
    a torch.ao quantized module cannot hold (float formats, groups or blocks, no zero point)."""
    if spec.is_float:
        raise ValueError(f"QstatsObserver: torch.ao quantized modules hold integer targets, not {spec.dtype!r}")
    if not isinstance(spec.granularity, (PerTensor, PerAxis)):
        raise ValueError(
            f"QstatsObserver: torch.ao quantizes per tensor or per channel, not {spec.granularity!r}"
        )
    if spec.zero_point_domain == "none":
        raise ValueError("QstatsObserver: torch.ao quantized tensors need a zero point (zero_point_domain 'none')")
    per_tensor = isinstance(spec.granularity, PerTensor)
    qmin, qmax = spec.qrange
    if spec.zero_point_domain == "float":
        if per_tensor:
            raise ValueError("QstatsObserver: float zero points are per channel in torch.ao")
        if isinstance(spec.convention, TorchaoConvention):
            raise ValueError(
                "QstatsObserver: spec has torchao's float zero point (ZeroPointDomain.FLOAT, in the input's units); "
                "torch.ao's per_channel_affine_float_qparams take it in code units: use QuantSpec.from_torch_ao("
                "torch.quint8, torch.per_channel_affine_float_qparams, ...) instead"
            )
        qscheme = torch.per_channel_affine_float_qparams
        dtype = torch.quint4x2 if qmax <= 15 and qmin >= 0 else torch.quint8
    else:
        symmetric = spec.mapping != "asymmetric"
        qscheme = {(True, True): torch.per_tensor_symmetric, (True, False): torch.per_tensor_affine,
                   (False, True): torch.per_channel_symmetric, (False, False): torch.per_channel_affine}[
            (per_tensor, symmetric)]
        dtype = (torch.quint8 if qmin >= 0 and qmax <= 255
                 else torch.qint8 if -128 <= qmin and qmax <= 127 else torch.qint32)
    ch_axis = 0 if per_tensor else spec.granularity.axis
    return dict(dtype=dtype, qscheme=qscheme, quant_min=int(qmin), quant_max=int(qmax), ch_axis=ch_axis, eps=spec.eps)


def _factory_option(factory: Callable, options: dict, name: str):
    """``options[name]``, else the factory's default for ``name``, else None."""
    if name in options:
        return options[name]
    try:
        parameter = inspect.signature(factory).parameters.get(name)
    except (TypeError, ValueError):  # a callable without a signature
        return None
    return None if parameter is None or parameter.default is inspect.Parameter.empty else parameter.default


def _averaging_constant(factory: Callable, options: dict) -> Optional[float]:
    """The moving average's ``averaging_constant`` (1 for `memoryless_minmax`), or None: torch.ao
    reads the attribute (1: memoryless, which dynamic QAT demands and eager ``prepare`` observes on
    the module's input)."""
    if factory is memoryless_minmax:
        return 1.0
    if _factory_option(factory, options, "mode") not in (None, "moving_average"):  # mse's "accumulate"
        return None
    return _factory_option(factory, options, "averaging_constant")


def _probe(spec: Optional[QuantSpec], device=None) -> torch.Tensor:
    """A small tensor every granularity this module accepts can view (for field names and the
    qparams of an observer that saw nothing), on ``device``."""
    axis = spec.granularity.axis if spec is not None and isinstance(spec.granularity, PerAxis) else 0
    return torch.zeros((1,) * max(axis + 1, -axis, 1), device=device)


def _float32(value) -> float:
    """``value`` rounded to float32 (a non-number as it is, to be named in the error)."""
    try:
        return float(torch.tensor(float(value), dtype=torch.float32))
    except (TypeError, ValueError):
        return value


def _refuse_disagreeing(fields: dict, spec: QuantSpec, given: dict) -> None:
    """ValueError where torch.ao arguments given beside ``spec=`` (``FakeQuantize``'s ``quant_min``,
    ``quant_max``, ``dtype`` and ``eps``; PT2E's ``QuantizationSpec``) differ from what ``spec`` quantizes to
    (``fields``): they were dropped silently, and the module quantized as the spec says."""
    per_channel = isinstance(spec.granularity, PerAxis)
    ours = dict(fields, per_channel=per_channel)  # eps: the spec's, compared in float32 below
    qscheme, axis, eps = given.pop("qscheme"), given.pop("ch_axis"), given.pop("eps", None)
    if eps is not None and _float32(eps) != _float32(spec.eps):  # torch.ao keeps eps as a float32 buffer
        given["eps"] = eps
    given["per_channel"] = None if qscheme is None else qscheme in PER_CHANNEL_QSCHEMES
    if given["per_channel"] == per_channel:  # symmetric against affine, float qparams: the qscheme itself
        given["qscheme"] = qscheme
    if per_channel and axis is not None and (axis < 0) == (fields["ch_axis"] < 0):  # -1 against 1: the input decides
        given["ch_axis"] = axis
    differ = [f"{name} {value} (the spec: {ours[name]})" for name, value in given.items()
              if value is not None and value != ours[name]]
    if differ:
        raise ValueError(
            f"QstatsObserver: {', '.join(differ)} given beside spec={spec}, which does not quantize to them; "
            "make them agree with the spec (PT2E: the QuantizationSpec's dtype, quant_min/quant_max, qscheme "
            "and ch_axis), or drop them"
        )


def _refuse_other_axis(given: Optional[int], spec: QuantSpec, x: torch.Tensor) -> None:
    """ValueError where a ``ch_axis`` given beside a per-channel ``spec=`` names another axis of ``x``
    than the spec's (``-1`` against ``0`` on a 2-d weight: `_refuse_disagreeing` cannot tell before the rank)."""
    if given is None or x.dim() == 0:
        return
    axis = spec.granularity.axis
    if -x.dim() <= given < x.dim() and -x.dim() <= axis < x.dim() and given % x.dim() != axis % x.dim():
        raise ValueError(
            f"QstatsObserver: ch_axis {given} given beside spec={spec} is axis {given % x.dim()} of this "
            f"{x.dim()}-d input, where the spec quantizes along axis {axis % x.dim()}; make them agree "
            "(PT2E: the QuantizationSpec's ch_axis), or drop ch_axis"
        )


class QstatsObserver(ao.ObserverBase):
    """A qstats observer as a torch.ao observer module (eager ``prepare``/``convert``, FX
    ``prepare_fx``/``convert_fx`` through a ``QConfig`` or ``QConfigMapping``).

    Args:
      observer: a qstats observer factory ``factory(spec, **options) -> Observer``
        (`qstats.minmax`, `qstats.histogram`, `qstats.moving_average_minmax`, ...).
      spec: the `QuantSpec`; default: ``QuantSpec.from_torch_ao`` of the torch.ao arguments
        below, so that the qparams equal torch.ao's observer with those arguments.
      dtype, qscheme, reduce_range, quant_min, quant_max, eps, ch_axis: torch.ao's arguments,
        used when ``spec`` is None (a float ``dtype`` builds no spec: placeholders only, whose
        ``qscheme`` is None, so that FX's convert skips them as torch.ao's placeholders). With
        ``spec``, a plain integer ``dtype`` holding its range (PT2E's ``torch.int16``) is kept as
        the observer's dtype; a ``dtype``, ``quant_min``, ``quant_max``, ``qscheme`` (per tensor or
        channel, symmetric or affine) or ``ch_axis`` given that the spec does not quantize to is a ValueError
        (``FakeQuantize.with_args(quant_min=0, quant_max=15)`` around a uint8 spec), and so is an ``eps``
        other than the spec's (compared in float32, as torch.ao keeps it).
      is_dynamic: torch.ao's flag for dynamic quantization placeholders.
      method: ``compute_qparams(state, spec, method=...)`` (histograms: ``"l2"``, ``"mse"``, ...).
      factory_kwargs: torch.ao's ``{"device": ...}`` for the buffers (torch.ao's QAT modules pass it).
      torch_ao_bins: histograms only: the number of linear bins of the ``histogram`` entry saved for
        torch.ao (default 2048), so that the checkpoint loads into ``HistogramObserver(bins=torch_ao_bins)``;
        qstats' own buckets are the factory's ``buckets_per_octave``.
      **options: passed to the factory (``averaging_constant``, ``buckets_per_octave``, ...).

    The state is one buffer per state field (empty until the first ``forward``), so
    ``state_dict()`` holds it.

    >>> import torch
    >>> obs = QstatsObserver.with_args(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric)()
    >>> _ = obs(torch.tensor([-1.0, 2.0]))
    >>> obs.calculate_qparams()[0]
    tensor([0.0157])
    """

    # torch.ao's observer state_dict version: its observers read "min_val"/"max_val" (version 3), not
    # version 1's "min_vals"/"max_vals" and default eps, from a state_dict this module saved
    _version = 3

    def __init__(
        self,
        observer: Callable = minmax,
        spec: Optional[QuantSpec] = None,
        *,
        dtype=None,
        qscheme=None,
        reduce_range: bool = False,
        quant_min: Optional[int] = None,
        quant_max: Optional[int] = None,
        eps: Optional[float] = None,
        ch_axis: Optional[int] = None,
        is_dynamic: bool = False,
        method: Optional[str] = None,
        factory_kwargs: Optional[dict] = None,
        torch_ao_bins: Optional[int] = None,
        **options: Any,
    ) -> None:
        torch.nn.Module.__init__(self)  # not ObserverBase.__init__: subclasses may add torchao's base
        if not callable(observer):
            raise TypeError(f"QstatsObserver: observer must be an observer factory, got {type(observer).__name__}")
        if spec is not None and not isinstance(spec, QuantSpec):
            raise TypeError(f"QstatsObserver: spec must be a QuantSpec, got {type(spec).__name__}")
        if spec is not None and reduce_range:
            raise ValueError("QstatsObserver: reduce_range applies to torch.ao's arguments; with spec= pass "
                             "QuantSpec(reduce_range=True) instead")
        if spec is None:
            dtype = torch.quint8 if dtype is None else dtype  # torch.ao's default
            qscheme = torch.per_tensor_affine if qscheme is None else qscheme  # torch.ao's defaults
            ch_axis = 0 if ch_axis is None else ch_axis
            eps = _FLOAT32_EPS if eps is None else eps  # torch.ao's default
            if dtype in _FLOAT_DTYPES:
                qscheme = None  # torch.ao's get_qparam_dict skips it, as a PlaceholderObserver
            else:
                spec = QuantSpec.from_torch_ao(dtype, qscheme, reduce_range, quant_min, quant_max, eps, ch_axis)
                (quant_min, quant_max), eps = spec.qrange, spec.eps
            fields = dict(dtype=dtype, qscheme=qscheme, quant_min=quant_min, quant_max=quant_max,
                          ch_axis=ch_axis, eps=eps)
        else:
            fields, reduce_range = torch_ao_fields(spec), spec.reduce_range
            if integer_dtype_holds(dtype, spec.qrange):  # a plain integer dtype given beside spec= (PT2E's torch.int16)
                fields["dtype"] = dtype
            _refuse_disagreeing(fields, spec, dict(dtype=dtype, quant_min=quant_min, quant_max=quant_max,
                                                   qscheme=qscheme, ch_axis=ch_axis, eps=eps))
        if spec is None or not isinstance(spec.granularity, PerAxis):
            # torch.ao's per-tensor and placeholder observers have no ch_axis: FakeQuantize reads its absence
            # as -1 (its ch_axis and repr), where a ch_axis of 0 read as axis 0
            fields.pop("ch_axis")
        for name, value in dict(fields, is_dynamic=is_dynamic, reduce_range=reduce_range).items():
            setattr(self, name, value)
        self.spec, self.method = spec, method
        # a ch_axis given beside spec= with the other sign (-1 against 1): the input's rank decides (forward)
        self._given_ch_axis = ch_axis if spec is not None and isinstance(spec.granularity, PerAxis) else None
        self._factory, self._options = observer, dict(options)
        constant = _averaging_constant(observer, self._options)
        if constant is not None:
            self.averaging_constant = constant
        try:
            self._state_type = type(self.observer.init(_probe(spec)))
        except TypeError as error:
            if spec is not None or _builds_without_spec(observer):
                raise  # an option's error (placeholder's custom_op_name=), not the float dtype's missing spec
            name = getattr(observer, "__name__", type(observer).__name__)
            raise TypeError(
                f"QstatsObserver: the float dtype {dtype} builds no QuantSpec, and {name} needs one: pass an "
                "integer dtype or spec=, or use observer=placeholder"
            ) from error
        if observer is histogram and "bins" in self._options:
            # its former name warned above, once; the builds of every forward take the current name
            self._options["buckets_per_octave"] = self._options.pop("bins")
        self._fields = self._state_type._fields
        self.torch_ao_bins = _check_torch_ao_bins(torch_ao_bins, self._state_type)
        # torch.ao's factory_kwargs (its QAT modules and FakeQuantize pass them): the buffers' device
        device = (factory_kwargs or {}).get("device")
        for name in self._fields:
            self.register_buffer(name, torch.empty(0, device=device))

    @property
    def observer(self):
        """The qstats Observer (built from the factory, the spec and the options)."""
        return self._factory(self.spec, **self._options)

    @property
    def state(self):
        """The observer's state (a NamedTuple of the buffers), or None before the first forward."""
        buffers = [getattr(self, name) for name in self._fields]
        if all(b.numel() == 0 and b.dim() == 1 for b in buffers):
            return None
        return self._state_type._make(buffers)

    def set_state(self, state) -> None:
        """Replaces the buffers by ``state``'s fields (a state of this observer's type); under
        ``torch.inference_mode`` by normal copies of them, as torch.ao's buffers stay (torch.export and
        torch.jit.trace write into them in place, which inference tensors refuse)."""
        if tuple(getattr(state, "_fields", ())) != tuple(self._fields):
            raise TypeError(
                f"QstatsObserver.set_state: expected a state with fields {self._fields}, got {type(state).__name__}"
            )
        if torch.is_inference_mode_enabled():
            with torch.inference_mode(False):
                state = [value.clone() for value in state]
        for name, value in zip(self._fields, state):
            setattr(self, name, value)

    def reset_min_max_vals(self) -> None:
        """Forgets what the observer saw (torch.ao's name; FX's equalization calls it): the buffers
        become empty, as before the first ``forward``, on their device."""
        for name in self._fields:
            setattr(self, name, torch.empty(0, device=getattr(self, name).device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"QstatsObserver: expected a tensor, got {type(x).__name__}")
        if x.numel() == 0:  # nothing to observe: torch.ao's observers return it untouched, whatever its shape
            return x
        _refuse_other_axis(self._given_ch_axis, self.spec, x)
        exporting = capturing_graph()
        if exporting and self._state_type in (PlaceholderState, FixedQParamsState):
            return x  # counts only, which torch.ao's keep none of (building fixed_qparams' checks failed there)
        observer = self.observer
        state = self.state
        data = x.detach()
        if not exporting:
            self.set_state(observer.update(observer.init(data) if state is None else state, data))
            return x
        # torch.export and torch.jit.trace keep in-place writes into buffers, as torch.ao's observers make them
        # (they left the new attributes of set_state out of the graph, whose module then observed nothing)
        if state is None:  # the graph would start from no data on every call (torch.ao's per-channel observers do)
            raise RuntimeError("QstatsObserver: torch.export of an observer that has seen no data would restart "
                               "from no data on every call of the exported program; run it on a batch first")
        for buffer, value in zip(state, observer.update(state, data)):
            buffer.copy_(value)  # same shapes and dtypes: update keeps them
        return x

    def calculate_qparams(self):
        """``(scale, zero_point)`` as torch.ao returns them: float32 scales, int32 (affine, and fixed
        qparams) or int64 (symmetric) zero points (float32 for float zero points), shape ``(1,)`` per tensor.
        Before any data (or after empty tensors only), torch.ao's defaults ``([1.], [0])`` (an
        int64 zero point, on the buffers' device) with a warning, as torch.ao's observers (a spec
        with ``on_uncalibrated="raise"`` raises instead); observers whose qparams need no data
        (fixed qparams) do not warn. On ``meta`` tensors (no values to read) no warning."""
        if self.spec is None:
            raise TypeError("QstatsObserver: an observer without a QuantSpec (float dtype) has no qparams")
        device = next(self.buffers()).device if self._fields else None
        state = self.state
        if state is None:
            state = self.observer.init(_probe(self.spec, device))
        options = {} if self.method is None else {"method": self.method}
        qp = compute_qparams(state, self.spec, **options)
        scale, zero_point = qp.scale, qp.zero_point
        if qp.calibrated.device.type != "meta" and not bool(qp.calibrated.all()):  # eager, outside the pure core
            warn(_uncalibrated_message(state))
            if not bool(qp.calibrated.any()):  # torch.ao's defaults: torch.tensor([1.0]), torch.tensor([0])
                ones = torch.ones(1, dtype=scale.dtype, device=scale.device)
                return ones, torch.zeros(1, dtype=torch.int64, device=scale.device)
        fixed = isinstance(state, FixedQParamsState)  # torch.ao's FixedQParamsObserver: int32 whatever the qscheme
        if not zero_point.is_floating_point() and self.spec.mapping != "asymmetric" and not fixed:
            zero_point = zero_point.to(torch.int64)  # torch.ao: int64 when symmetric, int32 when affine
        if scale.dim() == 0:  # torch.ao's per-tensor qparams have shape (1,)
            scale, zero_point = scale.reshape(1), zero_point.reshape(1)
        return scale, zero_point

    def _apply(self, fn, recurse=True):
        """``.to``/``.cuda``/``.half()`` move the state to their device but keep its dtypes: a
        qstats state is float32/int64 (``model.to(torch.bfloat16)`` rounded the observed extremes,
        and a float64 histogram state broke its search)."""
        before = {name: getattr(self, name) for name in self._fields}
        super()._apply(fn, recurse)
        for name, old in before.items():
            new = getattr(self, name)
            if new.dtype != old.dtype:
                setattr(self, name, old.to(new.device))
        return self

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        """A per-tensor min/max or histogram state before any data is saved as the state of no data
        (``min_val`` Inf, ``max_val`` -Inf, zero counts; shape ``()``), not as empty buffers: torch.ao's
        per-tensor observers hold those, so the checkpoint loads into them (a size mismatch before,
        and a ``HistogramObserver`` that failed on its next input). A per-tensor histogram also saves
        torch.ao's ``histogram`` entry (`_torch_ao_bins`: ``torch_ao_bins`` bins), so that a
        ``HistogramObserver(bins=torch_ao_bins)`` loading it keeps the counts (it kept an empty histogram)."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.spec is None or not isinstance(self.spec.granularity, PerTensor):
            return
        is_histogram = self._state_type is HistogramState
        if not (is_histogram or set(self._fields) <= _EXTREMES_FIELDS):
            return
        state = self.state
        if state is None:
            state = self.observer.init(_probe(self.spec, next(self.buffers()).device))
            destination.update({prefix + name: value for name, value in zip(self._fields, state)})
        if is_histogram:
            destination[prefix + "histogram"] = _torch_ao_bins(state, self.torch_ao_bins)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # a torch.ao observer's entries (min_val/max_val or histogram, eps) become this state's fields
        state_dict = _state_dict_of_torch_ao(self, state_dict, prefix, error_msgs)
        if _per_channel_into_per_tensor(self, state_dict, prefix, error_msgs):
            return  # left as it was, as torch.ao leaves a buffer of another size
        # the buffers take the shapes and dtypes of the loaded state (empty before the first forward)
        for name in self._fields:
            key = prefix + name
            if key in state_dict and isinstance(state_dict[key], torch.Tensor):
                setattr(self, name, torch.empty_like(state_dict[key], device=getattr(self, name).device))
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def __prepare_scriptable__(self):
        """``torch.jit.script`` calls this first: qstats observers are Python functions, which
        TorchScript cannot compile (it failed deep inside with 'keyword-arg expansion')."""
        raise TypeError(
            "QstatsObserver: torch.jit.script cannot compile a qstats observer (Python functions); script the "
            "converted model (convert / convert_fx) instead, or use torch.export"
        )

    def extra_repr(self) -> str:
        name = getattr(self._factory, "__name__", type(self._factory).__name__)
        return f"observer={name}, dtype={self.dtype}, qscheme={self.qscheme}, spec={self.spec}"


def _uncalibrated_message(state) -> str:
    """The warning of `QstatsObserver.calculate_qparams` where a parameter has no finite data: the
    NaN/Inf values left out where it saw some (torch.ao's own scale is NaN or Inf there; 'must run
    the observer' misled), else torch.ao's 'run the observer first'."""
    left_out = int(state.nonfinite.sum()) if "nonfinite" in getattr(state, "_fields", ()) else 0
    if left_out:
        return (f"QstatsObserver: saw only NaN/Inf values where it has no qparams ({left_out} non-finite values "
                "left out; torch.ao's scale is NaN or Inf from them); returning torch.ao's defaults (scale 1, "
                "zero point 0) there: check the calibration data and weights for non-finite values")
    return ("QstatsObserver: must run the observer on data before calculate_qparams; returning torch.ao's defaults "
            "(scale 1, zero point 0) where it saw none")


def _builds_without_spec(factory: Callable) -> bool:
    """Whether ``factory(None)``, without options, builds an observer (the placeholders do): a
    TypeError building it with a float dtype's missing spec then comes from an option."""
    try:
        factory(None)
    except Exception:  # any failure: the factory needs a spec
        return False
    return True


def _check_torch_ao_bins(bins, state_type) -> Optional[int]:
    """``bins`` (default torch.ao's 2048) for a histogram drop-in; ValueError for another count than a
    positive int, or for an observer whose state saves no torch.ao histogram."""
    if state_type is not HistogramState:
        if bins is not None:
            raise ValueError(f"QstatsObserver: torch_ao_bins={bins!r} applies to histogram observers "
                             f"(qstats.histogram), not to a {state_type.__name__}")
        return None
    if bins is None:
        return _TORCH_AO_BINS
    if not (isinstance(bins, int) and not isinstance(bins, bool) and bins >= 1):
        raise ValueError(f"QstatsObserver: torch_ao_bins must be a positive int (torch.ao's HistogramObserver "
                         f"bins), got {bins!r}")
    return bins


def _per_channel_into_per_tensor(module: QstatsObserver, state_dict, prefix: str, error_msgs: list) -> bool:
    """True, with an error, where ``state_dict`` holds extremes with a channel dimension (torch.ao's
    ``PerChannelMinMaxObserver``, a per-channel drop-in) for a per-tensor ``module``: they loaded,
    and its per-tensor qscheme returned one scale per channel (torch.ao's ``MinMaxObserver``
    refuses the size)."""
    if module.spec is None or not isinstance(module.spec.granularity, PerTensor):
        return False
    for name in [name for name in module._fields if name in ("min_val", "max_val")]:
        value = state_dict.get(prefix + name)
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() > 0:
            error_msgs.append(
                f"QstatsObserver: {prefix}{name} of shape {tuple(value.shape)} is a per-channel state; this observer "
                f"quantizes per tensor ({module.qscheme}): load it into a per-channel one (qscheme="
                "torch.per_channel_affine or per_channel_symmetric, and its ch_axis)"
            )
            return True
    return False


_EXTREMES_FIELDS = {"min_val", "max_val", "count", "batches", "nonfinite"}
# states of observers whose torch.ao counterparts keep no buffers (placeholder, noop, recording)
_NOTHING_SAVED_BY_TORCH_AO = (PlaceholderState, RecordingState)


def _state_dict_of_torch_ao(module: QstatsObserver, state_dict, prefix: str, error_msgs: list):
    """``state_dict`` with a torch.ao observer's entries (a ``MinMaxObserver``'s, a moving
    average's, a per-channel one's or a ``HistogramObserver``'s) converted to ``module``'s state
    as `from_observer` converts them; its ``eps`` buffer is dropped where it equals ``module.eps``
    (else an error). For a placeholder, noop or recording drop-in, no entries at all (torch.ao's save
    none) give the state before any data. Other state dicts come back as they are."""
    if module._state_type is FixedQParamsState:
        return _fixed_state_dict_of_torch_ao(module, state_dict, prefix, error_msgs)
    keys = {name: prefix + name for name in module._fields}
    if module._state_type in _NOTHING_SAVED_BY_TORCH_AO and not any(key in state_dict for key in keys.values()):
        # torch.ao's PlaceholderObserver, NoopObserver and RecordingObserver save no entries (a strict
        # load of their checkpoint missed "count"): the state before any data, as they hold nothing
        return dict(state_dict, **{key: torch.empty(0) for key in keys.values()})
    if any(key in state_dict for name, key in keys.items() if name not in ("min_val", "max_val")):
        if module._state_type is HistogramState:  # torch.ao's bins saved beside qstats' own buckets
            return {key: value for key, value in state_dict.items() if key != prefix + "histogram"}
        return state_dict  # qstats' own fields
    ao_keys = [prefix + name for name in ("min_val", "max_val", "histogram", "eps")]
    extremes = set(module._fields) <= _EXTREMES_FIELDS and {"min_val", "max_val"} <= set(module._fields)
    histogram_state = module._state_type is HistogramState and prefix + "histogram" in state_dict
    if not (prefix + "min_val" in state_dict and prefix + "max_val" in state_dict and (extremes or histogram_state)):
        return state_dict
    converted = {key: value for key, value in state_dict.items() if key not in ao_keys}
    if prefix + "eps" in state_dict:
        eps = float(state_dict[prefix + "eps"].reshape(-1)[0])
        if module.spec is not None and eps != float(torch.tensor(module.spec.eps, dtype=torch.float32)):
            error_msgs.append(f"QstatsObserver: the torch.ao observer's eps {eps} in {prefix}eps differs from this "
                              f"observer's eps {module.spec.eps}; build it with eps={eps}")
    found = SimpleNamespace(**{name: state_dict[prefix + name] for name in ("min_val", "max_val", "histogram")
                               if prefix + name in state_dict})
    if found.min_val.numel() == 0:  # a per-channel torch.ao observer before any data: empty buffers
        state = [torch.empty(0)] * len(module._fields)
    elif histogram_state:
        state = _histogram_state(found, module.observer)
    else:
        state = _extremes_state(module._fields, found.min_val.detach().float(), found.max_val.detach().float())
    converted.update({keys[name]: value for name, value in zip(module._fields, state)})
    return converted


def _fixed_state_dict_of_torch_ao(module: QstatsObserver, state_dict, prefix: str, error_msgs: list):
    """A torch.ao ``FixedQParamsObserver``'s entries (``scale``, ``zero_point``, no ``count``)
    checked against ``module``'s constants (else an error) and loaded as the state before any data
    (torch.ao counts nothing). Other state dicts come back as they are."""
    keys = [prefix + name for name in ("scale", "zero_point")]
    if prefix + "count" in state_dict or not all(key in state_dict for key in keys):
        return state_dict
    constants = module.observer.init(_probe(module.spec))
    for key, ours in zip(keys, (constants.scale, constants.zero_point)):
        theirs = state_dict[key]
        if not (isinstance(theirs, torch.Tensor) and theirs.numel() == ours.numel()
                and torch.equal(theirs.detach().cpu().double().reshape(-1), ours.double().reshape(-1))):
            error_msgs.append(f"QstatsObserver: the torch.ao observer's {key} {theirs} differs from this fixed_qparams "
                              f"observer's {ours.tolist()}")
    converted = {key: value for key, value in state_dict.items() if key not in keys}
    converted.update({prefix + name: torch.empty(0) for name in module._fields})
    return converted


def buckets_per_octave_for_bins(bins: int = 2048) -> int:
    """The ``buckets_per_octave`` of `qstats.histogram` that resolves at least what torch.ao's
    ``HistogramObserver(bins=bins)`` resolves, where the data's range includes zero.

    Buckets of the largest magnitude ``|m|``'s octave are at most ``|m| / buckets_per_octave`` wide
    and narrower below, and torch.ao's bins are ``(max - min) / bins >= |m| / bins`` wide when
    ``[min, max]`` includes zero, so ``bins`` rounded up to a power of two (at most 4096) is never
    coarser there. Data of one sign (``[10, 11]``) has narrower torch.ao bins, by up to
    ``|m| / (max - min)``.
    """
    if not (isinstance(bins, int) and not isinstance(bins, bool) and bins >= 1):
        raise ValueError(f"buckets_per_octave_for_bins: bins must be a positive int, got {bins!r}")
    return min(1 << (bins - 1).bit_length(), 4096)


_with = QstatsObserver.with_args

default_observer = _with(observer=minmax, quant_min=0, quant_max=127)
default_weight_observer = _with(observer=minmax, dtype=torch.qint8, qscheme=torch.per_tensor_symmetric)
weight_observer_range_neg_127_to_127 = _with(
    observer=minmax, dtype=torch.qint8, qscheme=torch.per_tensor_symmetric, quant_min=-127, quant_max=127, eps=2**-12
)
# 128 buckets per octave, not 2048: squared errors within 1% of 2048's (0.72% at most measured), about
# 20 times faster per update (docs/migrating_torch_ao.md); histogram's default, left unnamed so that
# with_args(bins=n), its former name, is no conflict of two options
default_histogram_observer = _with(observer=histogram, quant_min=0, quant_max=127)
default_per_channel_weight_observer = _with(observer=minmax, dtype=torch.qint8, qscheme=torch.per_channel_symmetric)
per_channel_weight_observer_range_neg_127_to_127 = _with(
    observer=minmax, dtype=torch.qint8, qscheme=torch.per_channel_symmetric, quant_min=-127, quant_max=127, eps=2**-12
)
default_dynamic_quant_observer = _with(observer=placeholder, dtype=torch.quint8, quant_min=0, quant_max=255,
                                       is_dynamic=True)
default_placeholder_observer = _with(observer=placeholder, dtype=torch.float32)
default_float_qparams_observer = _with(
    observer=minmax, dtype=torch.quint8, qscheme=torch.per_channel_affine_float_qparams, ch_axis=0
)
default_float_qparams_observer_4bit = _with(
    observer=minmax, dtype=torch.quint4x2, qscheme=torch.per_channel_affine_float_qparams, ch_axis=0
)
default_fixed_qparams_range_neg1to1_observer = _with(
    observer=fixed_qparams, dtype=torch.quint8, quant_min=0, quant_max=255, scale=2.0 / 256.0, zero_point=128
)
default_fixed_qparams_range_0to1_observer = _with(
    observer=fixed_qparams, dtype=torch.quint8, quant_min=0, quant_max=255, scale=1.0 / 256.0, zero_point=0
)
default_symmetric_fixed_qparams_observer = default_fixed_qparams_range_neg1to1_observer
default_affine_fixed_qparams_observer = default_fixed_qparams_range_0to1_observer


def _spec_of(obs) -> QuantSpec:
    """The spec whose qparams equal ``obs.calculate_qparams()`` (its range is already halved by
    ``reduce_range`` where it was custom: torch.ao keeps only the halved one)."""
    custom = getattr(obs, "has_customized_qrange", False)
    return QuantSpec.from_torch_ao(
        obs.dtype, obs.qscheme, False if custom else obs.reduce_range,
        obs.quant_min if custom else None, obs.quant_max if custom else None,
        float(obs.eps), getattr(obs, "ch_axis", 0),
    )


def _classes(*names: str, module=ao) -> tuple:
    """torch.ao's classes of these ``names`` in ``module`` (its observers by default), and torchao's PT2E
    copies of them (not subclasses) where torchao is loaded: one of its observers exists only then."""
    modules = [module, sys.modules.get(f"torchao.quantization.pt2e.{module.__name__.rpartition('.')[2]}")]
    return tuple(getattr(module, name) for module in modules if module is not None for name in names)


def _extremes_state(fields, lo, hi) -> list:
    """The values of a min/max state's ``fields`` for torch.ao's extremes ``lo``/``hi`` (float32):
    ``count`` and ``batches`` are 1 per calibrated parameter (torch.ao keeps neither)."""
    seen = (lo <= hi).to(torch.int64)
    values = dict(min_val=lo, max_val=hi, count=seen, batches=seen.clone(), nonfinite=torch.zeros_like(seen))
    return [values[name] for name in fields]


_TORCH_AO_BINS = 2048  # torch.ao's HistogramObserver default


def _rebinned(edges: torch.Tensor, counts: torch.Tensor, points: torch.Tensor, lo, hi) -> torch.Tensor:
    """The counts between consecutive ``points`` of a histogram of ``counts`` (float64) over ascending
    ``edges``, each bin's count spread evenly over it: the cumulative count at every point (0 at or
    below ``lo``, the total at or above ``hi``), rounded, then differenced (integer counts, the
    total kept). Zero-width bins hold their count at their edge."""
    before = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    index = (torch.searchsorted(edges, points, right=True) - 1).clamp(0, counts.numel() - 1)
    width = edges[index + 1] - edges[index]
    fraction = torch.where(width > 0, (points - edges[index]) / torch.where(width > 0, width, 1.0), 1.0)
    below = before[index] + counts[index] * fraction.clamp(0, 1)
    below = torch.where(points >= hi, before[-1], torch.where(points <= lo, 0.0, below))
    return torch.round(below).diff()


def _torch_ao_bins(state: HistogramState, bins: int) -> torch.Tensor:
    """A per-tensor histogram state as torch.ao's ``bins`` linear bins over ``[min_val, max_val]``
    (float32): each qstats bucket's count spread evenly over it, the rounded cumulative count at
    every bin edge (`_rebinned`; the inverse of `_histogram_state`). One repeated value lands in
    the middle bin, as torch.ao's ``histc`` puts it; no data gives zeros."""
    edges, counts = histogram_edges(state)  # (2K + 1,), (2K,): ascending by value
    lo, hi = state.min_val.double().reshape(()), state.max_val.double().reshape(())
    if counts.device.type == "meta" or not bool(lo <= hi):  # no values to read, or no finite data
        return torch.zeros(bins, device=counts.device)
    if bool(lo == hi):  # torch.ao's histc widens [v, v] to [v - 1, v + 1]
        return torch.zeros(bins, device=counts.device).index_fill(0, torch.tensor([bins // 2], device=counts.device),
                                                                  float(counts.sum()))
    targets = lo + (hi - lo) * torch.arange(bins + 1, dtype=torch.float64, device=counts.device) / bins
    return _rebinned(edges, counts.double(), targets, lo, hi).float()


def _histogram_state(obs, observer) -> HistogramState:
    """torch.ao's linear bins (``obs``: its ``histogram``, ``min_val``, ``max_val``) re-bucketed
    into the qstats histogram ``observer``'s: the values torch.ao's own search assumes (each bin's
    count spread evenly over it) counted into qstats' buckets, through the rounded cumulative count
    at every bucket edge (`_rebinned`: integer counts, the total kept, exact extremes)."""
    counts = obs.histogram.detach().double()
    empty = observer.init(counts[:1])
    lo, hi = obs.min_val.detach().float().reshape(()), obs.max_val.detach().float().reshape(())
    if not bool(lo <= hi) or float(counts.sum()) <= 0:  # torch.ao saw no finite data
        return empty
    if bool(lo == hi):  # one repeated value (zero-width bins): every count in that value's bucket
        one = observer.update(empty, lo.reshape(1))
        total = torch.round(counts.sum()).to(torch.int64)
        return one._replace(counts=one.counts * total, underflow=one.underflow * total, overflow=one.overflow * total)
    state = empty._replace(min_val=lo.clone(), max_val=hi.clone())
    edges, _ = histogram_edges(state)  # (2K + 1,) ascending: negative buckets flipped, then positive
    lo, hi, bins = lo.double(), hi.double(), counts.numel()
    linear = lo + (hi - lo) * torch.arange(bins + 1, dtype=torch.float64, device=counts.device) / bins  # torch.ao's
    flat = _rebinned(linear, counts, edges, lo, hi).to(torch.int64)  # (2K,): negative magnitudes, then positive
    half = flat.numel() // 2
    per_sign = torch.stack([flat[:half].flip(0), flat[half:]])  # (2, K): underflow, buckets, overflow
    return state._replace(counts=per_sign[:, 1:-1].reshape(state.counts.shape),
                          underflow=per_sign[:, 0].clone(), overflow=per_sign[:, -1].clone())


def _drop_in_state(obs: QstatsObserver):
    """The state of a drop-in; before any data, the state of no data where its shape needs no data
    (per tensor, as torch.ao's per-tensor observers hold it), else the per-channel ValueError."""
    state = obs.state
    if state is not None:
        return state
    if obs.spec is not None and not isinstance(obs.spec.granularity, PerTensor):
        raise ValueError(
            f"from_observer: the QstatsObserver ({obs.spec.granularity}) has seen no data (empty buffers); build "
            "the qstats state with observer.init(x) instead"
        )
    return obs.observer.init(_probe(obs.spec, next(obs.buffers()).device if obs._fields else None))


def from_observer(obs, buckets_per_octave: Optional[int] = None, octaves: int = 48):
    """A calibrated torch.ao observer (or torchao PT2E's copy of one) as ``(observer, spec, state)``
    of qstats.

    The min-max and moving-average min-max observers (per tensor and per channel) convert
    exactly: further ``observer.update`` calls give torch.ao's qparams bit for bit; ``count`` is 1
    per calibrated parameter (torch.ao keeps none). A ``HistogramObserver`` is re-bucketed into
    `qstats.histogram` (``buckets_per_octave`` default: `buckets_per_octave_for_bins`), values
    moving at most one torch.ao bin (docs/migrating_torch_ao.md). A `QstatsObserver` gives its own;
    per tensor, one that saw no data gives the state of no data, as torch.ao's per-tensor observers
    (per channel: ValueError, as torch.ao's, whose channel count comes from data). A
    ``FixedQParamsObserver`` gives `qstats.fixed_qparams` of its constants, before any data. A
    ``FakeQuantize`` (a QAT model's, ``FusedMovingAvgObsFakeQuantize`` and
    ``FixedQParamsFakeQuantize`` too) gives its observer's.
    """
    # FakeQuantize (its fused and fixed-qparams kin derive from it; not _LearnableFakeQuantize, whose scale is
    # learned): its observer holds the statistics (the fused op's too)
    if isinstance(obs, _classes("FakeQuantize", module=ao_fake_quantize)):
        obs = obs.activation_post_process
    if isinstance(obs, QstatsObserver):
        return obs.observer, obs.spec, _drop_in_state(obs)
    if isinstance(obs, _classes("FixedQParamsObserver")):  # its constants; it counts nothing
        spec = QuantSpec.from_torch_ao(obs.dtype, obs.qscheme, False, obs.quant_min, obs.quant_max, _FLOAT32_EPS)
        observer = fixed_qparams(spec, obs.scale.detach().cpu(), obs.zero_point.detach().cpu())
        return observer, spec, observer.init(_probe(spec, obs.scale.device))
    # the moving averages derive from the min-max classes
    if not isinstance(obs, _classes("MinMaxObserver", "PerChannelMinMaxObserver", "HistogramObserver")):
        raise TypeError(
            f"from_observer: cannot import a {type(obs).__module__}.{type(obs).__name__}; expected torch.ao's "
            "(or torchao PT2E's) MinMaxObserver, PerChannelMinMaxObserver, MovingAverage(PerChannel)MinMaxObserver, "
            "HistogramObserver or FixedQParamsObserver"
        )
    spec = _spec_of(obs)
    if isinstance(obs, _classes("HistogramObserver")):
        per_octave = buckets_per_octave_for_bins(obs.bins) if buckets_per_octave is None else buckets_per_octave
        observer = histogram(spec, per_octave, octaves)
        return observer, spec, _histogram_state(obs, observer)
    lo, hi = obs.min_val.detach().float().clone(), obs.max_val.detach().float().clone()
    if lo.numel() == 0:  # torch.ao's per-channel observers learn their channel count from data
        raise ValueError(
            f"from_observer: the {type(obs).__name__} has seen no data (empty min_val); build the qstats state "
            "with observer.init(x) instead"
        )
    moving = isinstance(obs, _classes("MovingAverageMinMaxObserver", "MovingAveragePerChannelMinMaxObserver"))
    observer = moving_average_minmax(spec, obs.averaging_constant) if moving else minmax(spec)
    state_type = MovingAverageMinMaxState if moving else MinMaxState
    return observer, spec, state_type._make(_extremes_state(state_type._fields, lo, hi))
