"""Fused scale groups: one shared global scale for several states, as pure functions.

Engines (vLLM) run q/k/v, gate/up and DeepSeek's q_a/kv_a projections as one matmul under one NVFP4
global scale. The group is a tuple of states (or one stacked state), and the shared scale comes from
the absolute maximum over every calibrated entry: for compressed-tensors' ``448 * 6 / amax`` it
equals llm-compressor's minimum over the group's global scales (its ``FusionHandler``). Entries that
saw no data (a reversed or non-finite range, as `compute_qparams` reads them) do not contribute.
vLLM's fused MoE keeps one global scale per expert (gate and up equal within it, as a stacked
``gate_up_proj``'s per-expert qparams have them); ``stacked=True`` shares one over all experts,
which neither vLLM nor llm-compressor needs. See docs/formats.md.

    >>> import torch, qstats
    >>> spec = qstats.QuantSpec(dtype="fp4_e2m1", granularity=qstats.TensorGroup(16),
    ...                         scale_dtype="float8_e4m3fn")
    >>> obs = qstats.minmax(spec)
    >>> q, k = torch.randn(4, 32), 3 * torch.randn(4, 32)
    >>> states = [obs.update(obs.init(w), w) for w in (q, k)]
    >>> qp_q, qp_k = qstats.fused_qparams(states, spec)
    >>> bool(qp_q.global_scale == qp_k.global_scale)
    True
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Optional

import torch

from . import _formats
from ._checks import check_flag
from ._granularity import TensorGroup
from ._qparams import QParams, calibrated_mask, check_calibrated, compute_qparams, range_of, range_rule_for
from ._spec import QuantSpec
from .distributed import is_named_tuple

__all__ = ["FUSED_LAYER_NAMES", "fused_amax", "fused_global_scale", "fused_groups", "fused_qparams"]

# Sibling projections that inference engines run as one matmul, so that two-level (NVFP4) weights
# of a group need one global scale: llm-compressor's ``FUSED_LAYER_NAMES`` (0.14), which links
# the weight observers of every module that has all the names of a group.
FUSED_LAYER_NAMES = (
    ("gate_proj", "up_proj"),  # MLP / experts: fused gate_up_proj
    ("q_proj", "k_proj", "v_proj"),  # attention: fused qkv_proj
    ("q_a_proj", "kv_a_proj_with_mqa"),  # DeepSeek multi-latent attention: fused_qkv_a_proj
    ("w1", "w3"),  # MoE experts named w1/w2/w3
)


def fused_groups(model: torch.nn.Module) -> list:
    """The module paths of each fused group of ``model`` (`FUSED_LAYER_NAMES`): for every module
    that has attributes of all the names of a group, the paths of its members, in the group's order.
    As llm-compressor's ``fuse_weight_observers``, a member set to None is skipped (Gemma 4's
    ``v_proj`` under ``attention_k_eq_v``) and the others stay fused, if two or more; a member that is
    the same module as an earlier one (``v_proj = k_proj``) counts once, under its path in
    ``named_modules``; a member that is neither None nor a module leaves the whole group out."""
    path_of = {id(module): path for path, module in model.named_modules()}
    groups = []
    for path, module in model.named_modules():
        for names in FUSED_LAYER_NAMES:
            members = [getattr(module, name, False) for name in names]  # False: no such attribute
            if not all(m is None or isinstance(m, torch.nn.Module) for m in members):
                continue
            paths = {id(m): path_of.get(id(m), f"{path}.{name}" if path else name)  # in the group's order
                     for name, m in zip(names, members) if m is not None}
            if len(paths) >= 2:
                groups.append(tuple(paths.values()))
    return groups


def _amax_of(state, spec: QuantSpec, where=None, **options) -> torch.Tensor:
    # the range compute_qparams maps: the rule's, with ``float_range`` pinned as there; with ``where``,
    # the spec's ``on_uncalibrated`` policy applied to it as compute_qparams applies it
    result = range_of(state, spec, options, "fused")
    if isinstance(result, QParams):
        raise TypeError(f"fused: {type(state).__name__}'s range rule returns QParams, not a range")
    min_val, max_val = result.min_val.float(), result.max_val.float()
    # as `qparams_from_minmax`: a reversed range (min > max) or a non-finite end saw no data
    valid = (min_val <= max_val) & torch.isfinite(min_val) & torch.isfinite(max_val)
    calibrated = valid if result.calibrated is None else calibrated_mask(result.calibrated) & valid
    if where is not None:
        calibrated = check_calibrated(calibrated, spec, where)
    amax = torch.where(calibrated, torch.max(-min_val, max_val), 0.0)
    return torch.clamp(amax, min=0).amax() if amax.numel() else amax.new_zeros(())


def _is_named_group(states) -> bool:
    """A NamedTuple holding states (``QKV(q=..., k=..., v=...)``) with no range rule of its own: a
    group, whose members that are not states (Gemma 4's ``v=None``) `_as_states` then names."""
    try:
        range_rule_for(states)
    except TypeError:
        return any(is_named_tuple(member) for member in states)
    return False


def _as_states(states) -> list:
    if is_named_tuple(states) and not _is_named_group(states):
        return [states]  # one (stacked) state
    if isinstance(states, Mapping):
        raise TypeError("fused: the group must be a sequence of states (q, k, v), got a mapping; pass "
                        "list(group.values())")
    if not isinstance(states, Iterable):
        raise TypeError(f"fused: the group must be a sequence of states (q, k, v), got a {type(states).__name__}")
    states = list(states)
    if not states:
        raise ValueError("fused: the group holds no states")
    for i, state in enumerate(states):
        if not is_named_tuple(state):  # None (an unquantized member), a tensor: not "mixes state types"
            raise TypeError(f"fused: member {i} of the group is a {type(state).__name__}, not an observer state; "
                            "pass the states of the group's quantized members only")
    kinds = {type(s) for s in states}
    if len(kinds) != 1:
        raise TypeError(f"fused: the group mixes state types {sorted(k.__name__ for k in kinds)}")
    return states


def fused_amax(states, spec: QuantSpec, **options) -> torch.Tensor:
    """Absolute maximum (float32 scalar) over all calibrated entries of ``states``: a sequence of
    states, or one state stacked along a leading dimension (all experts of a layer). ``options``
    go to the states' range rule (a histogram's ``method=``)."""
    return _fused_amax(states, spec, None, **options)


def _fused_amax(states, spec: QuantSpec, where: Optional[str], **options) -> torch.Tensor:
    """`fused_amax`; with ``where``, each member under the spec's ``on_uncalibrated`` policy (`_amax_of`)."""
    states = _as_states(states)
    member = lambda i: None if where is None else f"{where}: member {i} of the fused group of {len(states)}"  # noqa: E731
    return torch.stack([_amax_of(s, spec, member(i), **options) for i, s in enumerate(states)]).amax()


def fused_global_scale(states, spec: QuantSpec, **options) -> torch.Tensor:
    """The global scale (float32 scalar) shared by the group, in ``spec.global_scale_formula``'s
    convention. Pure; vmappable over a stacked group of groups.

    Under ``spec.on_uncalibrated="raise"`` an entry of a member that saw no data raises a ValueError
    naming the member, as `compute_qparams` raises for that state (under ``vmap`` such a slice is
    reported, not raised, as there); under ``"fallback"`` it does not contribute, and a group with
    no calibrated entry gets global scale 1, `compute_qparams`' fallback."""
    return _global_scale(states, spec, "fused_global_scale", **options)


def _global_scale(states, spec: QuantSpec, where: str, **options) -> torch.Tensor:
    _check_spec(spec, where)
    if not isinstance(spec.granularity, TensorGroup):
        raise ValueError(f"{where}: only two-level specs (TensorGroup, NVFP4) have a global scale; "
                         f"spec has granularity {spec.granularity!r}")
    return _formats.global_scale_from_amax(_fused_amax(states, spec, where, **options), spec)


def _check_spec(spec, where: str) -> None:
    if not isinstance(spec, QuantSpec):
        raise TypeError(f"{where}: spec must be a QuantSpec, got {type(spec).__name__}")


def fused_qparams(states, spec: QuantSpec, stacked: bool = False, **options):
    """QParams of every state of the group, all under the group's shared global scale.

    Args:
      states: a sequence of states (q/k/v, gate/up; a list, tuple or NamedTuple of them) or, with
        ``stacked=True``, one stacked state.
      spec: a two-level spec (`TensorGroup`); other specs get their usual qparams.
      stacked: compute per-slice qparams with ``torch.func.vmap`` over the leading dimension, as
        the list form of the slices gives (the shared global scale: over every slice's range);
        ``spec.on_uncalibrated="raise"`` raises for a slice that saw no data, as the list form does.
      **options: passed to `compute_qparams`.

    Returns:
      A tuple of QParams (one per state), or one QParams with a leading dimension when stacked.
    """
    check_flag(stacked, "stacked", "fused_qparams")
    if stacked and (not is_named_tuple(states) or _is_named_group(states)):
        raise TypeError(
            f"fused_qparams(stacked=True): states must be one state stacked along a leading dimension, "
            f"got a {type(states).__name__} (pass stacked=False for a sequence of states)"
        )
    _check_spec(spec, "fused_qparams")
    if "global_scale" in options:
        raise TypeError("fused_qparams: global_scale is the group's, computed here; pass none (compute_qparams "
                        "takes global_scale= to impose one)")
    group = [states] if stacked else _as_states(states)  # read an iterator once
    shared = {}
    if isinstance(spec.granularity, TensorGroup):  # the same range method as the scales
        where = "fused_qparams(stacked=True)" if stacked else "fused_qparams"
        shared["global_scale"] = _global_scale(group, spec, where, **options)

    def qparams(state):
        return compute_qparams(state, spec, **shared, **options)

    if not stacked:
        return tuple(qparams(s) for s in group)
    result = torch.func.vmap(qparams)(states)
    # the check's result returned, so that torch.compile keeps it (a discarded one was dead code there)
    return result._replace(calibrated=check_calibrated(result.calibrated, spec, where="fused_qparams(stacked=True)"))
