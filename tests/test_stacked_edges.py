"""Edge cases of `qstats.stacked_observer` / `qstats.stacked_qparams` and of the laws kit on stacked
observers: masks of every dtype, experts without tokens, merges, checkpoints, torch.ao per expert."""

from __future__ import annotations

import os

import pytest
import torch
from torch.ao.quantization import MovingAveragePerChannelMinMaxObserver, PerChannelMinMaxObserver

import qstats
import qstats.coreai_opt
from qstats import testing

EXPERTS = 3
FALLBACK = qstats.QuantSpec(granularity=qstats.PerAxis(-1), on_uncalibrated="fallback")
FAMILIES = {
    "mse": lambda: qstats.mse(FALLBACK),
    "mse_moving_average": lambda: qstats.mse(FALLBACK, mode="moving_average"),
    "imatrix": qstats.imatrix,
    "hessian": lambda: qstats.hessian(FALLBACK),
    "recording": lambda: qstats.recording(FALLBACK, 64),
    "memoryless_minmax": lambda: qstats.memoryless_minmax(FALLBACK),
    "coreai_opt.moving_average_minmax": lambda: qstats.coreai_opt.moving_average_minmax(FALLBACK, 0.1),
}


def _make_stack(generator):
    return torch.randn(EXPERTS, 6, 8, generator=generator)


def _masked_routing(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(EXPERTS, 10, 8, generator=g)
    routed = torch.rand(EXPERTS, 10, generator=g) > 0.5
    routed[1] = False  # an expert that got no token
    return x, routed


MASKS = {
    "bool": lambda routed: routed,
    "int": lambda routed: routed.to(torch.int32),
    "float": lambda routed: routed.to(torch.float32),
    "fractional": lambda routed: routed * torch.rand(routed.shape, generator=torch.Generator().manual_seed(0)),
}


@pytest.mark.parametrize("mask", sorted(MASKS))
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_masks_of_every_dtype_equal_each_expert_observing_its_routed_rows(family, mask):
    # a weight is a mask: a nonzero entry (a routing probability of 0.3 too) keeps its row once
    plain = FAMILIES[family]()
    stacked = qstats.stacked_observer(plain, EXPERTS)
    x, routed = _masked_routing(5)
    state = stacked.update(stacked.init(x), x, MASKS[mask](routed))
    approx = getattr(type(state), "approx_fields", ())
    for expert in range(EXPERTS):
        rows = x[expert][routed[expert]]
        reference = plain.update(plain.init(x[expert]), rows) if rows.numel() else plain.init(x[expert])
        one = type(state)(*[field[expert] for field in state])
        testing.assert_states_equal(one, reference, approx_fields=approx, message=f"{family} expert {expert}")


def test_stacked_min_max_match_torch_ao_per_channel_observers_per_expert():
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(EXPERTS, 6, 16, generator=g) * (i + 1) for i in range(3)]
    spec = qstats.QuantSpec.from_torch_ao(torch.quint8, torch.per_channel_affine, ch_axis=0)
    for plain, make_reference in (
        (qstats.minmax(spec), lambda: PerChannelMinMaxObserver(ch_axis=0)),
        (qstats.moving_average_minmax(spec, 0.01), lambda: MovingAveragePerChannelMinMaxObserver(ch_axis=0)),
    ):
        stacked = qstats.stacked_observer(plain, EXPERTS)
        state = stacked.init(xs[0])
        for x in xs:
            state = stacked.update(state, x)
        qparams = qstats.stacked_qparams(state, spec)
        for expert in range(EXPERTS):
            reference = make_reference()
            for x in xs:
                reference(x[expert])
            scale, zero_point = reference.calculate_qparams()
            assert torch.equal(qparams.scale[expert], scale)
            assert torch.equal(qparams.zero_point[expert].to(zero_point.dtype), zero_point)


def test_merged_stacked_states_survive_save_and_load(tmp_path):
    plain = qstats.histogram(FALLBACK, 8, 32)
    stacked = qstats.stacked_observer(plain, EXPERTS)
    (x1, m1), (x2, m2) = _masked_routing(7), _masked_routing(8)
    merged = stacked.merge(stacked.update(stacked.init(x1), x1, m1), stacked.update(stacked.init(x2), x2, m2))
    path = os.fspath(tmp_path / "stacked.safetensors")
    qstats.save(path, {"experts": merged})
    loaded = qstats.load(path)["experts"]
    for expert in range(EXPERTS):  # against the plain observer's merge of each expert's routed rows
        left = plain.update(plain.init(x1[expert]), x1[expert][m1[expert]])
        right = plain.update(plain.init(x2[expert]), x2[expert][m2[expert]])
        testing.assert_states_equal(type(loaded)(*[f[expert] for f in loaded]), plain.merge(left, right))
    qparams = qstats.stacked_qparams(loaded, FALLBACK)
    assert not qparams.calibrated[1].any() and torch.equal(qparams.scale[1], torch.ones(8))


@pytest.mark.parametrize("state", [None, (torch.zeros(EXPERTS),), [torch.zeros(EXPERTS)]])
def test_a_state_that_is_not_a_named_tuple_is_named(state):
    # None used to fail with "'NoneType' object is not iterable" from the shape check
    stacked = qstats.stacked_observer(qstats.histogram(FALLBACK, 8, 32), EXPERTS)
    x = torch.randn(EXPERTS, 4, 8)
    with pytest.raises(TypeError, match=r"stacked_observer: expected a state"):
        stacked.update(state, x)
    with pytest.raises(TypeError, match=r"stacked_observer: expected a state"):
        stacked.merge(state, stacked.init(x))


def _broken(update, name):
    return qstats.stacked_observer(qstats.minmax(FALLBACK), EXPERTS)._replace(update=update, name=name)


def test_laws_catch_a_stacked_update_that_applies_another_experts_routing_mask():
    # Every law used to pass: the rolled mask is consistent under rolling the experts, the complementary
    # weights still split the rows, and the slice-independence check varied the data only.
    good = qstats.stacked_observer(qstats.minmax(FALLBACK), EXPERTS)

    def update(state, x, weight=None):
        return good.update(state, x, None if weight is None else weight.roll(1, 0))

    xs = [_make_stack(torch.Generator().manual_seed(i)) for i in range(3)]
    with pytest.raises(AssertionError, match="depends on the weights of other slices"):
        testing.check_vmap(_broken(update, "rolled-mask"), xs, batch_dims=1)


def test_laws_catch_a_stacked_update_that_ignores_the_mask_of_shared_rows():
    # The stride-0 path (x.expand(E, ...): tokens shared by every expert) was never exercised by the laws.
    good = qstats.stacked_observer(qstats.minmax(FALLBACK), EXPERTS)

    def update(state, x, weight=None):
        if weight is not None and x.stride(0) == 0:
            return good.update(state, x.contiguous())
        return good.update(state, x, weight)

    with pytest.raises(AssertionError, match="stride-0 stack"):
        testing.check_all(_broken(update, "unmasked-shared"), _make_stack, laws="vmap", batch_dims=1, max_examples=2)


@pytest.mark.parametrize("family", ["mse", "hessian", "coreai_opt.moving_average_minmax"])
def test_stacked_observers_pass_the_slice_weight_laws(family):
    stacked = qstats.stacked_observer(FAMILIES[family](), EXPERTS)
    xs = [_make_stack(torch.Generator().manual_seed(i)) for i in range(3)]
    testing.check_vmap(stacked, xs, batch_dims=1)
