"""The ``q``/``k``/``v`` sites of transformers attention modules: the query, key and value their
forward hands to its attention function (``AttentionInterface``), after the rotary embedding and
q/k norms, as compressed-tensors' hooked attention and kv cache quantize them (llm-compressor
observes them there). They come as ``[batch, heads, tokens, head_dim]``; a site sees them in the
layout its spec reads (`per_head`): as ``[batch, tokens, heads * head_dim]`` (`heads_last`), the
projections' output shape, or, for one scale per head (`PerHead`, compressed-tensors' ``attn_head``),
as they come.

`intercepted(module)` says whether a module's sites are those (`attention_module`: whether it has
them without ``q_proj``/``k_proj``/``v_proj`` children, as Phi-3's fused ``qkv_proj`` or MLA's
``kv_b_proj``); `attention_sites(hooks, caller)`
runs such modules, for the duration, under qstats' counterpart of their attention implementation
(`qstats._attention_functions`), which hands each call's query, key and value to its module's hook.
Other attention modules (no transformers config) keep their projections' outputs as sites.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
from typing import Callable, Iterator, Mapping, Optional

import torch

from ._granularity import PerHead

__all__ = ["intercepted", "attention_module", "latent_attention", "LATENT_CACHE", "CROSS_STATES", "cross_attention",
           "attention_sites", "heads_last", "heads_first", "per_head", "site_weight", "SiteHooks"]


def intercepted(module: torch.nn.Module) -> bool:
    """Whether ``module``'s q/k/v sites are its attention function's arguments: a transformers
    attention module, which holds the config naming the implementation it calls."""
    return hasattr(getattr(module, "config", None), "_attn_implementation")


def attention_module(module: torch.nn.Module) -> bool:
    """Whether ``module`` has q/k/v sites whatever its children: an `intercepted` module whose class
    name says attention, as compressed-tensors names attention modules (a model, decoder layer or
    MLP holding the config is none). A forward that does not call its attention function through
    transformers' ``AttentionInterface`` is refused at calibration, naming it."""
    return intercepted(module) and "attention" in type(module).__name__.lower()


# why k/v of multi-head latent attention are refused where compressed-tensors' kv cache quantizes them
LATENT_CACHE = (
    "it is multi-head latent attention (a kv_b_proj child, no k_proj/v_proj): compressed-tensors' kv cache "
    "quantizes the tensors the module hands its cache, which in transformers 5 are the compressed latent and the "
    "rotary key for DeepSeek-V3 (k_scale/v_scale of those), where qstats' k/v sites are the key and value its "
    "attention function receives; not supported: drop the kv-cache scheme or ignore these modules"
)


def latent_attention(module: torch.nn.Module) -> bool:
    """Whether ``module`` is multi-head latent attention (MLA) as compressed-tensors names it: a
    ``kv_b_proj`` child and no ``k_proj``/``v_proj`` (`LATENT_CACHE`)."""
    children = dict(module.named_children())
    return "kv_b_proj" in children and not ({"k_proj", "v_proj"} & set(children))


# the arguments by which transformers hands an attention module the states its key and value come from in a
# cross-attention call: T5's, BART's and Whisper's key_value_states, Mllama's cross_attention_states,
# BERT's, GPT-2's and T5Gemma's encoder_hidden_states
CROSS_STATES = ("key_value_states", "cross_attention_states", "encoder_hidden_states")


def _forward_parameters(module: torch.nn.Module) -> list:
    """The names of ``module.forward``'s parameters, in order (none where its signature cannot be read)."""
    try:
        return list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return []


def cross_attention(module: torch.nn.Module) -> Callable[[tuple, dict], bool]:
    """``crosses(args, kwargs)``: whether a call of the attention ``module`` is cross-attention, its
    key and value those of other tokens than its query's (the image's, the encoder's), which the
    batch's observation weight does not describe: every call of a module whose class name says so
    (Mllama's ``MllamaTextCrossAttention``, also in a decode step reading its key and value from the
    cache) or that sets ``is_cross_attention`` (GPT-2's), else a call handing it a tensor as one of
    `CROSS_STATES` its forward declares."""
    if "crossattention" in type(module).__name__.lower() or getattr(module, "is_cross_attention", False) is True:
        return lambda args, kwargs: True
    parameters = _forward_parameters(module)
    declared = {name: parameters.index(name) for name in CROSS_STATES if name in parameters}

    def crosses(args: tuple, kwargs: dict) -> bool:
        return any(torch.is_tensor(args[at] if at < len(args) else kwargs.get(name)) for name, at in declared.items())

    return crosses


def heads_last(x: torch.Tensor) -> torch.Tensor:
    """An attention function's ``[batch, heads, tokens, head_dim]`` as ``[batch, tokens, heads *
    head_dim]``: the layout of the projections' outputs (a state's shape does not change), whose
    prefix is an observation weight ``[batch, tokens]`` (padding), as llm-compressor flattens it."""
    return x.transpose(1, 2).flatten(2) if x.ndim == 4 else x


def heads_first(y: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`heads_last` undone: ``y`` back in the layout of ``like``."""
    return y.unflatten(-1, (like.shape[1], like.shape[3])).transpose(1, 2) if like.ndim == 4 else y


def per_head(spec) -> bool:
    """Whether a q/k/v site of ``spec`` sees its tensor as the attention function takes it, ``[batch,
    heads, tokens, head_dim]``, for one scale per head (`PerHead`, whose axis 1 is then the heads,
    compressed-tensors' ``attn_head``); other sites see it as one tensor of the projections' output
    shape (`heads_last`)."""
    return isinstance(spec.granularity, PerHead)


def site_weight(x: torch.Tensor, spec, fit: Callable) -> Optional[torch.Tensor]:
    """The batch's observation weight (``[batch, tokens]``, padding 0) as the weight of ``x``, the
    tensor a site of ``spec`` sees: ``fit(view)`` fits it to ``x`` viewed as starting ``[batch,
    tokens]`` (`qstats.observation.weight_of`: None where it does not), then it is put in ``x``'s
    layout, repeated over the heads, so padding is left out of every head as out of a per-tensor site."""
    view = x.transpose(1, 2) if per_head(spec) and x.ndim == 4 else x
    weight = fit(view)
    if weight is None or view is x or weight.ndim < 2:
        return weight
    padded = weight.reshape(weight.shape + (1,) * (3 - weight.ndim))  # [batch, tokens, heads or 1, ...]
    return padded.expand(view.shape[: padded.ndim]).transpose(1, 2)


class SiteHooks:
    """``hook(query, key, value, cross) -> (query, key, value)`` of one attention module's sites: each
    ``sites[site]`` (``"q"``, ``"k"``, ``"v"``) gets its floating-point tensor in the layout of its
    spec ``specs[site]`` (`per_head`, decided here once) and returns its replacement in that
    layout, or None to keep it (observing and measuring keep it; `fake_quantized` replaces it).
    In a ``cross`` call (`cross_attention`), whose key and value are other tokens than the batch's,
    ``"k"`` and ``"v"`` go to ``other_tokens[site]`` where given (an observer leaving the batch's
    observation weight out), else to ``sites[site]``."""

    def __init__(self, sites: Mapping, specs: Mapping, other_tokens: Optional[Mapping] = None):
        self.sites = sites  # site -> fn(x) -> Optional[tensor]
        self.other_tokens = other_tokens or {}
        self.flattened = {site: not per_head(specs[site]) for site in sites}  # seen as `heads_last`

    def __call__(self, query, key, value, cross: bool = False):
        out = []
        for site, x in zip(("q", "k", "v"), (query, key, value)):
            fn, flattened = self.sites.get(site), self.flattened.get(site)
            if cross and site != "q":
                fn = self.other_tokens.get(site, fn)
            y = None
            if fn is not None and torch.is_tensor(x) and x.is_floating_point():
                y = fn(heads_last(x) if flattened else x)
            out.append(x if y is None else heads_first(y, x) if flattened else y)
        return tuple(out)


class _Call:
    """One call of an attention module: its hook, and whether its attention function ran it; a
    second run is a ValueError saying ``again``, before the hook sees anything twice. Where the call
    handed its cache a key and value first (`at_update`), the hook had them there, and the attention
    function's run hands it the query only. ``cross``: whether it is cross-attention (`cross_attention`),
    which the hook is told; such a call given a cache (``cached``) that it hands nothing reads its key
    and value back from it (BART's, Mllama's decode steps), read at the update that stored them."""

    def __init__(self, hook: Callable, again: str, cross: bool, cached: bool = False):
        self.hook, self.reached, self.again, self.updated, self.cross = hook, False, again, False, cross
        self.cached = cached

    def __call__(self, query, key, value):
        if self.reached:
            raise ValueError(self.again)
        self.reached = True
        if self.updated or (self.cross and self.cached):
            return self.hook(query, None, None, self.cross)[0], key, value
        return self.hook(query, key, value, self.cross)

    def at_update(self, query, key, value):
        """The hook on the key and value the call hands its cache (`_CacheUpdate`), at each update as
        compressed-tensors' kv cache reads them, where the attention function receives the whole cache."""
        self.updated = True
        return self.hook(query, key, value, self.cross)


# the arguments by which transformers hands an attention module its cache: ``past_key_values`` (most),
# ``past_key_value`` (before transformers#39956), ``layer_past`` (GPT-NeoX's, GPTBigCode's, CTRL's)
_CACHE_ARGUMENTS = ("past_key_values", "past_key_value", "layer_past")


def _cache_argument(module: torch.nn.Module) -> Callable[[tuple, dict], object]:
    """``cache(args, kwargs)``: the cache a call of the attention ``module`` is handed, by keyword or
    position, under one of `_CACHE_ARGUMENTS` its forward declares (the first it is given); None
    where it is given none."""
    parameters = _forward_parameters(module)
    declared = [(name, parameters.index(name) if name in parameters else None) for name in _CACHE_ARGUMENTS]

    def cache(args: tuple, kwargs: dict):
        for name, at in declared:
            found = kwargs.get(name, args[at] if at is not None and at < len(args) else None)
            if found is not None:
                return found
        return None

    return cache


def _handed_caches(cache) -> tuple:
    """The caches whose ``update`` an attention module given ``cache`` (`_cache_argument`) hands
    its key and value: an ``EncoderDecoderCache``'s self- and cross-attention caches, which BART's,
    Whisper's and T5's modules update (itself too), else ``cache``; none that cannot be given an
    ``update`` attribute (no ``__dict__``) or has none."""
    inner = (getattr(cache, name, None) for name in ("self_attention_cache", "cross_attention_cache"))
    return tuple(each for each in (cache, *inner)
                 if hasattr(each, "__dict__") and callable(getattr(each, "update", None)))


def _functions():
    """`qstats._attention_functions`, imported on first use (it imports transformers, and registers
    qstats' attention functions with it when imported)."""
    return importlib.import_module("qstats._attention_functions")


def _switched(module, path: str, caller: str) -> tuple:
    """``(config, implementation before, implementation inside)`` of the attention ``module``: qstats'
    counterpart of its implementation (None, as transformers reads it: eager), or an enclosing
    context's as it is; ValueError naming the module where there is none, or where its forward
    cannot pass the hooks on (no ``**kwargs``). Modules whose config `_compared_configs` holds keep
    their implementation (`_cache_hooks`)."""
    functions = _functions()
    name = module.config._attn_implementation
    if isinstance(name, str) and name.startswith(functions.PREFIX):  # an enclosing context's
        if _compares_implementation(module, name[len(functions.PREFIX):]):
            raise ValueError(f"{caller}: the attention module {path!r} ({type(module).__name__}) compares its "
                             f"attention implementation's name, which an enclosing qstats context renamed {name!r}: "
                             "it computes something else there; not supported")
        return module.config, name, name
    if (name or "eager") not in functions.WRAPPED:
        raise ValueError(f"{caller}: the attention module {path!r} ({type(module).__name__}) runs attention "
                         f"implementation {name!r}; qstats observes and quantizes q/k/v behind "
                         f"{list(functions.WRAPPED)} only (model.set_attn_implementation('sdpa'))")
    parameters = inspect.signature(module.forward).parameters.values()
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        raise ValueError(f"{caller}: the attention module {path!r} ({type(module).__name__}) takes no **kwargs "
                         "to pass on to its attention function, where qstats reads its q/k/v")
    return module.config, name, functions.PREFIX + (name or "eager")


def _compares_implementation(module, name: str) -> bool:
    """Whether ``module``'s forward, or a method of its class the forward calls (transitively), reads
    ``config._attn_implementation`` and holds ``name`` as a constant: it branches on the
    implementation's name (DeepSeek-V3.2's and MiniMax-M3's sparse indexer masks ``if ... in
    ("eager", "sdpa")``, GPT-2's upcast path ``== "eager"``, GLM-5-Next's top-k mask built by its
    ``build_attention_mask_from_topk``: boolean for ``"sdpa"``, additive otherwise), which names
    qstats' counterpart inside `attention_sites`. Read under any decorator."""
    pending, seen = [inspect.unwrap(type(module).forward)], set()
    while pending:
        code = getattr(pending.pop(), "__code__", None)
        if code is None or code in seen:
            continue
        seen.add(code)
        names, constants = _names_and_constants(code)
        if "_attn_implementation" in names and name in constants:
            return True
        pending += [method for method in map(functools.partial(_own_method, type(module)), names) if method]
    return False


def _names_and_constants(code) -> tuple:
    """``(names, constants)`` that ``code`` and the code nested in it (comprehensions, inner
    functions) read."""
    names, constants, pending = set(), set(), [code]
    while pending:
        code = pending.pop()
        names.update(code.co_names)
        for constant in code.co_consts:
            if isinstance(constant, type(code)):
                pending.append(constant)
            else:
                constants.update(constant if isinstance(constant, (tuple, frozenset)) else (constant,))
    return names, constants


def _own_method(cls: type, name: str):
    """The function of the method ``name`` of ``cls`` (a plain, static or class method, unwrapped),
    None where it is none or one ``torch.nn.Module`` defines."""
    if hasattr(torch.nn.Module, name):
        return None
    method = inspect.getattr_static(cls, name, None)
    method = getattr(method, "__func__", method)  # staticmethod, classmethod
    return inspect.unwrap(method) if inspect.isfunction(method) else None


def _compared_configs(hooks: Mapping) -> dict:
    """``{id(config): path}`` of the configs of ``hooks``' modules of which one (at ``path``) compares
    the name of the implementation it runs (`_compares_implementation`): renamed, they would compute
    something else, so every module of such a config keeps its implementation (`_cache_hooks`)."""
    compared: dict = {}
    for path, (module, _) in hooks.items():
        name = module.config._attn_implementation
        counterpart = isinstance(name, str) and name.startswith(_functions().PREFIX)
        if not counterpart and _compares_implementation(module, name or "eager"):
            compared.setdefault(id(module.config), path)
    return compared


def _cache_hooks(module, path: str, hook: Callable, caller: str, compared: str) -> list:
    """Hooks of an attention module that keeps its implementation (its config's is compared by name,
    by the module at ``compared``): its key and value are read where compressed-tensors' kv cache
    reads them, as the forward hands them to the cache it is called with (``past_key_values``), by
    that cache's ``update`` for the call (`_CacheUpdate`); its query, which reaches no cache, is
    refused. ValueError naming the module where a call hands none to a cache."""
    sites = getattr(inspect.unwrap(hook), "sites", ("q",))  # a `SiteHooks`' (under `eager`), else any
    who = "it" if compared == path else f"{compared!r}, which shares its config,"
    why = (f"{who} compares the name of the attention implementation it runs (a sparse-attention mask, an upcast "
           "path taken only then): under qstats' counterpart, which hands the query over, it would compute "
           "something else, so qstats reads its key and value where compressed-tensors' kv cache does, at the "
           "cache update")
    if "q" in sites:
        raise ValueError(f"{caller}: the attention module {path!r} ({type(module).__name__}) has a q site, but {why}, "
                         "and its query reaches no cache: not supported; ignore its q, or run an implementation "
                         "it does not compare with")
    calls: list = []
    crosses, cache_of = cross_attention(module), _cache_argument(module)

    def pre_hook(module, args, kwargs):
        caches = _handed_caches(cache_of(args, kwargs))
        calls.append((_Call(hook, f"{caller}: the attention module {path!r} ({type(module).__name__}) handed its "
                                  f"cache a key and value twice in one call, where qstats reads them once: not "
                                  "supported", crosses(args, kwargs)), caches))  # called by the updates only
        for cache in caches:
            _CacheUpdate.attach(cache, calls[-1][0])

    def check(module, args, kwargs, output):
        if not calls:
            return
        call, caches = calls.pop()
        for cache in caches:
            _CacheUpdate.detach(cache, call)
        # a cross-attention call reading its key and value back from the cache: read at the earlier update
        if not call.reached and not (call.cross and caches) and output is not None:
            raise ValueError(f"{caller}: the attention module {path!r} ({type(module).__name__}) handed no key and "
                             f"value to a cache passed as past_key_values (use_cache=True), where qstats reads them: "
                             f"{why}")

    return [module.register_forward_pre_hook(pre_hook, with_kwargs=True),
            module.register_forward_hook(check, with_kwargs=True, always_call=True)]


class _CacheUpdate:
    """A transformers cache's ``update`` for one attention module's call: its calls' hooks (of enclosing
    contexts first) get ``(None, key, value)`` and return the key and value it then stores, as
    compressed-tensors' ``QuantizedKVCache`` quantizes them. Set on the cache object while the call
    runs; the cache is otherwise unchanged (its class, its other attributes)."""

    def __init__(self, cache):
        self.before = vars(cache).get("update")  # the cache's own attribute, put back after the call
        self.update = cache.update
        self.calls: list = []

    def __call__(self, key, value, *args, **kwargs):
        for call in self.calls:
            _, key, value = call(None, key, value)
        return self.update(key, value, *args, **kwargs)

    @staticmethod
    def attach(cache, call) -> None:
        update = vars(cache).get("update")
        if not isinstance(update, _CacheUpdate):
            update = _CacheUpdate(cache)
            cache.update = update
        update.calls.append(call)

    @staticmethod
    def detach(cache, call) -> None:
        update = vars(cache)["update"]
        update.calls.remove(call)
        if update.calls:
            return
        if update.before is None:
            del cache.update
        else:
            cache.update = update.before


def _hooks(module, path: str, hook: Callable, caller: str) -> list:
    """A pre-hook handing each call's `_Call` to the attention function by keyword (after those of
    enclosing contexts: applied in that order), and to the caches the call hands its key and value
    (`_handed_caches` of `_cache_argument`, `_CacheUpdate`): a decode step's attention function
    receives every cached key and value, where
    compressed-tensors' kv cache reads the new ones at the update (but multi-head latent attention,
    which caches its latent); and a hook refusing a call that did not reach its attention function."""
    keyword = _functions().SITES_KEYWORD
    calls: list = []
    latent, crosses, cache_of = latent_attention(module), cross_attention(module), _cache_argument(module)

    again = (f"{caller}: the attention module {path!r} ({type(module).__name__}) called its attention function "
             "twice in one call (DiffLlama's differential attention hands it each half of the value): qstats reads "
             "q/k/v once a call, where compressed-tensors' kv cache reads the whole key and value at the cache "
             "update; not supported: ignore the module's q/k/v")

    def pre_hook(module, args, kwargs):
        # multi-head latent attention caches its latent (`LATENT_CACHE`): its k/v stay the attention function's
        caches = () if latent else _handed_caches(cache_of(args, kwargs))
        call = _Call(hook, again, crosses(args, kwargs), bool(caches))
        calls.append((call, caches))
        for cache in caches:
            _CacheUpdate.attach(cache, call.at_update)
        return args, {**kwargs, keyword: tuple(kwargs.get(keyword, ())) + (call,)}

    def check(module, args, kwargs, output):
        if not calls:
            return
        call, caches = calls.pop()
        for cache in caches:
            _CacheUpdate.detach(cache, call.at_update)
        if not call.reached and output is not None:
            raise ValueError(f"{caller}: the attention module {path!r} ({type(module).__name__}) did not call its "
                             "attention function through transformers' AttentionInterface, where qstats reads "
                             "its q/k/v: not supported")

    # traceable (a list and a keyword): a compiled model keeps one graph where ``hook`` does
    return [module.register_forward_pre_hook(pre_hook, with_kwargs=True),
            module.register_forward_hook(check, with_kwargs=True, always_call=True)]


@contextlib.contextmanager
def attention_sites(hooks: Mapping, caller: str) -> Iterator[None]:
    """Context: each attention module of ``hooks`` (``{path: (module, hook)}``, ``hook(query, key,
    value, cross) -> (query, key, value)``, ``cross`` whether the call is cross-attention:
    `cross_attention`) runs its attention function behind ``hook``. Their configs
    name qstats' counterpart of their implementation inside, and the user's implementation again
    on exit, also on error; those `_compared_configs` holds keep theirs, and their modules hand
    ``hook`` their key and value at the cache update (`_cache_hooks`)."""
    switched: dict = {}  # id(config) -> (config, implementation before, implementation inside)
    handles: list = []
    try:
        compared = _compared_configs(hooks)
        for path, (module, hook) in hooks.items():
            if id(module.config) in compared:
                handles += _cache_hooks(module, path, hook, caller, compared[id(module.config)])
                continue
            found = _switched(module, path, caller)
            switched.setdefault(id(found[0]), found)
            handles += _hooks(module, path, hook, caller)
        for config, _, inside in switched.values():
            config._attn_implementation_internal = inside
        yield
    finally:
        for handle in handles:
            handle.remove()
        for config, before, _ in switched.values():
            config._attn_implementation_internal = before
