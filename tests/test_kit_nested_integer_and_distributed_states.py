"""The observer author's kit (docs/write_an_observer.md) beyond the page's own example: integer
batches, half-precision batches, nested states, Python-number fields and the distributed law."""

from typing import NamedTuple

import optree
import pytest
import torch

import qstats
from qstats import testing
from qstats.observers import kit
from qstats.observers import state_types

SPEC = qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0))


def _int_batches(generator):
    return torch.randint(-100, 100, (6, 8), generator=generator)


@kit.register_state
class KitEdgeSquareState(NamedTuple):
    approx_fields = ("square_total",)

    square_total: torch.Tensor  # float64
    count: torch.Tensor  # int64


def _squares(dtype_of_state=lambda x: torch.float64):
    """The page's root-mean-square observer; ``dtype_of_state(x)`` the dtype init gives the sum."""

    def init_fn(x):
        shape = kit.qparam_shape(x.shape, SPEC.granularity)
        return KitEdgeSquareState(torch.zeros(shape, dtype=dtype_of_state(x), device=x.device),
                                  torch.zeros(shape, dtype=torch.int64, device=x.device))

    def update_fn(state, x, weight=None):
        if x.numel() == 0:
            return state
        view = kit.checked_view(x, SPEC.granularity, state.count.shape, "squares.update").double()
        keep = torch.isfinite(view)
        mask = kit.weight_view(x, weight, SPEC.granularity)
        if mask is not None:
            keep = keep & (mask != 0)
        total = state.square_total + torch.where(keep, view * view, 0.0).sum(dim=(0, -1))
        return KitEdgeSquareState(total.to(state.square_total.dtype), state.count + keep.sum(dim=(0, -1)))

    def merge_fn(a, b):
        kit.check_same_shapes(a, b, "squares.merge")
        return KitEdgeSquareState(a.square_total + b.square_total, a.count + b.count)

    return kit.Observer(init_fn, update_fn, merge_fn, exact=True, spec=SPEC, name="squares")


@kit.register_range_rule(KitEdgeSquareState)
def _squares_rule(state, spec):
    rms = (state.square_total / state.count.clamp(min=1)).sqrt().float()
    return kit.Range(-4 * rms, 4 * rms, state.count)


def test_check_all_takes_integer_batches_that_observers_take():
    """The vmap law fake-quantized the batches: every observer failed check_all on integer batches
    ("vmap(fake_quantize) failed: TypeError"), which observers accept (check_observable)."""
    minmax = qstats.minmax(SPEC)
    for obs in (minmax, qstats.histogram(qstats.QuantSpec()), _squares()):
        testing.check_all(obs, _int_batches, max_examples=3)
    x = _int_batches(torch.Generator().manual_seed(0))
    state = minmax.update(minmax.init(x), x)
    low, high = x.aminmax(dim=1)  # independent: torch
    assert torch.equal(state.min_val, low.float()) and torch.equal(state.max_val, high.float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_stability_catches_a_state_that_follows_the_input_dtype_whatever_the_batches(dtype):
    """The dtype drift check ran for float32 batches only: with the model's bf16/fp16 batches a state
    whose sum follows the input's dtype (float64 for float64 inputs) passed every law."""
    drifting = _squares(lambda x: torch.promote_types(x.dtype, torch.float32))._replace(name="drifting")
    with pytest.raises(AssertionError, match="drifting: stability: (init|update) of a torch.float"):
        testing.check_all(drifting, lambda g: torch.randn(6, 8, generator=g).to(dtype), max_examples=2)
    # a state that keeps its dtypes passes with these batches
    testing.check_all(_squares(), lambda g: torch.randn(6, 8, generator=g).to(dtype), max_examples=2)
    assert _squares().init(torch.zeros(6, 8, dtype=dtype)).square_total.dtype == torch.float64


@kit.register_state
class KitEdgeExtremes(NamedTuple):
    low: torch.Tensor
    high: torch.Tensor


@kit.register_state
class KitEdgeNestedState(NamedTuple):
    ext: KitEdgeExtremes
    count: torch.Tensor


def _nested():
    spec = qstats.QuantSpec()

    def init_fn(x):
        return KitEdgeNestedState(KitEdgeExtremes(torch.full((), torch.inf), torch.full((), -torch.inf)),
                                  torch.zeros((), dtype=torch.int64))

    def update_fn(state, x, weight=None):
        low, high, count, _ = kit.observe_extremes(x, weight, spec, (), "nested.update")
        return KitEdgeNestedState(KitEdgeExtremes(torch.minimum(state.ext.low, low),
                                                  torch.maximum(state.ext.high, high)), state.count + count)

    def merge_fn(a, b):
        kit.check_same_shapes(a, b, "nested.merge")
        return KitEdgeNestedState(KitEdgeExtremes(torch.minimum(a.ext.low, b.ext.low),
                                                  torch.maximum(a.ext.high, b.ext.high)), a.count + b.count)

    return kit.Observer(init_fn, update_fn, merge_fn, exact=True, spec=spec, name="nested")


@kit.register_range_rule(KitEdgeNestedState)
def _nested_rule(state, spec):
    return kit.Range(state.ext.low, state.ext.high, state.count)


def test_check_same_shapes_walks_a_nested_state():
    """It refused every nested state ("field 'ext' ... is a KitEdgeExtremes; states hold tensors only"),
    so a merge written with it, as the page shows, failed on states the page allows."""
    obs = _nested()
    x, y = torch.randn(4, 8), torch.randn(5, 8)
    merged = obs.merge(obs.update(obs.init(x), x), obs.update(obs.init(y), y))
    both = torch.cat([x, y])
    assert torch.equal(merged.ext.low, both.amin()) and torch.equal(merged.ext.high, both.amax())  # torch
    wider = KitEdgeNestedState(KitEdgeExtremes(torch.zeros(3), torch.zeros(())), torch.zeros((), dtype=torch.int64))
    with pytest.raises(ValueError, match=r"field 'ext.low' has shape \(\) in the first state and \(3,\)"):
        kit.check_same_shapes(merged, wider, "nested.merge")
    with pytest.raises(TypeError, match="field 'ext.high' of the second state is a float"):
        kit.check_same_shapes(merged, merged._replace(ext=merged.ext._replace(high=1.0)), "nested.merge")


def test_a_nested_state_goes_through_all_reduce_and_its_law():
    """all_reduce refused nested states (a field that is a NamedTuple) that the kit allows, and the law
    passed them; all_reduce now takes them (tests/test_distributed_nested_states.py merges them on
    several ranks) and the law checks them."""
    obs = _nested()
    x = torch.randn(4, 8)
    state = obs.update(obs.init(x), x)
    reduced = qstats.distributed.all_reduce({"s": state}, obs)["s"]  # one process: validated, unchanged
    assert all(torch.equal(a, b) for a, b in zip(optree.tree_leaves(reduced), optree.tree_leaves(state)))
    testing.check_all(obs, lambda g: torch.randn(4, 8, generator=g), laws="distributed", max_examples=2)


def test_distributed_law_names_itself_when_the_declared_ops_cannot_apply():
    """Reduce ops declared on a field that is not a tensor: the law's own reduction raised a bare
    TypeError naming no law."""

    class KitEdgeDeclaredNested(KitEdgeNestedState):
        pass

    kit.register_state(KitEdgeDeclaredNested)
    qstats.distributed.register_reduce_ops(KitEdgeDeclaredNested, {"ext": "min", "count": "sum"})
    x = [torch.randn(4, 8) for _ in range(3)]
    base = _nested()
    obs = base._replace(init=lambda t: KitEdgeDeclaredNested(*base.init(t)),
                        update=lambda s, t, w=None: KitEdgeDeclaredNested(*base.update(s, t, w)),
                        merge=lambda a, b: KitEdgeDeclaredNested(*base.merge(a, b)))
    with pytest.raises(AssertionError, match="nested: distributed: "):
        testing.check_distributed(obs, x)


def test_register_state_refuses_a_field_annotated_as_a_python_number():
    """A state keeping ``n: int`` registered, calibrated, and failed only later: qstats.save ("cannot save
    a int"), all_reduce, stacked_observer (a vmap error about init_fn's outputs)."""

    class KitEdgePythonCount(NamedTuple):
        total: torch.Tensor
        n: int

    class KitEdgeStringAnnotated(NamedTuple):
        total: "torch.Tensor"
        seen: "float"

    with pytest.raises(TypeError, match="field 'n' of KitEdgePythonCount is annotated int; states hold tensors"):
        kit.register_state(KitEdgePythonCount)
    with pytest.raises(TypeError, match="field 'seen' of KitEdgeStringAnnotated is annotated float"):
        kit.register_state(KitEdgeStringAnnotated)
    assert "KitEdgePythonCount" not in state_types()
    # what the early refusal spares: the state cannot be stacked over experts
    obs = kit.Observer(lambda x: KitEdgePythonCount(torch.zeros(()), 0), None, None, exact=True)
    with pytest.raises(ValueError, match="must only return Tensors"):
        qstats.stacked_observer(obs, 2).init(torch.zeros(2, 3))


def test_registering_an_observer_instead_of_its_factory_says_so():
    """``register("mine", mine(spec))`` said "factory must be callable, got Observer": the name of the
    mix-up was left to guess (a Rule calls the factory with its spec)."""
    with pytest.raises(TypeError, match="'kit_edge_instance' got an Observer \\(squares\\); register the factory"):
        qstats.observers.register("kit_edge_instance", _squares())
    assert "kit_edge_instance" not in qstats.observers.registered()
    qstats.observers.register("kit_edge_squares", lambda spec: _squares(), replace=True)
    rule = qstats.Rule("Linear", sites=("weight",), observer="kit_edge_squares", spec=SPEC)
    w = torch.randn(4, 8)
    obs = rule.make_observer()
    state = obs.update(obs.init(w), w)
    assert torch.equal(state.square_total, w.double().pow(2).sum(dim=1))  # independent: torch
