"""`_Rewriter`: a traced graph rewritten for `prepare`, each call of a quantized layer (or of a functional
call's weight) and of a batch norm replaced by pure points that take the QAT state, phase and ranges."""

from __future__ import annotations

import collections
import inspect
import operator
from typing import Any, Dict, Optional, Tuple

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from .._warn import warn
from ..observers import Observer
from ._layers import (
    _CONV_TRANSPOSE, _EMBEDDINGS, _EXTRA_INPUTS, _FOLDS, _FUNCTIONAL_LAYERS, _LAYER_FUNCTIONS, _PARAMETER_CALLS,
    _STOCK_FORWARDS, _computes, _conv_layout, _layer_parameter, _stock_forward,
)
from ._points import _BatchNormPoint, _FakeQuantPoint, _dynamic, _fold_factor, _folded_call, _folded_weight
from ._trace import (
    _call_groups, _call_kind, _call_weight, _computed_key, _float_call, _functional_owner, _model_names,
    _parameter_call, _weight_graph,
)


def _bound_inputs(layer: nn.Module, key: str, node) -> Dict[str, Any]:
    """The call's arguments by the names of the layer's forward (``input``, ConvTranspose's ``output_size``,
    EmbeddingBag's ``offsets`` and ``per_sample_weights``)."""
    try:
        return inspect.signature(type(layer).forward).bind(layer, *node.args, **node.kwargs).arguments
    except TypeError as error:
        raise ValueError(f"qstats.qat.prepare: layer {key!r} ({type(layer).__name__}) is called with arguments its "
                         f"forward does not take: {error}") from error


def _call_argument(node, position: int, name: str):
    """Argument ``name`` of the call ``node``: positional at ``position`` or a keyword."""
    return node.args[position] if len(node.args) > position else node.kwargs[name]


def _set_call_argument(node, position: int, name: str, value) -> None:
    """Replaces argument ``name`` of the call ``node`` where it was given: at ``position`` or as a keyword."""
    if len(node.args) > position:
        node.update_arg(position, value)
    else:
        node.update_kwarg(name, value)


def _observer_of(entries: tuple, kind: type) -> Optional[Observer]:
    """The observer of the first entry whose type the layer type ``kind`` is (a subclass of); None (float) if
    none is."""
    return next((observer for key, observer in entries if issubclass(kind, key)), None)


class _Rewriter:
    """Rewrites a traced graph for `prepare`: quantized layers and batch norms become calls of
    pure points that take the QAT state, phase and ranges (new placeholders) and return the new
    state, which the graph's output carries beside the model's."""

    def __init__(self, gm, weight_entries, activation_entries, ste, grad_scale, dynamic_activations: bool,
                 fold_batchnorm: bool = False):
        self.gm, self.graph = gm, gm.graph
        self.fold_batchnorm = fold_batchnorm
        self.folded = {}  # layer -> the batch norm folded into its weight (`_fold_partner`)
        self.unfolded = []  # batch norms after a quantized layer that could not be folded into it
        self.float_calls = []  # (caller, description) of F.linear/F.convNd/... calls of a weight no quantized layer holds
        self.calls = collections.Counter(node.target for node in self.graph.nodes if node.op == "call_module")
        self.entries = {"weights": weight_entries, "activations": activation_entries}  # `_observer_entries`
        self.observers = {"weights": {}, "activations": {}}  # layer -> the observer of its point of that kind
        self.ste, self.grad_scale, self.dynamic_activations = ste, grad_scale, dynamic_activations
        placeholders = [node for node in self.graph.nodes if node.op == "placeholder"]
        if not placeholders:
            raise ValueError("qstats.qat.prepare: the model's forward takes no inputs")
        # keyword arguments with defaults, after the model's own (some of which may have defaults,
        # or be *args) and before a **kwargs
        varkw = placeholders[-1] if str(placeholders[-1].target).startswith("**") else None
        for name in _EXTRA_INPUTS:
            with self.graph.inserting_before(varkw) if varkw is not None else self.graph.inserting_after(placeholders[-1]):
                placeholders.append(self.graph.placeholder(name, default_value=None))
        self.state, self.phase, self.ranges = placeholders[-3:]
        self.new_states = {"weights": {}, "activations": {}, "batchnorm": {}}  # layer -> its latest state node
        self.quantized, self.batchnorms = [], []
        self.hooked = []  # replaced layers with forward hooks, which the rewritten model does not run (`_note_hooks`)
        self.traced_hooked = []  # traced-through layers with hooks: run once on proxies while tracing, then never
        self.weights = {}  # layer -> its fake-quantized weight (a module called twice reuses it)
        self.parameter_calls = {}  # parameter -> the layer type of the F.linear/conv calls reading it
        self.parameter_groups = {}  # parameter -> groups of the F.conv_transposeNd calls reading it
        self.computed = {}  # point of a call of a computed weight -> `_weight_graph` of that weight
        self.computed_callers = set()  # the modules whose forwards make them
        self.points = 0  # numbers the submodules of the points

    def rewrite(self, model: nn.Module, layers: Tuple[type, ...]) -> Dict[str, str]:
        """Rewrites every call of a layer of ``layers`` (and every F.linear/conv/... of such a layer's own weight in
        a traced-through forward) and of a batch norm; returns the layers inside modules that torch.fx keeps
        whole (torch.nn's Transformer layers): name -> that module's type name."""
        hidden, names = {}, _model_names(model)  # the names a computed weight's points must not take
        for node in list(self.graph.nodes):
            if node.op == "call_function" and node.target in _FUNCTIONAL_LAYERS:
                owner = _functional_owner(model, node, layers)
                parameter = _parameter_call(model, node, layers) if owner is None else None
                if owner is not None:  # a traced-through forward passing a layer's own weight to F.linear/conv
                    self.quantize_functional(node, owner, model.get_submodule(owner))
                elif parameter is not None:  # a parameter or buffer, one tied to a layer's weight
                    self.quantize_parameter_call(node, parameter, _PARAMETER_CALLS[node.target])
                elif _call_kind(node, layers) is not None:  # a computed weight
                    key = _computed_key(node, self.quantized, names)
                    self.computed[key] = _weight_graph(self.gm, _call_weight(node))
                    self.computed_callers.add(key.rpartition(".")[0])
                    self.quantize_parameter_call(node, key, _PARAMETER_CALLS[node.target])
                else:
                    self.float_calls.extend(filter(None, [_float_call(node, layers)]))
            if node.op != "call_module":
                continue
            layer = self.gm.get_submodule(node.target)
            if isinstance(layer, layers):
                self.quantize_layer(node, layer)
            elif isinstance(layer, nn.modules.batchnorm._BatchNorm):
                self.pure_batchnorm(node, layer)
            else:
                hidden.update((f"{node.target}.{name}", type(layer).__name__) for name, child in layer.named_modules()
                              if name and isinstance(child, layers))
        return hidden

    def _point(self, kind: str, key: str, module: nn.Module, args: tuple):
        """Adds ``module`` as a submodule, calls it with ``args`` and the state layer ``key``'s earlier
        call returned (None at first: a layer called again chains one state); returns the value node and
        records the new state's."""
        name = f"qat_{kind.rstrip('s')}_{self.points}"  # qat_weight_0, qat_activation_1, qat_batchnorm_2
        self.points += 1
        self.gm.add_submodule(name, module)
        result = self.graph.call_module(name, (*args, self.new_states[kind].get(key)))
        value = self.graph.call_function(operator.getitem, (result, 0))
        self.new_states[kind][key] = self.graph.call_function(operator.getitem, (result, 1))
        return value

    def _fake_quantized(self, kind: str, key: str, value):
        observer = self.observers[kind].get(key)
        if observer is None:
            return value
        dynamic = kind == "activations" and _dynamic(observer, self.dynamic_activations)
        point = _FakeQuantPoint(kind, key, observer, self.ste, self.grad_scale, dynamic)
        return self._point(kind, key, point, (value, self.state, self.phase, self.ranges))

    def _resolve(self, key: str, kind: type) -> None:
        """Records ``key`` as quantized, with the observers of layer type ``kind`` (`_observer_of`); an embedding
        has no activation point."""
        self.quantized.append(key)
        for point, entries in self.entries.items():
            observer = _observer_of(entries, kind)
            if observer is not None and not (point == "activations" and issubclass(kind, _EMBEDDINGS)):
                self.observers[point][key] = observer

    def _quantized_inputs(self, node, key: str, layer: nn.Module, x, weight):
        """Fake-quantized (input, weight) nodes of one call of layer ``key``, inserted before ``node``;
        ``weight()`` makes the weight's node the first time the layer is met. An embedding's input (ids)
        stays as it is."""
        if key not in self.quantized:
            self._resolve(key, type(layer))
        if key in self.observers["weights"] and not layer.weight.is_floating_point():
            raise TypeError(f"qstats.qat.prepare: layer {key!r} ({type(layer).__name__}) has a {layer.weight.dtype} "
                            "weight; only floating-point weights can be fake-quantized")
        if not isinstance(layer, _EMBEDDINGS):
            x = self._fake_quantized_input(node, key, layer, x)
        with self.graph.inserting_before(node):
            if key not in self.weights:  # the same weight: observed once per pass
                groups = layer.groups if isinstance(layer, _CONV_TRANSPOSE) else None
                self.weights[key] = self._fake_quantized_weight(key, weight(), groups)
        return x, self.weights[key]

    def _fake_quantized_input(self, node, key: str, layer: nn.Module, x):
        """The fake-quantized input node of one call. A convolution padded otherwise than with zeros whose own
        forward is traced through gives ``F.pad`` then ``F.convNd``: its input is observed and fake-quantized
        before the padding, as a stock one's (whose forward pads the fake-quantized input),
        as torch.ao observes the module's input (the padding copies values, so the codes are the same; an
        observer that counts values, a histogram, sees each once)."""
        padded = (isinstance(layer, nn.modules.conv._ConvNd) and getattr(layer, "padding_mode", "zeros") != "zeros"
                  and isinstance(x, torch.fx.Node) and x.op == "call_function" and x.target is F.pad
                  and len(x.users) == 1 and len(x.args) > 0)
        with self.graph.inserting_before(x if padded else node):
            quantized = self._fake_quantized("activations", key, x.args[0] if padded else x)
        if not padded:
            return quantized
        x.update_arg(0, quantized)
        return x

    def _fake_quantized_weight(self, key: str, weight, groups: Optional[int]):
        """The fake-quantized weight node of layer (or parameter) ``key``. A transposed convolution's weight
        (``groups``: its groups; None for other layers) is observed and fake-quantized in a convolution's layout
        (`_conv_layout`), so that its per-channel ranges are per output channel, and returned in its own."""
        if groups is None or key not in self.observers["weights"]:
            return self._fake_quantized("weights", key, weight)
        conv = self.graph.call_function(_conv_layout, (weight, groups))
        return self.graph.call_function(_conv_layout, (self._fake_quantized("weights", key, conv), groups))

    def _dense_gradient(self, key: str, layer: nn.Module, sparse) -> bool:
        """Whether an embedding built with ``sparse=True`` computes a dense weight gradient: its weight is
        fake-quantized, whose straight-through gradient is elementwise over the whole weight (torch.ao's
        is sparse, of the same values)."""
        dense = bool(sparse) and key in self.observers["weights"] and isinstance(layer, _EMBEDDINGS)
        if dense:
            warn(f"qstats.qat.prepare: embedding {key!r} has sparse=True; the gradient of its fake-quantized weight "
                 "is dense (the same values as torch.ao's sparse one)")
        return dense

    def quantize_layer(self, node, layer) -> None:
        key = str(node.target)
        if not isinstance(layer, tuple(_LAYER_FUNCTIONS)):
            raise TypeError(f"qstats.qat.prepare: cannot quantize a {type(layer).__name__}; supported: Linear, "
                            "Conv1d/2d/3d, ConvTranspose1d/2d/3d, Embedding, EmbeddingBag (layer "
                            f"{key!r} is a {type(layer).__name__})")
        given = _bound_inputs(layer, key, node)
        self._note_hooks(key, layer)
        batchnorm = self._fold_partner(node, key, layer)
        with self.graph.inserting_before(node):  # the layer itself (functional_call swaps its tensors)
            module = self.graph.get_attr(key)
            if batchnorm is not None:  # its weight scaled by the batch norm's factor, as torch.ao's QAT ConvBn
                factor = self.graph.call_function(_fold_factor, (self.graph.get_attr(batchnorm), self.state, batchnorm))

        def weight():
            parameter = self.graph.call_function(_layer_parameter, (module, "weight"))
            return parameter if batchnorm is None else self.graph.call_function(_folded_weight, (parameter, factor))

        x, weight = self._quantized_inputs(node, key, layer, given["input"], weight)
        sparse = getattr(layer, "sparse", False)
        sparse = sparse and not self._dense_gradient(key, layer, sparse)
        with self.graph.inserting_before(node):
            arguments = {**{name: value for name, value in given.items() if name != "self"}, "input": x}
            replacement = (self.graph.call_function(_stock_forward, (module, weight, sparse, arguments))
                           if batchnorm is None else self.graph.call_function(_folded_call, (module, x, weight, factor)))
        node.replace_all_uses_with(replacement)
        self.graph.erase_node(node)

    def _fold_partner(self, node, key: str, layer: nn.Module) -> Optional[str]:
        """The name of the batch norm to fold layer ``key`` into (``fold_batchnorm``), or None: a Conv1d/2d/3d or
        Linear with a weight observer whose output feeds only a batch norm of its dimension (`_FOLDS`) that tracks
        running statistics of its channels, both called once, as torch.ao's ``fuse_fx`` patterns; unless the batch
        norm's weight holds a 0 (``zero_init_residual``): the folded output is divided by it, NaN in torch.ao's
        QAT ConvBn."""
        folds = [norm for cls, norm in _FOLDS.items() if isinstance(layer, cls)]
        if not (self.fold_batchnorm and folds and _observer_of(self.entries["weights"], type(layer)) is not None
                and len(node.users) == 1 and self.calls[node.target] == 1):
            return None
        user = next(iter(node.users))
        norm = self.gm.get_submodule(user.target) if user.op == "call_module" else None
        if not (isinstance(norm, folds[0]) and type(norm).forward in _STOCK_FORWARDS and user.args[:1] == (node,)
                and norm.track_running_stats and norm.running_var is not None and self.calls[user.target] == 1
                and norm.num_features == layer.weight.shape[0]):
            return None
        if norm.weight is not None and bool((norm.weight == 0).any()):  # the output is divided by it: NaN
            return None
        self.folded[key] = str(user.target)
        return self.folded[key]

    def _note_hooks(self, key: str, layer: nn.Module, traced: bool = False) -> None:
        """Records a layer whose call the rewrite replaces (``traced``: whose forward torch.fx traced
        through) and that has hooks other than those `_layer_parameter` computes (pruning, weight norm): the
        rewritten model does not run them."""
        pre_hooks = [h for h in layer._forward_pre_hooks.values() if _computes(h) is None]
        hooks = pre_hooks or layer._forward_hooks or layer._backward_hooks or layer._backward_pre_hooks
        noted = self.traced_hooked if traced else self.hooked
        if hooks and key not in noted:
            noted.append(key)

    def quantize_functional(self, node, key: str, layer: nn.Module) -> None:
        """An ``F.linear``/``F.convNd``/``F.embedding``/... call reading layer ``key``'s weight (a
        traced-through forward) takes the fake-quantized input and weight; its other arguments stay."""
        given = _call_argument(node, 1, "weight")
        self._note_hooks(key, layer, traced=True)
        x, weight = self._quantized_inputs(node, key, layer, _call_argument(node, 0, "input"), lambda: given)
        _set_call_argument(node, 0, "input", x)
        _set_call_argument(node, 1, "weight", weight)
        if node.target in (F.embedding, F.embedding_bag):  # F.embedding's sparse is its 7th argument, embedding_bag's 8th
            i = 6 if node.target is F.embedding else 7
            if self._dense_gradient(key, layer, node.args[i] if len(node.args) > i else node.kwargs.get("sparse", False)):
                _set_call_argument(node, i, "sparse", False)

    def quantize_parameter_call(self, node, key: str, kind: type) -> None:
        """An ``F.linear``/``F.convNd``/``F.conv_transposeNd`` call of parameter or buffer ``key``
        (`_parameter_call`) takes its input and weight fake-quantized by the observers of layer type ``kind`` (the
        mapping's first entry that ``kind`` is a subclass of), in points of its own named ``key``; its other
        arguments stay. A transposed convolution's weight is observed in a convolution's layout (`_conv_layout`,
        with the first call's ``groups``), as a ConvTranspose layer's. Calls of one parameter share its points, as
        a layer called twice."""
        if key not in self.quantized:
            self._resolve(key, kind)
            self.parameter_calls[key] = kind
            if issubclass(kind, _CONV_TRANSPOSE):
                self.parameter_groups[key] = _call_groups(node)
        weight = _call_argument(node, 1, "weight")
        with self.graph.inserting_before(node):
            x = self._fake_quantized("activations", key, _call_argument(node, 0, "input"))
            if key not in self.weights:  # the same weight: observed once per pass
                self.weights[key] = self._fake_quantized_weight(key, weight, self.parameter_groups.get(key))
        _set_call_argument(node, 0, "input", x)
        _set_call_argument(node, 1, "weight", self.weights[key])

    def pure_batchnorm(self, node, layer) -> None:
        key = str(node.target)
        source = node.args[0] if node.args else None  # a quantized layer's output it was not folded into: named
        if (self.fold_batchnorm and key not in self.folded.values() and isinstance(source, torch.fx.Node)
                and source.op == "call_function" and (source.target is _stock_forward or source.target in _FUNCTIONAL_LAYERS)
                and key not in self.unfolded):
            self.unfolded.append(key)
        if not layer.track_running_stats:  # normalises with each batch's statistics and updates none: pure as it is
            return
        if layer.running_mean is None:
            raise ValueError(f"qstats.qat.prepare: batch norm {key!r} tracks running statistics but has none "
                             "(running_mean is None)")
        if key not in self.batchnorms:
            self.batchnorms.append(key)
        self._note_hooks(key, layer)
        with self.graph.inserting_before(node):
            args = [self.graph.get_attr(f"{key}.{name}") if getattr(layer, name) is not None else None
                    for name in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")]
            point = _BatchNormPoint(key, layer)
            y = self._point("batchnorm", key, point, (node.args[0], *args, self.state, self.phase))
        node.replace_all_uses_with(y)
        self.graph.erase_node(node)

    def finish(self) -> torch.fx.GraphModule:
        output = next(node for node in self.graph.nodes if node.op == "output")
        output.args = ((output.args[0], self.new_states),)
        self.graph.lint()
        self.gm.recompile()
        return self.gm
