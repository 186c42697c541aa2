"""Tracing a model with torch.fx, and what `prepare` asks of the traced graph: which layer or parameter a
functional call reads as its weight, the calls left in float, the forwards that write buffers, and
the warning naming the layers the rewrite leaves in float."""

from __future__ import annotations

import itertools
import operator
from typing import Any, Dict, Optional, Tuple, Union

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from .._warn import warn
from ._layers import (
    _CONV_TRANSPOSE, _EXTRA_INPUTS, _FUNCTIONAL_LAYERS, _PARAMETER_CALLS, _STOCK_FORWARDS, _named_tensors,
)


def _functional_owner(model: nn.Module, node, layers) -> Optional[str]:
    """The name of the layer (of a type in ``layers`` and of the kind the function computes) whose own
    ``weight`` parameter ``node`` (an ``F.linear``/``F.convNd`` call) reads in that layer's own forward
    (traced through), or None: a call elsewhere (``F.linear(h, self.head.weight)``) is one of its own, with its
    own points (`_parameter_call`), as torch.ao's prepare_qat_fx gives it fake quants apart from the layer's."""
    weight = _call_weight(node)
    if not isinstance(weight, torch.fx.Node) or weight.op != "get_attr":
        return None
    try:
        tensor = model.get_parameter(str(weight.target))
    except AttributeError:  # a buffer or a plain attribute
        return None
    for name in reversed(_module_stack(node)):
        try:
            module = model.get_submodule(name)
        except AttributeError:
            continue
        if (isinstance(module, layers) and isinstance(module, _FUNCTIONAL_LAYERS[node.target])
                and getattr(module, "weight", None) is tensor):
            return name
    return None


def _parameter_call(model: nn.Module, node, layers) -> Optional[str]:
    """The name of the parameter or buffer that ``node``, an ``F.linear``/``F.convNd``/``F.conv_transposeNd`` call
    no layer's own forward makes with its weight (`_functional_owner`), reads as its weight, where the layer type
    computing that function is (a subclass of) a type of ``layers`` and, for a transposed convolution, ``groups`` is
    a Python int (`_call_groups`); None for another call (a computed weight, a plain attribute's or an integer one
    stays in float)."""
    weight = _call_weight(node)
    if _call_kind(node, layers) is None or weight.op != "get_attr":
        return None
    tensor = _model_tensor(model, str(weight.target))  # None: a plain attribute (a tensor constant)
    return str(weight.target) if tensor is not None and tensor.is_floating_point() else None


def _model_tensor(model: nn.Module, name: str) -> Optional[torch.Tensor]:
    """``model``'s parameter or buffer ``name``, or None where ``name`` is neither (a plain attribute)."""
    for get in (model.get_parameter, model.get_buffer):
        try:
            return get(name)
        except AttributeError:  # no such module or attribute, or another kind of attribute
            continue
    return None


def _call_weight(node):
    """The ``weight`` argument of ``node``, an ``F.linear``/``F.convNd``/... call."""
    return node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")


def _call_kind(node, layers) -> Optional[type]:
    """The layer type computing the function of ``node`` (`_PARAMETER_CALLS`), where it is (a subclass of) a type of
    ``layers``, the call's weight is a node of the graph and a transposed convolution's ``groups`` a Python int;
    else None."""
    kind = _PARAMETER_CALLS.get(node.target)
    if kind is None or not any(issubclass(kind, t) for t in layers) or not isinstance(_call_weight(node), torch.fx.Node):
        return None
    return None if issubclass(kind, _CONV_TRANSPOSE) and _call_groups(node) is None else kind


def _module_stack(node) -> list:
    """The paths of the modules whose forwards make ``node``'s call, outermost first."""
    return [entry[0] if isinstance(entry, tuple) else key
            for key, entry in (node.meta.get("nn_module_stack") or {}).items()]


def _model_names(model: nn.Module) -> frozenset:
    """The names of ``model``'s modules, parameters and buffers (`_computed_key` names no point after one)."""
    return frozenset({*dict(model.named_modules()), *dict(_named_tensors(model))})


def _computed_key(node, taken, names: frozenset) -> str:
    """The name of the points of ``node``, a call of a computed weight: its node's name in the traced graph under
    the path of the module whose forward makes it (``"block.linear_1"``), with ``_1``, ``_2``, ... appended where
    that name is in ``names`` (the model's modules, parameters and buffers: `_model_names`) or in ``taken`` (other
    points): a module ``linear`` whose masked weight its parent's forward passes to ``F.linear`` gives the call's
    points ``"linear_1"``."""
    stack = _module_stack(node)
    key = f"{stack[-1]}.{node.name}" if stack and stack[-1] else node.name
    candidates = itertools.chain([key], (f"{key}_{i}" for i in itertools.count(1)))
    return next(name for name in candidates if name not in names and name not in taken)


def _weight_graph(gm: torch.fx.GraphModule, weight) -> Union[torch.fx.GraphModule, str]:
    """A GraphModule computing the node ``weight`` from ``gm``'s parameters and buffers (`QATModel.observed_weight`
    calls it), or what else it reads, for its error: an input of the forward, or the QAT state and phase of a
    fake-quantized layer whose output it is computed from."""
    needed, pending = set(), [weight]
    while pending:
        node = pending.pop()
        if node not in needed:
            needed.add(node)
            pending.extend(node.all_input_nodes)
    inputs = {node.target for node in needed if node.op == "placeholder"}
    if inputs - set(_EXTRA_INPUTS):
        return "the forward's inputs"
    if inputs:
        return "the output of a fake-quantized layer (of the QAT state and phase)"
    graph, copies = torch.fx.Graph(), {}
    for node in gm.graph.nodes:
        if node in needed:
            copies[node] = graph.node_copy(node, copies.__getitem__)
    graph.output(copies[weight])
    return torch.fx.GraphModule(gm, graph, "ComputedWeight")


def _call_groups(node) -> Optional[int]:
    """``groups`` of ``node``, an ``F.conv_transposeNd`` call (its 7th argument), where it is a Python int."""
    groups = node.args[6] if len(node.args) > 6 else node.kwargs.get("groups", 1)
    return groups if isinstance(groups, int) and not isinstance(groups, bool) else None


# the functional calls `prepare` leaves in float, and what torch.ao's prepare_qat_fx does with them
_FLOAT_CALLS = ("F.embedding/F.embedding_bag calls, which torch.ao's prepare_qat_fx leaves in float too; integer "
                "weights, tensor attributes that are no parameter or buffer, transposed convolutions whose groups is "
                "no Python int")


def _float_call(node, layers) -> Optional[Tuple[str, str]]:
    """``node``, an ``F.linear``/``F.convNd``/... call (of a kind a type of ``layers`` computes) that reads no
    quantized layer's own weight, as ``(the path of the module whose forward makes it, a description for
    `prepare`'s warning: "F.conv2d(weight 'w') in 'block'")``. torch.ao's ``prepare_qat_fx`` fake-quantizes such a
    call's weight and input; `prepare` leaves it in float."""
    kind = _FUNCTIONAL_LAYERS[node.target]
    if not any(issubclass(kind, t) or issubclass(t, kind) for t in layers):
        return None
    stack = _module_stack(node)
    caller = stack[-1] if stack else ""
    weight = _call_weight(node)
    read = (f"weight {str(weight.target)!r}" if isinstance(weight, torch.fx.Node) and weight.op == "get_attr"
            else "a computed weight")
    return caller, f"F.{getattr(node.target, '__name__', node.target)}({read}) in {repr(caller) if caller else 'the model'}"


def _float_calls(model: nn.Module, layers, rewriter) -> list:
    """The descriptions of `_float_call`'s calls, but those in the forward of a layer that stays in float (a
    traced-through subclass whose own weight it could not find: the layer is named instead)."""
    return [text for caller, text in rewriter.float_calls
            if not (caller and isinstance(model.get_submodule(caller), layers) and caller not in rewriter.quantized)]


# in-place operators a traced forward may apply to a buffer (``self.count += 1``); methods ending in one "_" too
_IN_PLACE = (operator.iadd, operator.isub, operator.imul, operator.itruediv)
# functions that update the running statistics they are given unless told not to: (position, keyword) of that flag
_UPDATES_STATISTICS = {F.batch_norm: (5, "training"), F.instance_norm: (5, "use_input_stats")}


def _buffer_writers(graph: torch.fx.Graph, buffers) -> list:
    """The modules (by the path of the buffer's owner) whose traced forward writes one of ``buffers`` (names) in
    place: ``F.batch_norm``/``F.instance_norm`` updating running statistics it reads from them (a norm module of
    one's own), in-place methods and operators on them. Sorted, each once."""

    def buffer(node) -> Optional[str]:
        return str(node.target) if isinstance(node, torch.fx.Node) and node.op == "get_attr" \
            and str(node.target) in buffers else None

    written = []
    for node in graph.nodes:
        if node.op == "call_function" and node.target in _UPDATES_STATISTICS:
            position, keyword = _UPDATES_STATISTICS[node.target]
            flag = node.args[position] if len(node.args) > position else node.kwargs.get(keyword, False)
            statistics = node.args[1] if len(node.args) > 1 else node.kwargs.get("running_mean")
            written.append(buffer(statistics) if flag is not False else None)
        elif node.args and (node.op == "call_function" and node.target in _IN_PLACE or node.op == "call_method"
                            and node.target.endswith("_") and not node.target.endswith("__")):
            written.append(buffer(node.args[0]))
    return sorted({name.rpartition(".")[0] for name in written if name is not None})


def _warn_float_layers(model: nn.Module, layers, rewriter, hidden) -> None:
    """Names the layers `prepare` could not rewrite: those inside modules torch.fx keeps whole
    (``hidden``: name -> that module's type name), and subclasses with their own forward that torch.fx
    traced through (a weight not passed as is to F.linear/F.convNd, a batch norm's hidden buffers); also
    rewritten layers with hooks (not run; a traced-through layer's ran once on proxies), instance norms
    that track running statistics (buffers updated in place), SyncBatchNorm layers (rewritten to
    batch norms of each rank's own batch) and, with ``fold_batchnorm``, batch norms after a quantized layer that
    were not folded into it."""
    if hidden:
        warn(f"qstats.qat.prepare: {sorted(hidden)} run inside {sorted(set(hidden.values()))}, which torch.fx "
             "does not trace into: they stay in float")
    if rewriter.hooked:
        warn(f"qstats.qat.prepare: layers {rewriter.hooked} have forward or backward hooks, which the rewritten "
             "model does not run (it computes them with F.linear, F.conv, F.batch_norm, ...; torch.nn.utils.prune's "
             "masks are applied)")
    if rewriter.unfolded:
        warn(f"qstats.qat.prepare: fold_batchnorm=True, but batch norms {rewriter.unfolded} are not folded into the "
             "layer before them (folded: a Conv1d/2d/3d or Linear of torch.nn's forward, with a weight observer, whose "
             "output feeds only a batch norm of its dimension tracking running statistics, each called once, and whose "
             "batch norm weight holds no 0, which the folded output is divided by)")
    calls = _float_calls(model, layers, rewriter)
    if calls and rewriter.quantized:  # with no quantized layer, prepare's error names them
        warn(f"qstats.qat.prepare: the calls {', '.join(calls)} read weights held outside the layers it quantizes "
             f"({[t.__name__ for t in layers]}) that it does not fake-quantize ({_FLOAT_CALLS}): they stay in float; "
             "hold the weight in such a layer or as a parameter given as it is to F.linear/F.conv1d/2d/3d, or "
             "quantize it with qstats.observe_fake_quantize")
    if rewriter.traced_hooked:
        warn(f"qstats.qat.prepare: layers {rewriter.traced_hooked} have their own forward, which torch.fx traced "
             "through, and hooks: they ran once while tracing, on torch.fx proxies (what a forward or pre-hook "
             "returns is part of the rewritten model), and the rewritten model does not run them")
    writers = [name for name in _buffer_writers(rewriter.graph, {n for n, _ in rewriter.gm.named_buffers(remove_duplicate=False)})
               if not isinstance(model.get_submodule(name), nn.modules.batchnorm._BatchNorm)]  # named below
    if writers:
        warn(f"qstats.qat.prepare: the forwards of {[name or type(model).__name__ for name in writers]} write their "
             "buffers in place (F.batch_norm's running statistics, in-place ops): they stay buffers, outside the QAT "
             "state, changed by every qat.init and qat.apply (use nn.BatchNorm, which prepare makes pure)")
    floats, buffers, instance, synced = [], [], [], []
    for name, module in model.named_modules():
        if type(module).forward in _STOCK_FORWARDS or name in hidden or any(name.startswith(f"{h}.") for h in hidden):
            continue
        tracked = getattr(module, "track_running_stats", False)
        if isinstance(module, layers) and name not in rewriter.quantized and name not in rewriter.computed_callers:
            floats.append(name or type(module).__name__)
        elif isinstance(module, nn.SyncBatchNorm) and name in rewriter.batchnorms:
            synced.append(name or type(module).__name__)
        elif tracked and isinstance(module, nn.modules.batchnorm._BatchNorm) and name not in rewriter.batchnorms:
            buffers.append(name or type(module).__name__)
        elif tracked and isinstance(module, nn.modules.instancenorm._InstanceNorm):
            instance.append(name or type(module).__name__)
    if floats:
        warn(f"qstats.qat.prepare: {floats} have their own forward, which does not pass self.weight as is to "
             "F.linear/F.conv/F.conv_transpose/F.embedding: they stay in float (quantize them with qstats.observe_fake_quantize)")
    if buffers:
        warn(f"qstats.qat.prepare: batch norms {buffers} have their own forward: their running statistics stay "
             "buffers updated in place, outside the QAT state")
    if instance:
        warn(f"qstats.qat.prepare: instance norms {instance} track running statistics: they stay buffers updated "
             "in place by every training-mode call, outside the QAT state")
    if synced:
        warn(f"qstats.qat.prepare: SyncBatchNorm layers {synced} become batch norms of each rank's own batch: they "
             "normalise with its statistics and keep its running statistics (SyncBatchNorm's are all ranks'; "
             "qat.sync does not merge them)")


class _Tracer(torch.fx.Tracer):
    """torch.fx's tracer, with subclasses of the quantized layers and of batch norm that keep
    their stock forward as leaves (fx traces through modules defined outside torch.nn, which
    left a subclassed Linear in float)."""

    def __init__(self, layers: Tuple[type, ...]):
        super().__init__()
        self.layers = tuple(layers) + (nn.modules.batchnorm._BatchNorm,)
        # (the exception, the path of the innermost registered module whose forward raised it) for `_trace`; an
        # exception a forward caught (an optional path tried) is replaced by the next one, so it names no module
        self.failure = None

    def call_module(self, m: nn.Module, forward, args, kwargs):
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception as error:
            # the innermost module's handler sees an exception first; an outer one names it where that module is
            # not registered (held in a plain list)
            if self.failure is None or self.failure[0] is not error or self.failure[1] is None:
                try:
                    self.failure = (error, self.path_of_module(m))
                except NameError:
                    self.failure = (error, None)
            raise

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if isinstance(m, self.layers) and type(m).forward in _STOCK_FORWARDS:
            return True
        return super().is_leaf_module(m, module_qualified_name)


def _trace(model: nn.Module, layers: Tuple[type, ...]) -> torch.fx.GraphModule:
    attributes = {module: dict(vars(module)) for module in model.modules()}
    tracer = _Tracer(layers)
    try:
        graph = tracer.trace(model)
        return torch.fx.GraphModule(tracer.root, graph, type(model).__name__)
    except Exception as error:  # data-dependent control flow, unsupported Python in forward
        where = f"{type(model).__name__}.forward"
        failed_in = tracer.failure[1] if tracer.failure is not None and tracer.failure[0] is error else None
        if failed_in:  # a submodule's forward: named, the root's alone would not say which
            where += f", in the forward of {failed_in!r} ({type(model.get_submodule(failed_in)).__name__})"
        raise TypeError(f"qstats.qat.prepare: torch.fx cannot trace {where} ({type(error).__name__}: {error}); make "
                        "the traced part free of data-dependent control flow, or quantize it with "
                        "qstats.observe_fake_quantize directly") from error
    finally:
        _restore_attributes(attributes)


def _restore_attributes(attributes: Dict[nn.Module, Dict[str, Any]]) -> None:
    """Undoes what tracing wrote into the model's modules: hooks of traced-through modules run on proxies
    (torch.nn.utils.prune's sets ``module.weight`` to one), which left the model holding torch.fx Proxies
    (``torch.save(model)`` failed, ``module.weight`` computed nothing) until its next call."""
    for module, before in attributes.items():
        for name, value in list(vars(module).items()):
            if isinstance(value, torch.fx.Proxy):
                if name in before:
                    object.__setattr__(module, name, before[name])
                else:
                    delattr(module, name)
