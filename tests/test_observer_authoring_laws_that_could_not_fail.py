"""Observers a new author writes from docs/write_an_observer.md, and the laws of qstats.testing that
let a wrong one through or failed a right one:

- a weight is a mask (docs/observers.md: "0.5 or a routing probability counts as 1"), but the laws fed
  only 0/1 weights, so an update that scales |x| by its weight passed every law;
- non-finite values are to be left out, but the laws only asked for a finite state, so a
  ``torch.nan_to_num`` update (+inf turned into 3.4e38, a finite but absurd scale) passed;
- identity compared float fields listed in ``approx_fields`` bit for bit, so Chan's merge in its
  textbook form ``(mean_a * n_a + mean_b * n_b) / n``, right to rounding, failed it;
- a ``make_x`` that ignores its generator failed as hypothesis' ``FlakyFailure``, naming no law, and
  one that takes no argument as a bare TypeError of the lambda.

Each correct observer is compared with numpy on the concatenated data.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np
import pytest
import torch

import qstats
from qstats import testing
from qstats.observers import kit


@kit.register_state
class AuthoringAbsMaxState(NamedTuple):
    amax: torch.Tensor   # float32 running max of |x| per parameter
    count: torch.Tensor  # int64 values seen per parameter


@kit.register_state
class AuthoringWelfordState(NamedTuple):
    approx_fields = ("mean", "m2")
    count: torch.Tensor  # int64
    mean: torch.Tensor   # float64
    m2: torch.Tensor     # float64 sum of squared deviations from the mean


SPEC = qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(-1))


def _absmax(kept_values=lambda view, keep, mask: torch.where(keep, view.abs(), 0.0), name="absmax",
            nonfinite_out=True):
    def init_fn(x):
        kit.check_observable(x, f"{name}.init")
        shape = kit.qparam_shape(x.shape, SPEC.granularity)
        return AuthoringAbsMaxState(torch.zeros(shape, device=x.device),
                                    torch.zeros(shape, dtype=torch.int64, device=x.device))

    def update_fn(state, x, weight: Optional[torch.Tensor] = None):
        if x.numel() == 0:
            return state
        view = kit.checked_view(x, SPEC.granularity, state.count.shape, f"{name}.update").float()
        if not nonfinite_out:  # the mistake: NaN becomes 0, +inf the largest float, and both are counted
            view = torch.nan_to_num(view)
        keep = torch.isfinite(view)
        mask = kit.weight_view(x, weight, SPEC.granularity)
        if mask is not None:
            keep = keep & (mask != 0)
        values = kept_values(view, keep, mask)
        return AuthoringAbsMaxState(torch.maximum(state.amax, values.amax(dim=(0, -1))),
                                    state.count + keep.sum(dim=(0, -1)))

    def merge_fn(a, b):
        kit.check_same_shapes(a, b, f"{name}.merge")
        return AuthoringAbsMaxState(torch.maximum(a.amax, b.amax), a.count + b.count)

    return kit.Observer(init_fn, update_fn, merge_fn, exact=True, spec=SPEC, name=name)


@kit.register_range_rule(AuthoringAbsMaxState)
def _absmax_rule(state, spec):
    return kit.Range(-state.amax, state.amax, state.count)


def _chan(count_a, mean_a, m2_a, count_b, mean_b, m2_b, weighted_mean=True):
    """Chan et al.'s merge of two (count, mean, m2) triples. ``weighted_mean``: the mean as the weighted
    average of the two means (the form Wikipedia's parallel algorithm recommends when both counts are
    large), right to rounding, but ``merge(init, s)`` is ``(mean * n + 0) / n``, which rounds where the
    state's mean came from Welford's ``mean_a + delta * n_b / n`` of ``update``."""
    count = count_a + count_b
    total = count.double().clamp(min=1)
    delta = mean_b - mean_a
    if weighted_mean:
        mean = (mean_a * count_a.double() + mean_b * count_b.double()) / total
    else:
        mean = mean_a + delta * (count_b.double() / total)
    m2 = m2_a + m2_b + delta * delta * (count_a.double() * count_b.double() / total)
    return AuthoringWelfordState(count, mean, m2)


def _welford(rows_out=False):
    def init_fn(x):
        kit.check_observable(x, "welford.init")
        shape = kit.qparam_shape(x.shape, SPEC.granularity)
        zeros = torch.zeros(shape, dtype=torch.float64, device=x.device)
        return AuthoringWelfordState(torch.zeros(shape, dtype=torch.int64, device=x.device), zeros, zeros.clone())

    def update_fn(state, x, weight: Optional[torch.Tensor] = None):
        if x.numel() == 0:
            return state
        view, mask = kit.masked_view(x, weight, SPEC, state.count.shape, "welford.update")
        view = view.double()
        keep = torch.isfinite(view) if mask is None else torch.isfinite(view) & mask
        if rows_out:  # a token (row of the view) holding a NaN or Inf is left out whole, as qstats.hessian's rows
            keep = keep & torch.isfinite(view).all(dim=tuple(range(1, view.ndim)), keepdim=True)
        count = keep.sum(dim=(0, -1))
        mean = torch.where(keep, view, 0.0).sum(dim=(0, -1)) / count.double().clamp(min=1)
        deviation = torch.where(keep, view - mean.unsqueeze(0).unsqueeze(-1), 0.0)
        return _chan(state.count, state.mean, state.m2, count, mean, (deviation * deviation).sum(dim=(0, -1)),
                     weighted_mean=False)

    def merge_fn(a, b):
        kit.check_same_shapes(a, b, "welford.merge")
        return _chan(a.count, a.mean, a.m2, b.count, b.mean, b.m2)

    return kit.Observer(init_fn, update_fn, merge_fn, exact=True, spec=SPEC, name="welford")


@kit.register_range_rule(AuthoringWelfordState)
def _welford_rule(state, spec, k: float = 3.0):
    std = (state.m2 / state.count.double().clamp(min=1)).sqrt()
    return kit.Range((state.mean - k * std).float(), (state.mean + k * std).float(), state.count)


def _make_x(generator):
    return torch.randn(6, 4, 16, generator=generator) + 1.0


def test_the_correct_absmax_passes_every_law_and_is_numpy_s_masked_abs_max():
    obs = _absmax()
    testing.check_all(obs, _make_x, max_examples=3)
    x = _make_x(torch.Generator().manual_seed(1))
    x[0, 0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    routing = torch.rand(6, 4, generator=torch.Generator().manual_seed(2)) * (torch.arange(6 * 4).reshape(6, 4) % 3 != 0)
    state = obs.update(obs.init(x), x, routing)
    values = x.numpy()[routing.numpy() != 0]                  # [kept tokens, 16]
    expected = np.where(np.isfinite(values), np.abs(values), 0.0).max(axis=0)
    np.testing.assert_array_equal(state.amax.numpy(), expected.astype(np.float32))


def test_stability_catches_an_update_that_scales_by_its_weight():
    scaled = _absmax(lambda view, keep, mask: torch.where(keep, view.abs(), 0.0) * (1.0 if mask is None else mask),
                     name="weight_as_scale")
    with pytest.raises(AssertionError, match=r"weight_as_scale: stability: update with a weight in \(0, 1\].*masks"):
        testing.check_all(scaled, _make_x, laws="stability", max_examples=2)


def test_stability_catches_an_update_that_clamps_infinities_instead_of_leaving_them_out():
    clamped = _absmax(name="nan_to_num", nonfinite_out=False)
    x = _make_x(torch.Generator().manual_seed(0))
    dirty = x.clone()
    dirty.view(-1)[:2] = torch.tensor([float("nan"), float("inf")])
    # the independent computation: what left out means, against what nan_to_num gives
    finite_max = float(np.nanmax(np.where(np.isfinite(dirty.numpy()), np.abs(dirty.numpy()), np.nan)[..., 1]))
    assert float(_absmax().update(_absmax().init(x), dirty).amax[1]) == pytest.approx(finite_max)
    assert float(clamped.update(clamped.init(x), dirty).amax[1]) == float(torch.finfo(torch.float32).max)
    with pytest.raises(AssertionError, match=r"nan_to_num: stability: compute_qparams of update\(s, x holding NaN"):
        testing.check_all(clamped, _make_x, laws="stability", max_examples=2)


def test_identity_takes_chan_s_textbook_merge_which_numpy_confirms():
    obs = _welford()
    xs = [_make_x(torch.Generator().manual_seed(seed)) * (seed + 1) for seed in range(3)]
    states = [obs.update(obs.init(xs[0]), xs[0])]
    states.append(obs.update(obs.update(states[0], xs[1]), xs[2]))
    assert not torch.equal(obs.merge(obs.init(xs[0]), states[1]).mean, states[1].mean)  # rounds, to 1 ulp
    testing.check_identity(obs, xs)
    testing.check_all(obs, _make_x, max_examples=3)
    merged = obs.merge(obs.update(obs.init(xs[0]), xs[0]), obs.update(obs.update(obs.init(xs[0]), xs[1]), xs[2]))
    data = torch.cat(xs).double().reshape(-1, 16).numpy()
    np.testing.assert_allclose(merged.mean.numpy(), data.mean(axis=0), rtol=1e-12)
    np.testing.assert_allclose(merged.m2.numpy() / merged.count.numpy(), data.var(axis=0), rtol=1e-12)


def test_identity_still_catches_a_biased_merge_of_an_approx_field():
    obs = _welford()
    biased = obs._replace(merge=lambda a, b: obs.merge(a, b)._replace(m2=obs.merge(a, b).m2 * (1 + 1e-4)),
                          name="biased")
    with pytest.raises(AssertionError, match=r"biased: identity merge\(init, init\)|biased: identity merge\(init, s\)"):
        testing.check_identity(biased, [_make_x(torch.Generator().manual_seed(seed)) for seed in range(3)])


def test_check_all_names_a_make_x_that_ignores_or_does_not_take_its_generator():
    def wrong_merge(a, b):  # fails homomorphism only on some draws
        return AuthoringAbsMaxState(torch.where(b.amax > 2.5, a.amax, torch.maximum(a.amax, b.amax)), a.count + b.count)

    broken = _absmax()._replace(merge=wrong_merge)
    with pytest.raises(ValueError, match="different batches for the same seed.*generator=generator"):
        testing.check_all(broken, lambda generator: torch.randn(4, 16), laws="homomorphism", max_examples=20)
    with pytest.raises(TypeError, match=r"make_x must take one argument, a torch.Generator"):
        testing.check_all(broken, lambda: torch.randn(4, 16), max_examples=1)


def test_identity_catches_an_init_that_allocates_on_the_default_device():
    def init_on_cpu(x):  # the mistake: no device=x.device, which only a GPU input would show
        shape = kit.qparam_shape(x.shape, SPEC.granularity)
        return AuthoringAbsMaxState(torch.zeros(shape), torch.zeros(shape, dtype=torch.int64))

    broken = _absmax()._replace(init=init_on_cpu, name="cpu_init")
    meta = torch.empty(6, 4, 16, device="meta")
    assert broken.init(meta).amax.device.type == "cpu" and _absmax().init(meta).amax.device.type == "meta"
    testing.check_identity(_absmax(), [_make_x(torch.Generator().manual_seed(0))])
    with pytest.raises(AssertionError, match=r"cpu_init: identity: init of a tensor on the meta device put state.amax on cpu"):
        testing.check_all(broken, _make_x, laws="identity", max_examples=2)
    with pytest.raises(AssertionError, match=r"stacked\(cpu_init\): identity: .*meta device"):
        testing.check_all(qstats.stacked_observer(broken, 2), lambda generator: torch.randn(2, 4, 16, generator=generator),
                          laws="identity", batch_dims=1, max_examples=2)


def test_check_all_names_an_update_that_returns_a_plain_tuple():
    obs = _absmax()
    as_tuple = obs._replace(update=lambda state, x, weight=None: tuple(obs.update(state, x, weight)), name="as_tuple")
    assert type(as_tuple.update(obs.init(torch.ones(2, 16)), torch.ones(2, 16))) is tuple
    with pytest.raises(AssertionError, match=r"as_tuple: check_all: update returned a tuple where init returned a "
                                             r"AuthoringAbsMaxState"):
        testing.check_all(as_tuple, _make_x, max_examples=1)


def test_check_all_refuses_approx_fields_that_name_no_float_field():
    with pytest.raises(ValueError, match=r"approx_fields \['m_2'\] name no float field of AuthoringWelfordState; its "
                                         r"float fields: \['m2', 'mean'\]"):
        testing.check_all(_welford(), _make_x, approx_fields=("mean", "m_2"), max_examples=1)
    testing.check_all(_welford(), _make_x, approx_fields=("mean", "m2"), laws="identity", max_examples=1)


def test_check_all_takes_every_float_field_in_a_list_as_assert_states_equal_does():
    a = AuthoringWelfordState(torch.tensor([3]), torch.tensor([1.0], dtype=torch.float64),
                              torch.tensor([2.0], dtype=torch.float64))
    b = a._replace(mean=torch.tensor([1.0 + 1e-7], dtype=torch.float64))
    testing.assert_states_equal(b, a, approx_fields=["*"])  # "*" in a list: every float field
    testing.check_all(_welford(), _make_x, approx_fields=["*"], laws="identity", max_examples=1)


def test_stability_takes_an_update_that_leaves_out_the_rows_holding_infinities():
    # qstats.hessian's policy (a row's x^T x holds each of its values), for a per-channel mean and variance
    rows_out = _welford(rows_out=True)
    x = _make_x(torch.Generator().manual_seed(0))
    dirty = x.clone()
    dirty[0, 1, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    tokens = dirty.reshape(-1, 16).double().numpy()
    finite = tokens[np.isfinite(tokens).all(axis=1)]  # numpy: the tokens holding no NaN or Inf
    state = rows_out.update(rows_out.init(x), dirty)
    np.testing.assert_allclose(state.mean.numpy(), finite.mean(axis=0), rtol=1e-12)
    np.testing.assert_allclose(state.m2.numpy(), finite.var(axis=0) * len(finite), rtol=1e-12)
    testing.check_all(rows_out, _make_x, laws="stability", max_examples=3)


def _row_absmax(nonfinite_out=True):
    """A per-feature abs max that takes row weights only (``x.shape[:-1]`` or a prefix, as qstats.hessian):
    it leaves out the rows holding a NaN or Inf, or (the mistake) reads them through nan_to_num."""
    name = "row_absmax" if nonfinite_out else "row_nan_to_num"

    def init_fn(x):
        kit.check_observable(x, f"{name}.init")
        return AuthoringAbsMaxState(torch.zeros(x.shape[-1], device=x.device),
                                    torch.zeros(x.shape[-1], dtype=torch.int64, device=x.device))

    def update_fn(state, x, weight: Optional[torch.Tensor] = None):
        if x.numel() == 0:
            return state
        rows = x.reshape(-1, x.shape[-1]).float()
        keep = kit.row_mask(x, weight, f"{name}.update")
        keep = torch.ones(rows.shape[0], dtype=torch.bool, device=x.device) if keep is None else keep
        if nonfinite_out:
            keep = keep & torch.isfinite(rows).all(-1)
        else:
            rows = torch.nan_to_num(rows)
        values = torch.where(keep[:, None], rows.abs(), 0.0)
        return AuthoringAbsMaxState(torch.maximum(state.amax, values.amax(0)), state.count + keep.sum())

    def merge_fn(a, b):
        kit.check_same_shapes(a, b, f"{name}.merge")
        return AuthoringAbsMaxState(torch.maximum(a.amax, b.amax), a.count + b.count)

    return kit.Observer(init_fn, update_fn, merge_fn, exact=True, spec=SPEC, name=name)


def test_stability_catches_nan_to_num_in_an_observer_that_takes_row_weights_only():
    # the check compared with an element weight only, which such an observer refuses: it was skipped
    x = _make_x(torch.Generator().manual_seed(0))
    dirty = x.clone()
    dirty[0, 1, :2] = torch.tensor([float("nan"), float("inf")])
    rows = np.abs(dirty.reshape(-1, 16).numpy())
    finite_rows = rows[np.isfinite(rows).all(axis=1)]  # numpy: the rows holding no NaN or Inf
    np.testing.assert_array_equal(_row_absmax().update(_row_absmax().init(x), dirty).amax.numpy(),
                                  finite_rows.max(axis=0))
    testing.check_all(_row_absmax(), _make_x, laws="stability", max_examples=2)
    with pytest.raises(AssertionError, match=r"row_nan_to_num: stability: compute_qparams of update\(s, x holding NaN"):
        testing.check_all(_row_absmax(nonfinite_out=False), _make_x, laws="stability", max_examples=2)
