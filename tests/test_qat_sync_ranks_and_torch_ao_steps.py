"""QATModel.sync on 2 gloo ranks whose states differ, and QAT steps against torch.ao.

- `QATModel.sync` skipped its ``all_reduce`` when this rank's activation states were empty, so a rank
  passing ``activations={}`` returned while the other waited in the collective (a hang, or the
  process group's timeout). Whether sync calls a collective now depends on the model only; every
  rank raises ValueError (checked here with 2 forked gloo ranks, the result each rank's exit code).
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
from torch import nn

import qstats
from _shared import exit_rank, fork_ranks, gloo_group

ACT_SPEC = qstats.QuantSpec("uint8", "asymmetric")
W_SPEC = qstats.QuantSpec("int8", granularity=qstats.PerAxis(0))


def _qat():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    return qstats.qat.prepare(model, qstats.memoryless_minmax(W_SPEC), qstats.minmax(ACT_SPEC))


def _broken(state, how: str):
    if how == "no activations":
        return state._replace(activations={})
    if how == "no weights":
        return state._replace(weights={})
    if how == "extra activation":
        return state._replace(activations={**state.activations, "9": state.activations["0"]})
    return state.activations  # "not a QATState": the activations dict alone


def _sync_rank(rank, port, broken_ranks, how, weights):
    """Exit 0: sync raised ValueError on this rank (TypeError where it passed no QATState); 1: it
    returned; 2: another error (the collective's timeout on the old code)."""
    qat = _qat()
    x = torch.randn(4, 6) * (1 + rank)
    state = qat.init(x)
    _, state = qat.apply(qat.params(), state, x)
    if rank in broken_ranks:
        state = _broken(state, how)
    expected = TypeError if rank in broken_ranks and how == "not a QATState" else ValueError
    with gloo_group(rank, port, timeout=timedelta(seconds=20)):
        try:
            qat.sync(state, weights=weights)
            code = 1
        except expected:
            code = 0
        except Exception:  # noqa: BLE001
            code = 2
    exit_rank(code)


@pytest.mark.parametrize("broken_ranks, how, weights", [
    ((1,), "no activations", False),
    ((0,), "no weights", True),
    ((0, 1), "no activations", False),
    ((1,), "extra activation", False),
    ((0,), "not a QATState", False),
    ((1,), "not a QATState", True),
])
def test_sync_raises_on_every_rank_when_a_rank_passes_a_state_the_model_does_not_have(broken_ranks, how, weights):
    # sync skipped its all_reduce where this rank's activation states were empty: the other rank
    # waited in the collective (here: until its 20 s timeout, or a gloo error once the peer left)
    assert fork_ranks(_sync_rank, broken_ranks, how, weights, timeout=90) == [0, 0]


def test_sync_without_a_process_group_checks_the_state():
    qat = _qat()
    x = torch.randn(4, 6)
    state = qat.init(x)
    assert qat.sync(state) is not None
    with pytest.raises(ValueError, match="state.activations has keys"):
        qat.sync(state._replace(activations={}))
    with pytest.raises(TypeError, match="state must be a QATState"):
        qat.sync(state.activations)


# ------------------------------------------------------------------------------------------------
# ste="identity" at ±Inf


def test_identity_straight_through_keeps_infinite_inputs_at_the_ends_of_the_range_as_torch():
    # x - x.detach() is inf - inf at ±Inf: the identity estimator's forward gave NaN there, where the
    # clipped one and torch's fake quant give the range's ends.
    spec = qstats.QuantSpec.from_torch_ao(torch.quint8, torch.per_tensor_affine)
    observer = qstats.minmax(spec)
    x = torch.tensor([float("inf"), -float("inf"), 1.0, -0.5, 0.25])
    state = observer.update(observer.init(x), x)
    reference = torch.ao.quantization.MinMaxObserver(dtype=torch.quint8)
    reference(x[torch.isfinite(x)])  # qstats' observers leave ±Inf out of the range (docs/differences.md)
    scale, zero_point = reference.calculate_qparams()
    expected = torch.fake_quantize_per_tensor_affine(x, scale, zero_point, 0, 255)
    xg = x.clone().requires_grad_(True)
    y, _ = qstats.observe_fake_quantize(xg, state, observer, ste="identity")
    y.backward(torch.ones_like(y))
    assert torch.equal(y.detach(), expected)
    assert torch.equal(xg.grad, torch.isfinite(x).float())  # 1 at every finite value, 0 at ±Inf
    with torch.no_grad():
        y, _ = qstats.observe_fake_quantize(x, state, observer, ste="identity")
    assert torch.equal(y, expected)


def test_identity_straight_through_prepare_with_an_infinite_input_matches_clipped_forward():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2))
    qat = qstats.qat.prepare(model, qstats.memoryless_minmax(W_SPEC), qstats.minmax(ACT_SPEC), ste="identity")
    clipped = qstats.qat.prepare(model, qstats.memoryless_minmax(W_SPEC), qstats.minmax(ACT_SPEC))
    x = torch.tensor([[float("inf"), 1.0, -2.0], [0.5, -float("inf"), 3.0]])
    out, _ = qat.apply(qat.params(), qat.init(x), x)
    ref, _ = clipped.apply(clipped.params(), clipped.init(x), x)
    assert torch.isfinite(out).all() and torch.equal(out, ref)


def test_lsq_scale_gradient_past_int64_counts_the_nearest_end_as_the_forward():
    # torch's learnable backward casts x / scale to int64 (Inf, 3e38: quant_min's code) while its
    # forward clamps them to quant_max; qstats' gradient follows the forward (docs/qat.md).
    import math

    spec = qstats.QuantSpec("uint8", "asymmetric")
    x = torch.tensor([float("inf"), 3e38, -float("inf"), -3e38, 1.0])
    scale = torch.tensor(0.01, requires_grad=True)
    zero_point = torch.tensor(3.0, requires_grad=True)
    y = qstats.lsq_fake_quantize(x, qstats.LSQParams(scale, zero_point), spec)
    y.sum().backward()
    expected_forward = torch._fake_quantize_learnable_per_tensor_affine(
        x, scale.detach().reshape(1), zero_point.detach().reshape(1), 0, 255, 1.0)
    assert torch.equal(y.detach(), expected_forward)
    factor = 1 / math.sqrt(x.numel() * 255)
    inside = (y.detach()[4] - x[4]) / 0.01  # the one value inside the range
    expected_scale = (2 * (255 - 3) + 2 * (0 - 3) + inside) * factor
    torch.testing.assert_close(scale.grad, expected_scale, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(zero_point.grad, torch.tensor(-4 * 0.01 * factor), rtol=1e-6, atol=0)
