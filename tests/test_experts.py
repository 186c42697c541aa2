"""Stacked experts: one vmapped call equals torch.ao observers run expert by expert; routing masks;
experts with no token are reported and fall back. On transformers' Qwen3-MoE (random weights from a
tiny config, no download) and on the plain-torch MoE of examples/moe_experts.py; stacked observers
of every family against a per-expert loop of the plain observer (routing with duplicates, padding
and uncovered experts; states of the wrong expert count named)."""

import warnings

import pytest
import torch
from _shared import qwen3_moe_config, routed_calls
from torch.ao.quantization.observer import MinMaxObserver, PerChannelMinMaxObserver

import qstats

WEIGHTS = qstats.QuantSpec.from_torch_ao(dtype=torch.qint8, qscheme=torch.per_channel_symmetric, ch_axis=0)
INPUTS = qstats.QuantSpec.from_torch_ao(dtype=torch.quint8, qscheme=torch.per_tensor_affine)


def _torch_ao_per_channel(weight):
    observer = PerChannelMinMaxObserver(ch_axis=0, dtype=torch.qint8, qscheme=torch.per_channel_symmetric)
    observer(weight)
    return observer.calculate_qparams()


def test_stacked_observer_equals_expert_loop():
    generator = torch.Generator().manual_seed(0)
    stack = torch.randn(5, 6, 4, generator=generator) * torch.arange(1, 6).reshape(5, 1, 1)
    single = qstats.minmax(WEIGHTS)
    stacked = qstats.stacked_observer(single, 5)
    state = stacked.update(stacked.init(stack), stack)
    qparams = torch.vmap(lambda s: qstats.compute_qparams(s, WEIGHTS))(state)
    for expert in range(5):
        scale, zero_point = _torch_ao_per_channel(stack[expert])
        assert torch.equal(qparams.scale[expert], scale)
        assert torch.equal(qparams.zero_point[expert], zero_point.to(torch.int32))
    other = torch.randn(5, 6, 4, generator=generator)
    merged = stacked.merge(state, stacked.update(stacked.init(other), other))
    for expert in range(5):
        expected = single.update(single.update(single.init(stack[expert]), stack[expert]), other[expert])
        for left, right in zip(merged, expected):
            assert torch.equal(left[expert], right)
    with pytest.raises(ValueError, match=r"leading expert dimension 5"):
        stacked.update(state, torch.randn(4, 6, 4))


def test_routing_mask_from_top_k_index():
    index = torch.tensor([[0, 2], [2, 3], [1, 0]])
    mask = qstats.experts.routing_mask((torch.zeros(3, 4), index, torch.ones(3, 2)), {}, 4, 3)
    expected = torch.zeros(4, 3)
    for token, chosen in enumerate(index.tolist()):
        for expert in chosen:
            expected[expert, token] = 1.0
    assert torch.equal(mask, expected)
    assert qstats.experts.routing_mask((torch.zeros(3, 4),), {}, 4, 3) is None


def _qwen3_moe(num_experts=8, top_k=2):
    transformers = pytest.importorskip("transformers")
    config = qwen3_moe_config(num_experts=num_experts, num_experts_per_tok=top_k)
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(config).eval()


def _recipe(inputs=INPUTS):
    return qstats.Recipe(
        [
            qstats.Rule("Qwen3MoeExperts", sites=("gate_up_proj", "down_proj"), spec=WEIGHTS),
            qstats.Rule("Qwen3MoeExperts", sites=("input",), spec=inputs),
        ]
    )


def test_qwen3_moe_experts_match_per_expert_torch_ao():
    model = _qwen3_moe()
    generator = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 64, (2, 6), generator=generator) for _ in range(2)]
    recipe = _recipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qstats.UncalibratedWarning)
        states = qstats.calibrate(model, batches, recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    routed = routed_calls(model, batches, "Qwen3MoeExperts")
    assert sorted(states) == sorted(routed) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    for path, calls in routed.items():
        experts = model.get_submodule(path)
        for site in ("gate_up_proj", "down_proj"):
            stack = getattr(experts, site).detach()
            assert qparams[path][site].scale.shape == stack.shape[:2]
            for expert in range(8):
                scale, zero_point = _torch_ao_per_channel(stack[expert])
                assert torch.equal(qparams[path][site].scale[expert], scale)
        for expert in range(8):
            observer = MinMaxObserver(dtype=torch.quint8)
            tokens = 0
            for hidden, index in calls:
                rows = hidden[(index == expert).any(-1)]
                tokens += rows.shape[0]
                if rows.numel():
                    observer(rows)
            covered = bool(qparams[path]["input"].calibrated[expert])
            assert covered == (tokens > 0)
            assert int(states[path]["input"].count[expert]) == tokens * 16
            if covered:
                scale, zero_point = observer.calculate_qparams()
                assert torch.equal(qparams[path]["input"].scale[expert], scale.reshape(()))
                assert int(qparams[path]["input"].zero_point[expert]) == int(zero_point)


def test_uncovered_experts_are_warned_and_fall_back():
    model = _qwen3_moe(num_experts=8, top_k=1)
    batches = [torch.tensor([[1, 2, 3]])]  # 3 tokens, top-1: at least 5 experts get nothing
    routed = routed_calls(model, batches, "Qwen3MoeExperts")
    recipe = _recipe(INPUTS.replace(on_uncalibrated="fallback"))
    with pytest.warns(qstats.UncalibratedWarning) as caught:
        states = qstats.calibrate(model, batches, recipe, progress=False)
    message = str(caught[0].message)
    for path, calls in routed.items():
        chosen = set(calls[0][1].flatten().tolist())
        missing = [expert for expert in range(8) if expert not in chosen]
        assert f"{path}.input: experts {missing}" in message
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    for path, calls in routed.items():
        chosen = set(calls[0][1].flatten().tolist())
        coverage = qparams[path]["input"].calibrated
        assert coverage.tolist() == [expert in chosen for expert in range(8)]
        scale = qparams[path]["input"].scale
        assert bool(torch.isfinite(scale).all()) and bool((scale > 0).all())
        assert bool((scale[~coverage] == 1).all())
    strict = _recipe(INPUTS.replace(on_uncalibrated="raise"))
    with pytest.raises(ValueError, match="model.layers.0.mlp.experts"):
        qstats.compute_qparams_tree(states, strict, model)


def test_fake_quantized_stacked_weights_match_per_expert_torch_fake_quant():
    model = _qwen3_moe()
    recipe = qstats.Recipe([qstats.Rule("Qwen3MoeExperts", sites=("gate_up_proj",), spec=WEIGHTS)])
    states = qstats.calibrate(model, [], recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    experts = model.model.layers[0].mlp.experts
    original = experts.gate_up_proj.detach().clone()
    with qstats.fake_quantized(model, qparams, recipe):
        quantized = experts.gate_up_proj.detach().clone()
    for expert in range(8):
        scale, zero_point = _torch_ao_per_channel(original[expert])
        expected = torch.fake_quantize_per_channel_affine(original[expert], scale, zero_point.int(), 0, -128, 127)
        assert torch.equal(quantized[expert], expected)
    assert torch.equal(experts.gate_up_proj, original)



def test_plain_torch_moe_example(moe_example):
    example = moe_example
    model, states, qparams, caught = example.main(batches=2, tokens=16, verbose=False)
    assert any("experts [14, 15]" in str(w.message) for w in caught)
    for path in ("0.experts", "1.experts"):
        experts = model.get_submodule(path)
        for expert in range(16):
            scale, _ = _torch_ao_per_channel(experts.down_proj[expert].detach())
            # the example uses a plain symmetric int8 spec; torch.ao's per-channel symmetric qint8
            # observer computes the same scale
            assert torch.equal(qparams[path]["down_proj"].scale[expert], scale)
        coverage = qparams[path]["input"].calibrated
        assert not bool(coverage[14]) and not bool(coverage[15])
        assert bool(torch.isfinite(qparams[path]["input"].scale).all())


def test_only_modules_declaring_num_experts_are_stacked(moe_example):
    conv = torch.nn.Conv2d(3, 4, 3)
    assert qstats.experts.expert_count(conv) == 0
    recipe = qstats.Recipe([qstats.Rule("Conv2d", sites=("weight",), spec=WEIGHTS)])
    assert recipe.sites(torch.nn.Sequential(conv))["0"]["weight"].num_experts == 0
    assert qstats.experts.expert_count(moe_example.StackedExperts(5, 4, 2)) == 5


@pytest.mark.parametrize("factory", [qstats.minmax, qstats.memoryless_minmax, qstats.moving_average_minmax])
@pytest.mark.parametrize("granularity", [qstats.PerTensor(), qstats.PerAxis(-1)])
def test_shared_tokens_with_a_routing_mask_equal_the_dispatched_tokens(factory, granularity):
    # x.expand(E, ...) is observed once for all experts (rows reduced once, then masked per
    # expert); the result equals each expert observing only its own tokens.
    from qstats.experts import dispatch

    g = torch.Generator().manual_seed(3)
    tokens = torch.randn(40, 12, generator=g)
    tokens[5, 3] = float("nan")
    mask = (torch.rand(6, 40, generator=g) > 0.6).float()
    mask[4] = 0.0  # an expert without tokens
    spec = qstats.QuantSpec(granularity=granularity, on_uncalibrated="fallback")
    observer = qstats.stacked_observer(factory(spec), 6)
    shared = tokens.expand(6, *tokens.shape)
    state = observer.update(observer.init(shared), shared, mask)
    inner = factory(spec)
    for expert in range(6):
        kept = tokens[mask[expert] != 0]  # the expert's own tokens, sliced out
        reference = inner.update(inner.init(tokens), kept) if kept.numel() else inner.init(tokens)
        for field, ours, theirs in zip(state._fields, state, reference):
            assert torch.equal(ours[expert], theirs), (expert, field)
    x, weight = dispatch(tokens, mask)  # the gathered stack gives the same states
    for ours, gathered in zip(state, observer.update(observer.init(x), x, weight)):
        assert torch.equal(ours, gathered)


FALLBACK = qstats.QuantSpec(granularity=qstats.PerAxis(-1), on_uncalibrated="fallback")


@pytest.mark.parametrize("factory", [qstats.moments, qstats.histogram, qstats.minmax], ids=lambda f: f.__name__)
def test_state_of_the_wrong_expert_count_is_named(factory):
    # The vmapped path (every observer outside the min/max family) used to fail inside vmap
    # ("Expected all tensors to have the same size in the mapped dimension"), naming no field.
    observer = qstats.stacked_observer(factory(FALLBACK), 4)
    other = qstats.stacked_observer(factory(FALLBACK), 3)
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
        qstats.stacked_observer(qstats.minmax(FALLBACK), True)


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
    plain = factory(FALLBACK)
    stacked = qstats.stacked_observer(plain, experts)
    gathered, weight = qstats.experts.dispatch(x, mask)
    state = stacked.update(stacked.init(gathered), gathered, weight)
    for expert in range(experts):
        rows = x[mask[expert] != 0]
        reference = plain.update(plain.init(x), rows) if rows.numel() else plain.init(x)
        for field, ours, theirs in zip(state._fields, state, reference):
            assert torch.equal(ours[expert], theirs), (expert, field)
    assert qstats.experts.uncovered_experts(state) == [3]
    qparams = qstats.stacked_qparams(state, FALLBACK)
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
    plain = qstats.histogram(FALLBACK)
    stacked = qstats.stacked_observer(plain, experts)
    shared = x.expand(experts, *x.shape)
    state = stacked.update(stacked.init(shared), shared, mask)
    for expert in range(experts):
        reference = plain.update(plain.init(x), x, mask[expert])
        for field, ours, theirs in zip(state._fields, state, reference):
            assert torch.equal(ours[expert], theirs), (expert, field)


def test_copies_of_tokens_finds_every_expert_holding_every_token_in_any_order():
    from qstats.experts import copies_of_tokens

    gen = torch.Generator().manual_seed(0)
    tokens = torch.randn(7, 5, generator=gen)
    in_order = torch.cat([tokens, tokens])
    shuffled = torch.cat([tokens[torch.randperm(7, generator=gen)], tokens[torch.randperm(7, generator=gen)]])
    ids = torch.tensor([1] * 7 + [3] * 7)
    expected = torch.tensor([False, True, False, True])
    assert torch.equal(copies_of_tokens(in_order, ids, tokens, 4), expected)
    assert torch.equal(copies_of_tokens(shuffled, ids, tokens, 4), expected)
    interleaved = torch.stack([tokens, tokens], dim=1).reshape(14, 5)  # rows of experts 1 and 3 alternate
    assert torch.equal(copies_of_tokens(interleaved, torch.tensor([1, 3] * 7), tokens, 4), expected)
    other = shuffled.clone()
    other[9, 2] += 1e-3  # one value differs
    assert copies_of_tokens(other, ids, tokens, 4) is None
    repeated = torch.cat([tokens[[0, 0, 1, 2, 3, 4, 5]], tokens])  # a token twice, another missing
    assert copies_of_tokens(repeated, ids, tokens, 4) is None
    assert copies_of_tokens(in_order[:13], ids[:13], tokens, 4) is None  # an expert short of a token
    assert copies_of_tokens(in_order, torch.tensor([1] * 7 + [4] * 7), tokens, 4) is None  # a sentinel id
    assert copies_of_tokens(in_order.double(), ids, tokens, 4) is None


class _LoopExperts(torch.nn.Module):
    """Stacked experts in an eager loop over flattened hidden states ``[B, S, H]``; ``cast``: each
    expert's rows are cast to the weights' dtype before its matmuls (as transformers' kernels do)."""

    def __init__(self, experts=4, hidden=6, intermediate=5, cast=False):
        super().__init__()
        self.num_experts, self.cast = experts, cast
        self.gate_up_proj = torch.nn.Parameter(torch.randn(experts, 2 * intermediate, hidden))
        self.down_proj = torch.nn.Parameter(torch.randn(experts, hidden, intermediate))

    def forward(self, hidden_states, top_k_index, top_k_weights):
        flat = hidden_states.reshape(-1, hidden_states.shape[-1])
        out = torch.zeros(flat.shape, dtype=self.gate_up_proj.dtype)
        for e in range(self.num_experts):
            token, slot = torch.where(top_k_index == e)
            rows = flat[token].to(self.gate_up_proj.dtype) if self.cast else flat[token]
            gate, up = torch.nn.functional.linear(rows, self.gate_up_proj[e]).chunk(2, dim=-1)
            y = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, self.down_proj[e])
            out.index_add_(0, token, y * top_k_weights[token, slot, None])
        return out.reshape(hidden_states.shape).to(hidden_states.dtype)


class _LoopMoE(torch.nn.Module):
    def __init__(self, cast=False):
        super().__init__()
        torch.manual_seed(0)
        self.router = torch.nn.Linear(6, 4)
        self.experts = _LoopExperts(cast=cast)

    def forward(self, x, attention_mask=None):
        weights, index = self.router(x.float()).reshape(-1, 4).softmax(-1).topk(2, dim=-1)
        return self.experts(x, index, weights)


@pytest.mark.parametrize("observer", ["minmax", "hessian"])
def test_all_experts_copies_of_padded_or_cast_tokens_are_observed_once(observer, monkeypatch):
    """Under ``all_experts`` each expert's copy of the tokens is observed as the tokens once: from
    [B, S, H] hidden states with padding (which it leaves out, without warning that it cannot), and
    when the experts cast their rows to another dtype (the cast tokens, once: one Hessian product)."""
    import qstats.observation as observation

    seen, original = [], observation._RoutedSite.observe_rows
    monkeypatch.setattr(observation._RoutedSite, "observe_rows",
                        lambda self, rows, mask: seen.append((self.site, rows.shape[0])) or original(self, rows, mask))
    spec = qstats.QuantSpec(dtype="int8", mapping="asymmetric", on_uncalibrated="fallback")
    rule = dict(observer=qstats.hessian) if observer == "hessian" else dict(spec=spec)
    recipe = qstats.Recipe([qstats.Rule("_LoopExperts", sites=("input", "gate_up_proj.input"), **rule)])
    x = torch.randn(2, 3, 6)
    x[1, 2] = 100.0  # a padded token
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        padded = qstats.calibrate(_LoopMoE(), [(x, torch.tensor([[1, 1, 1], [1, 1, 0]]))], recipe, progress=False,
                                  all_experts=True, observation_weight=lambda batch: batch[1])["experts"]
    assert all(torch.equal(a, b) for a, b in zip(padded["input"], padded["gate_up_proj.input"]))
    cast = qstats.calibrate(_LoopMoE(cast=True), [(torch.randn(1, 8, 6, dtype=torch.bfloat16),)], recipe,
                            progress=False, all_experts=True)["experts"]
    assert dict(seen[2:]) == {"input": 8, "gate_up_proj.input": 8}, seen
    if observer == "hessian":  # one product of the cast tokens, shared: every expert's sum is the same
        total = cast["gate_up_proj.input"].total
        assert torch.equal(total, total[:1].expand_as(total))


class _HalvingLoopExperts(_LoopExperts):
    """`_LoopExperts` whose forward calls the module itself on each half of its tokens."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        if hidden_states.shape[0] <= 4:
            return super().forward(hidden_states, top_k_index, top_k_weights)
        halves = [self(hidden_states[part], top_k_index[part], top_k_weights[part])
                  for part in (slice(None, 4), slice(4, None))]
        return torch.cat(halves)


@pytest.mark.parametrize("all_experts", [False, True])
def test_experts_that_call_themselves_are_observed_once_per_outer_call(all_experts):
    """A moving average counts each batch once: the module's calls on halves of its tokens, from
    inside its own forward, are part of the outer call (they were observed again, 3 batches per
    batch, 5 with ``all_experts``). Reference: torch.ao's moving-average observer per expert, fed
    that expert's routed tokens (every token with ``all_experts``) and its own intermediates, computed
    per half as the module computes them."""
    from torch.ao.quantization.observer import MovingAverageMinMaxObserver

    torch.manual_seed(0)
    experts = _HalvingLoopExperts(experts=2, hidden=4, intermediate=3)
    spec = qstats.QuantSpec.from_torch_ao(dtype=torch.quint8, qscheme=torch.per_tensor_affine)
    observer = lambda s: qstats.moving_average_minmax(s, averaging_constant=0.5)  # noqa: E731
    recipe = qstats.Recipe([qstats.Rule("_HalvingLoopExperts", sites=("input", "down_proj.input"), spec=spec,
                                        observer=observer)])
    batches = [(torch.randn(8, 4) * (1 + b), torch.tensor([[0], [1]] * 4), torch.ones(8, 1)) for b in range(3)]
    states = qstats.calibrate(experts, batches, recipe, progress=False, all_experts=all_experts)[""]
    for e in range(2):
        refs = {site: MovingAverageMinMaxObserver(averaging_constant=0.5) for site in states}
        with torch.no_grad():
            for x, index, _ in batches:
                # each half's rows multiplied on their own, as the module does (a matmul's last bits
                # may depend on its row count)
                halves = [x[part] if all_experts else x[part][index[part][:, 0] == e]
                          for part in (slice(None, 4), slice(4, None))]
                gate_up = [torch.nn.functional.linear(rows, experts.gate_up_proj[e]).chunk(2, dim=-1) for rows in halves]
                refs["input"](torch.cat(halves))
                refs["down_proj.input"](torch.cat([torch.nn.functional.silu(gate) * up for gate, up in gate_up]))
        for site, ref in refs.items():
            assert int(states[site].batches[e]) == 3, site
            torch.testing.assert_close(states[site].min_val[e], ref.min_val, rtol=0, atol=0)
            torch.testing.assert_close(states[site].max_val[e], ref.max_val, rtol=0, atol=0)


def test_padding_is_left_out_of_the_intermediates_of_experts_that_flatten_their_tokens():
    """Routed (not ``all_experts``): experts that flatten their hidden states themselves
    (``hidden_states.reshape(-1, hidden)``, from ``[B, S, H]`` or already ``[T, H]``) keep their
    rows traceable to their tokens, so padding is left out of ``gate_up_proj.input`` and
    ``down_proj.input`` as of ``input``. It used to be observed, with a warning that it was."""
    recipe = qstats.Recipe([qstats.Rule("_LoopExperts", sites=("input", "gate_up_proj.input", "down_proj.input"),
                                        spec=qstats.QuantSpec(dtype="int8", mapping="asymmetric",
                                                              on_uncalibrated="fallback"))])
    x = torch.randn(2, 3, 6, generator=torch.Generator().manual_seed(1))
    x[1, 2] = 100.0  # a padded token
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.simplefilter("ignore", qstats.UncalibratedWarning)
        padded = qstats.calibrate(_LoopMoE(), [(x, mask)], recipe, progress=False,
                                  observation_weight=lambda batch: batch[1])["experts"]
        unpadded = qstats.calibrate(_LoopMoE(), [(x[:1],), (x[1:, :2],)], recipe, progress=False)["experts"]
        for site, state in unpadded.items():
            for field, ours, theirs in zip(state._fields, padded[site], state):
                torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0, msg=f"{site} {field}")
        flat = _LoopMoE()  # [T, H] hidden states, every token padded: no expert observes anything
        states = qstats.calibrate(flat, [(x[0],)], recipe, progress=False,
                                  observation_weight=lambda batch: torch.zeros(3))["experts"]
    assert all(int(state.count.sum()) == 0 for state in states.values()), {k: s.count for k, s in states.items()}


# --- transformers' other MoE architectures --------------------------------------------------------------------------

_SMALL = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
              max_position_embeddings=32, tie_word_embeddings=False)
# (model class, config class, config fields): 8 experts, top-2, every layer a MoE layer
_ARCHITECTURES = {
    "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", dict(
        intermediate_size=32, moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=8,
        num_experts_per_tok=2)),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", dict(intermediate_size=16, num_local_experts=8,
                                                            num_experts_per_tok=2, head_dim=16)),
    "olmoe": ("OlmoeForCausalLM", "OlmoeConfig", dict(intermediate_size=16, num_experts=8, num_experts_per_tok=2,
                                                      eos_token_id=None, pad_token_id=None)),
    "granitemoe": ("GraniteMoeForCausalLM", "GraniteMoeConfig", dict(intermediate_size=16, num_local_experts=8,
                                                                     num_experts_per_tok=2)),
    "deepseek_v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config", dict(
        intermediate_size=32, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
        topk_group=1, first_k_dense_replace=0, n_shared_experts=1, kv_lora_rank=16, q_lora_rank=None,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, num_key_value_heads=2)),
    "gpt_oss": ("GptOssForCausalLM", "GptOssConfig", dict(intermediate_size=16, num_local_experts=8,
                                                          num_experts_per_tok=2, head_dim=16,
                                                          layer_types=["full_attention"] * 2)),
}


def _tiny_moe(architecture):
    transformers = pytest.importorskip("transformers")
    model_class, config_class, fields = _ARCHITECTURES[architecture]
    config = getattr(transformers, config_class)(**{**_SMALL, **fields})
    torch.manual_seed(0)
    return getattr(transformers, model_class)(config).eval()


def _router_assignments(model, batches):
    """``{experts path: [(tokens [T, H], mask [E, T])]}``, one per call, from the model's own routers: a hook
    on the router next to each experts module reads the selected experts from its output (the first
    integer tensor it returns) and the tokens from its input."""
    seen, handles = {}, []
    for path, module in model.named_modules():
        if not qstats.experts.expert_count(module):
            continue
        parent = model.get_submodule(path.rsplit(".", 1)[0])
        router = getattr(parent, "gate", None) or parent.router

        def hook(router, args, output, path=path, experts=module.num_experts):
            index = next(o for o in output if isinstance(o, torch.Tensor) and not o.is_floating_point())
            tokens = args[0].detach().reshape(-1, args[0].shape[-1])
            mask = torch.zeros(experts, tokens.shape[0])
            mask.scatter_(0, index.T.long(), 1.0)
            seen.setdefault(path, []).append((tokens, mask))

        handles.append(router.register_forward_hook(hook))
    with torch.no_grad():
        for batch in batches:
            model(**batch)
    for handle in handles:
        handle.remove()
    return seen


def _intermediate(architecture, experts, rows, expert):
    """``down_proj``'s input for ``rows`` sent to ``expert``, computed here from the stacked weights."""
    if architecture == "gpt_oss":  # [E, H, 2I] with biases, interleaved gate/up and its own activation
        return experts._apply_gate(rows @ experts.gate_up_proj[expert] + experts.gate_up_proj_bias[expert])
    gate, up = torch.nn.functional.linear(rows, experts.gate_up_proj[expert]).chunk(2, dim=-1)
    return experts.act_fn(gate) * up


@pytest.mark.parametrize("all_experts", [False, True], ids=["routed", "all_experts"])
@pytest.mark.parametrize("implementation", ["eager", "grouped_mm", "batched_mm"])
@pytest.mark.parametrize("architecture", sorted(_ARCHITECTURES))
def test_every_expert_of_transformers_moe_architectures_observes_what_its_router_sends(
        architecture, implementation, all_experts):
    """Qwen2-MoE (shared expert), Mixtral, OLMoE, GraniteMoE, DeepSeek-V3 (grouped routing) and GPT-OSS
    (transposed, biased): each expert's ``input`` and ``down_proj.input`` observe exactly the tokens the
    model's own router sent it (read by a hook on the router's output), padding left out, or every
    unpadded token with ``all_experts``; the intermediates are computed here from those tokens."""
    model = _tiny_moe(architecture)
    model.set_experts_implementation(implementation)
    name = next(type(m).__name__ for m in model.modules() if qstats.experts.expert_count(m))
    spec = qstats.QuantSpec(dtype="int8", mapping="asymmetric", on_uncalibrated="fallback")
    recipe = qstats.Recipe([qstats.Rule(name, sites=("input", "down_proj.input"), spec=spec)])
    generator = torch.Generator().manual_seed(1)
    batches = [{"input_ids": torch.randint(0, 64, (2, 6), generator=generator),
                "attention_mask": torch.tensor([[1] * 6, [0] * 2 + [1] * 4])} for _ in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qstats.UncalibratedWarning)
        states = qstats.calibrate(model, batches, recipe, progress=False, all_experts=all_experts,
                                  observation_weight=lambda batch: batch["attention_mask"])
    routed = _router_assignments(model, batches)
    assert sorted(states) == sorted(routed) and len(routed) == 2
    kept = [batch["attention_mask"].reshape(-1) != 0 for batch in batches]
    for path, calls in routed.items():
        experts = model.get_submodule(path)
        for expert in range(8):
            selected = [(mask[expert] != 0 if not all_experts else torch.ones_like(keep)) & keep
                        for (_, mask), keep in zip(calls, kept)]
            rows = torch.cat([tokens[chosen] for (tokens, _), chosen in zip(calls, selected)])
            with torch.no_grad():
                values = _intermediate(architecture, experts, rows, expert)
            for site, expected in (("input", rows), ("down_proj.input", values)):
                state = states[path][site]
                assert int(state.count[expert]) == expected.numel(), (path, site, expert)
                if expected.numel():
                    torch.testing.assert_close(state.min_val[expert], expected.min(), rtol=1e-5, atol=1e-6)
                    torch.testing.assert_close(state.max_val[expert], expected.max(), rtol=1e-5, atol=1e-6)


def test_all_experts_calls_cover_every_expert_and_name_a_routing_without_slots():
    """ceil(E / k) calls route every token to every expert once; a top-k of 0 (an index [tokens, 0])
    raised Python's range() error."""
    x = torch.randn(5, 4)
    calls = qstats.experts.all_experts_calls((x, torch.zeros(5, 3, dtype=torch.long), torch.zeros(5, 3)), {}, 7, 5)
    routed = torch.cat([args[1] for args, _ in calls], dim=1)
    assert len(calls) == 3 and all(sorted(row.tolist()) == list(range(7)) for row in routed)
    assert all(torch.equal(args[2], torch.ones_like(args[1], dtype=torch.float32)) for args, _ in calls)
    with pytest.raises(ValueError, match="routing index has no slot per token"):
        qstats.experts.all_experts_calls((x, torch.zeros(5, 0, dtype=torch.long), torch.zeros(5, 0)), {}, 7, 5)
