"""Review of qstats.experts: bad input on the vmapped path of stacked_observer, routing masks
(duplicates, padding, experts with no or every token) against a per-expert loop of the plain
observer."""

import pytest
import torch

import qstats

SPEC = qstats.QuantSpec(granularity=qstats.PerAxis(-1), on_uncalibrated="fallback")


@pytest.mark.parametrize("factory", [qstats.moments, qstats.histogram, qstats.minmax], ids=lambda f: f.__name__)
def test_state_of_the_wrong_expert_count_is_named(factory):
    # The vmapped path (every observer outside the min/max family) used to fail inside vmap
    # ("Expected all tensors to have the same size in the mapped dimension"), naming no field.
    observer = qstats.stacked_observer(factory(SPEC), 4)
    other = qstats.stacked_observer(factory(SPEC), 3)
    x = torch.randn(4, 5, 8)
    state = observer.init(x)
    wrong = other.init(torch.randn(3, 5, 8))
    with pytest.raises(ValueError, match=r"state field '\w+' of shape \(3, .*leading expert dimension 4"):
        observer.update(wrong, x)
    with pytest.raises(ValueError, match=r"state field '\w+' of shape \(3, .*leading expert dimension 4"):
        observer.update(wrong, x, torch.ones(4, 5))
    with pytest.raises(ValueError, match=r"state field '\w+' of shape \(3, .*leading expert dimension 4"):
        observer.merge(state, wrong)


def test_bool_expert_count_is_refused():
    with pytest.raises(ValueError, match="num_experts"):
        qstats.stacked_observer(qstats.minmax(SPEC), True)


@pytest.mark.parametrize(
    "factory", [qstats.minmax, qstats.moving_average_minmax, qstats.moments, qstats.histogram], ids=lambda f: f.__name__
)
def test_routing_with_padding_duplicates_and_uncovered_experts_equals_the_expert_loop(factory):
    # expert 0 gets every token, expert 3 none; -1 and E are padding slots; token 1 picks
    # expert 1 twice (a mask is 0/1: the token is observed once).
    g = torch.Generator().manual_seed(11)
    experts, tokens = 4, 9
    x = torch.randn(tokens, 8, generator=g) * 3
    index = torch.tensor([[0, 1], [0, 1], [0, 2], [0, -1], [0, 4], [0, 2], [0, 1], [0, 2], [0, 1]])
    index[1, 0] = 1
    mask = qstats.experts.routing_mask((x, index, torch.ones(tokens, 2)), {}, experts, tokens)
    want = torch.zeros(experts, tokens)
    for token, chosen in enumerate(index.tolist()):
        for expert in chosen:
            if 0 <= expert < experts:
                want[expert, token] = 1.0
    assert torch.equal(mask, want)
    plain = factory(SPEC)
    stacked = qstats.stacked_observer(plain, experts)
    gathered, weight = qstats.experts.dispatch(x, mask)
    state = stacked.update(stacked.init(gathered), gathered, weight)
    for expert in range(experts):
        rows = x[mask[expert] != 0]
        reference = plain.update(plain.init(x), rows) if rows.numel() else plain.init(x)
        for field, ours, theirs in zip(state._fields, state, reference):
            assert torch.equal(ours[expert], theirs), (expert, field)
    assert qstats.experts.uncovered_experts(state) == [3]
    qparams = qstats.stacked_qparams(state, SPEC)
    assert torch.isfinite(qparams.scale).all() and (qparams.scale > 0).all()
    assert not qparams.calibrated[3].any() and qparams.calibrated[:3].all()


def test_shared_tokens_with_a_routing_mask_on_a_vmapped_histogram_equal_the_expert_loop():
    # The documented form for activations shared by every expert (and what qstats.calibrate does
    # off CPU): x.expand(E, ...) with the routing mask as the weight.
    g = torch.Generator().manual_seed(12)
    experts, tokens = 4, 10
    x = torch.randn(tokens, 8, generator=g)
    mask = (torch.rand(experts, tokens, generator=g) < 0.5).float()
    mask[2] = 0.0
    plain = qstats.histogram(SPEC)
    stacked = qstats.stacked_observer(plain, experts)
    shared = x.expand(experts, *x.shape)
    state = stacked.update(stacked.init(shared), shared, mask)
    for expert in range(experts):
        reference = plain.update(plain.init(x), x, mask[expert])
        for field, ours, theirs in zip(state._fields, state, reference):
            assert torch.equal(ours[expert], theirs), (expert, field)
