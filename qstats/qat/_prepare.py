"""`prepare`: a model traced and rewritten for pure QAT, once its arguments are checked and the models it
cannot rewrite refused; the observers by layer type (`_observer_entries`), and the other names of a module
registered several times (`_aliases`)."""

from __future__ import annotations

from typing import Dict, Mapping, Optional, Tuple, Union

from torch import nn

from .._checks import check_flag
from ..experts import expert_count
from ..lsq import check_grad_scale
from ..observers import Observer
from ._layers import _DEFAULT_LAYERS, _EMBEDDINGS, _named_tensors
from ._model import QATModel
from ._points import _check_ste, _dynamic
from ._rewrite import _Rewriter
from ._trace import _FLOAT_CALLS, _float_calls, _trace, _warn_float_layers


def _layer_types(layers) -> Tuple[type, ...]:
    """`prepare`'s ``layers`` (one type, a list or a tuple of them) as a tuple of nn.Module subclasses."""
    if isinstance(layers, (type, list)):
        layers = (layers,) if isinstance(layers, type) else tuple(layers)
    if not (isinstance(layers, tuple) and layers and all(isinstance(t, type) and issubclass(t, nn.Module) for t in layers)):
        raise TypeError(f"qstats.qat.prepare: layers must be nn.Module subclasses (Linear, Conv1d/2d/3d, ConvTranspose1d/2d/3d, "
                        f"Embedding, EmbeddingBag), got {layers!r}")
    return layers


def prepare(
    model: nn.Module,
    weight_observer: Union[Observer, Mapping[type, Optional[Observer]], None] = None,
    activation_observer: Union[Observer, Mapping[type, Optional[Observer]], None] = None,
    *,
    layers: Tuple[type, ...] = _DEFAULT_LAYERS,
    ste: str = "clipped",
    grad_scale="torch_ao",
    dynamic_activations: bool = False,
    fold_batchnorm: bool = False,
) -> QATModel:
    """Rewrites ``model`` (with ``torch.fx.symbolic_trace``) for pure QAT; ``model`` is not modified.

    The weight of every layer of a type in ``layers`` (Linear, Conv1d/2d/3d by default; also Embedding,
    EmbeddingBag, ConvTranspose1d/2d/3d) goes through ``weight_observer`` and its input through
    ``activation_observer`` (None: leave that kind in float). So do those of an ``F.linear``/``F.conv1d/2d/3d``
    (``F.conv_transpose1d/2d/3d`` where ``layers`` has ConvTranspose) call given a parameter or buffer of the model
    as its weight outside that layer's own forward (a custom block's ``F.linear(x, self.proj)``, a head tied to an
    embedding), with the observers of the layer type computing that function, in points named after the parameter
    (``qat.parameter_layers``), as torch.ao's ``prepare_qat_fx``; and those of such a call given a weight computed
    in the forward (``F.linear(x, self.a @ self.b)``), in points named after the call's node under the module
    making it (``"block.linear_1"``). F.embedding calls stay in float, as in torch.ao. Each observer may also be a
    mapping ``{layer type: Observer or None}`` (torch.ao's ``QConfigMapping.set_object_type``): a layer takes the observer of the
    first type in the mapping's order that it is an instance of; a layer of no type in it stays in float
    for that kind, as torch.ao gives it the global qconfig, None unless set (a last ``nn.Module: observer``
    entry is ``set_global``). Embeddings are weight-only (their inputs are ids); a transposed convolution's weight is observed in a convolution's layout, ``[out, in/groups, *k]``.
    Batch-norm layers become pure functions of a `BatchNormState`. A layer called several times per
    forward keeps one state per kind (docs/qat.md). Activation ranges per row (per token, group, ...) are
    each batch's own, whatever the phase; ``dynamic_activations=True`` makes every activation range so
    (coreai_opt's "dynamic" calculators), per tensor and per channel too. ``fold_batchnorm=True`` fake-quantizes
    the weight of a Conv1d/2d/3d or Linear that feeds a batch norm scaled by the batch norm's running statistics,
    as torch.ao's QAT ConvBn/LinearBn1d modules (``prepare_qat_fx`` fuses them); the parameters stay separate.

    Raises:
      ValueError: a mapping names a type that matches no type of ``layers``, names a type after one of its
        base classes (that entry would never be used), or gives an embedding type an activation observer.

    >>> import torch, qstats
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    >>> qat = qstats.qat.prepare(
    ...     model,
    ...     weight_observer=qstats.memoryless_minmax(qstats.QuantSpec("int8", granularity=qstats.PerAxis(0))),
    ...     activation_observer=qstats.moving_average_minmax(qstats.QuantSpec("uint8", "asymmetric"), 0.01))
    >>> x = torch.randn(5, 4)
    >>> state = qat.init(x)
    >>> out, state = qat.apply(qat.params(), state, x, phase=qstats.QATPhase())
    >>> sorted(state.activations)
    ['0', '2']
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"qstats.qat.prepare: model must be an nn.Module, got {type(model).__name__}")
    _check_ste(ste)
    check_grad_scale(grad_scale)
    for name, flag in (("dynamic_activations", dynamic_activations), ("fold_batchnorm", fold_batchnorm)):
        check_flag(flag, name, "qstats.qat.prepare")
    layers = _layer_types(layers)
    weight_entries = _observer_entries(weight_observer, layers, "weight_observer")
    activation_entries = _observer_entries(activation_observer, layers, "activation_observer")
    _refuse_embedding_activations(activation_entries)  # a single observer or None names no embedding type
    _refuse_stacked_experts(model)
    _refuse_lazy(model)
    rewriter = _Rewriter(_trace(model, layers), weight_entries, activation_entries, ste, grad_scale, dynamic_activations,
                         fold_batchnorm)
    _warn_float_layers(model, layers, rewriter, rewriter.rewrite(model, layers))
    if not rewriter.quantized:
        named = _float_calls(model, layers, rewriter)
        calls = (f"; its calls {', '.join(named)} read weights held outside such layers that it does not "
                 f"fake-quantize ({_FLOAT_CALLS}): hold each weight in such a layer or as a parameter given as it is to "
                 "F.linear/F.conv1d/2d/3d, or quantize it with qstats.observe_fake_quantize") if named else ""
        raise ValueError(f"qstats.qat.prepare: the model has no layer of the types {[t.__name__ for t in layers]}{calls}")
    activation_observers = rewriter.observers["activations"]  # every quantized layer but embeddings, given one
    if isinstance(activation_observer, Observer) and not activation_observers:
        raise ValueError(
            f"qstats.qat.prepare: an activation_observer is given, but the quantized layers {rewriter.quantized} are "
            "embeddings, whose inputs are integer ids: they are quantized weight-only (as torch.ao's QAT Embedding); "
            "pass activation_observer=None")
    module = rewriter.finish()
    dynamic = [key for key, observer in activation_observers.items() if _dynamic(observer, dynamic_activations)]
    return QATModel(module, weight_observer, activation_observer, rewriter.quantized, rewriter.batchnorms,
                    _aliases(model, module), rewriter.observers["weights"], activation_observers, dynamic,
                    rewriter.folded, rewriter.parameter_calls, rewriter.parameter_groups, rewriter.computed)


def _aliases(model: nn.Module, module: nn.Module) -> Dict[str, str]:
    """The names of ``model``'s parameters and buffers that ``module`` lacks, each mapped to the name its
    tensor has in ``module``: a module registered several times (``nn.ModuleList([block] * n)``) is kept by
    torch.fx under its first name only."""
    first = {id(tensor): name for name, tensor in reversed(_named_tensors(module))}  # reversed: the first name wins
    kept = {name for name, _ in _named_tensors(module)}
    return {name: first[id(tensor)] for name, tensor in _named_tensors(model) if name not in kept and id(tensor) in first}


def _refuse_stacked_experts(model: nn.Module) -> None:
    """Stacked experts (``[E, out, in]`` parameters, transformers' fused experts) are no Linear: the
    rewrite would leave them in float, training unquantized. They raise, naming the modules."""
    stacked = [f"{repr(name) if name else 'the model'} ({type(module).__name__}, {count} experts)"
               for name, module in model.named_modules() for count in (expert_count(module),) if count]
    if stacked:
        more = f" and {len(stacked) - 3} more" if len(stacked) > 3 else ""
        raise ValueError(
            f"qstats.qat.prepare: {', '.join(stacked[:3])}{more} hold stacked experts, which prepare does not fake-quantize "
            "(they would train in float); train such a model with qstats.fake_quantized (per-expert qparams, "
            "straight-through gradients; docs/qat.md)")


def _refuse_lazy(model: nn.Module) -> None:
    """Lazy modules (``nn.LazyLinear``, ``nn.LazyConv2d``, ...) whose parameters are not yet materialized have no
    shape to size states on: ValueError naming them (``QATModel.init`` failed later, naming none)."""
    lazy = [f"{repr(name) if name else 'the model'} ({type(module).__name__})" for name, module in model.named_modules()
            if any(nn.parameter.is_lazy(t) for t in (*module.parameters(recurse=False), *module.buffers(recurse=False)))]
    if lazy:
        raise ValueError(f"qstats.qat.prepare: {', '.join(lazy)} have uninitialized (lazy) parameters; run the model "
                         "once on an example input first, which gives them their shapes")


def _observer_entries(given, layers: Tuple[type, ...], name: str) -> tuple:
    """``given`` (one Observer, None, or a mapping ``{layer type: Observer or None}``) as
    ``((layer type, observer), ...)`` in matching order; one Observer or None serves every layer.

    Raises:
      TypeError: a key that is no ``nn.Module`` subclass, a value that is no Observer or None.
      ValueError: a key that is neither a type of ``layers`` (or a subclass of one) nor a base class of
        one (it would match no layer it quantizes); a key after one of its base classes (the earlier key
        matches every such layer first, so the entry would never be used).
    """
    if given is None or isinstance(given, Observer):
        return ((nn.Module, given),)
    if not isinstance(given, Mapping):
        raise TypeError(f"qstats.qat.prepare: {name} must be a qstats Observer, None, or a mapping "
                        f"{{layer type: Observer or None}}, got {type(given).__name__}")
    entries = tuple(given.items())
    for i, (key, observer) in enumerate(entries):
        if not (isinstance(key, type) and issubclass(key, nn.Module)):
            raise TypeError(f"qstats.qat.prepare: {name} has the key {key!r}; its keys must be layer types "
                            "(nn.Linear, nn.Embedding, ...)")
        if observer is not None and not isinstance(observer, Observer):
            raise TypeError(f"qstats.qat.prepare: {name}[{key.__name__}] must be a qstats Observer or None, "
                            f"got {type(observer).__name__}")
        if not any(issubclass(key, t) or issubclass(t, key) for t in layers):
            raise ValueError(f"qstats.qat.prepare: {name} names {key.__name__}, which is no type of layers="
                             f"{[t.__name__ for t in layers]} nor a base class of one, so it would match no layer; "
                             f"add {key.__name__} to layers= or remove it from {name}")
        earlier = next((k for k, _ in entries[:i] if issubclass(key, k)), None)
        if earlier is not None:
            raise ValueError(f"qstats.qat.prepare: {name} names {key.__name__} after {earlier.__name__}: layers match "
                             f"the first type they are an instance of, so every {key.__name__} would take "
                             f"{earlier.__name__}'s observer; put {key.__name__} first")
    return entries


def _refuse_embedding_activations(entries: tuple) -> None:
    """A mapping key that names an embedding type with an activation observer: its input is ids."""
    named = [key.__name__ for key, observer in entries if observer is not None and issubclass(key, _EMBEDDINGS)]
    if named:
        raise ValueError(f"qstats.qat.prepare: activation_observer maps {named} to an observer, but embeddings are "
                         "quantized weight-only (their inputs are integer ids, as torch.ao's QAT Embedding); map them "
                         "to None or leave them out")
