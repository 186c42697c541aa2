"""The per-expert intermediate activation of stacked experts ("down_proj.input": act(gate) * up of
the tokens routed to each expert), captured during the experts' forward, against the experts'
forward run by hand, expert by expert, and against llm-compressor's per-expert static_minmax
observers. On transformers' Qwen3-MoE (eager, grouped_mm and batched_mm experts) and on the
plain-torch MoE of examples/moe_experts.py."""

import warnings

import pytest
import torch
from _shared import qwen3_moe_config, routed_calls

import qstats

transformers = pytest.importorskip("transformers")

NUM_EXPERTS = 8
MINMAX = qstats.QuantSpec(dtype="int8", mapping="asymmetric", on_uncalibrated="fallback")
PER_CHANNEL = qstats.QuantSpec(dtype="int8", mapping="symmetric", granularity=qstats.PerAxis(-1), on_uncalibrated="fallback")
IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")


@pytest.fixture(scope="module")
def qwen3_moe():
    config = qwen3_moe_config(num_experts=NUM_EXPERTS, num_experts_per_tok=1)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():  # larger expert weights than the 0.02 init: intermediates of order 1
        for layer in model.model.layers:
            layer.mlp.experts.gate_up_proj.normal_(0.0, 0.5)
            layer.mlp.experts.down_proj.normal_(0.0, 0.5)
    return model


def _batches():
    # 2 x 4 + 1 x 3 tokens, top-1 routing over 8 experts: some experts get no token
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(0, 64, (2, 4), generator=generator), torch.randint(0, 64, (1, 3), generator=generator)]


def _linear(rows, weight):
    return torch.nn.functional.linear(rows, weight)


def _matrix_vector(rows, weight):
    # transformers' batched_mm multiplies each token by its own copy of the weight (bmm of
    # matrix-vector products), whose last bits can differ from one matrix-matrix product
    return torch.bmm(weight.expand(rows.shape[0], *weight.shape), rows[:, :, None])[..., 0]


UP_PROJECTION = {"eager": _linear, "grouped_mm": _linear, "batched_mm": _matrix_vector}


def _by_hand(experts, calls, act, up_projection=_linear):
    """Each expert's intermediates, computed here expert by expert from its routed tokens."""
    out = {expert: [] for expert in range(experts.num_experts)}
    with torch.no_grad():
        for hidden, index in calls:
            for expert in range(experts.num_experts):
                rows = hidden[(index == expert).any(dim=-1)]
                gate, up = up_projection(rows, experts.gate_up_proj[expert]).chunk(2, dim=-1)
                out[expert].append(act(gate) * up)
    return {expert: torch.cat(values) for expert, values in out.items()}


def _calibrate(model, batches, recipe):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", qstats.UncalibratedWarning)
        states = qstats.calibrate(model, batches, recipe, progress=False)
    return states, caught


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_qwen3_moe_intermediate_equals_the_forward_by_hand(qwen3_moe, implementation):
    model = qwen3_moe
    model.set_experts_implementation(implementation)
    batches = _batches()
    recipe = qstats.Recipe([qstats.Rule("Qwen3MoeExperts", sites=("down_proj.input",), spec=MINMAX)])
    sites = recipe.sites(model)
    assert sorted(sites) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    states, caught = _calibrate(model, batches, recipe)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    calls = routed_calls(model, batches, "Qwen3MoeExperts")
    for path, routed in calls.items():
        experts = model.get_submodule(path)
        intermediates = _by_hand(experts, routed, experts.act_fn, UP_PROJECTION[implementation])
        state = states[path]["down_proj.input"]
        assert state.max_val.shape == (NUM_EXPERTS,)
        empty = [expert for expert, values in intermediates.items() if values.shape[0] == 0]
        assert empty, "the batches must leave an expert without tokens"
        assert f"{path}.down_proj.input: experts {empty}" in str(caught[0].message)
        for expert, values in intermediates.items():
            assert int(state.count[expert]) == values.numel()
            assert bool(qparams[path]["down_proj.input"].calibrated[expert]) == (values.numel() > 0)
            if values.numel():
                assert torch.equal(state.min_val[expert], values.min()), (implementation, path, expert)
                assert torch.equal(state.max_val[expert], values.max()), (implementation, path, expert)
            else:
                assert float(qparams[path]["down_proj.input"].scale[expert]) == 1.0
        scale = qparams[path]["down_proj.input"].scale
        assert bool(torch.isfinite(scale).all()) and bool((scale > 0).all())
        assert bool(torch.isfinite(qparams[path]["down_proj.input"].zero_point.float()).all())
    # per-channel states, a histogram in layer 0 and min/max in layer 1, against one unstacked
    # observer per expert fed with that expert's intermediates
    per_channel = qstats.Recipe(
        [
            qstats.Rule(r"re:.*layers\.0\..*", sites=("down_proj.input",), spec=PER_CHANNEL, observer=qstats.histogram),
            qstats.Rule(r"re:.*layers\.1\..*", sites=("down_proj.input",), spec=PER_CHANNEL),
        ]
    )
    states, caught = _calibrate(model, batches, per_channel)
    for path, routed in calls.items():  # histogram states (no count field) are reported too
        empty = [expert for expert in range(NUM_EXPERTS) if not any(bool((index == expert).any()) for _, index in routed)]
        assert f"{path}.down_proj.input: experts {empty}" in str(caught[0].message)
        qparams = qstats.compute_qparams_tree(states, per_channel, model)[path]["down_proj.input"]
        assert qparams.scale.shape == (NUM_EXPERTS, 8)
        assert [expert for expert in range(NUM_EXPERTS) if not bool(qparams.calibrated[expert].any())] == empty
        assert bool(torch.isfinite(qparams.scale).all()) and bool((qparams.scale > 0).all())
    for path, factory in (("model.layers.0.mlp.experts", qstats.histogram), ("model.layers.1.mlp.experts", qstats.minmax)):
        experts = model.get_submodule(path)
        intermediates = _by_hand(experts, calls[path], experts.act_fn, UP_PROJECTION[implementation])
        single = factory(PER_CHANNEL)
        for expert, values in intermediates.items():
            reference = single.init(values)
            if values.numel():
                reference = single.update(reference, values)
            for field, ours, theirs in zip(reference._fields, states[path]["down_proj.input"], reference):
                assert torch.equal(ours[expert], theirs), (implementation, path, expert, field)


def test_qwen3_moe_intermediate_scales_match_llmcompressor_static_minmax(qwen3_moe):
    observers = pytest.importorskip("llmcompressor.observers")
    from compressed_tensors.quantization import QuantizationArgs

    model = qwen3_moe
    model.set_experts_implementation("grouped_mm")  # transformers' default
    args = QuantizationArgs(num_bits=8, type="int", symmetric=False, strategy="tensor")
    spec = qstats.QuantSpec.from_compressed_tensors(args).replace(on_uncalibrated="fallback")
    recipe = qstats.Recipe([qstats.Rule("Qwen3MoeExperts", sites=("down_proj.input",), spec=spec)])
    batches = _batches()
    states, _ = _calibrate(model, batches, recipe)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    calls = routed_calls(model, batches, "Qwen3MoeExperts")
    checked = 0
    for path, routed in calls.items():
        experts = model.get_submodule(path)
        per_call = [_by_hand(experts, [call], experts.act_fn) for call in routed]
        for expert in range(NUM_EXPERTS):
            observer = observers.Observer.load_from_registry("static_minmax", base_name="input", args=args.model_copy(deep=True))
            fed = False
            for values in per_call:
                if values[expert].numel():
                    observer(values[expert])
                    fed = True
            assert bool(qparams[path]["down_proj.input"].calibrated[expert]) == fed
            if fed:
                reference = observer.get_qparams()
                assert torch.equal(qparams[path]["down_proj.input"].scale[expert].reshape(1), reference["scale"].reshape(1))
                assert int(qparams[path]["down_proj.input"].zero_point[expert]) == int(reference["zero_point"])
                checked += 1
    assert checked >= 4


def test_gate_up_proj_input_equals_the_input_site(qwen3_moe):
    # the same mechanism on the other stacked parameter sees exactly the routed hidden states
    model = qwen3_moe
    model.set_experts_implementation("grouped_mm")
    recipe = qstats.Recipe([qstats.Rule("Qwen3MoeExperts", sites=("input", "gate_up_proj.input"), spec=MINMAX)])
    states, _ = _calibrate(model, _batches(), recipe)
    for entry in states.values():
        for ours, theirs in zip(entry["gate_up_proj.input"], entry["input"]):
            assert torch.equal(ours, theirs)


class _Layer(torch.nn.Module):
    """A model around one experts module, called as ``(hidden_states, top_k_index, top_k_weights)``."""

    def __init__(self, experts):
        super().__init__()
        self.experts = experts

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return self.experts(hidden_states, top_k_index, top_k_weights)


def _fused_experts(name, implementation):
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts
    from transformers.models.olmoe.modeling_olmoe import OlmoeExperts

    if name == "GptOssExperts":  # transposed [E, in, out] stacks with biases, its own gate
        config = transformers.GptOssConfig(hidden_size=16, intermediate_size=8, num_local_experts=NUM_EXPERTS)
        cls = GptOssExperts
    elif name == "MixtralExperts":
        config = transformers.MixtralConfig(hidden_size=16, intermediate_size=8, num_local_experts=NUM_EXPERTS)
        cls = MixtralExperts
    else:
        config = transformers.OlmoeConfig(hidden_size=16, intermediate_size=8, num_experts=NUM_EXPERTS)
        cls = OlmoeExperts
    config._experts_implementation = implementation
    torch.manual_seed(0)
    experts = cls(config)
    with torch.no_grad():
        for param in experts.parameters():
            param.normal_(0.0, 0.5)
    return _Layer(experts).eval()


def _fused_by_hand(experts, hidden, index, implementation):
    """Each expert's intermediate from its routed tokens, with the arithmetic of the
    implementation's up projection (matrix-vector products for batched_mm)."""
    out = {}
    with torch.no_grad():
        for expert in range(NUM_EXPERTS):
            rows = hidden[(index == expert).any(dim=-1)]
            weight = experts.gate_up_proj[expert]
            if type(experts).__name__ != "GptOssExperts":
                gate, up = UP_PROJECTION[implementation](rows, weight).chunk(2, dim=-1)
                out[expert] = experts.act_fn(gate) * up
                continue
            if implementation == "batched_mm":
                projected = torch.bmm(rows[:, None, :], weight.expand(rows.shape[0], *weight.shape))[:, 0]
            else:
                projected = rows @ weight
            out[expert] = experts._apply_gate(projected + experts.gate_up_proj_bias[expert])
    return out


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("name", ["MixtralExperts", "OlmoeExperts", "GptOssExperts"])
def test_other_fused_experts_intermediate_equals_the_forward_by_hand(name, implementation):
    layer = _fused_experts(name, implementation)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(6, 16, generator=generator)
    index = torch.stack([torch.randperm(NUM_EXPERTS - 2, generator=generator)[:2] for _ in range(6)])  # 6, 7: no token
    weights = torch.rand(6, 2, generator=generator)
    recipe = qstats.Recipe([qstats.Rule(name, sites=("down_proj.input",), spec=MINMAX)])
    states, caught = _calibrate(layer, [(hidden, index, weights)], recipe)
    state = states["experts"]["down_proj.input"]
    intermediates = _fused_by_hand(layer.experts, hidden, index, implementation)
    empty = [expert for expert, values in intermediates.items() if values.numel() == 0]
    assert empty[-2:] == [6, 7] and f"experts.down_proj.input: experts {empty}" in str(caught[0].message)
    for expert, values in intermediates.items():
        assert int(state.count[expert]) == values.numel()
        if values.numel():
            assert torch.equal(state.min_val[expert], values.min()), expert
            assert torch.equal(state.max_val[expert], values.max()), expert



def test_plain_torch_moe_example_intermediate(moe_example):
    example = moe_example
    model, states, qparams, caught = example.main(batches=2, tokens=16, verbose=False)
    assert any("0.experts.down_proj.input: experts [14, 15]" in str(w.message) for w in caught)
    generator = torch.Generator().manual_seed(1)  # the example's calibration data
    data = [torch.randn(16, 32, generator=generator) for _ in range(2)]
    calls = routed_calls(model, data, "StackedExperts")
    for path, routed in calls.items():
        experts = model.get_submodule(path)
        intermediates = _by_hand(experts, routed, torch.nn.functional.silu)
        state = states[path]["down_proj.input"]
        for expert, values in intermediates.items():
            assert int(state.count[expert]) == values.numel()
            if values.numel():
                assert torch.equal(state.min_val[expert], values.min())
                assert torch.equal(state.max_val[expert], values.max())
        coverage = qparams[path]["down_proj.input"].calibrated
        assert coverage.tolist() == [expert not in (14, 15) for expert in range(16)]
        assert bool((qparams[path]["down_proj.input"].scale[14:] == 1).all())


class _RandomStack(torch.nn.Module):
    """Stacked SwiGLU experts' parameters (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``), random."""

    def __init__(self, num_experts=4, hidden=6, intermediate=5):
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = torch.nn.Parameter(torch.randn(num_experts, 2 * intermediate, hidden))
        self.down_proj = torch.nn.Parameter(torch.randn(num_experts, hidden, intermediate))


class _EinsumExperts(_RandomStack):
    """Computes every expert on every token with one einsum over the whole stack: no per-expert
    matmul the capture can recognise."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        gate, up = torch.einsum("th,eoh->eto", hidden_states, self.gate_up_proj).chunk(2, dim=-1)
        out = torch.einsum("eti,ehi->eth", torch.nn.functional.silu(gate) * up, self.down_proj)
        routed = torch.nn.functional.one_hot(top_k_index, self.num_experts).float()  # [t, k, e]
        return torch.einsum("tke,tk,eth->th", routed, top_k_weights, out)


def test_unrecognised_experts_forward_raises_naming_the_module():
    torch.manual_seed(0)
    experts = _EinsumExperts()
    layer = _Layer(experts)
    hidden = torch.randn(5, 6)
    index = torch.tensor([[0], [1], [1], [2], [0]])
    batch = (hidden, index, torch.ones(5, 1))
    recipe = qstats.Recipe([qstats.Rule("_EinsumExperts", sites=("input", "down_proj.input"), spec=MINMAX)])
    with pytest.raises(ValueError, match=r"'down_proj.input' of the experts module 'experts' \(_EinsumExperts\)"):
        qstats.calibrate(layer, [batch], recipe, progress=False)
    # neither the capture mode nor a hook is left behind
    assert not torch.overrides._get_current_function_mode_stack()
    assert not experts._forward_hooks and not experts._forward_pre_hooks
    # a forward that raises leaves no mode behind either
    with pytest.raises(RuntimeError):  # one_hot: an index past the experts
        qstats.calibrate(layer, [(hidden, index + 8, torch.ones(5, 1))], recipe, progress=False)
    assert not torch.overrides._get_current_function_mode_stack()
    # the input site alone works on the same module
    states = qstats.calibrate(
        layer, [batch], qstats.Recipe([qstats.Rule("_EinsumExperts", sites=("input",), spec=MINMAX)]), progress=False
    )
    assert torch.equal(states["experts"]["input"].max_val[1], hidden[1:3].max())


def test_capture_recognises_transposed_and_weight_first_matmuls():
    from qstats.experts import ExpertInputCapture

    stack = torch.randn(3, 4, 2)  # [E, out, in]
    transposed = torch.randn(3, 2, 4)  # [E, in, out] layout
    x = torch.randn(5, 2)
    with ExpertInputCapture({"w": stack, "t": transposed}) as capture:
        torch.nn.functional.linear(x, stack[2])
        torch.matmul(x[:2], stack[0].T)
        x[2:] @ transposed[1]
        stack[1] @ x[:1].T  # weight first: the input rows are the columns
        torch.nn.functional.linear(x, torch.randn(4, 2))  # not a slice of a watched stack
    rows, ids = capture.captured("w")
    assert torch.equal(rows, torch.cat([x, x[:2], x[:1]])) and ids.tolist() == [2] * 5 + [0] * 2 + [1]
    rows, ids = capture.captured("t")
    assert torch.equal(rows, x[2:]) and ids.tolist() == [1] * 3


def test_capture_recognises_slices_of_detached_weights():
    # models that index ``P.data`` or ``P.detach()`` (new roots over the parameter's memory)
    from qstats.experts import ExpertInputCapture

    stack = torch.nn.Parameter(torch.randn(3, 4, 2))
    x = torch.randn(5, 2)
    with ExpertInputCapture({"w": stack}) as capture:
        torch.nn.functional.linear(x, stack.data[2])
        torch.nn.functional.linear(x[:2], stack.detach()[1])
        torch.nn.functional.linear(x, stack.detach().clone()[0])  # a copy: not the parameter
    rows, ids = capture.captured("w")
    assert torch.equal(rows, torch.cat([x, x[:2]])) and ids.tolist() == [2] * 5 + [1] * 2


def _right_padded(sequences):
    """``(input_ids, attention_mask)`` of right-padded sequences (pad id 0)."""
    length = max(len(sequence) for sequence in sequences)
    ids = torch.zeros(len(sequences), length, dtype=torch.long)
    mask = torch.zeros(len(sequences), length, dtype=torch.long)
    for row, sequence in enumerate(sequences):
        ids[row, : len(sequence)] = sequence
        mask[row, : len(sequence)] = 1
    return ids, mask


def _assert_states_close(padded, unpadded):
    assert padded.keys() == unpadded.keys()
    for path, entry in unpadded.items():
        assert padded[path].keys() == entry.keys(), path
        for site, state in entry.items():
            for field, ours, theirs in zip(state._fields, padded[path][site], state):
                if ours.is_floating_point():  # other batch shapes: other matmul blockings
                    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6, msg=f"{path} {site} {field}")
                else:
                    assert torch.equal(ours, theirs), (path, site, field)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_padding_is_left_out_of_every_site_of_a_qwen3_moe(implementation):
    """Issue 22, item 2: with right-padded batches and ``observation_weight=attention_mask``,
    every site equals calibrating the sequences one by one, unpadded; the per-expert
    intermediate site (``down_proj.input``) used to count the pad tokens routed to each expert."""
    config = qwen3_moe_config(num_experts=NUM_EXPERTS, num_experts_per_tok=2)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    model.set_experts_implementation(implementation)
    recipe = qstats.Recipe(
        [
            qstats.Rule("Qwen3MoeExperts", sites=("gate_up_proj", "down_proj", "input", "gate_up_proj.input",
                                                  "down_proj.input"), spec=MINMAX),
            qstats.Rule("Linear", sites=("weight", "input"), spec=MINMAX),
        ]
    )
    generator = torch.Generator().manual_seed(3)
    sequences = [torch.randint(1, 64, (length,), generator=generator) for length in (5, 9, 3)]
    ids, mask = _right_padded(sequences)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        padded = qstats.calibrate(model, [{"input_ids": ids, "attention_mask": mask}], recipe, progress=False,
                                  observation_weight=lambda batch: batch["attention_mask"])
    assert not [w for w in caught if "could not be traced" in str(w.message)]
    unpadded = qstats.calibrate(model, [sequence[None] for sequence in sequences], recipe, progress=False)
    _assert_states_close(padded, unpadded)
    intermediate = padded["model.layers.0.mlp.experts"]["down_proj.input"]
    assert int(intermediate.count.sum()) == sum(map(len, sequences)) * 2 * config.moe_intermediate_size


def test_padding_is_left_out_of_the_plain_torch_moe_intermediate(moe_example):
    model = moe_example.build()
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(2, 12, 32, generator=generator)
    mask = torch.tensor([[1] * 12, [1] * 7 + [0] * 5])
    padded = qstats.calibrate(model, [x], moe_example.RECIPE, progress=False, observation_weight=lambda batch: mask)
    unpadded = qstats.calibrate(model, [x[0], x[1, :7]], moe_example.RECIPE, progress=False)
    _assert_states_close(padded, unpadded)


class _CopyingExperts(_RandomStack):
    """Computes each expert's tokens from a copy of the hidden states the capture cannot follow
    (``hidden_states * 1``): its rows cannot be traced back to their tokens."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        copied = hidden_states * 1
        out = torch.zeros_like(hidden_states)
        for expert in range(self.num_experts):
            token, slot = torch.where(top_k_index == expert)
            gate, up = torch.nn.functional.linear(copied[token], self.gate_up_proj[expert]).chunk(2, dim=-1)
            expert_out = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, self.down_proj[expert])
            out = out.index_add(0, token, expert_out * top_k_weights[token, slot, None])
        return out


def test_untraceable_intermediate_rows_warn_that_padding_is_observed():
    torch.manual_seed(0)
    layer = _Layer(_CopyingExperts())
    batch = (torch.randn(5, 6), torch.tensor([[0], [1], [1], [2], [0]]), torch.ones(5, 1))
    recipe = qstats.Recipe([qstats.Rule("_CopyingExperts", sites=("down_proj.input",), spec=MINMAX)])
    weight = torch.tensor([1, 1, 0, 1, 0])
    with pytest.warns(UserWarning, match=r"'down_proj.input' of the experts module 'experts' could not be traced"):
        states = qstats.calibrate(layer, [batch], recipe, progress=False, observation_weight=lambda b: weight)
    assert int(states["experts"]["down_proj.input"].count.sum()) == 5 * 5  # every row, padding included


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_all_experts_observes_every_token_for_every_expert(qwen3_moe, implementation):
    """``calibrate(all_experts=True)`` (llm-compressor's ``moe_calibrate_all_experts``): every
    expert's ``input`` is every token and its ``down_proj.input`` the intermediate of every token
    (computed here by hand), padding still left out; the model's own outputs are unchanged."""
    model = qwen3_moe
    model.set_experts_implementation(implementation)
    recipe = qstats.Recipe([qstats.Rule("Qwen3MoeExperts", sites=("input", "down_proj.input"), spec=MINMAX)])
    generator = torch.Generator().manual_seed(4)
    ids = torch.randint(1, 64, (2, 6), generator=generator)
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2])
    batch = {"input_ids": ids, "attention_mask": mask}
    with torch.no_grad():
        expected_logits = model(**batch).logits
    outputs = []
    handle = model.register_forward_hook(lambda module, args, kwargs, output: outputs.append(output.logits),
                                         with_kwargs=True)
    try:
        states = qstats.calibrate(model, [batch], recipe, progress=False, all_experts=True,
                                  observation_weight=lambda b: b["attention_mask"])
    finally:
        handle.remove()
    assert torch.equal(outputs[0], expected_logits)
    calls = routed_calls(model, [ids], "Qwen3MoeExperts")  # right padding: the kept tokens are the same
    kept = mask.reshape(-1) != 0
    for path, ((hidden, _),) in calls.items():
        experts = model.get_submodule(path)
        rows = hidden[kept]
        state = states[path]["down_proj.input"]
        torch.testing.assert_close(states[path]["input"].max_val, rows.max().expand(NUM_EXPERTS), rtol=1e-6, atol=0)
        for expert in range(NUM_EXPERTS):
            gate, up = UP_PROJECTION[implementation](rows, experts.gate_up_proj[expert]).chunk(2, dim=-1)
            values = experts.act_fn(gate) * up
            assert int(state.count[expert]) == values.numel()
            torch.testing.assert_close(state.min_val[expert], values.min(), rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(state.max_val[expert], values.max(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_all_experts_observe_their_copies_of_the_tokens_once(qwen3_moe, implementation, monkeypatch):
    """Under ``all_experts`` every expert's ``gate_up_proj.input`` is its copy of every token: the
    update gets the tokens once (not E copies) and the states equal those of the experts' ``input``
    (the same tokens and padding) bit for bit, Hessians included."""
    import qstats.observation as observation

    model = qwen3_moe
    model.set_experts_implementation(implementation)
    rows_seen = []
    original = observation._RoutedSite.observe_rows

    def spy(self, rows, mask):
        rows_seen.append((self.site, rows.shape[0], mask.shape))
        return original(self, rows, mask)

    monkeypatch.setattr(observation._RoutedSite, "observe_rows", spy)
    sites = ("input", "gate_up_proj.input")
    recipe = qstats.Recipe([qstats.Rule("Qwen3MoeExperts", sites=sites, observer=qstats.hessian),
                            qstats.Rule("Qwen3MoeExperts", sites=sites, spec=MINMAX)])
    for rule in range(2):
        plan = qstats.Recipe([recipe.rules[rule]])
        mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2])
        batch = {"input_ids": torch.randint(1, 64, (2, 6), generator=torch.Generator().manual_seed(4)),
                 "attention_mask": mask}
        rows_seen.clear()
        states = qstats.calibrate(model, [batch], plan, progress=False, all_experts=True,
                                  observation_weight=lambda b: b["attention_mask"])
        assert {(site, rows) for site, rows, _ in rows_seen} == {(site, 12) for site in sites}
        for path, entry in states.items():
            for a, b in zip(entry["input"], entry["gate_up_proj.input"]):
                assert torch.equal(a, b), (path, rule)


@pytest.mark.parametrize("implementation", ["grouped_mm", "batched_mm"])
def test_sentinel_expert_ids_are_observed_by_no_expert(qwen3_moe, implementation):
    """Expert-parallel sentinels (an id past the experts, weight 0) route a slot nowhere. batched_mm
    clamps them into [0, E) before gathering the weights: its rows used to count as the last (or,
    for -1, the first) expert's, which then read as calibrated on tokens the router never sent it."""
    model = qwen3_moe
    model.set_experts_implementation(implementation)
    experts = model.model.layers[0].mlp.experts
    layer = _Layer(experts)
    generator = torch.Generator().manual_seed(2)
    hidden = torch.randn(6, 16, generator=generator)
    index = torch.tensor([[0, 8], [1, 2], [8, 3], [3, 4], [5, 6], [1, 8]])
    if implementation == "batched_mm":
        index[1, 1] = -1
    weights = torch.rand(6, 2, generator=generator) * ((index >= 0) & (index < NUM_EXPERTS))
    sites = ("input", "gate_up_proj.input", "down_proj.input")
    recipe = qstats.Recipe([qstats.Rule("Qwen3MoeExperts", sites=sites, spec=MINMAX)])
    states, caught = _calibrate(layer, [(hidden, index, weights)], recipe)
    intermediates = _fused_by_hand(experts, hidden, index, implementation)
    for expert in range(NUM_EXPERTS):
        rows = hidden[(index == expert).any(dim=-1)]
        for site, values in (("input", rows), ("gate_up_proj.input", rows), ("down_proj.input", intermediates[expert])):
            state = states["experts"][site]
            assert int(state.count[expert]) == values.numel(), (site, expert)
            if values.numel():
                assert torch.equal(state.min_val[expert], values.min()), (site, expert)
                assert torch.equal(state.max_val[expert], values.max()), (site, expert)
    empty = [expert for expert in range(NUM_EXPERTS) if not bool((index == expert).any())]
    assert 7 in empty and f"experts.down_proj.input: experts {empty}" in str(caught[0].message)
