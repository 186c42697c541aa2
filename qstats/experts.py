"""Stacked mixture-of-experts weights: one vmapped observer call, routing masks as weights.

Fused MoE modules keep all experts' weights in 3-D parameters ``[E, out, in]``; `stacked_observer`
vmaps an observer over the expert dimension. Per-expert activations use the router's assignment as
the update ``weight`` (`routing_mask`, `dispatch`); an expert with no token keeps an empty state
(``QParams.calibrated``). `ExpertInputCapture` keeps the inputs of per-expert matmuls computed inside
the experts' forward (``down_proj``). See docs/calibrate_api.md.
"""

from __future__ import annotations

import inspect
import math
from typing import NamedTuple, Optional

import torch
from torch.nn.utils import parametrize
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from ._checks import as_index
from ._qparams import range_rule_for
from .observers.hessian import HessianState
from .stacked import stacked_observer, stacked_qparams
from ._warn import warn

__all__ = [
    "EXPERT_COUNT_NAMES", "ExpertInputCapture", "UncalibratedWarning", "declared_experts",
    "dense_expert_rows", "dense_ids", "dense_rows_weight", "expert_count", "all_experts_calls",
    "copies_of_tokens", "ids_mask", "rows_by_expert", "parameter_input_site", "is_stacked_parameter",
    "linearized_experts", "linearized_layout_problem", "own_parameters", "dispatch", "routing_mask",
    "routed_slots", "stacked_observer", "stacked_qparams", "StackLayout", "stack_layout", "takes_routing",
    "unstacked_parameter_problem", "uncovered_experts", "warn_uncovered"
]


class UncalibratedWarning(UserWarning):
    """Some quantization parameters (experts that received no token) saw no data."""


def own_parameters(module: torch.nn.Module) -> dict:
    """``{name: tensor}`` of the parameters ``module`` owns directly, a parametrized one
    (``torch.nn.utils.parametrize``, as `qstats.fake_quantized` registers its fake quantization)
    under its own name, as its original tensor (for shapes: its value is ``getattr(module, name)``),
    or as its value where it has several originals (``weight_norm``'s ``original0``/``original1``)."""
    params = dict(module.named_parameters(recurse=False))
    if parametrize.is_parametrized(module):
        for name, parametrizations in module.parametrizations.items():
            original = getattr(parametrizations, "original", None)
            params[name] = original if isinstance(original, torch.Tensor) else getattr(module, name)
    return params


# attributes declaring a module's expert count, the first positive int wins: transformers' fused
# experts (num_experts), LongCat-Flash (num_routed_experts, its zero experts having no weights),
# DBRX's DbrxExpertGLU (moe_num_experts), DeepSeek-style (n_routed_experts), Mixtral-style
EXPERT_COUNT_NAMES = ("num_experts", "num_routed_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")


def declared_experts(module: torch.nn.Module) -> tuple:
    """``(attribute, count)``: the first attribute of ``EXPERT_COUNT_NAMES`` of ``module`` holding a
    positive int, or ``(None, 0)``."""
    for name in EXPERT_COUNT_NAMES:
        value = getattr(module, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return name, value
    return None, 0


# the Linear modules llm-compressor's ``linearize_moe`` makes of each expert's slice of a stack
_LINEARIZED = {"gate_up_proj": ("up_proj", "gate_proj"), "up_proj": ("up_proj",), "down_proj": ("down_proj",)}


def linearized_experts(path: str, module: torch.nn.Module, site: Optional[str] = None) -> list:
    """The paths of the Linear modules llm-compressor's ``linearize_moe`` turns the transformers
    experts module at ``path`` into (3-D ``gate_up_proj`` or ``up_proj``, and ``down_proj``, one
    leading expert dimension): per expert ``up_proj``, ``gate_proj`` (when fused with up) and
    ``down_proj``, in its module order. With ``site`` (a stacked parameter, ``"<parameter>.input"``,
    or ``"input"``: the first projection's input) only the modules behind it. [] for any other
    module or site, and for experts llm-compressor does not linearize (neither built by
    transformers' ``use_experts_implementation``, which sets ``is_transposed``, nor registered:
    `_STORED_LAYOUTS`)."""
    if not hasattr(module, "is_transposed") and type(module).__name__ not in _STORED_LAYOUTS:
        return []
    params = own_parameters(module)
    first = "gate_up_proj" if "gate_up_proj" in params else "up_proj"
    up, down = params.get(first), params.get("down_proj")
    if up is None or down is None or up.ndim != 3 or down.ndim != 3 or up.shape[0] != down.shape[0]:
        return []
    if site is None:
        names = _LINEARIZED[first] + _LINEARIZED["down_proj"]
    else:
        parameter = first if site == "input" else site.removesuffix(".input")
        if parameter not in (first, "down_proj"):
            return []
        names = _LINEARIZED[parameter]
    return [f"{path}.{expert}.{name}" for expert in range(down.shape[0]) for name in names]


class StackLayout(NamedTuple):
    """How a stacked weight is stored against the per-expert Linear weights llm-compressor's
    ``linearize_moe`` makes of it, ``[E, out, in]`` with gate rows then up rows (its ``canonical``
    view): ``transposed``, stored ``[E, in, out]``; ``interleaved``, gate and up alternating along
    ``out`` (gate ``0::2``, up ``1::2``); ``bias``, the name of the module's parameter ``[E, out]``
    holding the per-expert Linears' biases (stored in the same order along ``out``), or None.
    Both maps act on the last two dimensions (a stack or one expert's slice) and are views or
    reshapes, so gradients and vmap go through them.

    >>> import torch, qstats
    >>> layout = qstats.experts.StackLayout(transposed=True, interleaved=True)
    >>> stored = torch.arange(8.0).reshape(1, 2, 4)  # [E, in, out]: columns gate, up, gate, up
    >>> layout.canonical(stored)[0].tolist()  # [out, in]: gate rows, then up rows
    [[0.0, 4.0], [2.0, 6.0], [1.0, 5.0], [3.0, 7.0]]
    >>> torch.equal(layout.stored(layout.canonical(stored)), stored)
    True
    """

    transposed: bool = False
    interleaved: bool = False
    bias: Optional[str] = None

    def canonical(self, stored: torch.Tensor) -> torch.Tensor:
        """The stored weights as the per-expert Linear weights ``[..., out, in]``."""
        weight = stored.transpose(-1, -2) if self.transposed else stored
        return _regrouped(weight, -2, (-1, 2)) if self.interleaved else weight

    def stored(self, canonical: torch.Tensor) -> torch.Tensor:
        """The inverse of `canonical`: per-expert Linear weights ``[..., out, in]`` as stored."""
        weight = _regrouped(canonical, -2, (2, -1)) if self.interleaved else canonical
        return weight.transpose(-1, -2) if self.transposed else weight

    def canonical_bias(self, stored: torch.Tensor) -> torch.Tensor:
        """A stored bias ``[..., out]`` in the per-expert Linears' order (gate, then up)."""
        return _regrouped(stored, -1, (-1, 2)) if self.interleaved else stored

    def canonical_shape(self, shape) -> tuple:
        """The shape of `canonical` of a stored tensor of ``shape``."""
        shape = tuple(shape)
        return shape[:-2] + (shape[-1], shape[-2]) if self.transposed else shape


def _regrouped(x: torch.Tensor, dim: int, groups: tuple) -> torch.Tensor:
    """``x`` with ``dim`` split into ``groups``, the two transposed and flattened back: ``(-1, 2)``
    takes the entries ``0::2`` then ``1::2`` (a de-interleave), ``(2, -1)`` interleaves the two halves."""
    dim = dim % x.ndim
    return x.unflatten(dim, groups).transpose(dim, dim + 1).flatten(dim, dim + 1)


# the experts classes llm-compressor 0.14 linearizes by registration (LinearExperts2D._registry), each
# from a stored layout other than [E, out, in]: Llama4LinearExperts (halves of gate_up_proj [E, H, 2I])
# and GptOssLinearExperts (gate_up_proj [E, H, 2I] columns 0::2 and 1::2, biases copied into the Linears)
_STORED_LAYOUTS = {
    "Llama4TextExperts": {"gate_up_proj": StackLayout(transposed=True), "down_proj": StackLayout(transposed=True)},
    "GptOssExperts": {"gate_up_proj": StackLayout(True, True, "gate_up_proj_bias"),
                      "down_proj": StackLayout(True, False, "down_proj_bias")},
}


def stack_layout(module: torch.nn.Module, name: str) -> Optional[StackLayout]:
    """The `StackLayout` of the stacked parameter ``name`` of the experts ``module`` when it is not
    stored as the per-expert Linear weights ``[E, out, in]``, else None: Llama 4's and GPT-OSS'
    experts, and transformers' other transposed experts with gate and up halves (built by its
    ``use_experts_implementation(is_transposed=True)``, biases ``<name>_bias`` where ``has_bias``,
    the OpenAI privacy filter's), which llm-compressor's generic ``LinearExperts2D`` reads the same
    way. Interleaved experts of other classes are refused by `linearized_layout_problem`."""
    if type(module).__name__ in _STORED_LAYOUTS:
        return _STORED_LAYOUTS[type(module).__name__].get(name)
    if name not in _LINEARIZED or not _transposed_halves(module):
        return None
    return StackLayout(transposed=True, bias=f"{name}_bias" if getattr(module, "has_bias", False) else None)


def _transposed_halves(module: torch.nn.Module) -> bool:
    """True for transformers' experts stored transposed ``[E, in, out]`` with gate and up halves
    (``is_transposed``, not interleaved)."""
    return getattr(module, "is_transposed", False) is True and getattr(module, "is_concatenated", True) is True


def linearized_layout_problem(module: torch.nn.Module) -> Optional[str]:
    """Why qstats' stacked sites of ``module`` cannot be read as the per-expert Linears
    llm-compressor linearizes it into, or None: weights stored transposed ``[E, in, out]``, or gate
    and up interleaved column by column, in experts other than those `stack_layout` maps."""
    if type(module).__name__ in _STORED_LAYOUTS or _transposed_halves(module):
        return None
    if getattr(module, "is_transposed", False):
        return ("its stacked weights are transposed ([E, in, out]) with gate and up interleaved, a layout qstats "
                "does not map to llm-compressor's per-expert Linears (only GPT-OSS' experts)")
    if not getattr(module, "is_concatenated", True):
        return "its gate and up projections are interleaved column by column in gate_up_proj"
    return None


def expert_count(module: torch.nn.Module) -> int:
    """The number of stacked experts of ``module``, or 0: it needs an int expert count
    (`declared_experts`: ``num_experts``, ``num_routed_experts``, ...) and a directly owned parameter
    (parametrized or not) of 3+ dimensions whose leading dimension is that count.
    """
    declared = declared_experts(module)[1]
    if declared and any(p.ndim >= 3 and p.shape[0] == declared for p in own_parameters(module).values()):
        return declared
    return 0


def unstacked_parameter_problem(module: torch.nn.Module, name: str) -> Optional[str]:
    """Why parameter ``name`` of an experts module cannot be observed as one tensor without
    mixing experts, or None: a 3+-D parameter whose leading dimension is not the module's stacked
    expert count (LongCat-Flash's ``gate_up_proj``, which also holds its weightless zero experts),
    or a 2-D one holding the declared experts flattened along its rows (DBRX's ``[E * ffn, hidden]``)."""
    param = own_parameters(module).get(name)
    attribute, declared = declared_experts(module)
    if param is None or not declared or param.ndim < 2 or param.shape[0] == declared:
        return None
    shape = tuple(param.shape)
    if param.ndim >= 3:
        return (f"its parameter {name!r} of shape {shape} is stacked but its leading dimension {shape[0]} is "
                f"not the module's {declared} experts ({attribute}), so qstats cannot observe it per expert")
    if shape[0] > declared and shape[0] % declared == 0:
        return (f"its parameter {name!r} of shape {shape} holds its {declared} experts ({attribute}) "
                f"flattened along dim 0 ([E * rows, columns]); qstats observes per expert only parameters "
                f"stacked as [E, out, in], and one state would share scales (and mix channels) across the "
                f"experts")
    return None


def takes_routing(module: torch.nn.Module) -> bool:
    """True when ``module``'s forward has a parameter named like the routing (``top_k_index``, ...):
    an experts module, called on tokens with the experts each goes to."""
    try:
        names = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False
    return any(name in names for name in _INDEX_NAMES)


def is_stacked_parameter(param: torch.Tensor, num_experts: int) -> bool:
    """True when ``param`` is a stack of per-expert tensors (``[E, ...]`` with ``E = num_experts``
    and at least one more dimension)."""
    return bool(num_experts) and param.ndim >= 2 and param.shape[0] == num_experts


_INDEX_NAMES = ("top_k_index", "router_indices", "selected_experts", "expert_indices", "topk_ids")


def _is_int(value) -> bool:
    """True when ``value`` is a tensor of integers (expert ids), not of floats or bools."""
    return isinstance(value, torch.Tensor) and not value.is_floating_point() and value.dtype != torch.bool


def _arg(args: tuple, kwargs: dict, position: int, name: str):
    """Argument ``name`` of a torch call, passed at ``position`` or by keyword (None if absent)."""
    return args[position] if len(args) > position else kwargs.get(name)


def _routing_tensors(args: tuple, kwargs: dict, tokens: int) -> tuple:
    """``(index, weights)`` of an experts module's call: the first integer tensor ``[tokens, k]``
    (or a keyword named like ``top_k_index``) and the first floating tensor of that shape after
    the hidden states (the routing weights); either may be None."""
    candidates = [kwargs[name] for name in _INDEX_NAMES if name in kwargs]
    candidates += list(args[1:]) + list(kwargs.values())
    index = weights = None
    for value in candidates:
        if not isinstance(value, torch.Tensor) or value.ndim != 2 or value.shape[0] != tokens:
            continue
        if index is None and _is_int(value):
            index = value
        elif weights is None and value.is_floating_point() and (index is None or value.shape == index.shape):
            weights = value
    if weights is not None and index is not None and weights.shape != index.shape:
        weights = None
    return index, weights


def routing_mask(args: tuple, kwargs: dict, num_experts: int, tokens: int) -> Optional[torch.Tensor]:
    """The ``[E, tokens]`` float mask of which token went to which expert, read from a call
    ``forward(hidden_states, top_k_index, top_k_weights)``: the first integer ``[tokens, k]`` tensor (or a
    keyword like ``top_k_index``); indices outside ``[0, E)`` route nowhere. None when there is none.
    """
    index, _ = _routing_tensors(args, kwargs, tokens)
    return None if index is None else _scatter_mask(index.transpose(0, 1), num_experts)


def routed_slots(args: tuple, kwargs: dict, num_experts: int, tokens: int) -> Optional[torch.Tensor]:
    """``[E, k * tokens]``: the routing of a call (`routing_mask`) over its slots, row ``j * tokens + t``
    being token ``t`` in slot ``j``, when some token lists one expert in two slots (DeepSeek-V4's hash
    routing: its experts' forward then runs that token twice through the expert); None otherwise (a
    host read: whether any such repeat exists)."""
    index, _ = _routing_tensors(args, kwargs, tokens)
    if index is None or index.shape[1] < 2:
        return None
    ids = index.long().sort(dim=1).values
    repeated = (ids[:, 1:] == ids[:, :-1]) & (ids[:, 1:] >= 0) & (ids[:, 1:] < num_experts)
    if not bool(repeated.any()):
        return None
    return _scatter_mask(index.transpose(0, 1).reshape(1, -1), num_experts)


def all_experts_calls(args: tuple, kwargs: dict, num_experts: int, tokens: int,
                      module: Optional[torch.nn.Module] = None) -> Optional[list]:
    """The ``[(args, kwargs), ...]`` of ``ceil(E / k)`` calls of an experts module that together route every
    token to every expert with weight 1 (llm-compressor's ``moe_calibrate_all_experts``), each needing
    the memory of one routed forward; for a call of ``module`` passing dense rows, `_dense_all_experts_calls`.
    None when the call has neither a routing tensor nor dense rows.
    """
    index, weights = _routing_tensors(args, kwargs, tokens)
    if index is None:
        return None if module is None else _dense_all_experts_calls(module, args, kwargs)
    if index.shape[1] == 0:
        raise ValueError("all_experts: the experts module's routing index has no slot per token (top-k 0), so no "
                         "call of it can route tokens to an expert")
    calls = []
    for first in range(0, num_experts, index.shape[1]):
        experts = torch.arange(first, min(first + index.shape[1], num_experts), device=index.device)
        replace = {id(index): experts.to(index.dtype).expand(tokens, -1).contiguous()}
        if weights is not None:
            replace[id(weights)] = weights.new_ones(tokens, experts.shape[0])
        calls.append((
            tuple(replace.get(id(value), value) for value in args),
            {name: replace.get(id(value), value) for name, value in kwargs.items()},
        ))
    return calls


# the stacked experts called with dense per-expert rows [E * T, hidden] and nothing else: Llama 4's
# Llama4TextMoe passes its tokens repeated per expert, each block times that expert's router score
_DENSE_ROWS_EXPERTS = ("Llama4TextExperts",)


def dense_expert_rows(module: torch.nn.Module, args: tuple, kwargs: dict) -> Optional[int]:
    """``T`` when a call of the stacked-experts ``module`` passes dense per-expert rows
    ``[E * T, hidden]``: row block ``e`` is expert ``e``'s, zero where the router did not send the
    token. Only a class known to be called so (`_DENSE_ROWS_EXPERTS`): a shape alone cannot tell
    dense rows from tokens; else None."""
    if type(module).__name__ not in _DENSE_ROWS_EXPERTS:
        return None
    num_experts = expert_count(module)
    values = list(args) + list(kwargs.values())
    if len(values) != 1 or not isinstance(values[0], torch.Tensor) or not values[0].is_floating_point():
        return None
    rows = values[0].shape[0] if values[0].ndim == 2 else 0
    if not num_experts or not rows or rows % num_experts:
        return None
    return rows // num_experts


def dense_ids(num_experts: int, per_expert: int, device=None) -> torch.Tensor:
    """The expert of each dense row ``[E * T]`` (`dense_expert_rows`): ``e`` for block ``e``."""
    return torch.arange(num_experts, device=device).repeat_interleave(per_expert)


def dense_rows_weight(rows: torch.Tensor, per_expert: int, token_weight: Optional[torch.Tensor] = None,
                      routed: bool = True) -> Optional[torch.Tensor]:
    """The observation weight ``[E * T]`` of dense expert rows ``[E * T, hidden]`` (`dense_expert_rows`):
    the weight of each of the ``T`` tokens (``token_weight``, padding) in every expert's block, times,
    when ``routed``, whether the row is nonzero: a zero row is a token the router did not send to that
    expert (score 0), which it does not observe. None where neither applies."""
    weight = None if token_weight is None else token_weight.reshape(-1).repeat(rows.shape[0] // per_expert)
    if routed:
        sent = rows.ne(0).any(dim=-1).to(torch.float32)
        weight = sent if weight is None else weight.to(sent.device) * sent
    return weight


def _dense_all_experts_calls(module: torch.nn.Module, args: tuple, kwargs: dict) -> Optional[list]:
    """`all_experts_calls` of a call passing dense rows (`dense_expert_rows`): ``E`` calls, call ``c``
    holding block ``c`` once per expert, so that every expert runs on every row of the call (as
    llm-compressor's ``Llama4LinearExperts`` under ``moe_calibrate_all_experts``), each needing the
    memory of the routed forward. None when the call passes no dense rows."""
    per_expert = dense_expert_rows(module, args, kwargs)
    if per_expert is None:
        return None
    num_experts = expert_count(module)
    name = next(iter(kwargs), None)
    x = args[0] if args else kwargs[name]
    return [with_argument(args, kwargs, 0, name, block.repeat(num_experts, 1)) for block in x.split(per_expert)]


def dispatch(tokens: torch.Tensor, mask: torch.Tensor, capacity: Optional[int] = None):
    """Each expert's tokens gathered into a fixed-shape stack: ``(x [E, C, ...], weight [E, C])``.

    Row ``c`` of expert ``e`` is the ``c``-th token routed to ``e``; rows past its token count have
    weight 0. ``capacity`` ``C`` defaults to the largest token count (a host read; pass
    ``tokens.shape[0]`` to avoid it). With ``C`` at least every count, the statistics equal those of
    ``tokens`` weighted by ``mask``; a smaller ``C`` drops each expert's later tokens, as a
    capacity-limited router does (``C = 0`` keeps none). ``C`` is any integer: a Python or numpy one,
    or a 0-d integer tensor.
    """
    if mask.ndim != 2 or mask.shape[1] != tokens.shape[0]:
        raise ValueError(f"dispatch: mask of shape {tuple(mask.shape)} does not match {tokens.shape[0]} "
                         "tokens ([E, tokens])")
    if capacity is None:
        capacity = max(1, int((mask != 0).sum(dim=1).max()) if mask.numel() else 1)
    value = None if isinstance(capacity, torch.Tensor) and capacity.ndim else as_index(capacity)
    if value is None or value < 0:
        raise ValueError(f"dispatch: capacity must be an int >= 0 (rows kept per expert), got {capacity!r}")
    capacity = min(value, tokens.shape[0])
    order = torch.argsort((mask != 0).to(torch.int8), dim=1, descending=True, stable=True)[:, :capacity]
    return tokens[order], torch.gather(mask, 1, order)


def uncovered_experts(state) -> Optional[list]:
    """Indices of the experts whose stacked state saw no value, from its ``count`` field or,
    for states without one (histograms), from its extremes (``min_val > max_val`` everywhere:
    no finite value seen); None when the state has neither."""
    count = getattr(state, "count", None)
    if isinstance(count, torch.Tensor) and count.ndim >= 1:
        seen = count.reshape(count.shape[0], -1).sum(dim=1) > 0
    else:
        min_val, max_val = getattr(state, "min_val", None), getattr(state, "max_val", None)
        if not isinstance(min_val, torch.Tensor) or not isinstance(max_val, torch.Tensor) or min_val.ndim < 1:
            return None
        seen = (min_val <= max_val).reshape(min_val.shape[0], -1).any(dim=1)
    return [int(i) for i in torch.arange(seen.shape[0])[~seen]]


def _has_qparams(state) -> bool:
    """Whether ``compute_qparams`` gives ``state`` quantization parameters: not a Hessian
    (`gptq_layerwise`'s own sites, which it warns of itself) nor a state without a range rule."""
    try:
        range_rule_for(state)
    except TypeError:
        return False
    return not isinstance(state, HessianState)


def warn_uncovered(states: dict, sites: dict) -> None:
    """Warns (`UncalibratedWarning`) naming, per stacked activation site whose states have
    quantization parameters, the experts that received no token."""
    lines = []
    for path, entry in sites.items():
        for site, found in entry.items():
            if not found.num_experts or site not in states.get(path, {}) or not _has_qparams(states[path][site]):
                continue
            experts = uncovered_experts(states[path][site])
            if experts:
                lines.append(f"{path}.{site}: experts {experts} ({len(experts)} of {found.num_experts})")
    if lines:
        warn("qstats.calibrate: some experts received no calibration token; their quantization parameters "
             "follow the spec's on_uncalibrated policy (QParams.calibrated is False there): "
             + "; ".join(lines), UncalibratedWarning)


def parameter_input_site(site: str) -> Optional[str]:
    """The parameter named by a per-expert parameter-input site (``"down_proj.input"`` ->
    ``"down_proj"``), or None for any other site."""
    if isinstance(site, str) and site.endswith(".input") and site != ".input":
        return site.removesuffix(".input")
    return None


def rows_by_expert(ids, num_experts: int) -> list:
    """``[(expert, rows)]`` of captured rows with expert ``ids`` (`ExpertInputCapture.captured`):
    all rows for an int, else each expert present and a bool mask of its rows; ids outside
    ``[0, num_experts)`` (expert-parallel sentinels) are no expert's."""
    if isinstance(ids, int):
        return [(ids, slice(None))]
    return [(expert, ids == expert) for expert in torch.unique(ids).tolist() if 0 <= expert < num_experts]


def ids_mask(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The ``[E, rows]`` float mask of rows tagged with expert ids ``[rows]``; ids outside
    ``[0, E)`` (padding, sentinel rows) belong to no expert."""
    return _scatter_mask(ids.reshape(1, -1), num_experts)


def copies_of_tokens(rows: torch.Tensor, ids: torch.Tensor, tokens: torch.Tensor, num_experts: int):
    """``[E]`` bool, the experts holding rows, when each of them holds every row of ``tokens``
    ``[T, F]`` once, in any order (its copy of every token under ``all_experts``); else None. Such
    rows are observed as ``tokens`` once under a mask, not as ``E`` copies. Rows are compared
    exactly, after sorting both sides by a float32 projection of each row."""
    count, features = tokens.shape
    if not count or rows.dtype != tokens.dtype or rows.shape[1:] != tokens.shape[1:] or rows.shape[0] % count:
        return None
    if not bool(((ids >= 0) & (ids < num_experts)).all()):
        return None
    held = torch.bincount(ids, minlength=num_experts)
    if not bool((held[held > 0] == count).all()):
        return None
    if not bool((ids[1:] >= ids[:-1]).all()):
        rows = rows[torch.argsort(ids, stable=True)]
    blocks = rows.reshape(-1, count, features)
    if torch.equal(blocks, tokens.expand_as(blocks)):  # each expert's rows in token order
        return held > 0
    probe = torch.linspace(1.0, 2.0, features, device=tokens.device)
    keys, order = (blocks.float() @ probe).sort(dim=1, stable=True)
    token_keys, token_order = (tokens.float() @ probe).sort(stable=True)
    if ((keys - token_keys).abs() > 1e-4 * token_keys.abs().max()).any():  # other rows: no gather
        return None
    blocks = blocks.gather(1, order.unsqueeze(-1).expand_as(blocks))
    return held > 0 if torch.equal(blocks, tokens[token_order].expand_as(blocks)) else None


def _scatter_mask(index: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[E, columns]`` float mask with a 1 at ``(index[j, c], c)`` for every ``j``; indices
    outside ``[0, E)`` go to a spare row that is dropped. (A scatter into a fresh buffer: a
    fraction of the cost of a one-hot encoding.)"""
    index = index.long()
    index = index.masked_fill((index < 0) | (index >= num_experts), num_experts)
    mask = torch.zeros(num_experts + 1, index.shape[1], dtype=torch.float32, device=index.device)
    return mask.scatter_(0, index, 1.0)[:num_experts]


def _same_storage(view: torch.Tensor, stack: torch.Tensor) -> bool:
    """True when ``view`` lies in ``stack``'s memory: the same root ``Tensor._base`` (which every
    view points to), or, for views of ``stack.data`` / ``stack.detach()`` (new roots over the
    same memory), a first element inside ``stack``'s extent. No storage object is built, as
    this runs on every matmul of the experts' forward."""
    root = stack._base if stack._base is not None else stack
    if (view._base if view._base is not None else view) is root:
        return True
    if view.dtype != stack.dtype or view.device != stack.device or stack.numel() == 0:
        return False
    try:
        start, at = stack.data_ptr(), view.data_ptr()
    except RuntimeError:  # tensors without storage (torch.func.grad's): the `_base` test is the only one
        return False
    extent = 1 + sum((size - 1) * stride for size, stride in zip(stack.shape, stack.stride()))
    return start <= at < start + extent * stack.element_size()


def _layout(t: torch.Tensor) -> list:
    return sorted(zip(t.shape, t.stride()))


def _expert_of_slice(weight, stack: torch.Tensor) -> Optional[int]:
    """``e`` when ``weight`` is the view ``stack[e]`` (possibly transposed), else None. Reads
    only shapes, strides and storage offsets (no tensor data)."""
    if not isinstance(weight, torch.Tensor) or not _same_storage(weight, stack) or weight.ndim != stack.ndim - 1:
        return None
    offset, stride = weight.storage_offset() - stack.storage_offset(), stack.stride(0)
    if stride == 0 and stack.shape[0] > 1:  # experts sharing one memory (an expanded stack): whose slice is unknown
        return None
    expert, rest = divmod(offset, stride) if stride else (0, offset)
    inner = sorted(zip(stack.shape[1:], stack.stride()[1:]))  # the layout of one slice
    if rest or not 0 <= expert < stack.shape[0] or _layout(weight) != inner:
        return None
    return expert


def _is_whole_stack(weight, stack: torch.Tensor) -> bool:
    """True when ``weight`` is ``stack`` itself or a permuted view of it (``P.transpose(-2, -1)``)."""
    return (isinstance(weight, torch.Tensor) and weight.ndim == stack.ndim and weight.shape[0] == stack.shape[0]
            and _same_storage(weight, stack) and weight.storage_offset() == stack.storage_offset()
            and _layout(weight) == _layout(stack))


_LINEAR, _MATMUL, _BMM, _GATHER, _GROUPED, _REPEAT, _SELECT, _SAME_ROWS, _UNSQUEEZE, _CLAMP, _RESHAPE = range(11)
_KINDS = {
    func: kind
    for kind, funcs in (
        (_LINEAR, (torch.nn.functional.linear,)),
        (_GATHER, (torch.Tensor.__getitem__,)),
        (_MATMUL, (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm)),
        (_BMM, (torch.bmm, torch.Tensor.bmm)),
        (_GROUPED, (getattr(torch, "_grouped_mm", None), getattr(torch.nn.functional, "grouped_mm", None))),
        # expert ids clamped into [0, E) before a gather (transformers' batched_mm, for expert-parallel
        # sentinels): the rows of an id outside [0, E) belong to no expert, not to the clamped one
        (_CLAMP, (torch.clamp, torch.Tensor.clamp, torch.clip, torch.Tensor.clip)),
        # the calls through which the token of each row is followed (`ExpertInputCapture.row_tokens`)
        (_REPEAT, (torch.repeat_interleave, torch.Tensor.repeat_interleave)),
        (_SELECT, (torch.index_select, torch.Tensor.index_select)),
        (_UNSQUEEZE, (torch.unsqueeze, torch.Tensor.unsqueeze)),
        (_RESHAPE, (torch.reshape, torch.Tensor.reshape, torch.Tensor.view, torch.flatten,
                    torch.Tensor.flatten)),
        (_SAME_ROWS, (torch.Tensor.to, torch.Tensor.contiguous, torch.Tensor.clone, torch.clone,
                      torch.Tensor.detach, torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16,
                      torch.Tensor.type_as)),
    )
    for func in funcs
    if func is not None  # grouped_mm: only in some torch versions
}
_EXPERT_MATMULS = frozenset((_LINEAR, _MATMUL, _BMM, _GROUPED))
_OPS = (torch._ops.OpOverload, torch._ops.OpOverloadPacket)


def with_argument(args: tuple, kwargs: dict, position: int, name: str, value) -> tuple:
    """``(args, kwargs)`` of a call with ``value`` as its argument ``name``: at ``position`` where the
    call passes that many positional arguments, else by keyword."""
    if len(args) > position:
        return (*args[:position], value, *args[position + 1:]), kwargs
    return args, {**kwargs, name: value}


def _putting(args: tuple, kwargs: dict, position: int, name: str, back):
    """``put(rows)``: ``(args, kwargs)`` of a call with ``back(rows)`` as its argument ``name``
    (`with_argument`)."""
    return lambda rows: with_argument(args, kwargs, position, name, back(rows))


def _kind(func) -> Optional[int]:
    """Which recognised call ``func`` is (None for every other function: one dict look-up and
    one isinstance, as the mode sees every torch call of the experts' forward)."""
    kind = _KINDS.get(func)
    # custom grouped-mm ops (transformers' fallback)
    if kind is None and isinstance(func, _OPS) and "grouped_mm" in str(func):
        return _GROUPED
    return kind


class ExpertInputCapture(TorchFunctionMode):
    """Captures, during one forward of a stacked-experts module, the input rows of each expert's matmul
    with the named stacked parameters, as the model computes them (recognised calls: docs/calibrate_api.md).

    Use as a context manager around the experts' forward. Rows are kept by reference (the model must
    not modify them in place) and their expert ids are tensors (no host read). ``tokens``: the experts'
    input ``[tokens, hidden]``; when given, the token of each captured row is traced (`row_tokens`).
    ``replace(name, rows, ids, traced)``: when given, nothing is kept; each matmul takes the rows it
    returns in place of its input rows ``[N, in]`` (``ids``: an int or one expert per row; ``traced``:
    whether the rows' tokens are known, i.e. they are the experts' input) (`qstats.fake_quantized`).

    >>> import torch, qstats
    >>> stack = torch.randn(3, 4, 2)
    >>> x = torch.randn(5, 2)
    >>> with qstats.experts.ExpertInputCapture({"w": stack}) as capture:
    ...     y = torch.nn.functional.linear(x, stack[2])
    >>> rows, ids = capture.captured("w")
    >>> rows.shape, ids.tolist()
    (torch.Size([5, 2]), [2, 2, 2, 2, 2])
    """

    def __init__(self, parameters, tokens: Optional[torch.Tensor] = None, replace=None):
        super().__init__()
        self.replace = replace
        self.parameters = dict(parameters)
        self.rows: dict = {name: [] for name in self.parameters}
        self.ids: dict = {name: [] for name in self.parameters}
        self.tokens: dict = {name: [] for name in self.parameters}  # per call: each row's token, or None
        self._gathered = WeakIdKeyDictionary()
        self._unclamped = WeakIdKeyDictionary()  # clamped integer tensor -> the ids before the clamp
        self._token_of = WeakIdKeyDictionary()  # tensor -> the token of each of its leading rows
        self._flat = WeakIdKeyDictionary()  # tokens [..., hidden] of more than 2 dimensions -> their flat rows' tokens
        self._split = WeakIdKeyDictionary()  # [B, n, F] viewed from traced rows [B * n, F] -> each row's token
        self._copies = WeakIdKeyDictionary()  # a copy of a slice P[e] (P[e].float() of a bf16 P) -> (name, e)
        if tokens is not None and tokens.ndim == 2:
            self._token_of[tokens] = torch.arange(tokens.shape[0], device=tokens.device)
        elif tokens is not None and tokens.ndim > 2:  # traced from their flattening to [tokens, hidden]
            self._flat[tokens] = torch.arange(tokens.numel() // max(tokens.shape[-1], 1), device=tokens.device)

    def watch(self, name: str, stack: torch.Tensor) -> None:
        """Watches ``stack`` as parameter ``name`` from now on: for a parametrized parameter
        (``torch.nn.utils.parametrize``, e.g. inside `qstats.fake_quantized`), each value the
        forward computes, which it then slices (`calibrate` calls this from a forward hook of the
        parametrization)."""
        self.parameters[name] = stack

    def _add(self, name: str, rows: torch.Tensor, ids, tokens: Optional[torch.Tensor] = None) -> None:
        """Keeps ``rows``, their expert ids (an int, one expert, expanded in `captured`, or a
        tensor with one id per row) and their tokens (None where not traced)."""
        self.rows[name].append(rows.detach())
        self.ids[name].append(ids if isinstance(ids, int) else ids.reshape(-1))
        self.tokens[name].append(tokens)

    def _rows_tokens(self, x, rows_per_entry: Optional[int] = None) -> Optional[torch.Tensor]:
        """The token of each row of ``x.reshape(-1, x.shape[-1])``: its leading entries' tokens,
        each repeated ``rows_per_entry`` times (default: the rows of one entry); None when ``x``
        is not traced."""
        if isinstance(x, torch.Tensor) and x in self._split:
            return self._split[x]
        tokens = self._token_of.get(x) if isinstance(x, torch.Tensor) and x.ndim >= 2 else None
        if tokens is None:
            return None
        if rows_per_entry is None:
            rows_per_entry = math.prod(x.shape[1:-1])
        return tokens if rows_per_entry == 1 else tokens.repeat_interleave(rows_per_entry)

    def _sliced(self, weight):
        """``(name, e)`` when ``weight`` is a slice ``P[e]`` of a watched parameter, or a copy of one
        (a cast or ``contiguous``: the OpenAI privacy filter's experts multiply by ``P[e].float()``)."""
        if isinstance(weight, torch.Tensor) and weight in self._copies:
            return self._copies[weight]
        for name, stack in self.parameters.items():
            expert = _expert_of_slice(weight, stack)
            if expert is not None:
                return name, expert
        return None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = _kind(func)
        if kind in _EXPERT_MATMULS:
            found = self._expert_input(kind, args, kwargs)
            if found is not None and self.replace is not None:
                name, rows, ids, tokens, put = found
                args, kwargs = put(self.replace(name, rows, ids, tokens is not None))
            elif found is not None:
                self._add(*found[:4])
        out = func(*args, **kwargs)
        if kind is None or kind in _EXPERT_MATMULS:
            return out
        if kind == _GATHER and len(args) == 2:
            self._gather(args[0], args[1], out)
        elif kind == _CLAMP:
            if args and _is_int(args[0]) and isinstance(out, torch.Tensor) and out is not args[0]:
                self._unclamped[out] = self._unclamped.get(args[0], args[0])
        else:
            if kind == _SAME_ROWS and args and isinstance(out, torch.Tensor) and out is not args[0]:
                found = self._sliced(args[0])
                if found is not None:
                    self._copies[out] = found
            if (self._token_of or self._flat) and args:
                self._follow(kind, args, kwargs, out)
        return out

    def _follow(self, kind: int, args: tuple, kwargs: dict, out) -> None:
        """Traces the tokens of ``out``'s rows from those of ``args[0]`` through a copy, an
        ``unsqueeze`` after the first dimension, ``repeat_interleave`` or ``index_select`` along it,
        a reshape keeping the rows, or the flattening of ``[..., hidden]`` tokens to ``[tokens, hidden]``."""
        x = args[0]
        if not isinstance(x, torch.Tensor) or not isinstance(out, torch.Tensor) or out.ndim == 0:
            return
        if kind == _RESHAPE and x in self._flat:
            if out.ndim == 2 and out.shape == (self._flat[x].shape[0], x.shape[-1]):
                self._token_of[out] = self._flat[x]
            return
        tokens = self._token_of.get(x)
        if tokens is None:
            return
        if kind == _REPEAT:
            repeats = _arg(args, kwargs, 1, "repeats")
            if _arg(args, kwargs, 2, "dim") != 0 or repeats is None:
                return
            tokens = tokens.repeat_interleave(repeats.to(tokens.device) if isinstance(repeats, torch.Tensor) else repeats)
        elif kind == _SELECT:
            index = _arg(args, kwargs, 2, "index")
            if _arg(args, kwargs, 1, "dim") != 0 or not isinstance(index, torch.Tensor):
                return
            tokens = tokens[index.to(tokens.device)]
        elif kind == _RESHAPE and out.shape[0] != x.shape[0]:  # the same leading rows only, or
            if x.ndim == 2 and out.ndim == 3 and out.shape[-1] == x.shape[-1] and out.shape[0] * out.shape[1] == x.shape[0]:
                self._split[out] = tokens  # rows [B * n, F] split into [B, n, F] (dense expert rows)
            return
        elif kind == _UNSQUEEZE:
            dim = _arg(args, kwargs, 1, "dim")
            if not isinstance(dim, int) or dim in (0, -x.ndim - 1):
                return
        if out.shape[0] == tokens.shape[0]:
            self._token_of[out] = tokens

    def _expert_input(self, kind: int, args: tuple, kwargs: dict) -> Optional[tuple]:
        """``(name, rows [N, in], ids, tokens, put)`` of a call multiplying input rows by an expert's
        weights of watched parameter ``name`` (``ids``: an int, or one expert per row; ``tokens``:
        each row's token, or None), ``put(rows)`` giving the call's ``(args, kwargs)`` with other
        rows of that shape in their place; None for any other call."""
        if kind == _LINEAR:
            x, found = _arg(args, kwargs, 0, "input"), self._sliced(_arg(args, kwargs, 1, "weight"))
            if found is None or not isinstance(x, torch.Tensor):
                return None
            return self._input_rows(args, kwargs, x, *found)
        if len(args) < 2 or not all(isinstance(t, torch.Tensor) for t in args[:2]):
            return None
        a, b = args[:2]
        if kind == _MATMUL:
            return self._matmul_input(args, kwargs, a, b)
        whole = next((name for name, stack in self.parameters.items() if _is_whole_stack(b, stack)), None)
        if kind == _BMM and a.ndim == 3 and b.ndim == 3:
            if whole is not None and a.shape[0] == b.shape[0]:  # x [E, n, in] @ P: batch e is expert e's rows
                return self._input_rows(args, kwargs, a, whole, dense_ids(a.shape[0], a.shape[1], a.device))
            if b in self._gathered:  # x [S, m, in] @ P[ids]
                name, ids = self._gathered[b]
                return self._input_rows(args, kwargs, a, name, ids.repeat_interleave(a.shape[1]))
            if a in self._gathered:  # P[ids] @ x [S, in, m]
                name, ids = self._gathered[a]
                put = _putting(args, kwargs, 1, "mat2",
                               lambda rows: rows.reshape(b.shape[0], b.shape[2], b.shape[1]).transpose(1, 2))
                return (name, b.transpose(1, 2).reshape(-1, b.shape[1]), ids.repeat_interleave(b.shape[2]),
                        self._rows_tokens(b, b.shape[2]), put)
        if kind == _GROUPED:
            offs = _arg(args, kwargs, 2, "offs")
            if whole is not None and a.ndim == 2 and isinstance(offs, torch.Tensor):  # row r: first e with r < offs[e]
                positions = torch.arange(a.shape[0], device=offs.device, dtype=torch.int64)
                ids = torch.searchsorted(offs.to(torch.int64).contiguous(), positions, right=True)
                return self._input_rows(args, kwargs, a, whole, ids)
        return None

    def _input_rows(self, args: tuple, kwargs: dict, x: torch.Tensor, name: str, ids) -> tuple:
        """`_expert_input` of a call whose first argument (``input``) ``x`` holds the rows
        ``[..., in]`` multiplied by the weights of ``name``."""
        put = _putting(args, kwargs, 0, "input", lambda rows: rows.reshape(x.shape))
        return name, x.reshape(-1, x.shape[-1]), ids, self._rows_tokens(x), put

    def _matmul_input(self, args: tuple, kwargs: dict, a: torch.Tensor, b: torch.Tensor) -> Optional[tuple]:
        """`_expert_input` of ``x @ P[e]`` and ``P[e] @ x.T``."""
        found = self._sliced(b)
        if found is not None and a.ndim >= 1:  # x @ P[e]
            return self._input_rows(args, kwargs, a, *found)
        found = self._sliced(a)
        if found is not None and b.ndim in (1, 2):  # P[e] @ x.T
            rows = b.reshape(1, -1) if b.ndim == 1 else b.transpose(0, 1)
            put = _putting(args, kwargs, 1, "other", lambda rows: rows.reshape(b.shape) if b.ndim == 1 else rows.T)
            return found[0], rows, found[1], None, put
        return None

    def _gather(self, stack, index, out) -> None:
        tokens = self._token_of.get(stack) if self._token_of and isinstance(stack, torch.Tensor) else None
        if tokens is not None:  # tokens[index] (an int or bool tensor, or a slice, along the rows)
            if isinstance(out, torch.Tensor) and out.ndim >= 1 and (
                isinstance(index, slice) or (isinstance(index, torch.Tensor) and index.ndim == 1)
            ):
                self._token_of[out] = tokens[index.to(tokens.device) if isinstance(index, torch.Tensor) else index]
            return
        name = next((name for name, watched in self.parameters.items() if stack is watched), None)
        if name is not None and _is_int(index) and index.ndim == 1 and isinstance(out, torch.Tensor):
            # P[ids]: one expert's weights per row
            self._gathered[out] = (name, self._unclamped.get(index, index))

    def captured(self, name: str) -> Optional[tuple]:
        """``(rows [N, in], ids [N])``: every captured input row of parameter ``name`` and its
        expert, in call order; None when no call with that parameter was seen."""
        rows = self.rows[name]
        if not rows:
            return None
        if len({r.dtype for r in rows}) > 1:
            rows = [r.float() for r in rows]
        return torch.cat(rows), self._expert_ids(name, rows[0].device)

    def _expert_ids(self, name: str, device) -> torch.Tensor:
        """The expert of every captured row of ``name``, in call order."""
        rows, ids = self.rows[name], self.ids[name]
        if all(isinstance(i, int) for i in ids):  # slices P[e]: one id tensor built from host ints
            experts = torch.tensor(ids, dtype=torch.int64, device=device)
            counts = torch.tensor([r.shape[0] for r in rows], dtype=torch.int64, device=device)
            return torch.repeat_interleave(experts, counts, output_size=sum(r.shape[0] for r in rows))
        return torch.cat([torch.full((r.shape[0],), i, dtype=torch.int64, device=device) if isinstance(i, int)
                          else i.to(device=device, dtype=torch.int64) for r, i in zip(rows, ids)])

    def row_tokens(self, name: str) -> Optional[torch.Tensor]:
        """The token (row of ``tokens``) of every captured row of ``name``, in call order; None when not
        traced. Rows of a parameter whose input is computed inside the forward (``down_proj``) take the
        tokens of the traced parameter (``gate_up_proj``) whose rows they follow one for one.
        """
        if not self.rows[name]:
            return None
        if all(tokens is not None for tokens in self.tokens[name]):
            return torch.cat([tokens.to(self.rows[name][0].device) for tokens in self.tokens[name]])
        ids = self._expert_ids(name, self.rows[name][0].device)
        for source in self.parameters:
            traced = self.tokens[source]
            if source == name or not traced or any(tokens is None for tokens in traced):
                continue
            source_ids = self._expert_ids(source, ids.device)
            order, source_order = torch.argsort(ids, stable=True), torch.argsort(source_ids, stable=True)
            if ids.shape == source_ids.shape and torch.equal(ids[order], source_ids[source_order]):
                source_tokens = torch.cat([tokens.to(ids.device) for tokens in traced])
                return source_tokens[source_order][torch.argsort(order)]
        return None
