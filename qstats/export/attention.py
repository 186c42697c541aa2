"""Attention quantization: ``q``/``k``/``v`` sites become ``q_scale``/``k_scale``/``v_scale``, the
config's ``kv_cache_scheme`` and a ``q`` config group, as compressed-tensors' ``initialize_attn_qparams``.
"""

from __future__ import annotations

import inspect
import json
from typing import Mapping, Optional

import torch

from .._attention import LATENT_CACHE, intercepted, latent_attention
from .._schemes import head_count_problem
from .config import agreed_observer, fail, listed, module_targets, quantization_args
from .linear import static_site, write_qparams
from .scales import module_dtype

__all__ = ["attention_config", "write_attention"]


def write_attention(path: str, module, sites: Mapping, specs: Mapping, tensors: dict, log: dict,
                    dynamic=frozenset()) -> dict:
    """``q_scale``/``k_scale``/``v_scale`` of an attention module into ``tensors`` (shape ``(1,)``
    for the tensor strategy, ``(heads, 1, 1)`` for attn_head, in the attention module's parameter
    dtype; zero points ``q_zero_point``... for asymmetric args); returns ``{site: QuantizationArgs fields}``."""
    _check_cached_attention(path, module, sites)
    dtype = module_dtype(module)
    prefix = path + "." if path else ""
    written = {}
    for site, qp in sites.items():
        where = f"{path}/{site}"
        spec = specs.get(site)
        if spec is None:
            raise ValueError(f"export.compressed_tensors: no spec for {where}")
        # per tensor and static: quantization_args refuses other q/k/v specs
        args = quantization_args(spec, site, where, site in dynamic)
        stored = static_site(qp, spec, args, site, where, dtype, prefix, log)
        if args["strategy"] == "attn_head":  # its head counts read from the config before compressed-tensors is asked
            _check_head_counts(module, "attn_head", where)
            stored = stored._replace(qp=_per_head(stored.qp, module, site, where))
        write_qparams(stored, site, dtype, None, tensors, log)
        written[site] = args
    _check_attention_sites(path, written)
    # transformers' position_embeddings: rotary cos/sin applied to q and k after their projections,
    # whose outputs are the q/k sites of an attention module qstats does not intercept
    if ("q" in written or "k" in written) and _forward_takes(module, "position_embeddings") and not intercepted(module):
        log["rotary"].append(path)
    return written


def _per_head(qp, module: torch.nn.Module, site: str, where: str):
    """``qp`` of a per-head site with compressed-tensors' ``(heads, 1, 1)`` scales and zero points
    (``initialize_qparams`` of ``attn_head``); ValueError where it holds another number of heads than
    the module's config gives the site (``num_attention_heads`` for q, ``num_key_value_heads`` for k/v)."""
    from compressed_tensors.utils import get_num_attn_heads, get_num_kv_heads

    config = getattr(module, "config", None)
    heads = None if config is None else (get_num_attn_heads if site == "q" else get_num_kv_heads)(config)
    if qp.scale.ndim != 1 or (heads is not None and qp.scale.shape[0] != heads):
        fail(where, f"per-head qparams of shape {tuple(qp.scale.shape)}; the module's config gives {site!r} "
             f"{heads} heads, compressed-tensors' attn_head scales ({heads}, 1, 1)")
    zero_point = None if qp.zero_point is None else qp.zero_point.reshape(-1, 1, 1)
    return qp._replace(scale=qp.scale.reshape(-1, 1, 1), zero_point=zero_point)


def _check_cached_attention(path: str, module: torch.nn.Module, sites: Mapping) -> None:
    """Refuses q/k/v sites of a module that compressed-tensors does not quantize as attention (its
    ``is_cached_attention_module``): it registers no ``q_scale``/``k_scale``/``v_scale`` there, so a
    loader drops them (transformers: UNEXPECTED keys) and the model runs unquantized; k/v sites
    of multi-head latent attention, whose cache holds other tensors (`LATENT_CACHE`), and of
    cross-attention whose cache compressed-tensors does not quantize (`_reads_cross_attention_cache`)."""
    if not _is_kv_cache_module(module):
        fail(path, f"q/k/v sites of a {type(module).__name__}, which compressed-tensors does not quantize as "
             "attention (it takes modules whose class name contains 'attention', with a k_proj, v_proj, qkv_proj "
             "or kv_b_proj child and a forward taking past_key_values): its q_scale/k_scale/v_scale would not "
             "load; drop these sites or ignore the module")
    if latent_attention(module) and ("k" in sites or "v" in sites):
        fail(path, f"k/v sites of a {type(module).__name__}: {LATENT_CACHE}")
    if _reads_cross_attention_cache(module) and ("k" in sites or "v" in sites):
        fail(path, f"k/v sites of a {type(module).__name__}, a cross-attention that hands its key and value to an "
             "EncoderDecoderCache's cross_attention_cache: compressed-tensors' kv cache passes that through to the "
             "real cache unquantized (and fails without a cache), so its k_scale/v_scale would load unused and the "
             "loaded model compute other logits than qstats.fake_quantized; not supported: drop the kv-cache scheme")


def _check_attention_sites(path: str, written: dict) -> None:
    """compressed-tensors quantizes keys and values together, queries only with them, and q, k and
    v with one set of args."""
    if ("k" in written) != ("v" in written):
        fail(path, "the kv cache quantizes keys and values together: export both 'k' and 'v' sites")
    if "q" in written and "k" not in written:
        fail(path, "attention (query) quantization needs the 'k' and 'v' sites too (compressed-tensors' "
             "attention scheme quantizes q, k and v alike)")
    distinct = {json.dumps(args, sort_keys=True) for args in written.values()}
    if len(distinct) > 1:
        fail(path, "compressed-tensors quantizes q, k and v of a model with one set of QuantizationArgs; "
             f"the specs of {sorted(written)} differ")


def _reads_cross_attention_cache(module: torch.nn.Module) -> bool:
    """Whether ``module``'s forward takes ``cross_attention_cache`` from whatever cache it is handed (T5Gemma's
    cross-attention): compressed-tensors' ``QuantizedKVCache`` hands over the real cache's by attribute, whose
    ``update`` then quantizes nothing. A forward that takes it only from an ``EncoderDecoderCache`` (BART's and
    Whisper's ``isinstance`` check, which compressed-tensors' wrapper fails) updates the wrapper, which
    quantizes: compressed-tensors quantizes their self- and cross-attention k/v alike. Read under any decorator."""
    code = getattr(inspect.unwrap(type(module).forward), "__code__", None)
    return code is not None and "cross_attention_cache" in code.co_names and "EncoderDecoderCache" not in code.co_names


def _forward_takes(module: torch.nn.Module, *names: str) -> bool:
    """True when the module's forward takes one of the keyword ``names``."""
    try:
        parameters = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False
    return any(name in parameters for name in names)


def _is_kv_cache_module(module: torch.nn.Module) -> bool:
    """compressed-tensors' ``is_cached_attention_module``: the modules its ``kv_cache_scheme`` gives
    ``k_scale``/``v_scale``, every one of the model's."""
    return ("attention" in type(module).__name__.lower()
            and any(hasattr(module, name) for name in ("k_proj", "v_proj", "qkv_proj", "kv_b_proj"))
            and _forward_takes(module, "past_key_value", "past_key_values"))


def _check_head_counts(model: Optional[torch.nn.Module], strategy: str = "tensor",
                       where: str = "kv_cache_scheme") -> None:
    """Refuses q/k/v sites of a transformers model (or attention module) whose decoder config does not give
    compressed-tensors the attention's head counts and size (`head_count_problem`): it would raise loading the
    checkpoint, as llm-compressor's ``oneshot`` does calibrating it. The message names the sites' ``strategy``
    (``tensor``, or ``attn_head``: one scale per head)."""
    problem = head_count_problem(model)
    if problem is not None:
        fail(where, f"compressed-tensors cannot load the q/k/v scales (strategy {strategy!r}) of this "
             f"{type(model).__name__}: {problem}; drop the q/k/v sites (llm-compressor's oneshot fails alike on this model)")


def attention_config(attention: dict, groups: dict, modules: Mapping, rename, observers: Mapping) -> Optional[dict]:
    """The ``kv_cache_scheme`` (k/v sites, one for the whole model) and, for q sites, a config group
    targeting the attention modules (compressed-tensors' attention quantization, whose
    ``input_activations`` quantize q, k and v), added to ``groups``. Refuses a scheme that leaves
    some of compressed-tensors' kv-cache modules (of the model's ``modules``) without k/v scales.
    ``rename``: a module path's checkpoint name (`_checkpoint_names.module_renamer`), for the targets.
    ``observers``: ``{path: {site: (name, observer_kwargs)}}`` (`config.llm_compressor_observers`), the
    observer the args name when every q/k/v site has the same (`agreed_observer`: compressed-tensors
    holds one scheme for all)."""
    if not attention:
        return None
    args = next(iter(next(iter(attention.values())).values()))  # every module's, once the checks below pass
    _check_head_counts(modules.get(""), args["strategy"])
    uncovered = [path for path, module in modules.items() if path not in attention and _is_kv_cache_module(module)]
    if uncovered:
        fail("kv_cache_scheme", "k/v sites are written as compressed-tensors' kv_cache_scheme, which it "
             f"applies to every attention module, and {len(uncovered)} have no k/v qparams "
             f"({listed(uncovered, 4)}): their k_scale/v_scale would be left uninitialised at load; "
             "calibrate the 'k' and 'v' sites of every attention module")
    distinct = {json.dumps(next(iter(sites.values())), sort_keys=True) for sites in attention.values()}
    if len(distinct) > 1:
        fail("kv_cache_scheme", "compressed-tensors holds one kv-cache scheme per model; the attention "
             f"modules {sorted(attention)} have different q/k/v specs")
    name, kwargs = agreed_observer(observers.get(path, {}).get(site, (None, {}))
                                   for path, sites in attention.items() for site in sites)
    query = [path for path, sites in attention.items() if "q" in sites]
    if query:
        if len(query) != len(attention):
            fail("kv_cache_scheme", f"q sites on {query} but not on every attention module with k/v sites")
        groups["attention"] = {
            "targets": [target for path in query for target in module_targets(path, rename, modules)],
            "weights": None, "input_activations": {**args, "observer": name, "observer_kwargs": kwargs},
            "output_activations": None,
            "format": "dense",  # as compressed-tensors infers it for a group without weights (oneshot writes it)
        }
    if not query and (name, kwargs) == ("minmax", {}):
        # llm-compressor's default for static activations: oneshot writes none for a kv-cache scheme, but the
        # attention group's args it fills in (compressed-tensors' kv_cache_scheme is those args then)
        name = None
    return {**args, "observer": name, "observer_kwargs": kwargs}
