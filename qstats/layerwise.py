"""Calibrating a model whose weights do not fit in memory, one decoder layer at a time.

`calibrate_layerwise` takes a model built on the meta device and a directory of safetensors
shards. It runs the model up to its first decoder layer once per batch to capture that layer's
inputs (through every layer, standing in for each, when each layer gets its own arguments: layers
of several kinds, each with its mask), then loads each layer from the checkpoint, calibrates it (`qstats.calibrate` on the layer,
under the part of the recipe's `Plan` inside it, so the states keep their full module paths) over
every stored input, keeps its outputs as the next layer's inputs and puts the layer back on the
meta device. The modules outside the layers (embeddings, final norm, ``lm_head``) are observed
last, by running the model's own forward with every layer replaced by a stub returning the last
layer's stored outputs. Only one layer's weights (and the modules outside the layers) are in
memory at a time; the activations stay in memory or, with ``offload_dir``, on disk.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import os
import shutil
import tempfile
from types import MappingProxyType
from typing import Any, Callable, Iterator, Mapping, Optional, Union

import torch
from tqdm.auto import tqdm

from . import distributed
from ._checks import check_available, check_flag, is_instance_named
from ._lazy_checkpoint import LazyCheckpoint, check_covers, load_modules, release_modules
from ._sites import run_model
from .calibration import (batch_weight, check_batches, fake_quantized, observe_batches, qparams_unwarned,
                          warn_training_mode)
from .experts import with_argument
from .observation import (check_experts_layout, resumed_states, warn_transposed_weights, warn_unfitted,
                          warn_unobserved)
from .recipe import Plan, Recipe, as_plan

__all__ = ["calibrate_layerwise"]


@dataclasses.dataclass(frozen=True)
class _Inputs:
    """One calibration batch between layers: the user's batch, its observation weight, the
    arguments of the next layer and the output of the last layer run (None before the first).
    ``layers``: when the layers are of several kinds (sliding-window and full attention), each
    layer's own ``(arguments after the hidden states, keyword arguments without them)``."""

    batch: Any
    weight: Optional[torch.Tensor]
    args: tuple
    kwargs: dict
    output: Any = None
    layers: Optional[tuple] = None


class _Store:
    """The batches' `_Inputs`: in a list, or one ``torch.save`` file per batch under ``directory``;
    each batch's observation weight (one value per token at most) in memory too, read by `weight`
    without loading the batch's file."""

    def __init__(self, directory: Optional[str]):
        self.directory = directory
        self.records: list = []  # the `_Inputs`, or with a directory the file holding each
        self.weights: list = []  # each record's weight

    def weight(self, index: int) -> Optional[torch.Tensor]:
        return self.weights[index]

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> _Inputs:
        if self.directory is None:
            return self.records[index]
        return _Inputs(**torch.load(self.records[index], weights_only=False))

    def __setitem__(self, index: int, record: _Inputs) -> None:
        self.weights[index] = record.weight
        if self.directory is None:
            self.records[index] = record
        else:
            torch.save(_compact(vars(record)), self.records[index])  # a shallow dict: asdict would copy every tensor

    def append(self, record: _Inputs) -> None:
        name = f"batch_{len(self):07d}.pt"
        self.records.append(None if self.directory is None else os.path.join(self.directory, name))
        self.weights.append(None)
        self[len(self) - 1] = record

    def __iter__(self) -> Iterator[_Inputs]:
        return (self[index] for index in range(len(self)))


def _each_tensor(value: Any, change: Callable[[torch.Tensor], torch.Tensor], seen: dict) -> Any:
    """``value`` with ``change`` applied to every tensor in it (in tuples, lists and mappings); a
    tensor or container found several times in it (one mask for several layers; Gemma3n's
    ``shared_kv_states``, one dict every layer gets, which a layer fills for later ones) is changed
    once (``seen``: ``{id: changed}`` of the call), so the result shares it as ``value`` did."""
    if id(value) in seen:
        return seen[id(value)]
    if isinstance(value, torch.Tensor):
        seen[id(value)] = change(value)
    elif isinstance(value, (tuple, list)):
        items = [_each_tensor(item, change, seen) for item in value]  # a NamedTuple takes them by field
        seen[id(value)] = type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    elif isinstance(value, Mapping):
        seen[id(value)] = {key: _each_tensor(item, change, seen) for key, item in value.items()}
    else:
        return value
    return seen[id(value)]


def _compact(value: Any) -> Any:
    """``value`` with every tensor that views part of a larger storage (a batch sliced from a
    tokenized data set) copied to its own: ``torch.save`` writes a tensor's whole storage, so each
    offloaded batch would hold the whole data set, written again after every layer."""
    spans_more = lambda tensor: tensor.untyped_storage().nbytes() > tensor.numel() * tensor.element_size()  # noqa: E731
    return _each_tensor(value, lambda tensor: tensor.clone() if spans_more(tensor) else tensor, {})


class _Stop(Exception):
    """Raised by the first layer's pre-hook: the forward has reached it; carries its arguments."""

    def __init__(self, args: tuple, kwargs: dict):
        super().__init__("first decoder layer reached")
        self.layer_args, self.layer_kwargs = args, kwargs


def _moved(value: Any, device: Optional[torch.device]) -> Any:
    """``value`` with every tensor in it (in tuples, lists and mappings) on ``device``, each moved
    once; None: as is."""
    return value if device is None else _each_tensor(value, lambda tensor: tensor.to(device), {})


def _offloaded(value: Any, device: Optional[torch.device]) -> Any:
    """``value`` with its tensors on the CPU, where the store keeps them, when layers run on ``device``."""
    return value if device is None else _moved(value, torch.device("cpu"))


def _execution_device(device, where: str) -> Optional[torch.device]:
    """``device`` as a ``torch.device`` that can hold a tensor, or None; ValueError otherwise."""
    if device is None:
        return None
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"{where}: device={device!r} cannot hold tensors here: {error}") from None
    check_available(device, where)
    if device.type == "meta":
        raise ValueError(f"{where}: device='meta' holds no data; name the device the layers run on")
    return device


def inside(path: str, prefix: str) -> bool:
    """Whether ``path`` is the module ``prefix`` or inside it."""
    return path == prefix or path.startswith(prefix + ".")


def decoder_layers(model: torch.nn.Module, layers: Optional[str], where: str = "calibrate_layerwise") -> tuple:
    """``(path, container)`` of the decoder layers: ``layers`` when given, else the longest
    ``nn.ModuleList`` whose children are all of one class, or all of the layer classes the model
    declares in ``_no_split_modules`` (hybrid models: Jamba's attention and Mamba layers), outside
    any other such list; inside the language model when one holds such a list (`_language_model_path`);
    a list of declared layer classes rather than a longer one of other modules."""
    if layers is not None:
        try:
            container = model.get_submodule(layers)
        except (AttributeError, TypeError) as error:  # no such module (torch's message names one part of the path)
            raise ValueError(f"{where}: layers={layers!r} names no module of the model: {error}") from None
        if not isinstance(container, (torch.nn.ModuleList, torch.nn.Sequential)) or not len(container):
            raise ValueError(f"{where}: layers={layers!r} is not a non-empty nn.ModuleList")
        return layers, container
    declared = set(getattr(model, "_no_split_modules", None) or ())  # transformers' decoder-layer classes

    def of_layers(module: torch.nn.Module) -> bool:
        kinds = {type(item) for item in module}
        return len(kinds) == 1 or all(kind.__name__ in declared for kind in kinds)

    lists = [
        (len(module), path, module)
        for path, module in model.named_modules()
        if isinstance(module, torch.nn.ModuleList) and len(module) and of_layers(module)
    ]
    # not a list inside another's items (experts inside a decoder layer may outnumber the layers)
    found = [item for item in lists if not any(item[1].startswith(other[1] + ".") for other in lists)]
    if not found:
        raise ValueError(f"{where}: no nn.ModuleList of decoder layers found; name it with layers=")
    decoder = _language_model_path(model)
    found = [item for item in found if decoder is not None and inside(item[1], decoder)] or found
    # lists of the declared layer classes first, however short (a two-layer Gemma3n's three altup_projections)
    named = [item for item in found if all(type(layer).__name__ in declared for layer in item[2])]
    return max(named or found, key=lambda item: item[0])[1:]


def _language_model_path(model: torch.nn.Module) -> Optional[str]:
    """The path of a decoder-only transformers model's language model (``get_decoder()``), whose
    layers the text batches run: a multimodal model's vision encoder may have more blocks (Qwen2-VL's
    32 against 28 decoder layers), which its text-only forward never calls. None when unknown or the
    model is an encoder-decoder (its encoder's layers run first)."""
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False) or not hasattr(model, "get_decoder"):
        return None
    try:
        decoder = model.get_decoder()
    except Exception:  # noqa: BLE001 - transformers' lookup raises for models without a rule: no preference
        return None
    return next((path for path, module in model.named_modules() if module is decoder), None)


def _sub_plan(plan: Plan, keep: Callable[[str], bool], root: torch.nn.Module) -> Plan:
    """The part of ``plan`` on the modules whose paths ``keep`` selects, run through ``root``."""
    sites = {path: entry for path, entry in plan.sites.items() if keep(path)}
    modules = {path: module for path, module in plan.modules.items() if path and keep(path)}
    groups = tuple(group for group in plan.fused_groups if all(keep(path) for path in group))
    return Plan(plan.recipe, MappingProxyType(sites), MappingProxyType({"": root, **modules}), groups)


def _is_cache(value: Any) -> bool:
    """Whether ``value`` is a transformers KV cache (a ``transformers.cache_utils.Cache``)."""
    return is_instance_named(value, "transformers", "Cache")


def _without_cache(args: tuple, kwargs: dict) -> tuple:
    """The layer's ``(arguments, keyword arguments)`` without ``past_key_values`` and with
    ``use_cache=False``: a calibration batch is a whole sequence. A cache passed another way (by
    position: GPT-2; as ``layer_past=``: GPT-NeoX, Falcon, Bloom, GPT-J), which the layers fill
    whatever ``use_cache`` says, stays as the forward made it (empty: no layer has run) and each
    call of a layer gets a copy of it (`_fresh_caches`)."""
    cleared = {"past_key_values": None, "use_cache": False}
    return tuple(args), {key: cleared[key] if key in cleared else value for key, value in kwargs.items()}


def _fresh_caches(args: tuple, kwargs: dict) -> tuple:
    """``(args, kwargs)`` with a copy of every KV cache in them: a layer run twice on a batch
    (quantized propagation, GPTQ) would attend to the keys its first run cached, and one cache
    kept for every layer would hold the keys of the whole calibration set."""
    fresh = lambda value: copy.deepcopy(value) if _is_cache(value) else value  # noqa: E731
    return tuple(map(fresh, args)), {key: fresh(value) for key, value in kwargs.items()}


def _next_inputs(record: _Inputs, output, following: int) -> _Inputs:
    """``record`` with the layer's output as the hidden states of layer ``following`` (with that
    layer's own other arguments, when `_Inputs.layers` holds them)."""
    hidden = output[0] if isinstance(output, (tuple, list)) else output
    if not isinstance(hidden, torch.Tensor):
        raise ValueError(f"calibrate_layerwise: a decoder layer returned {type(output).__name__}, not hidden states")
    rest, kwargs = tuple(record.args[1:]), record.kwargs
    if record.layers is not None and following < len(record.layers):
        rest, kwargs = record.layers[following]
    if record.args:
        return dataclasses.replace(record, args=(hidden,) + tuple(rest), kwargs=kwargs, output=output)
    if "hidden_states" in record.kwargs:
        return dataclasses.replace(record, kwargs={**kwargs, "hidden_states": hidden}, output=output)
    raise ValueError("calibrate_layerwise: the decoder layers take their hidden states neither first nor by keyword")


class _LayerRun(torch.nn.Module):
    """The root `calibrate` runs for one layer: calls the layer on a stored batch and, when
    ``write``, stores its output as that batch's next inputs."""

    def __init__(self, layer: torch.nn.Module, store: _Store, device: Optional[torch.device], following: int):
        super().__init__()
        self.layer = layer
        self.store = store
        self.device = device  # where the layer runs; the store keeps its tensors on the CPU
        self.following = following  # the index of the layer its outputs go to
        self.write = True

    def forward(self, index: int):
        record = self.store[index]
        # the layer's arguments and every later layer's own, moved as one: what they share (Gemma3n's
        # shared_kv_states, which this layer fills for the later ones) stays shared on the device
        args, kwargs, layers = _moved((record.args, record.kwargs, record.layers), self.device)
        fresh_args, fresh_kwargs = _fresh_caches(args, kwargs)
        output = self.layer(*fresh_args, **fresh_kwargs)
        if self.write:
            record = _next_inputs(dataclasses.replace(record, args=args, kwargs=kwargs, layers=layers), output,
                                  self.following)
            args, kwargs, layers, kept = _offloaded((record.args, record.kwargs, record.layers, record.output), self.device)
            self.store[index] = dataclasses.replace(record, args=args, kwargs=kwargs, layers=layers, output=kept)
        return output


class _StandIn(torch.nn.Module):
    """Stands in for a decoder layer; an attribute it lacks is read from that layer (the model's
    forward may read one, as ModernBERT its layers' ``attention_type``)."""

    def __init__(self, layer: torch.nn.Module):
        super().__init__()
        self.__dict__["_layer"] = layer  # not a submodule: its tensors are none of the stand-in's

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_layer"], name)


class _Replay(_StandIn):
    """Stands in for a decoder layer after the last one has run: returns the stored output of
    the last layer for the current batch (``shared["stored"]``, which the first stub moves to
    ``device`` for every stub of the batch)."""

    def __init__(self, layer: torch.nn.Module, first: bool, shared: dict, device: Optional[torch.device]):
        super().__init__(layer)
        self.first, self.shared, self.device = first, shared, device

    def forward(self, *args, **kwargs):
        if self.first:
            self.shared["output"] = _moved(self.shared["stored"], self.device)
        return self.shared["output"]


def _passed_on(args: tuple, kwargs: dict, like: Any) -> Any:
    """A stand-in's output: the hidden states it was given, in the structure of ``like`` (what the
    first layer returned, None if unknown): in place of the first item of a tuple or list (Bamba's
    layers return ``(hidden_states, attention_weights)``, which its forward unpacks)."""
    hidden = args[0] if args else kwargs.get("hidden_states")
    if isinstance(like, (tuple, list)) and like and isinstance(like[0], torch.Tensor):
        items = [hidden, *like[1:]]
        return type(like)(*items) if hasattr(like, "_fields") else type(like)(items)
    return hidden


class _Recorder(_StandIn):
    """Stands in for decoder layer ``index``: records its call (``(index, args, kwargs)`` in ``calls``)
    and passes its hidden states on (as ``like``, `_passed_on`); stops the forward, with the first
    call's arguments, at a layer called a second time or at layer ``last``."""

    def __init__(self, layer: torch.nn.Module, index: int, calls: list, like: Any, last: Optional[int] = None):
        super().__init__(layer)
        self.index, self.calls, self.like, self.last = index, calls, like, last

    def forward(self, *args, **kwargs):
        called_before = any(index == self.index for index, _, _ in self.calls)
        self.calls.append((self.index, args, kwargs))
        if called_before or self.index == self.last:
            raise _Stop(*self.calls[0][1:])
        return _passed_on(args, kwargs, self.like)


@contextlib.contextmanager
def _stood_in(container, stand_in: Callable[[int, torch.nn.Module], torch.nn.Module]) -> Iterator[None]:
    """Every layer of ``container`` replaced by ``stand_in(index, layer)`` inside the with, put back after."""
    layers = list(container)
    try:
        for index, layer in enumerate(layers):
            container[index] = stand_in(index, layer)
        yield
    finally:
        for index, layer in enumerate(layers):
            container[index] = layer


def _stop(module, args, kwargs):
    """A forward pre-hook that stops the forward at its module, with the module's arguments."""
    raise _Stop(args, kwargs)


def _check_call_order(model: torch.nn.Module, container, container_path: str, batch, where: str,
                      like: Any) -> bool:
    """Runs the model's forward on ``batch`` through stand-ins of its layers (each returning its
    hidden states as ``like``, the first layer's output, `_passed_on`) and refuses a forward
    that calls a layer twice (one layer shared across depths, as ALBERT's) or out of list order:
    each layer is calibrated once, its outputs feeding the next in the list. Returns whether the
    layers get other arguments than the first one's (GraniteSWA's NoPE layers get no rotary
    embeddings): then each layer's own are captured."""
    calls: list = []
    walk = lambda index, layer: _Recorder(layer, index, calls, like)  # noqa: E731
    # _Stop at a second call; any other error the capture that follows reports
    with _stood_in(container, walk), contextlib.suppress(Exception):
        run_model(model, batch)
    order = [index for index, _, _ in calls]
    if order != list(range(len(order))):
        raise ValueError(
            f"{where}: the model's forward calls its decoder layers {container_path!r} in the order "
            f"{order[:12]}{' ...' if len(order) > 12 else ''}, not each once in list order (a layer shared across "
            "depths, as ALBERT's, or layers run out of order); layer-by-layer calibration runs each layer once, "
            "in list order: calibrate the loaded model with qstats.calibrate"
        )
    own = _own_arguments(calls)
    return any(not _same(arguments, own[0]) for arguments in own[1:])


def _same(one: Any, other: Any) -> bool:
    """Whether two layers' arguments are the same: the same tensors (the same objects: equal values
    on one batch, as two masks whose window exceeds it, need not be equal on the next), in the same
    containers, and equal other values."""
    if isinstance(one, torch.Tensor) or isinstance(other, torch.Tensor):
        return one is other
    if isinstance(one, (tuple, list)) and isinstance(other, (tuple, list)):
        return type(one) is type(other) and len(one) == len(other) and all(map(_same, one, other))
    if isinstance(one, Mapping) and isinstance(other, Mapping):
        return one.keys() == other.keys() and all(_same(one[key], other[key]) for key in one)
    if one is other:
        return True
    try:
        return type(one) is type(other) and bool(one == other)
    except Exception:  # noqa: BLE001 - a value without a plain equality is taken as another
        return False


def _check_passed_on(run: "_Run", container, container_path: str, batch, where: str, loaded: list) -> Any:
    """Runs the model's forward on ``batch`` through its first layer (read from the checkpoint) up
    to the second, and refuses a forward that passes the second layer a tensor the first returned
    beside its hidden states (T5's position bias, computed by the first block alone): layer by layer,
    only the hidden states go from one layer to the next. Returns the first layer's output (None
    if unknown), whose structure the stand-ins return. The first layer stays loaded (its
    `release_modules` list added to ``loaded``), so that its own run reads it no more."""
    if len(container) < 2:
        return None
    outputs: list = []

    def keep(module, args, kwargs, output):
        outputs.append((output, [*args, *kwargs.values()]))

    loaded.extend(load_modules(run.model, [f"{container_path}.0"], run.checkpoint, device=run.device))
    received: list = []
    try:
        with container[0].register_forward_hook(keep, with_kwargs=True), \
                container[1].register_forward_pre_hook(_stop, with_kwargs=True):
            run_model(run.model, batch)
    except _Stop as stopped:
        received = [*stopped.layer_args, *stopped.layer_kwargs.values()]
        _check_hidden_states(outputs, stopped.layer_args, stopped.layer_kwargs, container_path, where)
    except Exception:  # noqa: BLE001 - the capture and the layer's own run report the model's errors
        pass
    output, given = outputs[0] if outputs else (None, [])
    extras = output[1:] if isinstance(output, (tuple, list)) else ()
    # a tensor the first layer was given too (the same for every layer) is no output passed on
    extras = [extra for extra in extras if isinstance(extra, torch.Tensor) and not any(extra is g for g in given)]
    if any(extra is value for extra in extras for value in received):
        raise ValueError(
            f"{where}: the model's forward passes {container_path}.1 a tensor that {container_path}.0 returned beside "
            "its hidden states (as T5 passes the position bias its first block computes); layer-by-layer "
            "calibration passes only the hidden states from one layer to the next: calibrate the loaded model "
            "with qstats.calibrate"
        )
    return output


def _check_hidden_states(outputs: list, args: tuple, kwargs: dict, container_path: str, where: str) -> None:
    """Refuses a forward that passes the second layer other hidden states than the first layer
    returned (DeBERTa-v2's convolution after its first layer), or those in another argument too
    (Funnel's decoder layers take them as query, key and value): layer by layer, each layer's output
    goes to the next as it is, as its hidden states alone."""
    if len(outputs) != 1:  # the first layer called several times: `_check_call_order` names it
        return
    output = outputs[0][0]
    hidden = output[0] if isinstance(output, (tuple, list)) and output else output
    passed = args[0] if args else kwargs.get("hidden_states")
    others = [*args[1:], *(value for key, value in kwargs.items() if args or key != "hidden_states")]
    if isinstance(hidden, torch.Tensor) and any(value is hidden for value in others):
        raise ValueError(
            f"{where}: the model's forward passes {container_path}.1 the hidden states {container_path}.0 returns in "
            "another argument too (as Funnel's decoder its query, key and value); layer-by-layer calibration passes "
            "them as the hidden states alone: calibrate the loaded model with qstats.calibrate"
        )
    if not isinstance(hidden, torch.Tensor) or not isinstance(passed, torch.Tensor) or passed is hidden:
        return
    if passed.shape != hidden.shape or passed.dtype != hidden.dtype or not torch.equal(passed, hidden):
        raise ValueError(
            f"{where}: the model's forward changes the hidden states {container_path}.0 returns before passing them "
            f"to {container_path}.1 (as DeBERTa-v2's convolution after its first layer); layer-by-layer calibration "
            "passes each layer's output to the next as it is: calibrate the loaded model with qstats.calibrate"
        )


def _own_arguments(calls: list) -> tuple:
    """Each layer call `_Recorder` recorded as ``(arguments after the hidden states, keyword
    arguments without them)``."""
    return tuple(_without_cache(tuple(args[1:]), {k: v for k, v in kwargs.items() if k != "hidden_states"})
                 for _, args, kwargs in calls)  # fmt: skip


def _capture(model, container, container_path: str, batches, observation_weight, store: _Store,
             device: Optional[torch.device], each_layer: bool, checked: Callable[[Any], tuple], where: str) -> None:
    """Runs ``model`` on each batch (on ``device``) up to its first decoder layer and stores that
    layer's inputs (on the CPU); with ``each_layer``, or when ``checked(batch)`` (run first, on the
    first batch: ``(whether each layer gets its own arguments, the first layer's output)``) says
    so, up to the last, through stand-ins, keeping every layer's own arguments (`_Inputs.layers`)."""

    calls: list = []
    widths: list = []  # of each batch's hidden states
    last = len(container) - 1
    with contextlib.ExitStack() as installed, torch.no_grad():
        for number, batch in enumerate(batches):
            if number == 0:  # the stand-ins or the hook after the checks, which run layers of their own
                own_arguments, like = checked(_moved(batch, device))
                each_layer = own_arguments or each_layer
                if each_layer:
                    record = lambda index, layer: _Recorder(layer, index, calls, like, last)  # noqa: E731
                    installed.enter_context(_stood_in(container, record))
                else:
                    installed.enter_context(container[0].register_forward_pre_hook(_stop, with_kwargs=True))
            weight = batch_weight(observation_weight, batch, where)
            calls.clear()
            try:
                run_model(model, _moved(batch, device))
            except _Stop as stopped:
                args, kwargs, each = _offloaded((stopped.layer_args, stopped.layer_kwargs, calls), device)
            else:
                raise ValueError(f"{where}: the model's forward never called its first decoder layer, "
                                 f"{container_path}.0; pass layers= naming the list of layers the forward runs")
            own = _own_arguments(each) if each_layer else None
            args, kwargs = _without_cache(args, kwargs)
            widths.append(_hidden_width(args, kwargs))
            if None not in (widths[0], widths[-1]) and widths[-1] != widths[0]:  # here, not once all are captured
                raise ValueError(f"{where}: batch {number} gives {container_path}.0 hidden states of {widths[-1]} "
                                 f"features, batch 0 {widths[0]}: every batch must be of the model's width")
            batch, weight, args, kwargs, own = _apart_from(batch, (batch, weight, args, kwargs, own))
            store.append(_Inputs(batch, weight, args, kwargs, layers=own))


def _hidden_width(args: tuple, kwargs: dict) -> Optional[int]:
    """The features of the hidden states a layer is passed (first or as ``hidden_states=``), if a
    sequence ``[batch, tokens, features]`` (a convolution's ``[batch, channels, height, width]`` may vary)."""
    hidden = args[0] if args else kwargs.get("hidden_states")
    return hidden.shape[-1] if isinstance(hidden, torch.Tensor) and hidden.ndim == 3 else None


def _apart_from(batch: Any, kept: tuple) -> tuple:
    """``kept`` with a copy of every tensor that holds memory of ``batch``'s tensors (the batch itself,
    its attention mask as the observation weight, a 4-D mask the forward passes the layers as it is):
    an iterator may refill the same tensors for its next batch, and the kept ones are read again (in
    every layer; the batch by the modules outside the layers). Tensors shared stay shared."""
    storage = lambda tensor: tensor.untyped_storage().data_ptr()  # noqa: E731 - views of a batch's tensor too
    owned: set = set()
    _each_tensor(batch, lambda tensor: owned.add(storage(tensor)) or tensor, {})
    return _each_tensor(kept, lambda tensor: tensor.clone() if storage(tensor) in owned else tensor, {})


def _select(states: dict, keep: Callable[[str, str], bool]) -> dict:
    """The states of the ``(path, site)`` that ``keep`` selects, without empty entries."""
    kept = {path: {site: state for site, state in entry.items() if keep(path, site)}
            for path, entry in states.items()}  # fmt: skip
    return {path: entry for path, entry in kept.items() if entry}


def _reduce(states: dict, plan: Plan) -> dict:
    """``states`` with its activation sites merged across ranks (`qstats.distributed.all_reduce`);
    parameter sites are the same on every rank and stay as they are."""
    activations = _select(states, lambda path, site: plan.site(path, site).kind != "parameter")
    reduced = distributed.all_reduce(activations, plan.observers(activations))
    return {path: {**entry, **reduced.get(path, {})} for path, entry in states.items()}


@dataclasses.dataclass
class _Run:
    """What every phase of one `calibrate_layerwise` call shares."""

    model: torch.nn.Module
    checkpoint: LazyCheckpoint
    plan: Plan
    store: _Store
    states: dict
    all_experts: bool
    propagate: str
    all_reduce: bool
    device: Optional[torch.device] = None  # where layers run (None: the CPU, nothing moved)
    side_plan: Optional[Plan] = None  # observed per layer beside the plan, handed to after_layer, not returned
    after_layer: Optional[Callable[[str, torch.nn.Module, dict, dict], tuple]] = None
    # per stored batch, the activations offered its observation weight and those it fitted, over every pass
    weight_fits: list = dataclasses.field(default_factory=list)

    def calibrate(self, root, plan: Plan, batches, observation_weight) -> dict:
        """This rank's states of ``plan`` over ``batches`` (the stored ones, in order), resumed from its
        sites in ``self.states``; adds each batch's observation weight fits to ``weight_fits``."""
        resumed = _moved(_select(self.states, lambda path, site: plan.site(path, site) is not None), self.device)
        # the model's modules in training mode, the plan's layouts, the sites that saw no data and the weights
        # that fitted no activation are warned of once, on the whole model (`run_layerwise`), not on each part
        fits: list = []
        found = observe_batches(root, batches, plan, resumed or None, False, observation_weight, self.all_experts,
                                warn_unseen=False, checks_plan=False, fits=fits)
        self.weight_fits.extend([0, 0] for _ in range(len(fits) - len(self.weight_fits)))
        for total, (offered, fitted) in zip(self.weight_fits, fits):
            total[0], total[1] = total[0] + offered, total[1] + fitted
        return found

    def reduce(self, found: dict, plan: Plan, each: bool = False) -> dict:
        """``found`` merged across ranks (with ``all_reduce``); ``each``: one state at a time, so
        that every state owns its buffer and is freed on its own (a layer's Hessians, one by one)."""
        if not (self.all_reduce and group_up()):
            return found
        # sites only some ranks observed (routing to per-expert modules, a rank without batches)
        found, _, partial = distributed.merge_partial_sites(found, plan.observers(found),
                                                            device=self.device or torch.device("cpu"))
        if not each:
            found = _reduce(found, plan)
        else:
            found = {path: {site: _reduce({path: {site: state}}, plan)[path][site] for site, state in entry.items()}
                     for path, entry in found.items()}
        return {path: {**found.get(path, {}), **partial.get(path, {})} for path in [*found, *partial]}


def group_up() -> bool:
    """Whether the default process group is initialised (collectives would run)."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def agreed(all_reduce: bool, step: Callable[[], Any]) -> Any:
    """``step()``; with ``all_reduce``, every rank then learns whether one rank's step raised, so
    that all raise instead of the others waiting for it in the next collective."""
    if not (all_reduce and group_up()):
        return step()
    result = error = None
    try:
        result = step()
    except Exception as caught:  # re-raised below, once every rank knows
        error = caught
    failed = torch.tensor([int(error is not None)], dtype=torch.int64, device=distributed._probe_device(None))
    torch.distributed.all_reduce(failed, op=torch.distributed.ReduceOp.MAX)
    if error is not None:
        raise error
    if int(failed[0]):
        raise RuntimeError("another rank failed (see the error on that rank)")
    return result


def outer_paths(model: torch.nn.Module, container_path: str) -> list:
    """The paths of the modules outside the decoder layers (load each with ``recurse=False``)."""
    return [path for path, _ in model.named_modules() if not inside(path, container_path)]


@contextlib.contextmanager
def _loading(run: _Run, paths: list, recurse: bool = True) -> Iterator[Callable[[], None]]:
    """A ``load()`` that reads the modules at ``paths`` (their own tensors only, without ``recurse``)
    from the checkpoint onto ``run.device``; what it read goes back on the meta device when the with ends."""
    saved: list = []
    try:
        yield lambda: saved.extend(load_modules(run.model, paths, run.checkpoint, recurse=recurse, device=run.device))
    finally:
        release_modules(saved)


def _merged(plan: Plan, side: Plan) -> Optional[Plan]:
    """One plan observing both plans' sites (one forward pass), or None when a site is in both."""
    if any(site in plan.sites.get(path, {}) for path, entry in side.sites.items() for site in entry):
        return None
    paths = list(dict.fromkeys([*plan.sites, *side.sites]))
    sites = {path: {**plan.sites.get(path, {}), **side.sites.get(path, {})} for path in paths}
    return Plan(plan.recipe, MappingProxyType(sites), plan.modules, plan.fused_groups)


def _split(found: dict, side: Plan) -> tuple:
    """``(states of the recipe's sites, states of the side plan's sites)`` of a merged plan's states."""
    theirs = lambda path, site: site in side.sites.get(path, {})  # noqa: E731
    return _select(found, lambda path, site: not theirs(path, site)), _select(found, theirs)


def _observed_and_stepped(run: _Run, label: str, module: torch.nn.Module, plan: Plan, side: Optional[Plan],
                          over: Callable[[Plan, bool], dict], load: Callable[[], None]) -> tuple:
    """``(states, sites done)`` of the modules ``plan`` covers (a decoder layer, or those outside the
    layers): ``load()`` reads their weights, ``over(observed, final)`` returns this rank's states of
    ``observed`` over every batch (``final``: the last pass), with ``side``'s sites observed beside
    ``plan``'s (in one pass when no site is in both); the states are merged across ranks, then
    ``run.after_layer(label, module, states, side_states)`` (if any) runs on the loaded modules."""
    merged = None if side is None else _merged(plan, side)

    def observe() -> tuple:
        load()
        if merged is not None:
            return _split(over(merged, True), side)
        found = over(plan, side is None)
        return found, {} if side is None else over(side, True)

    found, side_found = agreed(run.all_reduce, observe)
    found = run.reduce(found, plan)
    if side is not None:
        side_found = run.reduce(side_found, side, each=True)
    done: set = set()
    if run.after_layer is not None:
        found, done = agreed(run.all_reduce, lambda: run.after_layer(label, module, found, side_found))
    return found, done


def _run_layer(run: _Run, path: str, layer: torch.nn.Module, following: int, last: bool = False) -> dict:
    """Loads, calibrates and releases one decoder layer; its outputs replace the stored inputs.
    With ``run.after_layer``, ``after_layer(path, layer, states, side_states)`` runs on the loaded
    layer before its outputs are computed; it may replace weights by quantized ones and returns
    the states kept and the ``(path, site)`` parameter sites it quantized; the layer's outputs then
    come from those weights and float activations (a step runs with ``propagate="float"`` only). The
    ``last`` layer's outputs are those it had before the step: llm-compressor's last subgraph holds the
    last layer and the modules after it, observed together before any of them is quantized."""
    runner = _LayerRun(layer, run.store, run.device, following)
    in_layer = lambda p: inside(p, path)  # noqa: E731
    plan = _sub_plan(run.plan, in_layer, runner)
    side = None if run.side_plan is None else _sub_plan(run.side_plan, in_layer, runner)
    float_outputs = run.propagate == "float" and (run.after_layer is None or last)

    def over_store(observed: Plan, final: bool) -> dict:  # this rank's states of ``observed`` over every stored batch
        runner.write = float_outputs and final  # float outputs are stored once, by the last pass
        return run.calibrate(runner, observed, range(len(run.store)), run.store.weight)

    def propagate(found: dict) -> None:  # "quantized": fake-quantized by found's qparams (no step runs then)
        runner.write = True
        quantized = contextlib.nullcontext()
        if run.propagate == "quantized":
            quantized = fake_quantized(runner, qparams_unwarned(found, plan), plan)
        with quantized, torch.no_grad():
            for index in range(len(run.store)):
                runner(index)

    with _loading(run, [path]) as load:
        found = _observed_and_stepped(run, path, layer, plan, side, over_store, load)[0]
        if not float_outputs:
            agreed(run.all_reduce, lambda: propagate(found))
        return found


def _without_router_logits(model: torch.nn.Module) -> contextlib.AbstractContextManager:
    """Calls ``model`` with ``output_router_logits=False`` when its forward takes it (transformers'
    MoE models, default ``config.output_router_logits``): the stand-in layers route no token, so
    the router logits the model would gather after the layers are none (an IndexError in its
    load-balancing loss); the modules outside the layers see the same values without them."""
    names = list(inspect.signature(model.forward).parameters)
    if "output_router_logits" not in names:
        return contextlib.nullcontext()
    position = names.index("output_router_logits")

    def off(module, args, kwargs):
        return with_argument(args, kwargs, position, "output_router_logits", False)

    return model.register_forward_pre_hook(off, with_kwargs=True)  # removed on leaving the with


def _run_outside(run: _Run, container_path: str, container, observation_weight) -> dict:
    """Observes the sites outside the decoder layers (and the side plan's there): the model's forward
    over the user's batches, each layer replaced by a stub returning the last layer's stored outputs;
    ``run.after_layer`` then runs on them as on a layer (GPTQ of an ``lm_head``, whose inputs are the
    last layer's outputs)."""
    outside = lambda p: not inside(p, container_path)  # noqa: E731
    plan = _sub_plan(run.plan, outside, run.model)
    side = None if run.side_plan is None else _sub_plan(run.side_plan, outside, run.model)

    def over_batches(observed: Plan, final: bool) -> dict:
        shared: dict = {}  # the current batch's weight and last layer's output (each record read once)

        def batches() -> Iterator:  # each batch as the capture saw it (moved), its weight as computed there
            for record in run.store:
                shared["weight"], shared["stored"] = record.weight, record.output
                yield _moved(record.batch, run.device)

        weight = None if observation_weight is None else (lambda batch: shared["weight"])
        replay = lambda index, layer: _Replay(layer, index == 0, shared, run.device)  # noqa: E731
        with _stood_in(container, replay), _without_router_logits(run.model):
            return run.calibrate(run.model, observed, batches(), weight)

    label = f"the modules outside {container_path}"
    with _loading(run, outer_paths(run.model, container_path), recurse=False) as load:
        return _observed_and_stepped(run, label, run.model, plan, side, over_batches, load)[0]


class _ToFirstLayer(torch.nn.Module):
    """The root `_step_before_layers` runs: the model's forward on a stored batch (moved to
    ``device``), stopped at its first decoder layer."""

    def __init__(self, model: torch.nn.Module, first_layer: torch.nn.Module, store: _Store,
                 device: Optional[torch.device]):
        super().__init__()
        self.__dict__.update(model=model, first_layer=first_layer)  # not submodules: the plan holds their paths
        self.store, self.device = store, device

    def forward(self, index: int) -> None:
        with self.first_layer.register_forward_pre_hook(_stop, with_kwargs=True), contextlib.suppress(_Stop):
            run_model(self.model, _moved(self.store[index].batch, self.device))


def _step_before_layers(run: _Run, container_path: str, container) -> bool:
    """``run.after_layer`` (GPTQ) on the modules the forward calls before the first decoder layer
    (OPT's ``project_in``), observed over the stored batches: llm-compressor's first subgraph holds
    them, quantized before the first layer runs on their outputs. Returns whether it changed a
    weight (the first layer's inputs are then captured again). The recipe's states of those
    modules are observed with the others outside the layers, last (on their float weights, as there)."""
    outside = lambda p: not inside(p, container_path)  # noqa: E731
    root = _ToFirstLayer(run.model, container[0], run.store, run.device)
    side = _sub_plan(run.side_plan, outside, root)
    if not side.sites:
        return False
    step = run.after_layer

    def called(label, module, found, side_found):  # only the modules called: those after the layers are not
        return step(label, module, {path: entry for path, entry in found.items() if path in side_found}, side_found)

    def over(observed: Plan, final: bool) -> dict:
        # sites this partial forward never reaches (lm_head's Hessian and, for the recipe, whose states
        # here are dropped, every site outside the layers) are observed in the last pass
        return run.calibrate(root, observed, range(len(run.store)), run.store.weight)

    before = dataclasses.replace(run, after_layer=called)
    label = f"the modules before {container_path}.0"
    plan = _sub_plan(run.plan, outside, root)
    return bool(_observed_and_stepped(before, label, run.model, plan, side, over, lambda: None)[1])


def _layer_kinds(model: torch.nn.Module, container_path: str) -> set:
    """The kinds in ``config.layer_types`` of the modules holding the decoder layers (a multimodal
    model keeps its text model's in ``text_config``, the config of its language model): layers of
    several kinds get different masks (sliding-window and full attention), captured layer by layer."""
    parts = container_path.split(".")
    owners = [model.get_submodule(".".join(parts[:count])) for count in range(len(parts))]
    return {kind for owner in owners for kind in getattr(getattr(owner, "config", None), "layer_types", None) or ()}


def check_on_meta(model: torch.nn.Module, where: str = "calibrate_layerwise",
                  why: str = "they would be used instead of the checkpoint's and never released",
                  otherwise: str = "") -> None:
    """ValueError naming the parameters of ``model`` off the meta device: ``why`` they may not be, and
    ``otherwise`` (what to do with a loaded model) after building it on meta."""
    loaded = [name for name, value in model.named_parameters() if value.device.type != "meta"]
    if loaded:
        raise ValueError(
            f"{where}: the model's parameters {loaded[:3]} ({len(loaded)} in all) are not on the meta "
            f'device: {why}; build the model under torch.device("meta"){otherwise}'
        )


def _ordered(states: dict, plan: Plan) -> dict:
    """The states in the plan's order of modules and sites."""
    return {
        path: {site: states[path][site] for site in entry if site in states.get(path, {})}
        for path, entry in plan.sites.items()
        if states.get(path)
    }


def calibrate_layerwise(
    model: torch.nn.Module,
    checkpoint: Union[str, os.PathLike],
    batches,
    recipe: Union[Recipe, Plan],
    *,
    states: Optional[Mapping] = None,
    propagate: str = "float",
    offload_dir: Optional[Union[str, os.PathLike]] = None,
    layers: Optional[str] = None,
    progress: bool = True,
    observation_weight: Optional[Callable[[Any], Optional[torch.Tensor]]] = None,
    all_experts: bool = False,
    all_reduce: bool = False,
    device: Optional[Union[str, torch.device]] = None,
) -> dict:
    """Observer states of a model too large for memory, calibrated one decoder layer at a time.

    Args:
      model: the model built on the meta device (``with torch.device("meta"):
        AutoModelForCausalLM.from_config(config)``), in eval mode. Its tensors are read from
        ``checkpoint`` when needed and put back on the meta device after.
      checkpoint: a directory holding ``model.safetensors`` or shards and their
        ``model.safetensors.index.json``; read tensor by tensor, in the dtypes of the model's meta
        tensors (as ``from_pretrained`` casts to the model's dtype). Stacked experts
        stored per expert (transformers' ``experts.<e>.gate_proj.weight``) are stacked on reading.
      batches, recipe, states, observation_weight, all_experts: as in `qstats.calibrate` (the
        batches are the model's; each is iterated once).
      propagate: ``"float"`` (default): each layer's outputs are those of the float layer, and the
        states equal ``qstats.calibrate`` on the loaded model bit for bit. ``"quantized"``: each
        layer's outputs are those of the layer fake-quantized (`qstats.fake_quantized`) under the
        qparams of its own states (llm-compressor 0.14's sequential pipeline, which runs with
        quantization disabled, gives ``"float"``'s states for a ``QuantizationModifier``).
      offload_dir: keep the layers' inputs on disk there (one file per batch, removed at the
        end) instead of in memory.
      layers: the path of the ``nn.ModuleList`` of decoder layers (default: the longest one).
      progress: a progress bar over the layers.
      all_reduce: merge each layer's activation states across the ranks of the default process
        group (`qstats.distributed.all_reduce`) as soon as it is observed, so quantized
        propagation uses the same qparams on every rank; the states returned are merged already.
        An error on one rank makes every rank raise (RuntimeError on the others), never hang; a rank
        whose ``all_reduce`` is no bool (None, 0) raises its TypeError so too, with the ranks that
        pass True (not with those passing False, which run no collective).
      device: where each layer runs (``"cuda"``, as llm-compressor's sequential pipeline onloads
        layers): its weights are read onto it, each stored batch is moved there and the outputs
        back to the CPU (or ``offload_dir``). Default: the CPU. The states are returned on it.

    Returns:
      ``{module_path: {site: state}}`` with full module paths, in the plan's order.

    Raises:
      ValueError: a model with parameters off the meta device, a tensor the checkpoint lacks (or of
        another shape, or tied in the model but held twice with different values: the model's
        tensors are back on meta after), a forward that never calls
        its first layer, or calls a layer twice (ALBERT's shared layers) or out of list order, or
        passes a layer a tensor the previous one returned beside its hidden states (T5's position
        bias), a bad ``propagate``.
    """
    return run_layerwise(model, checkpoint, batches, recipe, states=states, propagate=propagate,
                         offload_dir=offload_dir, layers=layers, progress=progress,
                         observation_weight=observation_weight, all_experts=all_experts, all_reduce=all_reduce,
                         device=device)


def run_layerwise(model, checkpoint, batches, recipe, *, states, propagate, offload_dir, layers, progress,
                  observation_weight, all_experts, all_reduce, device=None, layer_step=None, same_on_ranks=dict,
                  where="calibrate_layerwise"):
    """`calibrate_layerwise`; ``layer_step(plan) -> (side_plan, after_layer)`` gives a plan observed
    beside the recipe's in each layer and a step run on each loaded layer (see `_run_layer`);
    ``same_on_ranks()``: more arguments every rank must pass alike, read once they are checked."""

    def prepare() -> tuple:  # every check here, so that with all_reduce a rank's bad argument stops all
        for name, flag in (("all_experts", all_experts), ("all_reduce", all_reduce), ("progress", progress)):
            check_flag(flag, name, where)
        if propagate not in ("float", "quantized"):
            raise ValueError(f"{where}: propagate must be 'float' or 'quantized', got {propagate!r}")
        if all_reduce and states is not None:
            raise ValueError(f"{where}: all_reduce cannot resume states (ranks' resumed states would be merged as "
                             "new ones); resume without all_reduce (propagate='float') and merge the returned "
                             "states with qstats.distributed.all_reduce")
        check_on_meta(model)
        warn_training_mode(model, where)  # as calibrate warns, naming the module's path in the model
        execution = _execution_device(device, where)
        check_batches(batches, where, observation_weight)
        plan = as_plan(recipe, model, where)
        resumed = resumed_states(states, plan, where)
        check_experts_layout(plan, where)  # once, on the whole model, before the first layer is read
        warn_transposed_weights(plan, where)
        container_path, container = decoder_layers(model, layers, where)
        side_plan, after_layer = (None, None) if layer_step is None else layer_step(plan)
        source = LazyCheckpoint(checkpoint, where)
        check_covers(model, source)
        if offload_dir is not None and not os.path.isdir(offload_dir):
            raise ValueError(f"{where}: offload_dir={os.fspath(offload_dir)!r} is not a directory")
        directory = None if offload_dir is None else tempfile.mkdtemp(prefix="qstats_layerwise_", dir=offload_dir)
        made.append(directory)  # removed at the end, whatever fails after this
        run = _Run(model, source, plan, _Store(directory), resumed,
                   all_experts, propagate, all_reduce, execution, side_plan, after_layer)
        return run, container_path, container

    made: list = []  # the offload folder, once made
    try:
        # a rank joins the first collective unless it passed all_reduce=False: one whose all_reduce is no bool
        # (None, 0 from its config) joins it too and fails there, so that the other ranks raise with it
        run, container_path, container = agreed(all_reduce is not False, prepare)
        if run.all_reduce and group_up():  # another propagate or experts split runs other collectives
            distributed.check_same_arguments({
                "propagate": propagate, "all_experts": run.all_experts, "layers": container_path,
                "layer count": len(container), "observation_weight": observation_weight is not None,
                "device": None if run.device is None else run.device.type, **same_on_ranks(),
            }, where)  # fmt: skip
        found = _calibrate_all(run, container_path, container, batches, observation_weight, progress, where)
        for index, (offered, fitted) in enumerate(run.weight_fits):  # as calibrate warns, once per batch
            warn_unfitted(where, run.store.weight(index), offered, fitted)
        warn_unobserved(found, run.plan, len(run.store))  # the recipe's sites (not the side plan's), once
        return _ordered(found, run.plan)
    finally:
        for directory in filter(None, made):
            shutil.rmtree(directory, ignore_errors=True)


def _calibrate_all(run: _Run, container_path: str, container, batches, observation_weight, progress: bool,
                   where: str) -> dict:
    found: dict = {}
    first: list = []  # the first layer, read by the checks and kept for its own run

    each_layer = len(_layer_kinds(run.model, container_path)) > 1
    checks: list = []  # the checks' result on the first batch, which a second capture reuses

    def checked(batch) -> tuple:
        if not checks:
            like = _check_passed_on(run, container, container_path, batch, where, first)
            checks.append((_check_call_order(run.model, container, container_path, batch, where, like), like))
        return checks[0]

    def capture(given) -> None:
        _capture(run.model, container, container_path, given, observation_weight, run.store, run.device, each_layer,
                 checked, where)

    def capture_first(load_outer: Callable[[], None]) -> None:
        load_outer()  # the modules outside the layers, for the capture
        capture(batches)

    def capture_again() -> None:  # the first layer's inputs from the stepped modules before it
        recorded, run.store = run.store, _Store(run.store.directory)  # rewritten file by file, each read first
        capture(record.batch for record in recorded)

    try:
        with _loading(run, outer_paths(run.model, container_path), recurse=False) as load_outer:
            agreed(run.all_reduce, lambda: capture_first(load_outer))
            if run.after_layer is not None and _step_before_layers(run, container_path, container):
                agreed(run.all_reduce, capture_again)
        with tqdm(total=len(container) + 1, unit="layer", desc=f"qstats.{where}", disable=not progress) as bar:
            for index, layer in enumerate(container):
                last = index + 1 == len(container)
                found.update(_run_layer(run, f"{container_path}.{index}", layer, index + 1, last))
                release_modules(first)
                first.clear()
                bar.update(1)
            found.update(_run_outside(run, container_path, container, observation_weight))
            bar.update(1)
    finally:
        release_modules(first)
    return found
