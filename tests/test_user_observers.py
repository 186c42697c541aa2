"""Observers a user writes from docs/write_an_observer.md, through the laws of qstats.testing and the
machinery the page promises they work with (calibrate, all_reduce, save/load): the mistakes the laws
let through before, each shown to do harm outside the laws."""

import functools
from typing import NamedTuple

import pytest
import torch
from _shared import exit_rank, fork_ranks, gloo_group

import qstats
from qstats import testing
from qstats.observers import kit

SPEC = qstats.QuantSpec(granularity=qstats.PerAxis(0))
SHAPE = (2, 3, 8)


def _make_x(generator):
    return torch.randn(6, 8, generator=generator)


# ---------------------------------------------------------------------------------------------
# A memoryless envelope (elementwise max of the latest batch) whose update keeps x.float(): for a
# float32 x that is x itself, so a model's in-place op rewrites the state after the update.


@kit.register_state
class UserEnvelopeState(NamedTuple):
    values: torch.Tensor  # float32, the elementwise max of the latest batch's kept rows


def _envelope(copy: bool):
    spec = qstats.QuantSpec()

    def init_fn(x):
        return UserEnvelopeState(torch.full(SHAPE, -torch.inf, dtype=torch.float32, device=x.device))

    def update_fn(state, x, weight=None):
        if x.numel() == 0:
            return state
        if tuple(x.shape) != SHAPE:
            raise ValueError(f"envelope: expected inputs of shape {SHAPE}, got {tuple(x.shape)}")
        # the copying envelope also leaves NaN/Inf out (as unobserved, -inf)
        values = torch.where(torch.isfinite(x), x.float(), -torch.inf) if copy else x.float()
        if weight is not None:
            keep = kit.weight_view(x, weight, qstats.PerTensor()).reshape(x.shape) != 0
            values = torch.where(keep, values, -torch.inf)
        return UserEnvelopeState(values)

    def merge_fn(a, b):
        return UserEnvelopeState(torch.maximum(a.values, b.values))

    return kit.Observer(init_fn, update_fn, merge_fn, exact=True, spec=spec, name="envelope")


@kit.register_range_rule(UserEnvelopeState)
def _envelope_rule(state, spec):
    peak = state.values.abs().amax()
    return kit.Range(-peak, peak, torch.isfinite(state.values).any())


def _calibrated_envelope(observer):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(inplace=True)).eval()
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("output",), observer=observer, spec=qstats.QuantSpec())])
    x = torch.randn(SHAPE)
    state = qstats.calibrate(model, [x], recipe, progress=False)["0"]["output"]
    return state, torch.nn.functional.linear(x, model[0].weight, model[0].bias)


def test_purity_catches_an_update_whose_state_shares_memory_with_its_input():
    """The aliasing envelope passed every law; under calibrate, ReLU(inplace=True) zeroed the
    negative outputs the state had kept."""
    aliasing, copying = (lambda spec: _envelope(copy=False)), (lambda spec: _envelope(copy=True))
    state, linear_out = _calibrated_envelope(aliasing)
    assert not torch.equal(state.values, linear_out)  # the harm: the state holds relu(linear(x))
    state, linear_out = _calibrated_envelope(copying)
    assert torch.equal(state.values, linear_out)

    def make(generator):
        return torch.randn(SHAPE, generator=generator)

    with pytest.raises(AssertionError, match="envelope: purity: update returned a state that shares memory"):
        testing.check_purity(_envelope(copy=False), [make(torch.Generator().manual_seed(i)) for i in range(3)])
    with pytest.raises(AssertionError, match="purity: update returned a state that shares memory"):
        testing.check_all(_envelope(copy=False), make, accumulates=False, max_examples=2)
    testing.check_all(_envelope(copy=True), make, accumulates=False, max_examples=2)


# ---------------------------------------------------------------------------------------------
# A state holding a NamedTuple of extremes: the nested type must be registered too, or neither
# qstats.save nor torch.load can rebuild the state.


class UserUnregisteredExtremes(NamedTuple):
    low: torch.Tensor
    high: torch.Tensor


@kit.register_state
class UserRegisteredExtremes(NamedTuple):
    low: torch.Tensor
    high: torch.Tensor


def _nested_observer(inner, outer):
    spec = qstats.QuantSpec()

    def init_fn(x):
        return outer(inner(torch.full((), torch.inf), torch.full((), -torch.inf)), torch.zeros((), dtype=torch.int64))

    def update_fn(state, x, weight=None):
        low, high, count, _ = kit.observe_extremes(x, weight, spec, (), "nested.update")
        return outer(inner(torch.minimum(state.ext.low, low), torch.maximum(state.ext.high, high)), state.count + count)

    def merge_fn(a, b):
        return outer(inner(torch.minimum(a.ext.low, b.ext.low), torch.maximum(a.ext.high, b.ext.high)),
                     a.count + b.count)

    return kit.Observer(init_fn, update_fn, merge_fn, exact=True, spec=spec, name="nested")


@kit.register_state
class UserNestedUnregisteredState(NamedTuple):
    ext: UserUnregisteredExtremes
    count: torch.Tensor


@kit.register_state
class UserNestedRegisteredState(NamedTuple):
    ext: UserRegisteredExtremes
    count: torch.Tensor


def test_stability_catches_a_nested_state_type_that_is_not_registered(tmp_path):
    """Only the outer class was checked: the state passed every law, and qstats.save refused it."""
    unregistered = _nested_observer(UserUnregisteredExtremes, UserNestedUnregisteredState)
    x = torch.randn(4, 8)
    with pytest.raises(TypeError, match="not a registered state type"):
        qstats.save(tmp_path / "bad.safetensors", {"s": unregistered.update(unregistered.init(x), x)})
    with pytest.raises(AssertionError, match=r"nested: stability: state type UserUnregisteredExtremes \(at state.ext\) "
                                             "is not registered"):
        testing.check_all(unregistered, _make_x, laws="stability", max_examples=2)

    registered = _nested_observer(UserRegisteredExtremes, UserNestedRegisteredState)
    testing.check_all(registered, _make_x, laws="stability", max_examples=2)
    state = registered.update(registered.init(x), x)
    qstats.save(tmp_path / "good.safetensors", {"s": state})
    back = qstats.load(tmp_path / "good.safetensors")["s"]
    assert type(back.ext) is UserRegisteredExtremes
    assert torch.equal(back.ext.low, x.amin()) and torch.equal(back.ext.high, x.amax())  # independent: torch


# ---------------------------------------------------------------------------------------------
# register_state and the result types checkpoints hold by name.


@pytest.mark.parametrize("name", ["QParams", "LSQParams", "QATState", "BatchNormState"])
def test_register_state_refuses_the_name_of_a_checkpoint_result_type(name, tmp_path):
    """A user's BatchNormState was accepted, after which a QAT model's BatchNormState could no
    longer be saved (qstats.save: not a registered state type)."""
    import qstats.io

    assert name in {cls.__name__ for cls in qstats.io._RESULT_TYPES}  # the reserved names are io's
    user_class = NamedTuple(name, [("total", torch.Tensor)])
    with pytest.raises(ValueError, match=f"register_state: '{name}' is the name of a qstats type"):
        qstats.register_state(user_class)
    batchnorm = qstats.qat.BatchNormState(*(torch.full((2,), float(i)) for i in range(len(qstats.qat.BatchNormState._fields))))
    qstats.save(tmp_path / "bn.safetensors", {"bn": batchnorm})
    back = qstats.load(tmp_path / "bn.safetensors")["bn"]
    assert type(back) is qstats.qat.BatchNormState
    assert all(torch.equal(a, b) for a, b in zip(back, batchnorm))


def test_every_result_type_of_checkpoints_is_reserved():
    import qstats.io
    from qstats.observers import _base

    assert {cls.__name__ for cls in qstats.io._RESULT_TYPES} == set(_base._RESERVED_NAMES)


# ---------------------------------------------------------------------------------------------
# The distributed law: an EMA of abs-max per channel declared with sum ops that its merge (a
# batch-weighted mean) is not.


@kit.register_state
class UserEmaAbsMaxState(NamedTuple):
    ema: torch.Tensor      # float32 per channel
    batches: torch.Tensor  # int64 batches averaged per channel


qstats.distributed.register_reduce_ops(UserEmaAbsMaxState, {"ema": "sum", "batches": "sum"})  # wrong: merge averages


@kit.register_range_rule(UserEmaAbsMaxState)
def _ema_rule(state, spec):
    return kit.Range(-state.ema, state.ema, state.batches)


def _ema_absmax(spec, constant=0.1):
    def init_fn(x):
        shape = kit.qparam_shape(x.shape, spec.granularity)
        return UserEmaAbsMaxState(torch.zeros(shape, device=x.device), torch.zeros(shape, dtype=torch.int64, device=x.device))

    def update_fn(state, x, weight=None):
        if x.numel() == 0:
            return state
        low, high, count, _ = kit.observe_extremes(x, weight, spec, state.ema.shape, "ema_absmax.update")
        peak, seen = torch.maximum(low.abs(), high.abs()), count > 0
        ema = torch.where(state.batches == 0, peak, state.ema + constant * (peak - state.ema))
        return UserEmaAbsMaxState(torch.where(seen, ema, state.ema), state.batches + seen.long())

    def merge_fn(a, b):
        return UserEmaAbsMaxState(kit.batch_weighted_mean(a.ema, b.ema, a.batches, b.batches), a.batches + b.batches)

    return kit.Observer(init_fn, update_fn, merge_fn, exact=False, spec=spec, name="ema_absmax")


def _rank_data(rank):
    generator = torch.Generator().manual_seed(rank)
    return [torch.randn(6, 8, generator=generator) for _ in range(3)]


def _fold(obs, xs):
    return functools.reduce(obs.update, xs, obs.init(xs[0]))


def _all_reduce_rank(rank, port, out):
    code = 1
    try:
        with gloo_group(rank, port):
            obs = _ema_absmax(SPEC)
            merged = qstats.distributed.all_reduce({"s": _fold(obs, _rank_data(rank))}, obs)["s"]
            if rank == 0:
                torch.save(tuple(merged), out)
        code = 0
    finally:
        exit_rank(code)


def test_distributed_law_catches_reduce_ops_that_disagree_with_merge(tmp_path):
    """check_all passed the mis-declared state; all_reduce summed the two ranks' averages."""
    obs = _ema_absmax(SPEC)
    out = tmp_path / "merged.pt"
    assert fork_ranks(_all_reduce_rank, str(out)) == [0, 0]
    got = torch.load(out)
    first, second = (_fold(obs, _rank_data(rank)) for rank in range(2))
    # independent: the per-channel mean of the two ranks' averages (each averaged 3 batches)
    assert torch.allclose(obs.merge(first, second).ema, (first.ema + second.ema) / 2)
    assert torch.equal(got[0], first.ema + second.ema)  # the harm: all_reduce applied the declared sum
    with pytest.raises(AssertionError, match=r"ema_absmax: distributed: the reduce ops declared for UserEmaAbsMaxState"):
        testing.check_all(obs, _make_x, max_examples=3)
    testing.check_all(obs, _make_x, laws=[law for law in testing.LAWS if law != "distributed"], max_examples=3)


@kit.register_state
class UserAbsSumState(NamedTuple):
    abs_total: torch.Tensor  # float64 sum of |x| per channel
    count: torch.Tensor


qstats.distributed.register_reduce_ops(UserAbsSumState, {"abs_total": "sum", "count": "sum"})


@kit.register_range_rule(UserAbsSumState)
def _abs_sum_rule(state, spec):
    mean = (state.abs_total / state.count.clamp(min=1)).float()
    return kit.Range(-3 * mean, 3 * mean, state.count)


def _abs_sum(spec):
    def init_fn(x):
        shape = kit.qparam_shape(x.shape, spec.granularity)
        return UserAbsSumState(torch.zeros(shape, dtype=torch.float64, device=x.device),
                               torch.zeros(shape, dtype=torch.int64, device=x.device))

    def update_fn(state, x, weight=None):
        if x.numel() == 0:
            return state
        view = kit.checked_view(x, spec.granularity, state.count.shape, "abs_sum.update").double()
        keep = torch.isfinite(view)
        mask = kit.weight_view(x, weight, spec.granularity)
        if mask is not None:
            keep = keep & (mask != 0)
        return UserAbsSumState(state.abs_total + torch.where(keep, view.abs(), 0.0).sum(dim=(0, -1)),
                               state.count + keep.sum(dim=(0, -1)))

    def merge_fn(a, b):
        kit.check_same_shapes(a, b, "abs_sum.merge")
        return UserAbsSumState(a.abs_total + b.abs_total, a.count + b.count)

    return kit.Observer(init_fn, update_fn, merge_fn, exact=True, spec=spec, name="abs_sum")


@pytest.mark.parametrize("granularity", [qstats.PerTensor(), qstats.PerAxis(0), qstats.PerGroup(4)], ids=str)
def test_a_correct_elementwise_declaration_passes_every_law(granularity):
    testing.check_all(_abs_sum(qstats.QuantSpec(granularity=granularity)), _make_x, max_examples=3)
    testing.check_distributed(qstats.minmax(SPEC), [_make_x(torch.Generator().manual_seed(i)) for i in range(3)])


def test_batch_weighted_mean_keeps_the_precision_of_float64_averages():
    """The shares were float32: two float64 averages of 1 and 2 batches merged 3e-8 off."""
    generator = torch.Generator().manual_seed(0)
    u, v = (torch.rand(64, generator=generator, dtype=torch.float64) for _ in range(2))
    u_batches, v_batches = torch.randint(1, 1000, (64,), generator=generator), torch.randint(1, 1000, (64,), generator=generator)
    got = kit.batch_weighted_mean(u, v, u_batches, v_batches)
    # independent: exact rational weights in float64
    want = (u * u_batches.double() + v * v_batches.double()) / (u_batches + v_batches).double()
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-14, atol=0)
    assert torch.equal(got, kit.batch_weighted_mean(v, u, v_batches, u_batches))  # still commutative bit for bit
    float32 = kit.batch_weighted_mean(u.float(), v.float(), u_batches, v_batches)
    assert float32.dtype == torch.float32
    torch.testing.assert_close(float32, want.float(), rtol=1e-6, atol=0)


def _python310():
    """A Python 3.10 interpreter that runs (a pyenv shim may name one it cannot start), or None."""
    import glob
    import os
    import shutil
    import subprocess

    found = [*sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.10*/bin/python"))), shutil.which("python3.10")]
    for path in filter(None, found):
        try:
            done = subprocess.run([path, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True,
                                  text=True, timeout=30)
        except OSError:
            continue
        if done.stdout.strip() == "(3, 10)":
            return path
    return None


_STUB_TORCH = """
import runpy, sys, types
torch = types.ModuleType("torch")
torch.Tensor = type("Tensor", (), {})
sys.modules["torch"] = torch
module = runpy.run_path(sys.argv[1])
Observer = module["Observer"]
obs = Observer(None, None, None, exact=True)
assert obs._replace(name="x").name == "x" and obs.shared_rows is False, obs
print("ok")
"""


@pytest.mark.skipif(_python310() is None, reason="needs a Python 3.10 interpreter")
def test_the_observer_class_is_defined_on_python_3_10():
    """pyproject.toml says python >= 3.10, whose NamedTuple refuses a Generic base: ``import qstats``
    raised 'Multiple inheritance with NamedTuple is not supported'. The module runs under 3.10 with a
    stub torch (3.10 here has none; the class definition needs none)."""
    import subprocess
    from pathlib import Path

    base = Path(__file__).resolve().parents[1] / "qstats" / "observers" / "_base.py"
    done = subprocess.run([_python310(), "-c", _STUB_TORCH, str(base)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


@pytest.mark.parametrize("bad", [None, 0.0, [torch.zeros(())]], ids=["None", "float", "list"])
def test_check_same_shapes_names_a_field_that_is_not_a_tensor(bad):
    """A user's merge calling kit.check_same_shapes on a state with a None field raised a bare
    AttributeError ('NoneType' object has no attribute 'shape')."""
    good = qstats.minmax(qstats.QuantSpec()).init(torch.zeros(3))
    broken = good._replace(count=bad)
    for a, b, which in ((broken, good, "first"), (good, broken, "second")):
        with pytest.raises(TypeError, match=f"user.merge: field 'count' of the {which} state is a {type(bad).__name__}"):
            kit.check_same_shapes(a, b, "user.merge")
