"""Merging observer states across ``torch.distributed`` ranks with few collectives (docs/distributed.md).

`all_reduce(tree, observers, group)` returns, on every rank, the merge of all ranks' states. States
whose merge is elementwise (`register_reduce_ops`: min, max, sum) are packed into flat buckets per
``(op, dtype, device)`` of at most 64 MiB and all-reduced; the others are gathered once and folded
with ``obs.merge`` in rank order. A 24-byte check first makes ranks passing different trees raise instead of hang.
With ``partial=True``, ranks may hold different sites of a dict tree (`merge_partial_sites`).

>>> import torch, qstats
>>> obs = qstats.minmax(qstats.QuantSpec())
>>> state = obs.update(obs.init(torch.zeros(3)), torch.tensor([1.0, -2.0, 3.0]))
>>> qstats.distributed.all_reduce({"layer": state}, obs)["layer"].max_val  # no process group: unchanged
tensor(3.)
"""

from __future__ import annotations

import hashlib
import pickle
from typing import Any, Mapping, NamedTuple, Optional, Union

import optree
import torch
import torch.distributed as dist

from ._checks import check_available, check_flag
from ._spec import QuantSpec
from .observers._base import Observer, state_types

__all__ = ["REDUCE_OPS", "all_reduce", "extremes_and_sums", "reduce_ops", "register_reduce_ops"]

REDUCE_OPS = ("min", "max", "sum")
"""Field reductions an elementwise state may declare."""

_FOLD = "fold"
# ops declared for a class, and for a class name (qstats' own states, a name given as a string): a name
# covers a class of that name only where no other class is registered under it (`qstats.register_state`),
# so that a user's class named as a qstats state (another ``MinMaxState``) is not merged by qstats' ops
_BY_CLASS: dict[type, Any] = {}
_BY_NAME: dict[str, Any] = {}


def extremes_and_sums(fields) -> dict[str, str]:
    """The ops of a state whose merge is ``min_val`` min, ``max_val`` max (a nested NamedTuple's too,
    ``"ext.min_val"``) and every other field summed (running extremes with counts, histograms);
    usable as ``ops`` of `register_reduce_ops` so the declaration follows the state's fields."""
    return {field: {"min_val": "min", "max_val": "max"}.get(field.rsplit(".", 1)[-1], "sum") for field in fields}


def register_reduce_ops(state_cls: Union[type, str], ops: Any) -> None:
    """Declares how a state type's fields merge across ranks.

    Args:
      state_cls: the state NamedTuple class (its subclasses too), or its class name: a name covers the
        classes of that name but where another class is registered under it (`qstats.register_state`):
        a user's class named as a qstats state is not merged by that state's ops.
      ops: ``{field: "min" | "max" | "sum"}`` when ``obs.merge`` is that field by field (a field of a
        NamedTuple nested in the state is named by its dotted path, ``"ext.low"``; the nested NamedTuple
        itself takes no op); a callable ``fields -> mapping`` (given the dotted names, e.g.
        `extremes_and_sums`); or ``"fold"`` to gather and fold ``obs.merge``.

    Raises:
      TypeError: ``state_cls`` is neither a NamedTuple class nor a name.
      ValueError: an unknown op, or field names that differ from the class's (checked again, nested
        fields included, on the first state `reduce_ops` sees).
    """
    if isinstance(state_cls, str):
        name, fields, registry = state_cls, None, _BY_NAME
    elif isinstance(state_cls, type) and issubclass(state_cls, tuple) and hasattr(state_cls, "_fields"):
        name, fields, registry = state_cls.__name__, state_cls._fields, _BY_CLASS
    else:
        raise TypeError(f"register_reduce_ops: expected a NamedTuple state class or its name, got {state_cls!r}")
    if not (callable(ops) or ops == _FOLD):
        if isinstance(ops, str):
            raise ValueError(f"register_reduce_ops({name}): ops must be a field mapping or 'fold', got {ops!r}")
        ops = dict(ops)
        bad = {field: op for field, op in ops.items() if op not in REDUCE_OPS}
        if bad:
            raise ValueError(f"register_reduce_ops({name}): unknown ops {bad}; use one of {REDUCE_OPS} or 'fold'")
        if fields is not None and {field.split(".")[0] for field in ops} != set(fields):
            raise ValueError(f"register_reduce_ops({name}): ops name fields {sorted(ops)} but the state has fields "
                             f"{sorted(fields)}")
    registry[state_cls] = ops


def _declared_ops(cls: type) -> Any:
    """The ops declared for ``cls`` itself, or for its name where no other class is registered under it."""
    if cls in _BY_CLASS:
        return _BY_CLASS[cls]
    if state_types().get(cls.__name__, cls) is not cls:  # qstats' state of that name, not cls
        return None
    return _BY_NAME.get(cls.__name__)


def is_named_tuple(x: Any) -> bool:
    """Whether ``x`` is a NamedTuple (a state, or one nested in a state's fields)."""
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def named_fields(state: Any, prefix: str = ""):
    """``(name, value)`` of every field of ``state`` in order, each NamedTuple nested in it followed
    by its own fields, named by their dotted path (``"ext"``, ``"ext.low"``, ``"ext.high"``)."""
    for field, value in zip(state._fields, state):
        yield f"{prefix}{field}", value
        if is_named_tuple(value):
            yield from named_fields(value, f"{prefix}{field}.")


def _state_fields(state: Any) -> list[tuple[str, Any]]:
    """``[(name, value), ...]``: the fields of ``state`` in order, those of a NamedTuple nested in it
    walked and named by their dotted path (``"ext.low"``)."""
    return [(name, value) for name, value in named_fields(state) if not is_named_tuple(value)]


def _values(state: Any) -> list:
    """The field values of ``state``, nested NamedTuples walked, in `_state_fields` order."""
    return [leaf for value in state for leaf in (_values(value) if is_named_tuple(value) else (value,))]


def _rebuild(template: Any, values) -> Any:
    """A state of ``template``'s types (nested ones too) holding the next of ``values`` (an iterator)."""
    return type(template)(*(_rebuild(v, values) if is_named_tuple(v) else next(values) for v in template))


def _structure(state: Any) -> str:
    """The state's types and field names, nested NamedTuples included: ``S(ext=Ext(low,high),count)``."""
    inner = ",".join(f"{f}={_structure(v)}" if is_named_tuple(v) else f for f, v in zip(state._fields, state))
    return f"{type(state).__name__}({inner})"


def reduce_ops(state: Any) -> Union[dict[str, str], str]:
    """The declared reduction of ``state``'s type: a ``{field: op}`` dict, or ``"fold"`` (also for
    types nobody declared)."""
    ops = next((ops for ops in map(_declared_ops, type(state).__mro__) if ops is not None), _FOLD)
    if ops == _FOLD:  # declared so, or by nobody
        return ops
    names = [name for name, _ in _state_fields(state)]
    if callable(ops):
        ops = dict(ops(tuple(names)))
        bad = {field: op for field, op in ops.items() if op not in REDUCE_OPS}
        if bad:
            raise ValueError(f"all_reduce: unknown reduce ops {bad} for {type(state).__name__}")
    nested = [(name, value) for name, value in named_fields(state) if name in ops and is_named_tuple(value)]
    if nested:
        name, value = nested[0]
        raise ValueError(f"all_reduce: the reduce ops declared for {type(state).__name__} name {name!r}, a "
                         f"nested {type(value).__name__}; name its fields instead: "
                         f"{[n for n in names if n.startswith(name + '.')]}")
    if set(ops) != set(names):
        raise ValueError(f"all_reduce: the reduce ops declared for {type(state).__name__} name fields "
                         f"{sorted(ops)}, but the state has fields {sorted(names)}")
    return ops


# Elementwise: extremes min/max and every other field summed. Running and memoryless extremes with
# their counts; histograms (integer bucket and under/overflow counts: bit-exact in any order); the
# importance matrix (a float64 sum of squares: exact=True folds it in rank order); GPTQ's sum of
# x^T x; placeholders' counts. (Law 8 of qstats.testing checks each against its observer's merge.)
for _name in ("MinMaxState", "MemorylessMinMaxState", "HistogramState", "IMatrixState", "HessianState",
              "PlaceholderState"):
    register_reduce_ops(_name, extremes_and_sums)
# Not elementwise: moving averages (weighted means), Chan's variance merge, the MSE search's
# widest-range pick, bounded samples, constants kept from the first operand.
for _name in ("MovingAverageMinMaxState", "MomentsState", "MSEState", "MovingAverageMSEState", "RecordingState",
              "FixedQParamsState"):
    register_reduce_ops(_name, _FOLD)


# --------------------------------------------------------------------------------------------
def _is_state(x: Any) -> bool:
    return is_named_tuple(x) and not isinstance(x, Observer)


def _where(path) -> str:
    """A tree path as errors name it."""
    return "/".join(map(str, path)) or "<root>"


def _flatten(tree: Any, observers: Any):
    paths, states, treespec = optree.tree_flatten_with_path(tree, is_leaf=_is_state)
    for path, state in zip(paths, states):
        where = _where(path)
        if not _is_state(state):
            raise TypeError(f"all_reduce: the leaf at {where!r} is a {type(state).__name__}, not an observer state")
        for field, value in _state_fields(state):
            if not isinstance(value, torch.Tensor):
                problem = f"{type(value).__name__}, not a tensor"
            elif value.layout != torch.strided:  # the flat buckets and byte views need dense tensors
                problem = f"{value.layout} tensor, not a dense (strided) one"
            else:
                continue
            raise TypeError(f"all_reduce: field {field!r} of the {type(state).__name__} at {where!r} is a "
                            f"{problem}")
    if isinstance(observers, Observer):
        leaf_observers = [observers] * len(states)
    else:
        is_node_leaf = lambda x: isinstance(x, Observer) or _is_state(x)  # noqa: E731
        try:
            broadcast = optree.tree_broadcast_prefix(observers, tree, is_leaf=is_node_leaf)
        except (ValueError, TypeError) as error:
            raise ValueError(f"all_reduce: the observers tree is not a prefix of the states tree {treespec}: "
                             f"{str(error)[:300]}") from None
        leaf_observers = optree.tree_leaves(broadcast, is_leaf=is_node_leaf)
        for path, obs in zip(paths, leaf_observers):
            if not isinstance(obs, Observer):
                raise TypeError(f"all_reduce: the observer for {_where(path)!r} is a {type(obs).__name__}, "
                                "not a qstats.Observer")
    return paths, states, leaf_observers, treespec


# dtypes every backend reduces (gloo refuses int16, uint16/32/64 and float8 with "Invalid scalar type")
_REDUCIBLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8, torch.int32,
              torch.int64, torch.bool)


def _plan(states, exact: bool):
    """Per state: its ``{field: op}`` dict when reduced elementwise, or None when folded (also when a
    field has a dtype the backends cannot reduce: its raw bytes are gathered and merged by obs.merge)."""
    plan = []
    for state in states:
        ops = reduce_ops(state)
        folds = ops == _FOLD or any(v.dtype not in _REDUCIBLE for v in _values(state))
        if not folds and exact:
            folds = any(ops[f] == "sum" and v.is_floating_point() for f, v in _state_fields(state))
        plan.append(None if folds else ops)
    return plan


# the float dtypes observers keep; float8/float4 fields (of user states, which fold) are not checked for NaN
_NAN_CHECKED = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_values(paths, states, plan) -> None:
    """Raises ValueError where a state is corrupt or the collectives would go wrong on this rank alone:
    a NaN in a floating field that holds none unless the state is corrupt, or folded states on several
    devices. Such fields are every one of a state that counts the values it left out (a ``nonfinite``
    field, as qstats' observers keep; a NaN in a sum would reach every rank, and the mse merge would
    drop one in a range), and any field reduced by min/max (the backends drop a NaN where ``obs.merge``
    keeps it, so the result would depend on the rank order)."""
    checked = [
        (path, state, field, value)
        for path, state, ops in zip(paths, states, plan)
        for field, value in _state_fields(state)
        if value.dtype in _NAN_CHECKED and value.numel() and value.device.type != "meta"
        and ("nonfinite" in state._fields or (ops is not None and ops[field] != "sum"))
    ]
    flags: dict[torch.device, list[torch.Tensor]] = {}
    for *_, value in checked:  # a flag per field, not a copy of it (a Hessian is as large as its layer)
        flags.setdefault(value.device, []).append(value.isnan().any())
    if any(bool(torch.stack(parts).any()) for parts in flags.values()):  # one sync per device
        path, state, field, _ = next(e for e in checked if bool(torch.isnan(e[3]).any()))
        raise ValueError(f"all_reduce: field {field!r} of the {type(state).__name__} at {_where(path)!r} "
                         "holds NaN; observers leave NaN out of their states (counted in nonfinite), so "
                         "the state is corrupt")
    devices = {v.device for state, ops in zip(states, plan) if ops is None for v in _values(state) if v.numel() > 0}
    if len(devices) > 1:
        raise ValueError(f"all_reduce: states to fold live on several devices {sorted(map(str, devices))}")


def _device_numbers(states) -> dict[torch.device, int]:
    """Each device of ``states`` numbered by first use, alike on ranks that pass the same tree on
    devices of other indices (cuda:0 and cuda:8 on one rank, cuda:1 and cuda:9 on the next)."""
    return {device: n for n, device in enumerate(dict.fromkeys(v.device for s in states for v in _values(s)))}


def _check_merges(paths, states, plan, leaf_observers) -> None:
    """Raises ValueError where ``obs.merge`` refuses an elementwise state (a float count, a state of
    another observer, fields of other shapes): the collectives reduce its fields without
    ``obs.merge``, so such a state would merge silently where a sequential merge raises. Folded
    states go through ``obs.merge`` anyway."""
    for path, state, ops, obs in zip(paths, states, plan, leaf_observers):
        if ops is None:
            continue
        try:
            obs.merge(state, state)
        except Exception as error:
            raise ValueError(f"all_reduce: {obs.name}.merge refuses the {type(state).__name__} at "
                             f"{_where(path)!r}: {error}") from error


def _records(paths, states, plan, leaf_observers, devices: Optional[dict] = None) -> list[tuple[str, str, str]]:
    """Per state ``(path, key, description)``: the key holds what must agree across ranks (types and
    fields, nested ones too, the reduction, a folding observer's name, the observer's QuantSpec and
    ``options``, shapes, dtypes and devices numbered by first use, or as ``devices`` numbers them);
    the description says it in words, with this rank's device names."""
    devices = _device_numbers(states) if devices is None else devices
    records = []
    for path, state, ops, obs in zip(paths, states, plan, leaf_observers):
        fields = _state_fields(state)
        spec = _spec_key(obs.spec)
        # folded with this rank's obs.merge: another observer raises on its rank only
        # an option the state does not hold (an averaging constant) would merge into what no observer computes
        options = ", ".join(f"{name}={value!r}" for name, value in getattr(obs, "options", ()))
        key = _structure(state) + repr(ops) + (str(obs.name) if ops is None else "") + spec + options + "".join(
            f"{tuple(v.shape)}{v.dtype}{(v.device.type, devices[v.device])}" for _, v in fields
        )
        merged = f"folded by {obs.name}.merge" if ops is None else "reduced elementwise"
        described = ", ".join(f"{name} {tuple(v.shape)} {str(v.dtype).replace('torch.', '')} on {v.device}"
                              for name, v in fields)
        observed = (f"; observed for {_spec_words(obs.spec)}" if spec else "") + (
            f"; built with {options}" if options else "")
        # a nested state is named with its nested types, which may be all that differs between ranks
        name = _structure(state) if any(map(is_named_tuple, state)) else type(state).__name__
        records.append((_where(path), key, f"a {name} ({merged}; {described}{observed})"))
    return records


def _spec_key(spec: Any) -> str:
    """The repr of an observer's QuantSpec, which every rank must share: states of one shape but
    another granularity (per row and per column of a square weight) hold entries that mean other
    things, and another target gives that rank other qparams from the merged state. Empty for
    other specs, and for a repr naming a memory address (a granularity class of the user's
    without a dataclass repr), which differs between processes."""
    text = repr(spec) if isinstance(spec, QuantSpec) else ""
    return "" if " at 0x" in text else text


def _spec_words(spec: QuantSpec) -> str:
    """The spec's fields that differ from ``QuantSpec()``'s, as its repr writes them."""
    default = QuantSpec()
    changed = [f"{name}={getattr(spec, name)!r}" for name in spec.__dataclass_fields__
               if getattr(spec, name) != getattr(default, name)]
    return f"QuantSpec({', '.join(changed)})"


def _fingerprint(treespec, records) -> int:
    digest = hashlib.sha256(str(treespec).encode())
    for _, key, _ in records:
        digest.update(key.encode() + b"\0")  # one state's key cannot run into the next's
    return _as_int(digest.digest())


def _bucket_key(op: str, value: torch.Tensor):
    if op == "sum" and value.dtype == torch.bool:  # torch adds bools as a logical or; the backends add
        op = "max"  # their bytes (3 where three ranks set a flag, 0 past 255 ranks)
    if op == "max" and value.is_floating_point():
        return ("min", value.dtype, value.device), True  # max(x) == -min(-x), exactly
    return (op, value.dtype, value.device), False


def all_reduce(
    tree: Any,
    observers: Any,
    group: Optional[Any] = None,
    *,
    exact: bool = False,
    check: bool = True,
    partial: bool = False,
) -> Any:
    """Merges the states in ``tree`` across all ranks of ``group``; every rank gets the result.

    Costs 1 check + one ``all_reduce`` per elementwise bucket (of at most 64 MiB, a larger field alone)
    + one ``all_gather`` if some state folds (minmax states: 1 + 2). Memory: the states, their results
    and one bucket (plus every rank's copy of the folded states). Min/max/integer-sum states equal ``reduce(obs.merge, [s_rank0, ...])`` bit
    for bit, as do folded ones; floating sums equal it up to rounding unless ``exact=True``.

    Args:
      tree: nested dict/list/tuple of observer states (NamedTuples of tensors, or of NamedTuples of
        tensors), alike on every rank (a rank without data passes ``obs.init`` states). Pass activation
        sites only: weight states would be counted ``world`` times.
      observers: a tree of `qstats.Observer` whose structure is a prefix of ``tree``'s, or one Observer;
        every state must be one its observer's ``merge`` accepts, and every rank's observers must have
        the same QuantSpecs (else ValueError on every rank).
      group: the process group (default: the world).
      exact: fold states with floating ``sum`` fields in rank order, bit-identical to a sequential merge.
      check: first verify with one 24-byte collective that all ranks pass the same tree.
      partial: ranks may hold different subsets of the sites of a dict tree (a rank without batches,
        an expert no token reached on a rank): a site only some ranks hold is merged from them with
        ``obs.merge`` in rank order and returned on every rank (`merge_partial_sites`); needs ``check``
        (ValueError with ``check=False``). ``observers`` may then hold every rank's sites.

    Returns:
      A new tree of the same structure (with ``partial``, where the ranks' sites differ: nested dicts
      of every rank's sites); ``tree`` itself without a process group, with one rank, or on a rank
      outside ``group``.

    Raises:
      TypeError: ``exact``, ``check`` or ``partial`` is not True or False, before any collective; with
        a process group and a ``check`` other than False (one that is no bool joins the check too),
        any of them that is not raises ValueError on every rank that joins the check instead, after
        it (the other ranks would wait in it).
    """
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    flag_error = _flag_error(check, exact, partial)
    # a rank joins the check unless it passed check=False: one whose check is no bool (None or "no" from its
    # config) joins it too and fails there, on every rank that joins, instead of raising alone
    joins = check is not False
    if flag_error is not None and not (world > 1 and joins):
        raise flag_error
    if flag_error is None and partial and not check:  # the check finds the sites the ranks hold
        # differently: without it their collectives would pair buffers of other sizes (gloo aborts the
        # process) or other sites
        raise ValueError("all_reduce: partial=True needs check=True: the check is the collective that finds the "
                         "sites that only some ranks hold")
    states = treespec = plan = records = local_error = None
    if partial is True:
        observers = _pruned(observers, tree)
    try:  # validated locally, but raised only after every rank has joined the check
        if flag_error is not None:
            raise flag_error
        paths, states, leaf_observers, treespec = _flatten(tree, observers)
        plan = _plan(states, exact)
        if world > 1:  # what the collectives would get wrong (one process: the tree comes back as it is)
            _check_values(paths, states, plan)
            _check_merges(paths, states, plan, leaf_observers)
            records = _records(paths, states, plan, leaf_observers)
    except Exception as error:  # any local failure (a user's reduce-ops callable, say) raises on every rank
        local_error = error
    if world > 1 and joins:
        fingerprint = -1 if local_error is not None else _fingerprint(treespec, records)
        report = {"exact": exact, "partial": partial, "treespec": str(treespec), "records": records}
        if _check_same_trees(fingerprint, local_error, group, report, partial):
            common, common_observers, merged = merge_partial_sites(tree, observers, group)
            return _joined(all_reduce(common, common_observers, group, exact=exact), merged)
    elif local_error is not None:  # without the check every rank must pass a valid tree
        raise local_error
    if world <= 1 or not states:
        # no process group, one rank, or this rank is not in ``group`` (size -1): no-op, as
        # torch's collectives
        return tree

    # per state its fields, or where it folds the state obs.merge returns (of the class it returns)
    results: list = [[None] * len(_values(s)) for s in states]
    _reduce_elementwise(states, plan, group, results)
    _gather_and_fold(paths, states, plan, leaf_observers, group, world, results)
    new_states = [result if _is_state(result) else _rebuild(state, iter(result))
                  for state, result in zip(states, results)]
    return optree.tree_unflatten(treespec, new_states)


def _flag_error(check: Any, exact: Any, partial: Any) -> Optional[TypeError]:
    """`check_flag`'s TypeError for the first of ``check``, ``exact`` and ``partial`` that is not True or False."""
    for name, flag in (("check", check), ("exact", exact), ("partial", partial)):
        try:
            check_flag(flag, name, "all_reduce")
        except TypeError as error:
            return error
    return None


# The most bytes one all_reduce packs several fields into: the result's fields own their memory, so
# each is copied out of the reduced buffer, which (this size at most) lives beside them meanwhile. A
# field as large alone is reduced in a buffer of its own that becomes the result: no copy.
BUCKET_BYTES = 64 << 20


def _reduce_elementwise(states, plan, group, results) -> None:
    """One all_reduce per (op, dtype, device) bucket of at most `BUCKET_BYTES` (a larger field
    alone), into ``results``: the peak is the states, their results and one bucket."""
    buckets: dict[tuple, list[tuple[int, int, bool]]] = {}
    leaves = [_values(state) for state in states]
    for i, (state, ops) in enumerate(zip(states, plan)):
        if ops is None:
            continue
        for j, (field, value) in enumerate(_state_fields(state)):
            key, negate = _bucket_key(ops[field], value)
            buckets.setdefault(key, []).append((i, j, negate))
    for key in _bucket_order(buckets, _device_numbers(states)):
        # runs of at most BUCKET_BYTES, alike on every rank (the check compares shapes and dtypes)
        for run in _runs([leaves[i][j].nbytes for i, j, _ in buckets[key]]):
            members = [buckets[key][index] for index in run]
            # a copy (inputs stay as they are), without autograd history: the collective is not differentiable
            flat = torch.cat([leaves[i][j].detach().reshape(-1) for i, j, _ in members])
            sizes = [leaves[i][j].numel() for i, j, _ in members]
            for (_, _, negate), piece in zip(members, flat.split(sizes)):
                if negate:
                    piece.neg_()  # max(x) == -min(-x), exactly
            dist.all_reduce(flat, op=getattr(dist.ReduceOp, key[0].upper()), group=group)
            for (i, j, negate), piece in zip(members, flat.split(sizes)):
                # a field of its own, not a view of a shared buffer (which torch.save would write whole)
                owned = piece if len(members) == 1 else piece.clone()
                results[i][j] = (owned.neg_() if negate else owned).reshape(leaves[i][j].shape)


def _bucket_order(keys, devices: dict) -> list:
    """The ``(op, dtype, device)`` bucket keys in the order every rank all-reduces them: devices by
    first use (`_device_numbers`), as the check compares them, not by name (``cuda:10`` sorts before
    ``cuda:9``, and a rank's first device may have the higher index: the ranks would pair buckets of
    other devices and sizes)."""
    return sorted(keys, key=lambda k: (k[0], str(k[1]), devices[k[2]]))


def _gather_and_fold(paths, states, plan, leaf_observers, group, world: int, results) -> None:
    """One all_gather of every folded state's raw bytes, then ``obs.merge`` in rank order (every
    rank folds the same states: where a merge refuses one, every rank raises, naming it)."""
    folded = [i for i, ops in enumerate(plan) if ops is None]
    if not folded:
        return
    local = _pack([states[i] for i in folded])
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local, group=group)
    del local
    per_rank = [_unpack(gathered.pop(0), [states[i] for i in folded]) for _ in range(world)]  # each freed once read
    for k, i in enumerate(folded):
        obs, where, merged = leaf_observers[i], _where(paths[i]), per_rank[0][k]
        for rank in range(1, world):  # in rank order
            merged = _merge_named(obs, where, group, merged, per_rank[rank][k], range(rank), rank)
        results[i] = merged


def _merge_named(obs: Observer, where: str, group, state, other, into, source: int):
    """``obs.merge(state, other)``, after ValueError naming the tree path and the ranks (in the world)
    where ``obs.merge`` refuses the pair (the constants of two ``fixed_qparams``, say: each rank's
    state passed its own checks), or where it returns no state (its fields would be read from whatever
    it returned): ``other`` is rank ``source``'s, ``state`` merges ranks ``into``'s."""
    ranks = [_world_rank(group, i) for i in (*into, source)]
    merging = f"merging the {type(other).__name__} of rank {ranks[-1]} at {where!r} into that of rank(s) {ranks[:-1]}"
    try:
        merged = obs.merge(state, other)
    except Exception as error:
        raise ValueError(f"all_reduce: {obs.name}.merge raised {merging}: {error}") from error
    if not _is_state(merged):
        raise ValueError(f"all_reduce: {obs.name}.merge returned a {type(merged).__name__}, not a state, {merging}")
    return merged


def _world_rank(group, rank: int) -> int:
    """``rank`` of ``group`` as a rank of the world (messages name ranks so; broadcasts take them)."""
    return dist.get_global_rank(group, rank) if group is not None else rank


def _as_int(digest: bytes) -> int:
    """62 bits of a digest: its negation never overflows int64 (`_min_over_ranks` takes min and -max)."""
    return int.from_bytes(digest[:8], "little") >> 2


def _min_over_ranks(values: list, group) -> list:
    """The elementwise minimum of ``values`` (int64) over the ranks of ``group``: one small collective."""
    probe = torch.tensor(values, dtype=torch.int64, device=_probe_device(group))
    dist.all_reduce(probe, op=dist.ReduceOp.MIN, group=group)
    return probe.tolist()


def _same_on_every_rank(probe: list, value: int) -> bool:
    """Whether every rank held ``value``: the minimum of it and the minimum of its negation agree."""
    return probe[0] == value and -probe[1] == value


def check_same_arguments(arguments: Mapping[str, Any], where: str, group=None) -> None:
    """ValueError on every rank unless every rank of ``group`` passed the same ``arguments`` (compared
    by their repr): arguments that decide which collectives run would otherwise leave ranks waiting.
    The message names each argument that differs and its value on every rank."""
    given = {name: repr(value) for name, value in arguments.items()}
    value = _as_int(hashlib.sha256(repr(sorted(given.items())).encode()).digest())
    if _same_on_every_rank(_min_over_ranks([value, -value], group), value):
        return
    ranks, reports = _gather_from_ranks(given, group)
    names = list(dict.fromkeys(name for report in reports for name in report))
    listed = "; ".join(
        ", ".join(f"{name}={report.get(name, '<none>')} on rank {rank}" for rank, report in zip(ranks, reports))
        for name in names if len({report.get(name) for report in reports}) > 1
    )
    raise ValueError(f"{where}: the ranks passed different arguments ({listed[:2000]}); every rank passes the same "
                     "ones but its batches")


def _gather_from_ranks(report: Any, group) -> tuple[list, list]:
    """``(ranks, reports)``: every rank's ``report`` (plain Python data) with its rank in the world, in
    the order of the ranks of ``group``; one all_gather_object, for the messages of failed checks."""
    reports = [None] * dist.get_world_size(group)
    dist.all_gather_object(reports, report, group=group)
    return [_world_rank(group, i) for i in range(len(reports))], reports


def _gather_valid(report: Any, error: Optional[Exception], detail: Any, group) -> tuple[list, list]:
    """`_gather_from_ranks` of this rank's ``report``, or of ``{"error": detail}`` where its tree
    failed its local checks (raising ``error``); then ValueError on every rank where any rank's tree
    failed them, naming each such rank and its error."""
    ranks, reports = _gather_from_ranks(report if error is None else {"error": str(detail)}, group)
    if error is not None:  # named by its rank too, as the other ranks' messages name it
        raise ValueError(f"all_reduce: this rank's tree is not valid (rank {ranks[dist.get_rank(group)]}): "
                         f"{detail}") from error
    failed = "; ".join(f"rank {rank}: {r['error']}" for rank, r in zip(ranks, reports)
                       if isinstance(r, dict) and "error" in r)
    if failed:
        raise ValueError(f"all_reduce: another rank's tree failed its local checks ({failed[:2000]})")
    return ranks, reports


def _check_same_trees(fingerprint: int, local_error, group, report: dict, partial: bool = False) -> bool:
    """One 24-byte collective: every rank learns whether all ranks passed the same valid tree,
    so that every rank raises ValueError (none waits for a rank that raised before it). Where they
    did not, one more collective gathers every rank's error or tree, so that each rank's message
    names the rank, the tree path and what differs there. With ``partial``, valid trees that differ
    return True instead (on every rank): the caller merges them site by site."""
    failed = 1 if local_error is not None else 0
    probe = _min_over_ranks([fingerprint, -fingerprint, -failed], group)
    if probe[2] == 0 and _same_on_every_rank(probe, fingerprint):
        return False
    detail = local_error if isinstance(local_error, (TypeError, ValueError)) else repr(local_error)
    ranks, reports = _gather_valid(report, local_error, detail, group)  # every rank is here: the probe told them all
    for name in ("exact", "partial"):  # exact=True folds the float sums that exact=False reduces elementwise
        values = {r.get(name, False): rank for rank, r in reversed(list(zip(ranks, reports)))}  # each one's first rank
        if len(values) > 1:
            listed = " and ".join(f"{name}={value} on rank {rank}" for value, rank in sorted(values.items()))
            raise ValueError(f"all_reduce: the ranks passed different arguments: {listed}; every rank passes the "
                             f"same {name}=")
    if partial:
        return True
    hint = "" if report["records"] else (
        " (no states here: a rank that calibrated no batch has no activation states; pass partial=True, "
        "give every rank at least one batch, or pass each missing site's observer init state)")
    raise ValueError(
        f"all_reduce: the ranks passed different state trees: {_first_difference(reports, ranks)}; this rank's "
        f"tree is {report['treespec'][:1000]} with {len(report['records'])} states{hint}"
    )


def _first_difference(reports: list, ranks: list) -> str:
    """Where the first rank whose tree differs from the first rank's differs from it, in words."""
    first = {path: (key, text) for path, key, text in reports[0]["records"]}
    for rank, report in zip(ranks[1:], reports[1:]):
        here = {path: (key, text) for path, key, text in report["records"]}
        for path, (key, text) in first.items():
            if path not in here:
                return f"rank {ranks[0]} holds {text} at {path!r}, rank {rank} holds nothing at {path!r}"
            if here[path][0] != key:
                return f"at {path!r} rank {ranks[0]} holds {text}, rank {rank} holds {here[path][1]}"
        for path, (key, text) in here.items():
            if path not in first:
                return f"rank {rank} holds {text} at {path!r}, rank {ranks[0]} holds nothing at {path!r}"
        if report["treespec"] != reports[0]["treespec"]:
            return (f"the containers differ: rank {ranks[0]} has {reports[0]['treespec'][:500]}, rank {rank} has "
                    f"{report['treespec'][:500]}")
    return "(structure, state types, folding observers, field shapes, dtypes or devices differ)"


def _probe_device(group) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _pack(states) -> torch.Tensor:
    parts = [flat_unit_stride(value).view(torch.uint8) for state in states for value in _values(state)
             if value.numel() > 0]
    if not parts:
        device = next((v.device for s in states for v in _values(s)), torch.device("cpu"))
        return torch.zeros(0, dtype=torch.uint8, device=device)
    return torch.cat(parts)


def flat_unit_stride(value: torch.Tensor) -> torch.Tensor:
    """``value`` as a 1-D unit-stride tensor of its own values (conjugate and negative bits resolved),
    for a byte view (here and in `qstats.io`). ``contiguous()`` keeps a one-element view's stride
    (``x[:1, 0]`` of a (5, 3) tensor has stride 3), which the byte view refuses."""
    flat = value.detach().resolve_conj().resolve_neg().reshape(-1)
    return flat if flat.stride(0) == 1 else flat.clone(memory_format=torch.contiguous_format)


def _unpack(buffer: torch.Tensor, templates):
    """The states ``templates`` (shapes, dtypes) from a buffer that `_pack` made of them."""
    sizes = [value.numel() * value.element_size() for state in templates for value in _values(state)]
    raws = iter(buffer.split(sizes))
    return [
        _rebuild(state, iter([next(raws).clone().view(value.dtype).reshape(value.shape) for value in _values(state)]))
        for state in templates
    ]


# ---- trees whose ranks hold different subsets of a dict's sites ------------------------------
def _units(tree: Any, prefix: tuple = ()):
    """``(key path, subtree)`` of each part of ``tree`` reached through dicts only, in insertion
    order: the parts a rank may lack (an expert no token reached on it, every activation site of a
    rank without batches). A tree that is not a dict is one part, at ``()``."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _units(value, (*prefix, key))
    else:
        yield prefix, tree


def _nested(units) -> Any:
    """The nested dicts holding each ``(key path, subtree)`` of ``units`` (the subtree itself at ``()``)."""
    root: dict = {}
    for path, subtree in units:
        if not path:
            return subtree
        node = root
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = subtree
    return root


def _joined(tree: Any, other: dict) -> Any:
    """``tree`` with the parts of ``other`` (nested dicts at key paths ``tree`` lacks) added."""
    if not other:
        return tree
    out = dict(tree)
    for key, value in other.items():
        out[key] = _joined(out[key], value) if key in out else value
    return out


def _pruned(observers: Any, tree: Any) -> Any:
    """``observers`` without the dict keys ``tree`` lacks: one observers tree of every site serves a
    rank that holds fewer of them."""
    if isinstance(observers, dict) and isinstance(tree, dict):
        return {key: _pruned(value, tree[key]) for key, value in observers.items() if key in tree}
    return observers


class _Part(NamedTuple):
    """One part of a rank's tree (`_units`): its states and their observers in flattening order."""

    path: tuple
    subtree: Any
    treespec: Any
    states: list
    observers: list
    key: int  # what every rank holding the part must agree on, hashed
    text: str  # the part in words, for the message where ranks disagree


def _local_parts(tree: Any, observers: Any) -> list:
    """This rank's `_Part`s of ``tree``; raises what `_flatten` raises for an invalid tree."""
    paths, states, leaf_observers, _ = _flatten(tree, observers)
    by_path = {tuple(path): (path, state, obs) for path, state, obs in zip(paths, states, leaf_observers)}
    parts = []
    for prefix, subtree in _units(tree):
        inner, _, treespec = optree.tree_flatten_with_path(subtree, is_leaf=_is_state)
        held = [by_path[(*prefix, *path)] for path in inner]
        paths_, states_, observers_ = ([item[i] for item in held] for i in range(3))
        # the device index is left out: a rank's devices are numbered by first use over the states it holds
        records = _records(paths_, states_, _plan(states_, False), observers_,
                           {v.device: 0 for state in states_ for v in _values(state)})
        text = "; ".join(text for _, _, text in records)
        if not _is_state(subtree):  # its containers too: ranks holding [s, s] and (s, s) differ by them alone
            text = f"{str(treespec)[:200]} of {text}" if text else f"an empty {str(treespec)[:200]}"
        parts.append(_Part(prefix, subtree, treespec, states_, observers_, _fingerprint(treespec, records), text))
    return parts


def _first_conflict(union: list, held: list) -> Optional[tuple]:
    """``(key path, why)`` of the first part that ranks hold differently (another key), or that one
    rank holds where another holds a dict of parts; None when the ranks differ by missing parts only."""
    every = set(union)
    for path in union:
        keys = {rank_held[path] for rank_held in held if path in rank_held}
        if len(keys) > 1:
            return path, "states"
        below = next((path[:n] for n in range(len(path)) if path[:n] in every), None)
        if below is not None:
            return below, "dict"
    return None


def _conflict_error(path: tuple, parts: dict, group) -> ValueError:
    """The ValueError every rank raises where ranks hold different things at ``path``: what each
    holds there, named by rank (one all_gather_object, the message only)."""
    below = any(other[:len(path)] == path for other in parts)
    mine = parts[path].text if path in parts else "a dict of states" if below else None
    ranks, texts = _gather_from_ranks(mine, group)
    holding = [(rank, text) for rank, text in zip(ranks, texts) if text is not None]
    (first, text), others = holding[0], [(rank, other) for rank, other in holding[1:] if other != holding[0][1]]
    rank, other = others[0] if others else holding[1]
    return ValueError(f"all_reduce: the ranks passed different state trees: at {_where(path)!r} rank {first} holds "
                      f"{text}, rank {rank} holds {other}")


def merge_partial_sites(tree: Any, observers: Any, group: Optional[Any] = None, *,
                        device: Optional[torch.device] = None) -> tuple:
    """Splits ``tree`` into the parts every rank of ``group`` holds and merges those only some hold.

    A part is what ``tree`` holds below dicts only (a site's state in ``{path: {site: state}}``).
    A module that only some ranks' batches call (an expert no token reached on a rank) or a rank
    without batches leaves parts on some ranks alone: each holder but the first sends its states
    to the first (one broadcast per rank and 64 MiB), which merges them with ``obs.merge`` in rank
    order and sends the result to every rank. Costs 2 all_gather_object, plus where parts are
    missing a third, one small all_reduce and at most two broadcasts per rank (and a fourth
    all_gather_object where an ``obs.merge`` returns other dtypes or shapes than it is given).

    Returns:
      ``(common, common_observers, merged)``: the parts every rank holds (nested dicts, in one order
      on every rank) and their observers, and the merged parts (nested dicts, alike on every rank, on
      ``device``, default the device the group communicates through).

    Raises:
      ValueError: on every rank, where a rank's tree fails its local checks or its ``device`` is none
        this process can use, ranks hold parts of other state types, shapes, dtypes or specs at one
        key path, or ``obs.merge`` refuses a pair.
    """
    error = parts = None
    try:
        if device is not None:  # here, not where the merged sites arrive: the other ranks would wait there
            device = _usable_device(device)
        parts = {part.path: part for part in _local_parts(tree, observers)}
    except Exception as caught:  # raised below, once every rank knows
        error = caught
    report = [(path, part.key) for path, part in parts.items()] if error is None else None
    _, reports = _gather_valid(report, error, error, group)
    held = [dict(r) for r in reports]
    union = list(dict.fromkeys(path for r in reports for path, _ in r))
    conflict = _first_conflict(union, held)
    if conflict is not None:
        raise _conflict_error(conflict[0], parts, group)
    common = [path for path in union if all(path in rank_held for rank_held in held)]
    partial = [(path, [i for i, rank_held in enumerate(held) if path in rank_held]) for path in union
               if path not in common]
    observed = _nested((path, optree.tree_unflatten(parts[path].treespec, parts[path].observers)) for path in common)
    merged = _merged_parts(partial, parts, group, device or _probe_device(group)) if partial else {}
    return _nested((path, parts[path].subtree) for path in common), observed, merged


def _usable_device(device: Any) -> torch.device:
    """``device`` as a torch.device this process can put tensors on, else ValueError naming it."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"merge_partial_sites: device {device!r} is no device: {error}") from None
    check_available(device, "merge_partial_sites")
    return device


def _meta(subtree: Any) -> Any:
    """``subtree`` with every state's tensors on the meta device: its types, shapes and dtypes, sent
    to the ranks that lack the part."""
    return optree.tree_map(lambda state: _rebuild(state, iter([v.detach().to("meta") for v in _values(state)])),
                           subtree, is_leaf=_is_state)


def _merged_parts(partial: list, parts: dict, group, device: torch.device) -> dict:
    """The parts ``[(key path, holders), ...]`` merged from their holders in rank order, on every rank."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    mine = {path: _meta(parts[path].subtree) for path, holders in partial if holders[0] == rank}
    try:  # before the gather, which would fail on this rank alone and leave the others waiting
        pickle.dumps(mine)
        error = None
    except Exception as caught:
        error = caught
    _, sent = _gather_valid(mine, error, f"the states of parts only it holds cannot be sent to the other ranks "
                                         f"(a state class pickle cannot import: {error})", group)
    templates = {path: optree.tree_flatten(sent[holders[0]][path], is_leaf=_is_state) for path, holders in partial}
    first = {path: holders[0] for path, holders in partial}
    local = {path: part.states for path, part in parts.items()}
    received: dict = {}
    for source in range(world):  # every holder but the first sends its states to the first
        paths = [path for path, holders in partial if source in holders[1:]]
        for path, part in _broadcast_parts(paths, local, templates, source, group, device):
            if first[path] == rank:
                received.setdefault(path, []).append((source, part))
    merged, changed, error = {}, {}, None
    for path, holders in partial:
        if holders[0] == rank and error is None:
            try:
                merged[path] = _merged_states(parts[path], received.get(path, []), holders, group)
                # obs.merge may return other dtypes or shapes than it was given (a moving average's float32
                # merge of bfloat16 states): the ranks that receive them learn them first, or buffers differ
                if _layout(merged[path]) != _layout(templates[path][0]):
                    changed[path] = (_meta(merged[path]), templates[path][1])
            except Exception as caught:  # raised below, once every rank knows
                error = caught
    flag = _min_over_ranks([-2 if error is not None else -1 if changed else 0], group)[0]
    if flag == -2:
        ranks, errors = _gather_from_ranks(None if error is None else str(error), group)
        if error is not None:
            raise error
        raise ValueError(f"all_reduce: another rank's merge failed ({[e for e in errors if e][0][:2000]})")
    if flag == -1:
        for report in _gather_from_ranks(changed, group)[1]:
            templates.update(report)
    out = {}
    for source in range(world):  # each first holder sends the merged states to every rank
        paths = [path for path, holders in partial if holders[0] == source]
        for path, part in _broadcast_parts(paths, merged, templates, source, group, device):
            out[path] = optree.tree_unflatten(templates[path][1], part)
    return _nested((path, out[path]) for path, _ in partial)


def _layout(states: list) -> list:
    """The types, shapes and dtypes of ``states``, which a broadcast of their bytes must agree on."""
    return [(_structure(state), *((tuple(v.shape), v.dtype) for v in _values(state))) for state in states]


def _runs(sizes: list) -> list:
    """The indexes of ``sizes`` in consecutive runs of at most `BUCKET_BYTES` in all (a larger one alone)."""
    runs: list = []
    total = 0
    for index, size in enumerate(sizes):
        if not runs or total + size > BUCKET_BYTES:
            runs.append([])
            total = 0
        runs[-1].append(index)
        total += size
    return runs


def _broadcast_parts(paths: list, held: dict, templates: dict, source: int, group, device: torch.device) -> list:
    """``[(path, its states), ...]`` of the parts at ``paths``, as rank ``source`` holds them in
    ``held``, on every rank (`_broadcast_states`; ``templates`` give every rank their shapes)."""
    states = [state for path in paths for state in held[path]] if source == dist.get_rank(group) else None
    shapes = [state for path in paths for state in templates[path][0]]
    received = iter(_broadcast_states(states, shapes, source, group, device))
    return [(path, [next(received) for _ in templates[path][0]]) for path in paths]


def _merged_states(part: _Part, received: list, holders: list, group) -> list:
    """The part's states merged with those ``received`` from the other ``holders``, in rank order."""
    merged = list(part.states)
    for source, states in received:
        into = [holder for holder in holders if holder < source]
        merged = [_merge_named(obs, _where(part.path), group, state, other, into, source)
                  for obs, state, other in zip(part.observers, merged, states)]
    return merged


def _broadcast_states(states: Optional[list], templates: list, source: int, group, device: torch.device) -> list:
    """``source``'s ``states`` (None on the other ranks), shaped as ``templates``, on every rank on
    ``device``: one broadcast of their bytes per run of at most `BUCKET_BYTES` (a larger state alone)."""
    through = _probe_device(group)
    sizes = [sum(v.numel() * v.element_size() for v in _values(state)) for state in templates]
    out: list = []
    for indexes in _runs(sizes):
        if states is not None:
            buffer = _pack([states[i] for i in indexes]).to(through)
        else:
            buffer = torch.empty(sum(sizes[i] for i in indexes), dtype=torch.uint8, device=through)
        if buffer.numel():
            dist.broadcast(buffer, src=_world_rank(group, source), group=group)
        out += _unpack(buffer.to(device), [templates[i] for i in indexes])
    return out
