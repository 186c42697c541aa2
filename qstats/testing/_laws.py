"""Law checks for observers: plain functions over concrete batches, needing only torch.

Integer, bool and ordinary float fields compare bit for bit. Float fields holding sums (a state
class's ``approx_fields``) compare to `DEFAULT_RTOL` of the largest magnitude among the compared
states and the states they were built from (a sum that cancels is only as precise as its terms);
NaN and infinite entries must match exactly. ``exact=False`` observers compare every float field
to that tolerance in the associativity check.

``batch_dims``: the number of leading dimensions of every batch, state field and weight that index
independent slices (the experts of a `qstats.stacked_observer`, ``batch_dims=1``). Empty batches, row
masks, concatenations and kept rows act on the rows inside each slice (dimension ``batch_dims``),
``compute_qparams`` and ``fake_quantize`` are vmapped over those dimensions, and `check_vmap` also
checks that each slice is observed independently of the others.
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import Any, Iterable, Optional, Sequence

import optree
import torch

from .. import distributed
from .. import tree as qtree
from .._checks import as_index, is_real_number
from .._qparams import NoStatistics, compute_qparams
from .._quant import fake_quantize
from .._spec import QuantSpec
from .._warn import warn
from ..observation import raise_renamed
from ..observers._base import state_types

__all__ = [
    "DEFAULT_RTOL",
    "assert_states_equal",
    "check_identity",
    "check_associative",
    "check_commutative",
    "check_homomorphism",
    "check_purity",
    "check_stability",
    "check_vmap",
    "check_compile",
    "check_distributed",
]

DEFAULT_RTOL = 1e-5
"""Relative tolerance for ``approx_fields`` (float sums), relative to the field's largest magnitude."""

_ALL_FLOAT = "*"


def _declared_approx_fields(tree: Any) -> set:
    """Union of the ``approx_fields`` declared by the NamedTuple classes inside ``tree``."""
    if isinstance(tree, torch.Tensor) or optree.tree_is_leaf(tree):
        return set()
    found = set(getattr(type(tree), "approx_fields", ())) if hasattr(type(tree), "_fields") else set()
    for child in optree.tree_flatten_one_level(tree)[0]:
        found |= _declared_approx_fields(child)
    return found


def _approx_set(state: Any, approx_fields: Optional[Iterable[str]]) -> frozenset:
    if approx_fields is None:
        return frozenset(_declared_approx_fields(state))
    return frozenset((approx_fields,) if isinstance(approx_fields, str) else approx_fields)


def _finite_magnitude(terms: list) -> float:
    """Largest finite ``|t|`` among the float tensors of ``terms`` (0 for none, empty or all non-finite)."""
    magnitude = 0.0
    for term in terms:
        if isinstance(term, torch.Tensor) and term.is_floating_point() and term.numel():
            values = term.detach().double().abs()
            magnitude = max(magnitude, float(torch.where(torch.isfinite(values), values, 0).amax()))
    return magnitude


_APPROX_HINT = ("; if it holds a float sum, which rounds differently when the data is split, list it in the "
                "state class's approx_fields")


def _leaf_difference(actual: torch.Tensor, expected: torch.Tensor, approx: bool, rtol: float,
                     magnitude: float = 0.0, hint: str = "") -> Optional[str]:
    if actual.is_floating_point():
        a_nan, e_nan = torch.isnan(actual), torch.isnan(expected)
        if not torch.equal(a_nan, e_nan):
            return "NaN entries differ"
        a_inf = torch.isinf(actual)
        # equal where-results imply equal masks: an infinity is never 0
        if not torch.equal(torch.where(a_inf, actual, 0), torch.where(torch.isinf(expected), expected, 0)):
            return "infinite entries differ"
        finite = ~(a_nan | a_inf)
        a = torch.where(finite, actual, 0).double()
        e = torch.where(finite, expected, 0).double()
        if a.numel() == 0 or (not approx and torch.equal(a, e)):
            return None
        worst = (a - e).abs().max()
        if not approx:
            return f"not bit-exact (largest difference {float(worst):.3g}){hint}"
        bound = rtol * max(float(a.abs().max()), float(e.abs().max()), magnitude) + 1e-300
        if worst > bound:
            return f"differs by {float(worst):.3g} > tolerance {float(bound):.3g} (rtol {rtol})"
        return None
    return None if torch.equal(actual, expected) else "not equal"


def assert_states_equal(actual: Any, expected: Any, *, approx_fields: Optional[Iterable[str]] = None,
                        rtol: float = DEFAULT_RTOL, message: str = "",
                        magnitudes: Sequence[Any] = ()) -> None:
    """Asserts two trees of tensors (states, QParams, ...) are equal under the module's policy.

    Args:
      actual, expected: trees of identical structure, shapes and dtypes (checked strictly).
      approx_fields: fields compared to ``rtol``; None reads the state class's; ``"*"``: every float field.
      rtol: tolerance for those fields, relative to the field's largest magnitude.
      message: prefix of the AssertionError.
      magnitudes: trees of the states the compared ones were built from, whose magnitudes also scale
        the tolerance.

    Raises:
      AssertionError: naming the path of the first differing leaf and how it differs.
    """
    prefix = f"{message}: " if message else ""
    # NaN or inf passed every difference (a difference > NaN is False), a negative one failed equal states
    if not (is_real_number(rtol) and 0 <= float(rtol) < math.inf):
        raise ValueError(f"assert_states_equal: rtol must be a finite non-negative number, got {rtol!r}")
    try:
        qtree.assert_same_structure(actual, expected, name="state")
    except ValueError as error:
        raise AssertionError(f"{prefix}{error}") from None
    approx = _approx_set(expected, approx_fields)
    expected_leaves = dict(qtree.leaves_with_paths(expected, "state"))
    magnitude_leaves = [dict(qtree.leaves_with_paths(tree, "state")) for tree in magnitudes]
    # the hint where the tolerance comes from the state class (not where the law is bit-exact)
    hint = _APPROX_HINT if approx_fields is None else ""
    for path, leaf in qtree.leaves_with_paths(actual, "state"):
        other = expected_leaves[path]
        if not isinstance(leaf, torch.Tensor):
            continue
        field_approx = _ALL_FLOAT in approx or path.rsplit(".", 1)[-1] in approx
        # only float sums compare to a tolerance that these magnitudes scale
        magnitude = _finite_magnitude([leaves.get(path) for leaves in magnitude_leaves if field_approx])
        problem = _leaf_difference(leaf, other, field_approx, rtol, magnitude, hint)
        if problem is not None:
            raise AssertionError(f"{prefix}{path} {problem}\n  got:      {leaf}\n  expected: {other}")


def _name(obs) -> str:
    return getattr(obs, "name", "observer")


_SIGNATURES = (("init", "init(x)", 1), ("update", "update(state, x, weight=None)", 3), ("merge", "merge(a, b)", 2))


def check_observer(obs, law: str) -> None:
    """TypeError unless ``obs`` has callable ``init``, ``update`` and ``merge`` and an ``exact`` flag (a
    factory given for its Observer: ``rms_range`` for ``rms_range(spec)``)."""
    missing = [field for field in ("init", "update", "merge") if not callable(getattr(obs, field, None))]
    if missing or not hasattr(obs, "exact"):
        hint = (f"; {getattr(obs, '__name__', 'it')} is callable: pass the Observer it returns, "
                f"{getattr(obs, '__name__', 'factory')}(spec)" if callable(obs) else "")
        raise TypeError(f"{law}: expected an Observer (init, update, merge, exact), got {type(obs).__name__}{hint}")
    if not isinstance(obs.exact, bool):  # a truthy "no" checked an order-dependent observer as exact, None skipped it
        raise TypeError(f"{law}: {_name(obs)}'s exact must be True or False (whether splitting the data never changes "
                        f"its state), got {obs.exact!r}")


def _check_signatures(obs, law: str) -> None:
    """AssertionError naming the function and the call the laws (and `qstats.calibrate`, which passes
    the row weight) make, when ``init``, ``update`` or ``merge`` cannot take their positional arguments."""
    check_observer(obs, law)
    for field, call, count in _SIGNATURES:
        try:
            signature = inspect.signature(getattr(obs, field))
        except (TypeError, ValueError):  # a callable whose signature Python cannot read: called as it is
            continue
        try:
            signature.bind(*(None,) * count)
        except TypeError as error:
            raise AssertionError(f"{_name(obs)}: {law}: {field}{signature} cannot be called as {call} "
                                 f"({error})") from None


def _need(xs: Sequence[torch.Tensor], count: int, law: str, obs, batch_dims: int = 0) -> list:
    _check_signatures(obs, law)
    if isinstance(xs, torch.Tensor):  # its rows would be the batches, of another shape than the tensor
        raise TypeError(f"{law}: xs is a list of input batches, got a tensor of shape {tuple(xs.shape)} "
                        "(pass [x] for one batch)")
    xs = list(xs)
    strays = sorted({type(x).__name__ for x in xs if not isinstance(x, torch.Tensor)})
    if strays:
        raise TypeError(f"{law}: xs is a list of input batches (tensors), got items of type {', '.join(strays)}")
    if len(xs) < count:
        raise ValueError(f"{law} needs at least {count} batches, got {len(xs)}")
    if all(x.numel() == 0 for x in xs):  # every state would be init's: any observer would pass
        raise ValueError(f"{law}: every batch of xs is empty (shapes {sorted({tuple(x.shape) for x in xs})}); the laws "
                         "compare the states of data: pass batches holding values")
    ndim = xs[0].ndim
    # -1 or a bool failed deep in a weight check, past the batches' dimensions as an IndexError
    index = as_index(batch_dims)  # an int (numpy's too), not a bool
    if index is None or index < 0 or 0 < ndim <= index:
        raise ValueError(f"{law}: batch_dims must be an int from 0 to {max(ndim - 1, 0)} (leading dimensions of the "
                         f"batches, of shape {tuple(xs[0].shape)}, that index independent slices, each with its rows "
                         f"after them), got {batch_dims!r}")
    return xs


def _batches_and_init(obs, xs: Sequence[torch.Tensor], count: int, law: str, batch_dims: int = 0) -> tuple[list, Any]:
    """``xs`` as a list of at least ``count`` batches (a ValueError naming ``law`` otherwise, or naming a
    ``batch_dims`` they do not have) and the identity state ``obs.init(xs[0])`` that the law starts from."""
    xs = _need(xs, count, law, obs, batch_dims)
    return xs, obs.init(xs[0])


def _groups(xs: list, parts: int) -> list[list]:
    """Splits ``xs`` into ``parts`` (2 or 3) consecutive groups of near-equal size, the first ones one
    longer where ``len(xs)`` does not divide (some may be empty)."""
    bounds = [-(-len(xs) * i // parts) for i in range(parts + 1)]  # ceil(len(xs) * i / parts)
    return [xs[lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])]


def check_identity(obs, xs: Sequence[torch.Tensor], *, approx_fields=None) -> None:
    """Law 1: ``merge(init, s) == s == merge(s, init)`` for states built from ``xs``, and
    ``merge(init, init) == init``; ``init`` reads only the shape, dtype and device of ``x`` and allocates
    on that device. Bit-exact except the ``approx_fields`` (a sum plus zero is exact, but
    a mean merged as ``(mean * n + 0) / n``, Chan's textbook form, rounds), which compare to tolerance."""
    xs, init = _batches_and_init(obs, xs, 1, "check_identity")
    name = _name(obs)
    # init is the identity of every tensor like x: it reads the shape, dtype and device of x, never its
    # values (an init seeded with x0's extremes is the identity only of states that have seen x0)
    for other in [*xs[1:], torch.zeros_like(xs[0])]:
        if (other.shape, other.dtype, other.device) == (xs[0].shape, xs[0].dtype, xs[0].device):
            assert_states_equal(obs.init(other), init, approx_fields=(),
                                message=f"{name}: identity: init(x) depends on the values of x (it may read only "
                                "their shape, dtype and device)")
    _check_init_follows_device(obs, xs[0], name)
    assert_states_equal(obs.merge(init, init), init, approx_fields=(), message=f"{name}: identity merge(init, init)")
    state = init
    for x in xs:
        state = obs.update(state, x)
        for what, merged in (("merge(init, s)", obs.merge(init, state)), ("merge(s, init)", obs.merge(state, init))):
            assert_states_equal(merged, state, approx_fields=approx_fields, message=f"{name}: identity {what}")


def _check_init_follows_device(obs, x: torch.Tensor, name: str) -> None:
    """``init`` allocates its state on the device of ``x``: checked on the meta device, which every
    machine has, so that ``torch.zeros(shape)`` without ``device=x.device`` fails here rather than on
    the first GPU batch. An ``init`` that cannot run on meta tensors (one reading a value) is not checked."""
    try:
        state = obs.init(x.to("meta"))
    except Exception:
        return
    for path, leaf in qtree.leaves_with_paths(state, "state"):
        if isinstance(leaf, torch.Tensor) and leaf.device != x.to("meta").device:
            raise AssertionError(f"{name}: identity: init of a tensor on the meta device put {path} on {leaf.device}: "
                                 "allocate the state on the input's device (torch.zeros(shape, device=x.device)), "
                                 "or update fails on the first batch on a GPU")


def check_associative(obs, xs: Sequence[torch.Tensor], *, exact: Optional[bool] = None, approx_fields=None) -> None:
    """Law 2a: ``merge(merge(a, b), c) == merge(a, merge(b, c))`` for states folded over three consecutive
    groups of ``xs`` (an empty group gives ``init``); float fields to tolerance when not ``exact``.
    """
    xs, init = _batches_and_init(obs, xs, 1, "check_associative")
    exact = obs.exact if exact is None else exact
    a, b, c = (functools.reduce(obs.update, group, init) for group in _groups(xs, 3))
    # not exact: every float field to tolerance
    assert_states_equal(obs.merge(obs.merge(a, b), c), obs.merge(a, obs.merge(b, c)),
                        approx_fields=approx_fields if exact else _ALL_FLOAT, message=f"{_name(obs)}: associativity",
                        magnitudes=(a, b, c))


def check_commutative(obs, xs: Sequence[torch.Tensor], *, approx_fields=None) -> None:
    """Law 2b: ``merge(a, b) == merge(b, a)`` for states folded over two halves of ``xs`` and
    over single batches. Bit-exact except ``approx_fields``."""
    xs, init = _batches_and_init(obs, xs, 2, "check_commutative")
    first, second = (functools.reduce(obs.update, group, init) for group in _groups(xs, 2))
    for a, b in [(first, second), (obs.update(init, xs[0]), obs.update(init, xs[-1]))]:
        assert_states_equal(obs.merge(a, b), obs.merge(b, a), approx_fields=approx_fields,
                            message=f"{_name(obs)}: commutativity", magnitudes=(a, b))


def _concat_dim(obs, a: torch.Tensor, b: torch.Tensor, batch_dims: int = 0) -> Optional[int]:
    """The first dimension after the ``batch_dims`` along which ``a`` and ``b`` concatenate without
    changing the state's structure (the row dimension for per-tensor or ``PerAxis(-1)``, the next one for
    ``PerAxis(0)``, ...) and which ``update`` accepts, or None."""
    if a.ndim <= batch_dims or a.ndim != b.ndim:
        return None
    structure = obs.init(a)
    for dim in range(batch_dims, a.ndim):
        if a.shape[:dim] + a.shape[dim + 1 :] != b.shape[:dim] + b.shape[dim + 1 :]:
            continue
        joined = torch.cat([a, b], dim)
        try:
            qtree.assert_same_structure(structure, obs.init(joined))
        except ValueError:  # other errors of init are the observer's: they propagate
            continue
        # an observer bound to one input shape (a weight's) need not take the concatenation
        if _takes(obs, structure, joined):
            return dim
    return None


def check_homomorphism(obs, xs: Sequence[torch.Tensor], splits: Optional[Sequence[Sequence[int]]] = None, *,
                       accumulates: bool = True, approx_fields=None, batch_dims: int = 0) -> None:
    """Law 3, for exact observers: splitting the data never changes the result (bit-exact except
    ``approx_fields``).

    - Sequential: ``fold(update, init, xs)`` equals the merge of the folds over the groups of each split
      (``splits``: cut-point lists; default every two-way split and all singletons). Skipped with
      ``accumulates=False`` (observers keeping only the latest batch, `memoryless_minmax`).
    - Concatenation, where batches concatenate without changing the parameter shape:
      ``update(s, cat(a, b)) == merge(update(s, a), update(init, b))``, from ``init`` and a seen state.
    - Masked, where rows are observations: ``update(s, a, mask) == update(s, a[mask != 0])``.
    - Weighted, at every granularity: ``update(init, a, 0) == init`` and, for complementary 0/1 row
      weights, ``merge(update(s, a, w), update(init, a, 1 - w)) == update(s, a)`` (from ``init`` only
      with ``accumulates=False``).
    - Token weights, for batches of three or more dims (``[batch, tokens, features]``): a 0/1 weight over
      the first two (an attention mask) splits the values as a row weight does, and one leaving out the
      first token equals the batch without it, where that batch keeps the parameter shape.
    """
    xs, init = _batches_and_init(obs, xs, 2, "check_homomorphism", batch_dims)

    def check(actual, expected, equation: str, magnitudes=(), approx=approx_fields):
        assert_states_equal(actual, expected, approx_fields=approx, magnitudes=magnitudes,
                            message=f"{_name(obs)}: homomorphism {equation}")

    # the states of single batches: the terms whose magnitudes scale the tolerance of float sums
    terms = [obs.update(init, x) for x in xs]
    if accumulates:
        sequential = functools.reduce(obs.update, xs, init)
        if splits is None:
            splits = [[i] for i in range(1, len(xs))] + [list(range(1, len(xs)))]
        for cuts in splits:
            bounds = _split_bounds(cuts, len(xs))
            folds = [functools.reduce(obs.update, xs[lo:hi], init) for lo, hi in zip(bounds[:-1], bounds[1:])]
            check(functools.reduce(obs.merge, folds), sequential,
                  f"(merge of per-group states for split {list(cuts)} vs sequential updates)", terms + folds)
    a, b = (xs[1], xs[2]) if len(xs) >= 3 else (xs[0], xs[1])
    states = (("init", init), ("a state that has seen data", obs.update(init, xs[0])))
    dim = _concat_dim(obs, a, b, batch_dims)
    if dim is not None:
        _check_concatenation(obs, a, b, dim, init, states, check, batch_dims)
    # an observer keeping only the latest batch keeps a seen state's parameters that a batch leaves out
    _check_weight_split(obs, a, init, states if accumulates else states[:1], check, batch_dims)
    _check_token_weight(obs, a, init, states if accumulates else states[:1], check, batch_dims)


def _split_bounds(cuts, count: int) -> list:
    """``[0, *cuts, count]`` for one split of ``count`` batches, after TypeError for a split that is no
    list of cut points (``splits=[1]`` for ``[[1]]``) and ValueError for a cut that is no int from 1 to
    ``count - 1``: such cuts were dropped in silence, and a split left with none compared the merge of
    one fold with that fold, which holds for any observer."""
    try:
        cuts = list(cuts)
    except TypeError:
        raise TypeError(f"check_homomorphism: splits is a list of cut-point lists ([[1], [1, 2]]), got the split "
                        f"{cuts!r}") from None
    indices = [as_index(cut) for cut in cuts]
    bad = [cut for cut, index in zip(cuts, indices) if index is None or not 0 < index < count]
    if bad:
        raise ValueError(f"check_homomorphism: cut points must be ints from 1 to {count - 1} (between the {count} "
                         f"batches), got {bad} in the split {cuts}")
    return [0, *sorted(set(indices)), count]


def _check_concatenation(obs, a: torch.Tensor, b: torch.Tensor, dim: int, init, states, check,
                         batch_dims: int) -> None:
    """`check_homomorphism`'s concatenation and row mask forms (``check``: its assertion)."""
    joined = torch.cat([a, b], dim)
    for label, state in states:
        left, right = obs.update(state, a), obs.update(init, b)
        check(obs.merge(left, right), obs.update(state, joined),
              "update(s, cat(a, b)) == merge(update(s, a), update(init, b)) "
              f"along dim {dim} with s = {label}",
              (state, left, right))
    # at least one row kept and one left out; the same rows of every slice, so that they form a tensor
    for kind, mask, kept in _left_out(a, batch_dims) if dim == batch_dims else ():
        if kind != "rows":
            continue
        for label, state in states:
            check(obs.update(state, a, mask), obs.update(state, kept),
                  "update(s, x, mask) == update(s, x[mask != 0]) (a 0/1 row weight "
                  f"leaves rows out) with s = {label}",
                  (state, obs.update(init, kept)))


def _check_weight_split(obs, x: torch.Tensor, init, states, check, batch_dims: int) -> None:
    """The weight forms that need no concatenation, so hold at every granularity (per channel, group
    or block too, where batches do not concatenate along the rows): a zero row weight observes
    nothing, ``update(init, x, 0) == init``; complementary 0/1 row weights split the rows,
    ``merge(update(s, x, w), update(init, x, 1 - w)) == update(s, x)``."""
    mask = _row_mask(x, batch_dims)
    if mask is None:
        return
    check(obs.update(init, x, torch.zeros_like(mask)), init,
          "update(init, x, weight=0) == init (a zero row weight leaves every row out)", approx=())
    _check_complementary(obs, x, mask, init, states, check, "(complementary 0/1 row weights split the rows)")


def _check_complementary(obs, x: torch.Tensor, weight: torch.Tensor, init, states, check, what: str) -> None:
    """``merge(update(s, x, w), update(init, x, 1 - w)) == update(s, x)`` for each state ``s`` of
    ``states``: complementary 0/1 weights split what ``x`` observes (``check``: the law's assertion)."""
    for label, state in states:
        kept, left_out = obs.update(state, x, weight), obs.update(init, x, 1 - weight)
        check(obs.merge(kept, left_out), obs.update(state, x),
              f"merge(update(s, x, w), update(init, x, 1 - w)) == update(s, x) {what} with s = {label}",
              (state, kept, left_out))


def _check_token_weight(obs, x: torch.Tensor, init, states, check, batch_dims: int) -> None:
    """`check_homomorphism`'s token weight forms: a weight of ``x.shape[:batch_dims + 2]`` (an attention
    mask ``[batch, tokens]`` of ``[batch, tokens, features]`` activations) reaches every token, not only
    the rows: complementary 0/1 token weights split the values, and a weight leaving out token 0 equals
    ``x`` without it (where that keeps the parameter shape and ``update`` takes it)."""
    tokens = batch_dims + 1
    if x.ndim < batch_dims + 3 or x.shape[tokens] < 2:
        return
    grid = torch.arange(x.shape[batch_dims], device=x.device).reshape(-1, 1) + torch.arange(x.shape[tokens],
                                                                                        device=x.device)
    checkerboard = (grid % 2 == 0).to(torch.float32).expand(x.shape[:tokens + 1]).contiguous()
    _check_complementary(obs, x, checkerboard, init, states, check, f"for complementary 0/1 weights of shape "
                         f"{tuple(checkerboard.shape)} over rows and tokens (an attention mask)")
    for kind, weight, rest in _left_out(x, batch_dims):
        # per-token parameters, or an observer bound to one shape: no such batch
        if kind != "tokens" or not _takes(obs, init, rest):
            continue
        for label, state in states:
            check(obs.update(state, x, weight), obs.update(state, rest),
                  f"update(s, x, w) == update(s, x[:, 1:]) for a weight of shape {tuple(weight.shape)} that "
                  f"leaves out token 0 of every row (an attention mask) with s = {label}",
                  (state, obs.update(init, rest)))


def _map_tensors(tree, fn):
    return optree.tree_map(lambda t: fn(t) if isinstance(t, torch.Tensor) else t, tree)


def qparams_spec(obs, state, law: str, batch_dims: int = 0) -> Optional[QuantSpec]:
    """The spec that ``law`` checks ``compute_qparams`` and ``fake_quantize`` with: None when ``obs``
    carries none, or when its ``state`` holds no quantization statistic, which ``compute_qparams``
    refuses with `NoStatistics` (placeholder, noop and recording, as torch.ao's, carry a spec for the
    modules that read it, or a state type with no range rule); a warning then says which checks were
    left out and why. Other errors of ``compute_qparams`` (a TypeError of a range rule's own) are the
    law's to report."""
    spec = getattr(obs, "spec", None)
    if not isinstance(spec, QuantSpec):
        return None
    try:
        _per_slice(lambda s: compute_qparams(s, spec), batch_dims)(state)
    except NoStatistics as error:
        warn(f"{_name(obs)}: {law}: compute_qparams and fake_quantize not checked, as the state holds no "
             f"quantization statistic (compute_qparams refused it: {error})")
        return None
    except Exception:
        pass
    return spec


def _unseen_allowed(spec: Optional[QuantSpec], xs: Sequence[torch.Tensor]) -> Optional[QuantSpec]:
    """``spec`` with ``on_uncalibrated="fallback"`` where no batch of ``xs`` holds a finite value (all NaN
    or ±inf): compute_qparams then refuses the state by the spec's policy, not by a broken law."""
    if spec is None or any(bool(torch.isfinite(x).any()) for x in xs):  # integers are finite, empty ones not
        return spec
    return spec.replace(on_uncalibrated="fallback")


def _row_mask(x: torch.Tensor, batch_dims: int = 0, offset: int = 0, per_slice: bool = True) -> Optional[torch.Tensor]:
    """A 0/1 float32 weight ``x.shape[:batch_dims + 1]`` over the rows (dim ``batch_dims``) of ``x``
    keeping rows ``offset``, ``offset + 2``, ... of the first slice; with ``per_slice`` the next slice
    starts one row later, so that slices get different masks. None when ``x`` has fewer than two rows."""
    if x.ndim <= batch_dims or x.shape[batch_dims] < 2:
        return None
    batch, rows = tuple(x.shape[:batch_dims]), x.shape[batch_dims]
    start = torch.arange(math.prod(batch), device=x.device).reshape(*batch, 1) if per_slice else 0
    keep = (torch.arange(rows, device=x.device) + start + offset) % 2 == 0
    return keep.to(torch.float32).expand(*batch, rows).contiguous()


def _empty_batch(x: torch.Tensor, batch_dims: int = 0) -> torch.Tensor:
    """``x`` with no rows: dimension ``batch_dims`` cut to 0 (a flat one appended when ``x`` has none)."""
    if x.ndim <= batch_dims:
        x = x.reshape(*x.shape, -1)
    return x.narrow(batch_dims, 0, 0)


def _per_slice(fn, batch_dims: int):
    """``fn`` vmapped over the ``batch_dims`` leading dimensions of its arguments."""
    for _ in range(batch_dims):
        fn = torch.func.vmap(fn)
    return fn


def _overwrite(tensor: torch.Tensor) -> None:
    """Writes into every element of ``tensor`` (a value other than the one there)."""
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.fill_(math.nan)
    else:
        tensor.bitwise_not_()  # of a bool: its logical not


def _check_owns_its_state(obs, state, x: torch.Tensor, extra: tuple, same, with_weight: str) -> None:
    """``update``'s state shares no memory with its inputs: writing into ``x`` (and the weight) after
    ``update`` leaves the state as it was. A model writes into the activations an observer saw
    (``ReLU(inplace=True)``), an optimizer into the weights."""
    inputs = [t.clone(memory_format=torch.contiguous_format) for t in (x, *extra)]
    got = obs.update(state, *inputs)
    kept = _map_tensors(got, torch.clone)
    for tensor in inputs:
        _overwrite(tensor)
    same(got, kept, f"update{with_weight} returned a state that shares memory with its input (it changed when the "
         "input was written to afterwards); copy what you keep of x (x.float() of a float32 x is x itself)")


def _check_keeps_a_dirty_batch(obs, state, x: torch.Tensor, same) -> None:
    """``update`` leaves a batch holding NaN and ±inf as it was (an update cleaning its input in place,
    ``x.masked_fill_(~torch.isfinite(x), 0)``, writes only there: a clean batch never shows it);
    skipped where ``update`` raises on it (``nonfinite="raise"``; `check_stability` names other errors)."""
    if not x.is_floating_point() or x.numel() < 3:
        return
    dirty = _dirty(x)
    dirty_copy = dirty.clone()
    try:
        obs.update(state, dirty)
    except Exception:  # refused: a ValueError under nonfinite="raise", another error check_stability names
        return
    same(dirty, dirty_copy, "update modified the input tensor, a batch holding NaN and ±inf (leave them out with "
         "torch.where, not by writing into the batch)")


def _check_keeps_no_history(obs, init, state, other, x: torch.Tensor, x0: torch.Tensor, same) -> None:
    """The same inputs give the same outputs whatever was observed in between: an update or merge keeping
    something between calls (a running maximum in a global or a closure) gives another state once a larger
    batch (``x0`` times 4, exact) was observed; such an observer failed as hypothesis' FlakyStrategyDefinition
    or a vmap RuntimeError, naming no law. Float batches only, where the larger batch stays as finite."""
    larger = x0 * 4 if x0.is_floating_point() else None
    if larger is None or not torch.equal(torch.isfinite(larger), torch.isfinite(x0)):
        return
    updated, merged = obs.update(state, x), obs.merge(state, other)
    seen = obs.update(state, larger)
    obs.merge(obs.merge(seen, obs.update(init, larger)), state)
    advice = ("for the same inputs once a larger batch was observed in between: keep what it reads in the state, "
              "not in a global or a closure")
    same(obs.update(state, x), updated, f"update gave another state {advice}")
    same(obs.merge(state, other), merged, f"merge gave another state {advice}")


def check_purity(obs, xs: Sequence[torch.Tensor], *, weight: Optional[torch.Tensor] = None,
                 batch_dims: int = 0) -> None:
    """Law 4: ``init``, ``update`` (with and without ``weight``), ``merge`` and ``compute_qparams`` never
    modify their inputs (``xs[1]`` holding NaN and ±inf too) and are deterministic; ``merge`` gets two
    distinct states in both orders. ``weight`` defaults to a 0/1 row mask over ``xs[1]``.
    """
    xs = _need(xs, 2, "check_purity", obs, batch_dims)
    name = _name(obs)

    def same(actual, expected, what):
        assert_states_equal(actual, expected, approx_fields=(), message=f"{name}: purity: {what}")

    x0, x1 = xs[0], xs[1]
    x0_copy, x1_copy = x0.clone(), x1.clone()
    init = obs.init(x0)
    same(x0, x0_copy, "init modified its input")
    init_copy = _map_tensors(init, torch.clone)
    state = obs.update(init, x0)
    same(x0, x0_copy, "update modified the input tensor")
    same(init, init_copy, "update modified the state")
    state_copy = _map_tensors(state, torch.clone)
    if weight is None:
        weight = _row_mask(x1, batch_dims)
    for extra in [()] if weight is None else [(), (weight,)]:
        extra_copy = _map_tensors(extra, torch.clone)
        first = obs.update(state, x1, *extra)
        second = obs.update(state, x1, *extra)
        with_weight = " (with a weight)" if extra else ""
        same(x1, x1_copy, f"update{with_weight} modified the input tensor")
        same(state, state_copy, f"update{with_weight} modified the state")
        if extra:
            same(extra[0], extra_copy[0], "update modified the weight")
        same(first, second, f"update{with_weight} gave different results twice")
        _check_owns_its_state(obs, state, x1, extra, same, with_weight)
    _check_keeps_a_dirty_batch(obs, state, x1, same)
    # two states of different batches: neither contains the other
    other = obs.update(init, x1)
    for left, right in ((state, other), (other, state)):
        left_copy, right_copy = _map_tensors((left, right), torch.clone)
        merged = obs.merge(left, right)
        again = obs.merge(left, right)
        same(left, left_copy, "merge modified its first argument")
        same(right, right_copy, "merge modified its second argument")
        same(merged, again, "merge gave different results twice")
    same(init, init_copy, "update or merge modified the init state")
    _check_keeps_no_history(obs, init, state, other, x1, x0, same)
    merged_copy = _map_tensors(merged, torch.clone)
    spec = _unseen_allowed(qparams_spec(obs, merged, "purity", batch_dims), xs[:2])
    if spec is not None:
        qparams_of = _per_slice(lambda s: compute_qparams(s, spec), batch_dims)
        try:
            qparams = qparams_of(merged)
        except Exception as error:  # keeps its type (a range rule's own TypeError) and names the law
            raise_renamed(error, f"{name}: purity: compute_qparams of a merged state")
        same(merged, merged_copy, "compute_qparams modified the state")
        same(qparams, qparams_of(merged), "compute_qparams gave different results twice")


def _check_state_leaves(state, name: str) -> None:
    parts = [("state", state), *distributed.named_fields(state, "state.")]
    # nested NamedTuples too: qstats.save and torch.load rebuild every one of them by name
    for path, cls in [(path, type(value)) for path, value in parts if distributed.is_named_tuple(value)]:
        if state_types().get(cls.__name__) is not cls:
            raise AssertionError(f"{name}: stability: state type {cls.__name__} (at {path}) is not registered; "
                                 "decorate it with qstats.register_state")
    for path, leaf in [(path, value) for path, value in parts if not distributed.is_named_tuple(value)]:
        if not isinstance(leaf, torch.Tensor):
            raise AssertionError(f"{name}: stability: {path} is a {type(leaf).__name__}; states hold tensors only")
        if leaf.is_complex() and leaf.dtype != torch.complex64:
            raise AssertionError(f"{name}: stability: {path} has dtype {leaf.dtype}, which qstats.save cannot hold "
                                 "(a safetensors file holds complex64)")
        if leaf.is_floating_point() and leaf.dtype not in (torch.float32, torch.float64):
            raise AssertionError(f"{name}: stability: {path} has dtype {leaf.dtype}; accumulate in float32 or wider")
        if not leaf.is_floating_point() and leaf.dtype not in (torch.int64, torch.bool) and not leaf.is_complex():
            raise AssertionError(f"{name}: stability: {path} has dtype {leaf.dtype}; counts are int64")


def check_stability(obs, xs: Sequence[torch.Tensor], *, batch_dims: int = 0) -> None:
    """Law 5: ``update`` and ``merge`` return exactly the structure, NamedTuple type, shapes and
    dtypes that ``init`` returned, for the batches and for them cast to each other float dtype (float32,
    bfloat16, float16, float64) when they are floats (finite wherever the state of the uncast batch is);
    an empty batch, with or without its row weight, leaves the state unchanged (bit for bit); NaN and
    ±inf in a batch are refused with a ValueError or left out (no non-finite value where the clean
    batch's state is finite, and the quantization parameters of the clean batch weighted 0 on those
    elements, or on the rows holding them: `_check_nonfinite_as_masked`); a weight in (0, 1] observes as the 0/1 one that is nonzero at
    the same rows (weights are masks); a bool or int64 0/1 row weight observes as the float32 one, a zero one
    leaves ``init`` unchanged for every input dtype, and a 0/1 weight observes as the rows (or tokens) it
    keeps (`_check_weight_leaves_rows_out`, for order-dependent observers too); the state type is registered, its leaves are
    tensors, floats are float32 or wider, integers int64."""
    xs, init = _batches_and_init(obs, xs, 1, "check_stability", batch_dims)
    name = _name(obs)
    _check_state_leaves(init, name)

    def same(what, fn, *args):
        """``fn(*args)``, which must have the structure of ``init``."""
        state = _attempt(f"{name}: stability: {what}", fn, *args)
        try:
            qtree.assert_same_structure(init, state, name="state")
        except ValueError as error:
            raise AssertionError(f"{name}: stability: {what} changed the state: {error}") from None
        return state

    state = init
    for x in xs:
        seen = same("update(init, x)", obs.update, init, x)
        # merges of two states that have seen data too: a merge may take another path than with init
        same("merge(s, t) of two states that have seen data", obs.merge, state, seen)
        state = same("update", obs.update, state, x)
        same("merge(s, init)", obs.merge, state, init)
        same("merge(init, s)", obs.merge, init, state)
    # an empty batch (a loader's short last batch, an expert given no token) leaves the state as it is,
    # with its (empty) row weight too: an expert given no token under a routing mask
    empty = _empty_batch(xs[0], batch_dims)
    weight = torch.ones(empty.shape[: batch_dims + 1], device=empty.device)
    for extra in ((), (weight,)):
        what = f"update with an empty tensor of shape {tuple(empty.shape)}"
        what += f" and weight of shape {tuple(weight.shape)}" if extra else ""
        emptied = _attempt(f"{name}: stability: {what}", obs.update, state, empty, *extra)
        assert_states_equal(emptied, state, approx_fields=(), message=f"{name}: stability: {what} changed the state")
    dirty = _check_nonfinite_left_out(obs, xs[0], state, name)
    if xs[0].is_floating_point():
        # the state's dtypes do not follow the input's, narrower or wider (whatever the batches' dtype)
        for dtype in [d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64) if d != xs[0].dtype]:
            same(f"init of a {dtype} tensor", obs.init, xs[0].to(dtype))
            cast = xs[0].to(dtype)
            updated = same(f"update with a {dtype} tensor", obs.update, state, cast)
            # squares or sums taken in float16 overflow where float32 ones do not (unless the cast itself does)
            if torch.equal(torch.isfinite(cast), torch.isfinite(xs[0])):
                _check_no_new_nonfinite(updated, obs.update(state, xs[0]), init,
                                        f"{name}: stability: update with a {dtype} tensor", f"the {xs[0].dtype} batch",
                                        "compute in float32 or wider whatever the input dtype")
    _check_weight_dtypes(obs, xs[0], state, name, batch_dims)
    _check_weight_leaves_rows_out(obs, xs[0], init, state, name, batch_dims)
    _check_nonfinite_as_masked(obs, xs[0], state, dirty, name, batch_dims)
    _check_zero_batch(obs, xs[0], init, name, batch_dims)


def _check_zero_batch(obs, x: torch.Tensor, init, name: str, batch_dims: int) -> None:
    """An all-zero batch (padding, a dead channel, a zero-initialized weight) is calibrated wherever
    ``x`` is: ``compute_qparams`` of ``update(init, zeros)`` gives a finite positive scale there, not a
    range of 0/0 left uncalibrated (or refused). Skipped where ``compute_qparams`` of ``x``'s state fails
    (no statistic, no spec, ``x`` left a parameter unobserved under ``on_uncalibrated="error"``)."""
    spec = getattr(obs, "spec", None)
    if not isinstance(spec, QuantSpec) or x.numel() == 0:
        return
    compute = _per_slice(lambda s: compute_qparams(s, spec), batch_dims)
    try:
        reference = compute(obs.update(init, x))
    except Exception:
        return
    what = f"{name}: stability: compute_qparams of update(init, an all-zero batch)"
    zero = _attempt(what, compute, obs.update(init, torch.zeros_like(x)))
    expected = reference.calibrated.expand(zero.scale.shape)
    bad = expected & ~(zero.calibrated.expand(zero.scale.shape) & torch.isfinite(zero.scale) & (zero.scale > 0))
    if bool(bad.any()):
        raise AssertionError(f"{what} left {int(bad.sum())} parameter(s) uncalibrated, or with a zero or non-finite "
                             "scale, that a batch of data calibrates: a zero range maps to the smallest scale (a range "
                             f"rule dividing by the range gives 0/0)\n  got: {zero}")


def _takes(obs, init, x: torch.Tensor) -> bool:
    """Whether ``x`` gives ``init``'s structure and ``update`` takes it (an observer bound to one input
    shape, or per-row parameters, do not take a batch with fewer rows or tokens)."""
    try:
        qtree.assert_same_structure(init, obs.init(x))
        obs.update(obs.init(x), x)
    except Exception:
        return False
    return True


def _check_weight_leaves_rows_out(obs, x: torch.Tensor, init, state, name: str, batch_dims: int) -> None:
    """A 0/1 weight observes as the batch without what it leaves out, for every observer (order-dependent
    ones too: no merge is involved): a row weight equals the kept rows, ``update(s, x, w) ==
    update(s, x[w != 0])``, and a ``[batch, tokens]`` weight leaving out token 0 equals ``x[:, 1:]``,
    where those batches keep the parameter shape. A weight read along the wrong rows shows here."""
    for kind, weight, without in _left_out(x, batch_dims):
        if not _takes(obs, init, without):
            continue
        what = ("x[w != 0] (a 0/1 row weight leaves rows out)" if kind == "rows" else
                f"x[:, 1:] (a weight of shape {tuple(weight.shape)} leaving out token 0)")
        for label, start in (("init", init), ("a state that has seen data", state)):
            got = _attempt(f"{name}: stability: update(s, x, w)", obs.update, start, x, weight)
            # float sums (the state class's approx_fields) add the kept values in another order
            assert_states_equal(got, obs.update(start, without), magnitudes=(start, obs.update(init, x)),
                                message=f"{name}: stability: update(s, x, w) vs update(s, {what}) with s = {label}")


def _left_out(x: torch.Tensor, batch_dims: int):
    """The 0/1 weights that leave part of ``x`` out, with ``x`` without it: ``("rows", w, x[w != 0])``
    for a row weight keeping every other row, the same rows of every slice (where ``x`` has two rows),
    and ``("tokens", w, x[:, 1:])`` for a ``[batch, tokens]`` weight leaving out token 0 (where ``x``
    has three dims or more after the ``batch_dims`` and two tokens)."""
    mask = _row_mask(x, batch_dims, per_slice=False)
    if mask is not None:
        yield "rows", mask, x.index_select(batch_dims, torch.arange(0, x.shape[batch_dims], 2, device=x.device))
    tokens = batch_dims + 1
    if x.ndim >= batch_dims + 3 and x.shape[tokens] >= 2:
        weight = torch.ones(x.shape[: tokens + 1], device=x.device)
        weight.narrow(tokens, 0, 1).zero_()
        yield "tokens", weight, x.narrow(tokens, 1, x.shape[tokens] - 1)


def _check_weight_dtypes(obs, x: torch.Tensor, state, name: str, batch_dims: int) -> None:
    """A 0/1 row weight observes alike whatever its dtype and the batch's: a bool or int64 one (an
    attention mask) gives the state of the float32 one, and a zero weight leaves ``init`` unchanged
    for the batch cast to each float dtype."""
    mask = _row_mask(x, batch_dims)
    if mask is None:
        return
    expected = obs.update(state, x, mask)
    _check_weight_is_a_mask(obs, x, mask, state, name)
    for dtype in (torch.bool, torch.int64):
        what = f"update with a {dtype} weight"
        got = _attempt(f"{name}: stability: {what}", obs.update, state, x, mask.to(dtype))
        assert_states_equal(got, expected, approx_fields=(),
                            message=f"{name}: stability: {what} vs the same 0/1 weight in float32")
    dtypes = (torch.float32, torch.bfloat16, torch.float16, torch.float64) if x.is_floating_point() else (x.dtype,)
    for dtype in dtypes:
        init = obs.init(x.to(dtype))
        what = f"update(init, x, weight=0) of a {dtype} x"
        got = _attempt(f"{name}: stability: {what}", obs.update, init, x.to(dtype), torch.zeros_like(mask))
        assert_states_equal(got, init, approx_fields=(),
                            message=f"{name}: stability: {what} changed init (a zero row weight leaves every row out)")


def _check_weight_is_a_mask(obs, x: torch.Tensor, mask: torch.Tensor, state, name: str) -> None:
    """Weights are masks, not frequencies or scales: a weight in (0, 1] (routing probabilities) keeps
    each of its rows once, as the 0/1 weight that is nonzero at the same rows, from ``init`` and from
    ``state``."""
    fractions = torch.linspace(0.125, 1.0, mask.numel(), device=mask.device).reshape(mask.shape)
    what = "update with a weight in (0, 1] (routing probabilities)"
    for label, start in (("init", obs.init(x)), ("a state that has seen data", state)):
        got = _attempt(f"{name}: stability: {what}", obs.update, start, x, mask * fractions)
        assert_states_equal(got, obs.update(start, x, mask), approx_fields=(),
                            message=f"{name}: stability: {what} vs the same weight as 0/1, from {label} (a nonzero "
                                    "weight keeps its row once, whatever its value: weights are masks, not "
                                    "frequencies or scales)")


def _check_nonfinite_left_out(obs, x: torch.Tensor, state, name: str) -> Optional[tuple]:
    """A batch holding NaN, +inf and -inf (a diverged activation) is refused with a ValueError
    (``nonfinite="raise"``) or its non-finite values are left out (``"ignore"``): where the state of
    the clean batch is finite, that of the dirty batch is finite too (no NaN or infinite scale), or
    holds ``init``'s value (an element that saw only non-finite values stays unobserved). Returns that
    batch and ``update(state, batch)`` for `_check_nonfinite_as_masked` (None where none was observed),
    so that ``update`` runs once on it."""
    if not x.is_floating_point() or x.numel() < 3:
        return None
    dirty = _dirty(x)
    try:
        got = obs.update(state, dirty.clone())  # a copy: an update writing into it is purity's to name
    except ValueError:  # the raise policy: non-finite values refused with a clear error
        return None
    except AssertionError:
        raise
    except Exception as error:
        raise AssertionError(f"{name}: stability: update with a batch holding NaN and ±inf failed: "
                             f"{type(error).__name__}: {error}; leave non-finite values out and count them, or "
                             "refuse them with a ValueError") from error
    _check_no_new_nonfinite(got, obs.update(state, x), obs.init(x), f"{name}: stability: update with a batch "
                            "holding NaN and ±inf", "the batch without them", "leave non-finite values out and count "
                            "them, or refuse them with a ValueError")
    return dirty, got


def _dirty(x: torch.Tensor, start: int = 0) -> torch.Tensor:
    """``x`` with its elements ``start`` to ``start + 2`` (flat, in C order) NaN, +inf and -inf."""
    dirty = x.clone(memory_format=torch.contiguous_format)
    dirty.view(-1)[start : start + 3] = torch.tensor([math.nan, math.inf, -math.inf], dtype=x.dtype, device=x.device)
    return dirty


def _check_nonfinite_as_masked(obs, x: torch.Tensor, state, dirty: Optional[tuple], name: str,
                               batch_dims: int) -> None:
    """Left out means left out: the quantization parameters of the batch holding NaN and ±inf equal
    those of the clean batch under a weight of the batch's shape that is 0 on those elements, or under
    a weight of ``x.shape[:-1]`` that is 0 on the rows holding them (the Hessian's policy: a row's
    ``x^T x`` holds each of its values); a ``nan_to_num`` that turns +inf into the largest float, or
    counts NaN as 0, gives another range. ``dirty``: `_check_nonfinite_left_out`'s batch and state.
    Skipped where the observer refused the batch, takes no such weight, holds no statistic, or the
    masked batch leaves a parameter unobserved."""
    spec = getattr(obs, "spec", None)
    if not isinstance(spec, QuantSpec) or dirty is None:  # not a float batch, or refused: nonfinite="raise"
        return
    batch, got = dirty
    compute = _per_slice(lambda s: compute_qparams(s, spec), batch_dims)
    finite = torch.isfinite(batch)
    weights = (finite, finite.all(-1)) if x.ndim >= 2 else (finite,)
    expected = [found for found in (_masked_qparams(obs, state, x, w, compute) for w in weights) if found is not None]
    if not expected:  # no such weight taken, no statistic, or a parameter left unobserved
        return
    qparams = _attempt(f"{name}: stability: compute_qparams of the state updated with a batch holding NaN and ±inf",
                       compute, got)
    if not any(_equal_states(qparams, found) for found in expected):
        assert_states_equal(qparams, expected[0], approx_fields=_ALL_FLOAT,
                            message=f"{name}: stability: compute_qparams of update(s, x holding NaN and ±inf) vs of "
                                    "update(s, x, weight 0 on those elements, or on the rows holding them): non-finite "
                                    "values must be left out (not clamped to the largest float, not counted as zeros) "
                                    "or refused with a ValueError")


def _masked_qparams(obs, state, x: torch.Tensor, keep: torch.Tensor, compute):
    """The qparams of ``x`` observed under the 0/1 weight ``keep``, or None where the observer takes no
    such weight or the weight leaves a parameter unobserved."""
    try:
        return compute(obs.update(state, x, keep.to(torch.float32)))
    except Exception:
        return None


def _equal_states(a, b) -> bool:
    try:
        assert_states_equal(a, b, approx_fields=_ALL_FLOAT)
    except AssertionError:
        return False
    return True


def _check_no_new_nonfinite(got, clean, init, what: str, reference: str, advice: str) -> None:
    """``got`` is finite wherever ``clean`` (the state of ``reference``) is, or holds ``init``'s value
    there (an element left unobserved)."""
    clean_leaves = dict(qtree.leaves_with_paths(clean, "state"))
    init_leaves = dict(qtree.leaves_with_paths(init, "state"))
    for path, leaf in qtree.leaves_with_paths(got, "state"):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            unobserved = init_leaves[path]
            as_init = (leaf == unobserved) | (torch.isnan(leaf) & torch.isnan(unobserved))
            spoiled = ~torch.isfinite(leaf) & torch.isfinite(clean_leaves[path]) & ~as_init
            if bool(spoiled.any()):
                raise AssertionError(f"{what} put {int(spoiled.sum())} non-finite value(s) into {path} (finite for "
                                     f"{reference}): {advice}\n  got: {leaf}")


def _attempt(what: str, fn, *args):
    try:
        return fn(*args)
    except AssertionError:
        raise
    except Exception as error:
        raise AssertionError(f"{what} failed: {type(error).__name__}: {error}") from error


def _check_slices(obs, xs: Sequence[torch.Tensor], states, weights: bool, approx_fields, batch_dims: int) -> None:
    """Each of the ``batch_dims`` leading slices (experts) is observed on its own and alike:
    rolling the slices of the inputs rolls those of ``update`` and ``merge`` (a slice whose data is
    dropped or observed differently shows), and the first slice's state does not depend on the other
    slices' data."""
    x, other, state, seen = xs[0], xs[1], states[0], states[1]

    def check(actual, expected, what: str, magnitudes=()):
        assert_states_equal(actual, expected, approx_fields=approx_fields, magnitudes=magnitudes,
                            message=f"{_name(obs)}: vmap over the batch dims: {what}")

    mask = _row_mask(x, batch_dims) if weights else None
    extra = () if mask is None else (mask,)
    with_weight = " (with a weight)" if extra else ""
    updated, merged = obs.update(state, x, *extra), obs.merge(state, seen)
    for dim in range(batch_dims):
        if x.shape[dim] < 2:
            continue

        def roll(tree, dim=dim):
            return _map_tensors(tree, lambda t: t.roll(1, dim))

        check(obs.update(roll(state), roll(x), *roll(extra)), roll(updated),
              f"update{with_weight} of slices rolled along dim {dim} vs the rolled update (slices must be "
              "observed alike)", (state, updated))
        check(obs.merge(roll(state), roll(seen)), roll(merged),
              f"merge of slices rolled along dim {dim} vs the rolled merge", (state, seen))
    _check_first_slice(check, obs.update(state, _first_slice_of(x, other, batch_dims), *extra),
                       updated, batch_dims, "data")
    if mask is not None:
        _check_slice_weights(obs, x, mask, check, batch_dims)


def _first_slice_of(a: torch.Tensor, b: torch.Tensor, batch_dims: int) -> torch.Tensor:
    """``a`` in the first of the slices indexed by the ``batch_dims`` leading dimensions, ``b`` in the
    others."""
    is_first = torch.zeros(a.shape[:batch_dims], dtype=torch.bool, device=a.device)
    is_first[(0,) * batch_dims] = True
    return torch.where(is_first.reshape(*is_first.shape, *(1,) * (a.ndim - batch_dims)), a, b)


def _check_first_slice(check, actual, expected, batch_dims: int, what: str) -> None:
    """The first slices of two states are equal (``check``: `_check_slices`'s assertion): that of
    ``actual``, observed with the ``what`` of the other slices changed, does not depend on them."""
    first = (0,) * batch_dims
    check(_map_tensors(actual, lambda t: t[first]), _map_tensors(expected, lambda t: t[first]),
          f"the state of slice {first} depends on the {what} of other slices")


def _check_slice_weights(obs, x: torch.Tensor, mask: torch.Tensor, check, batch_dims: int) -> None:
    """Each slice is observed under its own row weight (the other slices' weights never reach it), and
    a stride-0 stack of one slice (``x[0].expand(E, ...)``, tokens shared by every expert) is observed
    as its materialized copy."""
    state = obs.init(x)  # from init: a state that has seen x would hide the weight of min/max observers
    updated = obs.update(state, x, mask)
    mixed = _first_slice_of(mask, 1 - mask, batch_dims)  # the other slices' weights changed
    _check_first_slice(check, obs.update(state, x, mixed), updated, batch_dims, "weights")
    shared = x[(0,) * batch_dims].expand(x.shape)
    check(obs.update(state, shared, mask), obs.update(state, shared.contiguous(), mask),
          "update (with a weight) of a stride-0 stack of one slice (x[0].expand(...), rows shared by every "
          "slice) vs its contiguous copy")


def check_vmap(obs, xs: Sequence[torch.Tensor], *, weights: bool = True, approx_fields=None,
               batch_dims: int = 0) -> None:
    """Law 6: ``torch.func.vmap`` of ``update`` (with and without ``weight``), ``merge``, ``compute_qparams``
    and ``fake_quantize`` (of float batches) over stacked states equals the per-slice loop (bit for bit except
    ``approx_fields`` in ``update`` and ``merge``). With ``batch_dims``, ``compute_qparams`` and
    ``fake_quantize`` are also vmapped over those dimensions, and each of their slices must be observed
    alike and independently of the others (see the module docstring).
    """
    xs, init = _batches_and_init(obs, xs, 2, "check_vmap", batch_dims)
    name = _name(obs)
    states = [obs.update(init, x) for x in xs]
    if batch_dims:
        _check_slices(obs, xs, states, weights, approx_fields, batch_dims)
    stacked_states = qtree.stack(states)

    def vmap_vs_loop(what, fn, *slices, approx=approx_fields, magnitudes=()):
        """``vmap(fn)`` over the stacked ``slices`` (lists of arguments) vs ``fn`` on each slice."""
        batched = _attempt(f"{name}: vmap({what})", torch.func.vmap(fn), *map(qtree.stack, slices))
        looped = qtree.stack([fn(*args) for args in zip(*slices)])
        assert_states_equal(batched, looped, approx_fields=approx, message=f"{name}: vmap({what}) vs loop",
                            magnitudes=magnitudes)
        return batched

    nexts = xs[1:] + xs[:1]
    batched = vmap_vs_loop("update", obs.update, states, nexts, magnitudes=(stacked_states,))
    if weights and _row_mask(xs[0], batch_dims) is not None:
        masks = [_row_mask(xs[0], batch_dims, offset=i) for i in range(len(xs))]
        vmap_vs_loop("update, weight", obs.update, states, nexts, masks, magnitudes=(stacked_states,))
    merged = vmap_vs_loop("merge", obs.merge, states, qtree.unstack(batched),
                          magnitudes=(stacked_states, batched))
    spec = _unseen_allowed(qparams_spec(obs, states[0], "vmap", batch_dims), xs)
    if spec is None:
        return
    # a stacked observer's spec is each slice's: compute_qparams and fake_quantize map over the batch dims
    qparams_of = _per_slice(lambda s: compute_qparams(s, spec), batch_dims)
    quantize = _per_slice(lambda x, qp: fake_quantize(x, qp, spec), batch_dims)
    qparams = vmap_vs_loop("compute_qparams", qparams_of, qtree.unstack(merged), approx=())
    if xs[0].is_floating_point():  # fake_quantize takes floats; observers also take integer tensors
        vmap_vs_loop("fake_quantize", quantize, xs, qtree.unstack(qparams), approx=())


def check_compile(obs, xs: Sequence[torch.Tensor], *, backend: str = "inductor", approx_fields=None) -> None:
    """Law 7: ``torch.compile(update, fullgraph=True)``, with and without a row weight, runs without graph
    breaks and equals eager (bit for bit except ``approx_fields``; inductor may reorder float sums)."""
    xs, state = _batches_and_init(obs, xs, 1, "check_compile")
    name = _name(obs)
    compiled = torch.compile(obs.update, fullgraph=True, backend=backend)
    for x in xs[:2]:
        # with a row weight too (padding, routing): a host read on the weight breaks the graph there only
        mask = _row_mask(x)
        for extra in [()] if mask is None else [(), (mask,)]:
            what = " with a weight" if extra else ""
            # graph breaks surface as torch._dynamo errors
            got = _attempt(f"{name}: torch.compile(update, fullgraph=True){what}", compiled, state, x, *extra)
            assert_states_equal(got, obs.update(state, x, *extra), approx_fields=approx_fields,
                                message=f"{name}: compiled update{what} vs eager",
                                magnitudes=(state, obs.update(obs.init(x), x)))
        state = obs.update(state, x)


_REDUCE = {"min": torch.minimum, "max": torch.maximum, "sum": torch.add}


def check_distributed(obs, xs: Sequence[torch.Tensor], *, approx_fields=None) -> None:
    """Law 8: a state type declared elementwise (`qstats.distributed.register_reduce_ops`) merges as
    its declared field ops, which `qstats.distributed.all_reduce` applies instead of ``merge``; for
    states folded over three groups of ``xs`` (bit-exact except ``approx_fields``). States that fold
    (the default) pass where ``all_reduce`` takes them: every field a dense tensor, nested NamedTuples walked
    (their fields declared by dotted names, ``"ext.low"``)."""
    xs, init = _batches_and_init(obs, xs, 1, "check_distributed")
    name = _name(obs)
    a, b, c = (functools.reduce(obs.update, group, init) for group in _groups(xs, 3))
    ops = _attempt(f"{name}: distributed: qstats.distributed.reduce_ops", distributed.reduce_ops, a)
    # the checks all_reduce makes of every tree, without its collectives (a process group may be up): a
    # field that is no dense tensor (a Python number, a list) is refused there; nested NamedTuples are walked
    _attempt(f"{name}: distributed: qstats.distributed.all_reduce", distributed._flatten, {"state": a}, obs)
    if ops == "fold":
        return

    def reduce(left, right):  # field by field, nested NamedTuples walked (fields named "ext.low")
        reduced = [_REDUCE[ops[field]](u, v) for (field, u), v in
                   zip(distributed._state_fields(left), distributed._values(right))]
        return distributed._rebuild(left, iter(reduced))

    for left, right in ((init, a), (a, b), (obs.merge(a, b), c)):
        reduced = _attempt(f"{name}: distributed: the reduce ops declared for {type(left).__name__} ({ops})",
                           reduce, left, right)
        assert_states_equal(reduced, obs.merge(left, right), approx_fields=approx_fields, magnitudes=(left, right),
                            message=f"{name}: distributed: the reduce ops declared for {type(left).__name__} "
                            f"({ops}), which qstats.distributed.all_reduce applies, vs merge")

