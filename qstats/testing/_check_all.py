"""`check_all`: every law, with batches drawn by hypothesis."""

from __future__ import annotations

import inspect
from functools import partial
from typing import Callable, Iterable, Optional

import torch

from .. import tree as qtree
from .._checks import check_flag
from ..observers._base import Observer
from . import _laws

__all__ = ["check_all", "LAWS"]

LAWS = ("identity", "associative", "commutative", "homomorphism", "purity", "stability", "vmap", "distributed")


def check_all(
    obs,
    make_x: Callable[[torch.Generator], torch.Tensor],
    exact: Optional[bool] = None,
    *,
    laws: Iterable[str] = LAWS,
    max_examples: int = 10,
    compile: bool = False,
    accumulates: bool = True,
    approx_fields=None,
    batch_dims: int = 0,
) -> None:
    """Runs the laws on ``obs`` with hypothesis-drawn batches of ``make_x``.

    Args:
      obs: the Observer to check.
      make_x: ``make_x(generator) -> tensor`` of a fixed shape (hypothesis draws seed, count, magnitude,
        and whether one float batch holds a NaN, a +inf and a -inf, unless ``update`` refuses them).
      exact: whether the homomorphism law applies and associativity is bit-exact (default ``obs.exact``).
      laws: a subset of `LAWS` to run (or the name of one).
      max_examples: hypothesis examples per call.
      compile: also run `check_compile` once (slow: compiles ``update``).
      accumulates: False for observers that keep only the latest batch (see `check_homomorphism`).
      approx_fields: float-sum fields compared to tolerance (default: the state class's).
      batch_dims: leading dimensions of the batches, states and weights that index independent slices
        (1 for a `qstats.stacked_observer`, whose ``make_x`` returns ``[E, ...]`` stacks): empty batches,
        row masks and concatenations act on the rows of each slice (dimension ``batch_dims``).

    Raises:
      AssertionError: from the first law that fails, with hypothesis's minimal example.
      ImportError: when hypothesis is not installed.
    """
    from hypothesis import HealthCheck, given, settings
    from hypothesis.errors import Flaky
    from hypothesis import strategies as st

    from . import strategies

    laws = _law_names(laws)
    # a truthy string ("no") checked an order-dependent observer as exact, None skipped the sequential form
    if not isinstance(exact, bool) and exact is not None:
        raise TypeError(f"check_all: exact must be True, False or None (obs.exact), got {exact!r}")
    check_flag(accumulates, "accumulates", "check_all")
    check_flag(compile, "compile", "check_all")
    _laws.check_observer(obs, "check_all")
    probe = _probe(make_x)
    exact = obs.exact if exact is None else exact
    if not isinstance(batch_dims, int) or isinstance(batch_dims, bool) or batch_dims < 0:
        raise ValueError(f"check_all: batch_dims must be a non-negative int, got {batch_dims!r}")
    seen = _first_update(obs, probe, approx_fields)
    if {"purity", "vmap"} & set(laws) and getattr(obs, "spec", None) is not None and seen is not None:
        # one warning, not one per example, when the state holds no quantization statistic (an object
        # with the Observer's fields but not its _replace warns in each example instead)
        if _laws.qparams_spec(obs, seen, "check_all", batch_dims) is None and isinstance(obs, Observer):
            obs = obs._replace(spec=None)
    # purity and stability first: a state written in place or holding a non-tensor breaks the other
    # laws too, whose messages would point at merge instead
    checks = {
        "purity": partial(_laws.check_purity, batch_dims=batch_dims),
        "stability": partial(_laws.check_stability, batch_dims=batch_dims),
        "identity": _laws.check_identity,
        "associative": partial(_laws.check_associative, exact=exact, approx_fields=approx_fields),
        "commutative": partial(_laws.check_commutative, approx_fields=approx_fields),
        "homomorphism": None,  # with a split drawn in run
        "vmap": partial(_laws.check_vmap, approx_fields=approx_fields, batch_dims=batch_dims),
        "distributed": partial(_laws.check_distributed, approx_fields=approx_fields),
    }

    @settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        report_multiple_bugs=False,  # one AssertionError naming its law, not a group of several
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(data=st.data())
    def run(data):
        xs = data.draw(strategies.batches(make_x), label="xs")
        _check_like_probe(probe, xs)
        if data.draw(st.booleans(), label="with NaN and ±inf"):
            xs = _with_nonfinite(obs, xs, data.draw(st.integers(0, len(xs) - 1), label="dirty batch"),
                                 data.draw(st.integers(0, 2**31 - 1), label="dirty position"))
        for law, check in checks.items():
            if law not in laws:
                continue
            if law != "homomorphism":
                check(obs, xs)
            elif exact:  # at least one cut: with none, the merge of one group's fold is the fold itself
                cuts = data.draw(strategies.splits(len(xs), min_cuts=1), label="split")
                _laws.check_homomorphism(obs, xs, [cuts], accumulates=accumulates, approx_fields=approx_fields,
                                         batch_dims=batch_dims)

    try:
        run()
    except Flaky as error:  # a failing example that passed, or failed elsewhere, when replayed
        raise AssertionError(
            f"{_laws._name(obs)}: purity: an example gave other results when hypothesis replayed it: the observer "
            "(or make_x) may keep something between calls (a global, a closure, torch's global generator): keep what "
            "update and merge read in the state, and draw make_x's batch from its generator. "
            f"First failure: {_first_failure(error)}") from error
    if compile:
        generator = torch.Generator().manual_seed(0)
        _laws.check_compile(obs, [make_x(generator) for _ in range(2)], approx_fields=approx_fields)


def _first_failure(error: BaseException) -> str:
    """The first line of the error that made hypothesis replay an example (``FlakyFailure`` holds it in
    ``exceptions``, ``FlakyStrategyDefinition`` as its context)."""
    cause = next(iter(getattr(error, "exceptions", ())), None) or error.__context__ or error
    return f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"


def _law_names(laws) -> tuple:
    """``laws`` as a tuple of names of `LAWS` (a string is one law: "vmap", not four letters), after
    ValueError for an unknown or no name (with none, every observer passed) and TypeError for what is
    no name or collection of them (None)."""
    try:
        laws = (laws,) if isinstance(laws, str) else tuple(laws)  # a generator or dict keys too
    except TypeError:
        raise TypeError(f"check_all: laws must be a law's name or a collection of them (of {LAWS}), "
                        f"got {laws!r}") from None
    unknown = sorted(map(repr, set(laws) - set(LAWS)))
    if unknown:
        raise ValueError(f"check_all: unknown laws [{', '.join(unknown)}]; known: {LAWS}")
    if not laws:
        raise ValueError(f"check_all: laws is empty, so no law would be checked; name one or more of {LAWS}")
    return laws


def _with_nonfinite(obs, xs: list, index: int, position: int) -> list:
    """``xs`` with NaN, +inf and -inf written into three consecutive values of ``xs[index]`` (from
    ``position`` modulo its size), so that the laws also see the non-finite values an observer leaves
    out and counts; ``xs`` itself for integer batches and for observers that refuse them (``"raise"``)."""
    x = xs[index]
    if not x.is_floating_point() or x.numel() < 3:
        return xs
    dirty = _laws._dirty(x, position % (x.numel() - 2))
    try:  # on a copy: an update that cleans its input in place would clean the batch the laws see
        probe = dirty.clone()
        obs.update(obs.init(probe), probe)
    except Exception:  # the raise policy: the laws run on finite batches
        return xs
    return [*xs[:index], dirty, *xs[index + 1 :]]


def _probe(make_x) -> torch.Tensor:
    """``make_x``'s batch for seed 0, after checking that it takes the generator, returns a tensor and
    draws from the generator: hypothesis replays a failing example from its seed, and a batch drawn
    from the global generator instead would fail as hypothesis' ``FlakyFailure``, naming no law."""
    try:
        inspect.signature(make_x).bind(torch.Generator())
    except TypeError:
        raise TypeError(f"check_all: make_x must take one argument, a torch.Generator seeded by hypothesis, and "
                        f"draw its batch from it: lambda generator: torch.randn(4, 8, generator=generator) (got "
                        f"{getattr(make_x, '__name__', type(make_x).__name__)}{inspect.signature(make_x)})") from None
    except ValueError:  # no signature to read (a builtin): let the call speak
        pass
    probe, again = (make_x(torch.Generator().manual_seed(0)) for _ in range(2))
    if not isinstance(probe, torch.Tensor):
        raise TypeError(f"check_all: make_x(generator) must return one input batch (a tensor), got "
                        f"{type(probe).__name__}")
    if probe.numel() == 0:  # every state would be init's: any observer, however broken, would pass
        raise ValueError(f"check_all: make_x(generator) returned an empty tensor (shape {tuple(probe.shape)}): the "
                         "laws compare the states of data; return batches holding values")
    if probe.is_meta:  # the laws compare values, which a meta tensor lacks
        raise ValueError("check_all: make_x(generator) returned a tensor on the meta device, which holds no values: "
                         "the laws compare the states of batches; return it on the device to check (cpu, cuda)")
    if isinstance(again, torch.Tensor):
        _check_like_probe(probe, [again])
    same = (isinstance(again, torch.Tensor) and again.shape == probe.shape and again.dtype == probe.dtype
            and bool(((again == probe) | (again != again) & (probe != probe)).all()))
    if not same:
        raise ValueError("check_all: make_x(generator) returned different batches for the same seed: draw them from "
                         "the generator it is given (torch.randn(..., generator=generator)), so that hypothesis can "
                         "replay and shrink a failing example")
    return probe


def _check_like_probe(probe: torch.Tensor, xs: list) -> None:
    """A ValueError naming ``make_x`` where a batch of ``xs`` lies on another device, or has another
    shape or dtype, than ``probe`` (the laws concatenate, stack and merge the batches and their states,
    which would fail there with an error naming no law)."""
    for x in xs:
        for what, got, expected in (("on different devices", x.device, probe.device),
                                    ("of different shapes", tuple(x.shape), tuple(probe.shape)),
                                    ("of different dtypes", x.dtype, probe.dtype)):
            if got != expected:
                raise ValueError(f"check_all: make_x(generator) returned batches {what} ({expected}, then {got}): "
                                 "return batches of one shape and dtype, on one device")


def _first_update(obs, probe: torch.Tensor, approx_fields):
    """``update(init(probe), probe)``, after checking that it returns ``init``'s state type (a plain
    tuple would otherwise show as a state with no range rule) and that ``approx_fields`` names float
    fields of that state (a misspelt name would leave the field it meant bit for bit). None where
    ``init`` or ``update`` raises: the laws report that, naming the call."""
    try:
        init = obs.init(probe)
        seen = obs.update(init, probe)
    except Exception:
        return None
    name = getattr(obs, "name", "observer")
    if type(seen) is not type(init):
        raise AssertionError(f"{name}: check_all: update returned a {type(seen).__name__} where init returned a "
                             f"{type(init).__name__}: return the state type (state._replace(...) or "
                             f"{type(init).__name__}(...)), which qstats.save, compute_qparams and merge read")
    names = () if approx_fields is None else (approx_fields,) if isinstance(approx_fields, str) else tuple(approx_fields)
    if _laws._ALL_FLOAT in names:  # every float field, as assert_states_equal reads "*" in a list too
        return seen
    floats = {path.rsplit(".", 1)[-1] for path, leaf in qtree.leaves_with_paths(seen, "state")
              if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()}
    unknown = [field for field in names if field not in floats]
    if unknown:
        raise ValueError(f"check_all: approx_fields {unknown} name no float field of {type(seen).__name__}; its float "
                         f"fields: {sorted(floats)}")
    return seen
