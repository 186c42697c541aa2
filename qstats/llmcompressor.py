"""llm-compressor observers backed by qstats states: ``import qstats.llmcompressor`` registers them.

A recipe names them like llm-compressor's own (``QuantizationModifier(..., input_observer=
"qstats_minmax")`` or ``QuantizationArgs(observer="qstats_histogram")``):

- ``qstats_minmax``: `qstats.moving_average_minmax`, llm-compressor's ``minmax`` bit for bit;
- ``qstats_static_minmax``: `qstats.minmax`, ``static_minmax`` bit for bit;
- ``qstats_memoryless_minmax``: `qstats.memoryless_minmax`, ``memoryless_minmax`` bit for bit;
- ``qstats_histogram``: `qstats.histogram`, an exactly mergeable histogram searched at the end;
- ``qstats_mse``: `qstats.mse`, losses accumulated over all batches (``mode="moving_average"``:
  llm-compressor's ``mse``); weights: ``memoryless_mse``, its early stop (``patience`` 5) included.

Each is an llm-compressor ``Observer``: ``forward`` folds the observed tensor into a qstats state
(``obs.update``), ``get_qparams`` maps it with ``qstats.compute_qparams`` under
``QuantSpec.from_compressed_tensors(args, observed_dtype=...)``, fused groups (NVFP4 q/k/v,
gate/up) share ``qstats.fused_global_scale``, and ``sync_activation_stats`` merges the states of
all ranks with ``qstats.distributed.all_reduce`` (each observer's own ``merge``). ``observer_kwargs``
that the qstats factory takes configure it (``averaging_constant``, ``buckets_per_octave``,
``maxshrink``, ...); the others go to ``compute_qparams`` (a histogram's ``method="mse"``).
"""

from __future__ import annotations

from typing import Callable, Optional

import optree
import torch

try:
    from compressed_tensors.quantization import QuantizationStrategy
    from compressed_tensors.registry import standardize_lookup_name
    from llmcompressor.observers.base import Observer as LLMCompressorObserver
    from llmcompressor.observers.helpers import flatten_for_calibration
except ImportError as error:  # llm-compressor is optional
    raise ImportError(
        "qstats.llmcompressor needs llm-compressor and compressed-tensors: pip install llmcompressor "
        f"(import failed: {error})"
    ) from error

from . import distributed
from ._formats import global_scale_from_amax
from ._granularity import PerTensor
from ._qparams import compute_qparams
from ._schemes import DROPIN_OBSERVERS, STATIC_GROUP_ACTIVATIONS, check_observer_kwargs, split_observer_kwargs
from ._spec import QuantSpec
from ._warn import warn
from .experts import UncalibratedWarning
from .fused import fused_amax
from .observers import registry
from .recipe import averages_feature_groups, feature_grouped, runtime_scaled

__all__ = ["QstatsObserver", "OBSERVERS", "QstatsMinmaxObserver", "QstatsStaticMinmaxObserver",
           "QstatsMemorylessMinmaxObserver", "QstatsHistogramObserver", "QstatsMseObserver"]


_MIXED_GROUP = ("its fusion group (q/k/v or gate/up weights sharing a global scale) mixes qstats and "
                "llm-compressor observers; give every layer of the group a qstats observer")


class _QstatsStatistics(dict):
    """A qstats observer's statistics in its fusion group: its state, spec and qparams options. An
    llm-compressor observer of the group reads ``min_vals``/``max_vals`` of every member for the
    shared global scale; a qstats member has none, so that read raises the TypeError a qstats
    member of the group raises, not a KeyError inside llm-compressor."""

    def __missing__(self, key):
        raise TypeError(f"{self['qstats_observer']} has no {key!r} for llm-compressor's observers: {_MIXED_GROUP}")


class QstatsObserver(LLMCompressorObserver):
    """An llm-compressor observer whose statistics are one qstats state (``qstats_state``).

    Subclasses set ``factory`` (``spec -> qstats.Observer``, keyword options from
    ``observer_kwargs``). The spec is made at the first observation, from ``args`` and the observed
    dtype (compressed-tensors computes bf16/fp16 weights' qparams in their dtype).
    """

    factory: Callable = None
    _stats_attrs = ["qstats_state"]

    def __init__(self, base_name, args, **observer_kwargs):
        super().__init__(base_name, args, **observer_kwargs)
        strategy = QuantizationStrategy(self.args.strategy)
        grouped = strategy in (QuantizationStrategy.GROUP, QuantizationStrategy.TENSOR_GROUP)
        if not self.is_weight_obs and grouped and self.args.dynamic is False:  # not True, nor NVFP4's "local"
            raise ValueError(f"{type(self).__name__} ({base_name}, strategy {strategy.value!r}): "
                             f"{STATIC_GROUP_ACTIVATIONS}")
        self.factory_options, self.qparams_options = split_observer_kwargs(
            type(self).factory, dict(self.args.observer_kwargs), f"{type(self).__name__} ({base_name})",
            self.is_weight_obs)
        self._check_options()
        self.spec: Optional[QuantSpec] = None
        self.qstats_observer = None

    def _check_options(self) -> None:
        """Errors for bad ``observer_kwargs`` now, as the recipe is applied (`check_observer_kwargs`):
        an input's qparams come after the whole calibration."""
        spec = QuantSpec.from_compressed_tensors(self.args)
        self.make_observer(spec)
        if "bins" in self.factory_options and "buckets_per_octave" not in self.factory_options:
            # a histogram's former option name, warned of once above: not again at each build
            self.factory_options["buckets_per_octave"] = self.factory_options.pop("bins")
        check_observer_kwargs(type(self).factory, self.factory_options, self.qparams_options, spec,
                              f"{type(self).__name__} ({self.base_name})")

    def __getstate__(self) -> dict:
        # the qstats Observer holds closures: pickled without it, rebuilt from the factory and spec
        return {**self.__dict__, "qstats_observer": None}

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        if self.spec is not None:
            self.qstats_observer = self.make_observer()

    def make_observer(self, spec: Optional[QuantSpec] = None):
        """The qstats Observer of ``spec`` (``self.spec`` by default). An activation whose scales come
        at run time (NVFP4's ``dynamic="local"``: only the global scale is calibrated) is observed as
        `qstats.calibrate` observes it: under a moving average (``qstats_minmax``, ``qstats_mse`` with
        ``mode="moving_average"``) per group of features, as llm-compressor's ``minmax`` and ``mse``
        (`averages_feature_groups`); else per tensor (a per-token state would take the first batch's
        length and refuse a batch of another length). A 2-D input (a linearized MoE expert's rows) is
        observed per tensor (`feature_grouped`): llm-compressor's view of it has no group dimension."""
        spec = self.spec if spec is None else spec
        factory, options = type(self).factory, self.factory_options
        if not self.is_weight_obs and runtime_scaled(spec):
            if averages_feature_groups(factory, options, spec):
                return feature_grouped(lambda grouped: factory(grouped, **options), spec)
            spec = spec.replace(granularity=PerTensor())
        return factory(spec, **options)

    def update_statistics_from_observed(self, observed: torch.Tensor) -> None:
        raise NotImplementedError(
            f"{type(self).__name__} observes the tensor itself (call the observer): qstats reduces it "
            "over its own canonical view of the spec's granularity"
        )

    @torch.no_grad
    def forward(self, observed: torch.Tensor) -> "QstatsObserver":
        """Fold ``observed`` into the state (weights: once, as llm-compressor's observers)."""
        if observed.numel() == 0 or (self.is_weight_obs and self.has_statistics):
            return self
        if not observed.is_floating_point():  # an Embedding's input: compressed-tensors would quantize the ids
            raise ValueError(
                f"{type(self).__name__} ({self.base_name}): observed a {observed.dtype} tensor, not floating point: "
                "an Embedding's token ids? compressed-tensors' forward cannot quantize them (the checkpoint would not "
                "run: docs/differences.md); give Embedding modules a config group without input activations")
        # llm-compressor's view: refuses strategies the site cannot take; its middle dims are
        # the shape llm-compressor's modules hold the qparams in
        try:
            self.qparam_shape = flatten_for_calibration(observed, self.base_name, self.args).shape[1:-1]
        except (RuntimeError, ValueError) as error:  # its messages name neither the site nor the sizes
            raise ValueError(self._unfit_message(observed.shape, error)) from error
        dtype = self._compute_dtype(observed.dtype)
        if self.qstats_observer is None or not self.has_statistics or getattr(torch, self.spec.compute_dtype) != dtype:
            self.spec = QuantSpec.from_compressed_tensors(self.args, observed_dtype=dtype)
            self.qstats_observer = self.make_observer()
        obs = self.qstats_observer
        state = self.qstats_state if self.has_statistics else obs.init(observed)
        self.qstats_state = obs.update(state, observed)
        self.fusion_handler.get_fused_statistics()
        return self

    def _unfit_message(self, shape: torch.Size, error: Exception) -> str:
        """Why llm-compressor's view of the strategy (`flatten_for_calibration`) refused a tensor of ``shape``."""
        args, strategy = self.args, QuantizationStrategy(self.args.strategy)
        where = f"{type(self).__name__} ({self.base_name}, strategy {strategy.value!r})"
        if args.group_size and strategy in (QuantizationStrategy.GROUP, QuantizationStrategy.TENSOR_GROUP):
            if shape[-1] % args.group_size:
                return (f"{where}: a tensor of shape {tuple(shape)} has {shape[-1]} columns, not a multiple of "
                        f"group_size {args.group_size}; give the layer a group size dividing them, or ignore it")
        if strategy == QuantizationStrategy.BLOCK and self.is_weight_obs and len(shape) != 2:
            return f"{where}: block_structure {args.block_structure} takes 2-D weights, got shape {tuple(shape)}"
        return f"{where}: llm-compressor's view cannot take a tensor of shape {tuple(shape)}: {error}"

    def _compute_dtype(self, observed_dtype: torch.dtype) -> torch.dtype:
        """The dtype of the qparams once a tensor of ``observed_dtype`` is observed, as in llm-compressor,
        whose statistics are tensors: a new start or an observer keeping the latest batch only
        (``memoryless_minmax``, ``averaging_constant`` 1) takes its dtype; running extremes and moving
        averages, torch's promotion of it and the earlier batches' (bf16, then float32: float32)."""
        if self.qstats_observer is None or not self.has_statistics:  # a new start
            return observed_dtype
        if type(self).factory is registry.get("memoryless_minmax") or self.factory_options.get("averaging_constant") == 1:
            return observed_dtype
        return torch.promote_types(getattr(torch, self.spec.compute_dtype), observed_dtype)

    def get_global_scale(self) -> Optional[torch.Tensor]:
        """The global scale shared by this observer's fusion group (two-level specs; else None)."""
        if self.args.strategy != QuantizationStrategy.TENSOR_GROUP:
            return None
        group = self.fusion_handler.get_fused_statistics()
        if any("qstats_state" not in stats for stats in group):
            raise TypeError(f"{type(self).__name__}: {_MIXED_GROUP}")
        # each member's range under its own observer and options (llm-compressor fuses minmax and mse
        # members alike), one global scale over them, as compute_qparams_tree shares it
        amax = torch.stack([fused_amax([stats["qstats_state"]], stats["qstats_spec"], **stats["qstats_options"])
                            for stats in group]).amax()
        return global_scale_from_amax(amax, self.spec).reshape(1)

    def get_statistics(self) -> dict:
        """The state, with the spec and qparams options its fusion group reads its range under."""
        return _QstatsStatistics(super().get_statistics(), qstats_spec=self.spec, qstats_options=self.qparams_options,
                                 qstats_observer=type(self).__name__)

    @torch.no_grad
    def get_qparams(self) -> dict:
        """``{"scale", "zero_point", "global_scale"}`` in llm-compressor's shapes and dtypes, from
        `qstats.compute_qparams`; then the statistics are deleted, as llm-compressor's."""
        assert self.has_statistics, "No statistics available. Call observer(value) first."
        global_scale = self.get_global_scale()
        options = dict(self.qparams_options)
        if global_scale is not None:
            options["global_scale"] = global_scale.reshape(())
        qparams = compute_qparams(self.qstats_state, self.spec, **options)
        self.delete_statistics()
        uncalibrated = int((~qparams.calibrated).sum()) if isinstance(qparams.calibrated, torch.Tensor) else 0
        if uncalibrated:  # llm-compressor's own observers give NaN scales there
            warn(f"qstats.llmcompressor: {uncalibrated} of {qparams.calibrated.numel()} {self.base_name} "
                 "quantization parameter(s) saw only NaN/Inf values; they get scale 1 and zero point 0",
                 UncalibratedWarning)
        # compressed-tensors' dtypes: scales in the observed dtype (float32 under a global scale,
        # which promotes them), zero points in zp_dtype
        scale_dtype = torch.float32 if global_scale is not None else getattr(torch, self.spec.compute_dtype)
        zero_point_dtype = self.args.zp_dtype or scale_dtype
        return {
            "scale": self._shaped(qparams.scale.to(scale_dtype)),
            "zero_point": self._shaped(qparams.zero_point.to(zero_point_dtype)),
            "global_scale": global_scale,
        }

    def _shaped(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` in the shape of llm-compressor's qparams. Sites whose scales are computed at
        run time (``dynamic="local"``: only the global scale is kept) keep qstats' shape."""
        if values.numel() == torch.Size(self.qparam_shape).numel():
            return values.reshape(self.qparam_shape)
        if self.args.dynamic:
            return values
        raise ValueError(
            f"{type(self).__name__}: qstats' qparams of shape {tuple(values.shape)} do not fit "
            f"llm-compressor's {tuple(self.qparam_shape)} for {self.base_name} ({self.args.strategy})"
        )

    def sync_activation_stats(self) -> list:
        """Merges this activation observer's state across ranks (its qstats ``merge``); weights
        are the same on every rank and are not merged. Where only some ranks saw data (an MoE expert
        whose tokens were routed on some ranks' shards), every rank gets the merge of theirs, in rank
        order (``all_reduce(..., partial=True)``), and takes their spec and qparams shape; an observer
        no rank saw data for stays without statistics, as llm-compressor's. Costs a
        one-integer ``all_reduce`` plus the merge's collectives (and one ``all_gather_object`` where
        only some ranks saw data). Returns no pending handles."""
        if self.is_weight_obs or not torch.distributed.is_initialized():
            return []
        seen = torch.tensor([int(self.has_statistics)], device=distributed._probe_device(None))
        torch.distributed.all_reduce(seen)  # every rank learns how many ranks saw data
        if seen.item() == 0:
            return []
        if seen.item() == torch.distributed.get_world_size():
            self.qstats_state = distributed.all_reduce(self.qstats_state, self.qstats_observer)
            return []
        # each rank's observer and options, and what it saw (its spec: the observed dtype, and
        # llm-compressor's qparams shape) or None: a rank without data takes the first holder's spec,
        # so its observer must be the holders' (the merge's check compares the holders' states only)
        config = (type(self).__name__, repr(self.factory_options), repr(self.qparams_options))
        mine = (self.spec, tuple(self.qparam_shape)) if self.has_statistics else None
        ranks, reports = distributed._gather_from_ranks((config, mine), None)
        other = next((rank for rank, (theirs, _) in zip(ranks, reports) if theirs != reports[0][0]), None)
        if other is not None:
            raise ValueError(
                f"qstats.llmcompressor: the ranks' {self.base_name} observers differ, so their states cannot be "
                f"merged: rank {ranks[0]} has {reports[0][0]}, rank {other} has {reports[ranks.index(other)][0]} "
                "(class, factory options, qparams options; give every rank the same recipe)")
        seen = [saw for _, saw in reports if saw is not None]
        if mine is None:  # the first holder's spec: its states arrive here, and its qparams are computed here
            self.spec, self.qparam_shape = seen[0]
            self.qstats_observer = self.make_observer()
        tree = {self.base_name: self.qstats_state} if mine is not None else {}
        device = (optree.tree_leaves(self.qstats_state)[0].device if mine is not None
                  else distributed._probe_device(None))
        merged = distributed.all_reduce(tree, {self.base_name: self.qstats_observer}, partial=True)
        self.qstats_state = optree.tree_map(lambda value: value.to(device), merged[self.base_name])
        return []


def _observer_class(name: str, factory: Callable, doc: str) -> type:
    cls = type(f"Qstats{name.title().replace('_', '')}Observer", (QstatsObserver,),
               {"factory": staticmethod(factory), "__doc__": doc, "__module__": __name__})
    return _registered(f"qstats_{name}", cls)


def _registered(name: str, cls: type) -> type:
    """The class llm-compressor's registry holds as ``name``: ``cls``, registered now, or the class
    an earlier import of this module registered (``importlib.reload``: compressed-tensors'
    registry takes a name once). ImportError where another package holds the name."""
    held_names = LLMCompressorObserver.registered_names() + LLMCompressorObserver.registered_aliases()
    if standardize_lookup_name(name) not in held_names:
        return LLMCompressorObserver.register(name)(cls)
    held = LLMCompressorObserver.get_value_from_registry(name)
    if getattr(held, "__module__", None) == __name__ and getattr(held, "__qualname__", None) == cls.__qualname__:
        return held
    raise ImportError(
        f"qstats.llmcompressor: llm-compressor's observer registry already holds {name!r} as {held!r}, "
        "registered by another package; qstats registers its observers under the qstats_* names")


_DOCS = {
    "minmax": "Moving average of per-batch extremes (llm-compressor ``minmax``).",
    "static_minmax": "Running extremes (llm-compressor ``static_minmax``).",
    "memoryless_minmax": "The latest batch's extremes (``memoryless_minmax``).",
    "histogram": "Exactly mergeable histogram; the range is searched at get_qparams.",
    "mse": "MSE shrink search; losses accumulated over all batches (mode='accumulate').",
}

OBSERVERS = {suffix: _observer_class(suffix, registry.get(name), _DOCS[suffix])
             for suffix, name in DROPIN_OBSERVERS.items()}
"""``{suffix: class}`` of the observers registered as ``"qstats_<suffix>"``."""

# module attributes under their class names, so that pickle (torch.save of a model under
# calibration) finds the classes
QstatsMinmaxObserver = OBSERVERS["minmax"]
QstatsStaticMinmaxObserver = OBSERVERS["static_minmax"]
QstatsMemorylessMinmaxObserver = OBSERVERS["memoryless_minmax"]
QstatsHistogramObserver = OBSERVERS["histogram"]
QstatsMseObserver = OBSERVERS["mse"]
