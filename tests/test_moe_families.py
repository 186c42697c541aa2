"""The mixture-of-experts families of the installed transformers, each as a tiny random model (2 layers,
8 experts, hidden 64), calibrated with a W8A8 min/max recipe on its stacked experts' weights, ``input``
and ``down_proj.input``, routed and with ``all_experts``, in each experts implementation; against an
independent reference: each expert's rows recomputed in plain torch from the experts' recorded calls
(the routing read from the call's own argument names; under eager, also which tokens an expert
really touches, found by zeroing its down projection) and plain amin/amax over each weight slice (as the
per-expert Linear weights llm-compressor linearizes: GPT-OSS' transposed, interleaved stacks rearranged).
Families whose experts qstats cannot observe per expert must raise naming the module."""

import inspect
import warnings

import pytest
import torch

import qstats

transformers = pytest.importorskip("transformers")

E, K = 8, 2
WEIGHTS = qstats.QuantSpec(dtype="int8", mapping="symmetric", granularity=qstats.PerAxis(0))
INPUTS = qstats.QuantSpec(dtype="int8", mapping="asymmetric", on_uncalibrated="fallback")
FIELDS = dict(
    hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, vocab_size=128, num_experts=E, num_local_experts=E, n_routed_experts=E,
    moe_num_experts=E, num_experts_per_tok=K, moe_k=K, moe_topk=K, top_k=K, n_group=1, topk_group=1,
    first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
    decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=64, shared_expert_intermediate_size=32,
    moe_layer_freq=1, expert_layer_period=1, expert_layer_offset=0, attn_layer_period=1, attn_layer_offset=0,
    pad_token_id=0, use_cache=False, layers_block_type=["moe", "moe"],
)
# fused experts (transformers' `use_experts_implementation`): every implementation that runs on CPU
FAMILIES = (
    "qwen2_moe", "qwen3_moe", "mixtral", "granitemoe", "deepseek_v2", "deepseek_v3", "olmoe", "phimoe", "gpt_oss",
    "jamba", "ernie4_5_moe", "glm4_moe", "hunyuan_v1_moe", "minimax", "nemotron_h",
)
IMPLEMENTATIONS = ("eager", "batched_mm", "grouped_mm")


def _model(family):
    try:
        config = transformers.AutoConfig.for_model(family)
    except (ValueError, KeyError):
        pytest.skip(f"{family} is not in transformers {transformers.__version__}")
    fields = config.to_dict()
    chosen = {name: value for name, value in FIELDS.items() if name in fields}
    for name in ("layer_types", "mlp_layer_types"):  # per-layer lists: the first layer's kind, twice
        if isinstance(fields.get(name), list):
            chosen[name] = fields[name][:1] * 2
    if "qk_rope_head_dim" in fields:  # multi-head latent attention: head_dim is the rope dimension
        chosen["head_dim"] = 8
    if family == "dbrx":
        chosen = dict(d_model=64, n_heads=4, n_layers=2, vocab_size=128, max_seq_len=64, use_cache=False,
                      ffn_config=dict(ffn_hidden_size=32, moe_num_experts=E, moe_top_k=K),
                      attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0))
        fields = {}
    if family == "longcat_flash":  # 8 routed experts and 2 zero (identity) experts
        chosen.update(ffn_hidden_size=64, expert_ffn_hidden_size=32, num_layers=1, zero_expert_num=2, qk_head_dim=16,
                      num_key_value_heads=4, head_dim=8)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_config(type(config)(**{**fields, **chosen})).eval()


def _batches():
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(1, 128, (2, 6), generator=generator), torch.randint(1, 128, (1, 5), generator=generator)]


def _stacked(model):
    return {name: m for name, m in model.named_modules() if qstats.experts.expert_count(m)}


def _recorded_calls(model, modules, batches):
    """Per experts module, the arguments of each call, by the forward's own parameter names."""
    calls = {name: [] for name in modules}

    def record(name):
        def hook(module, args, kwargs):
            bound = inspect.signature(type(module).forward).bind(module, *args, **kwargs).arguments
            calls[name].append({k: v.detach().clone() for k, v in bound.items() if isinstance(v, torch.Tensor)})
        return hook

    handles = [m.register_forward_pre_hook(record(name), with_kwargs=True) for name, m in modules.items()]
    with torch.no_grad():
        for batch in batches:
            model(batch)
    for handle in handles:
        handle.remove()
    return calls


def _touched_tokens(module, call, expert):
    """The tokens whose output changes when ``expert``'s down projection is zeroed."""
    with torch.no_grad():
        before = module(**call)
        saved = module.down_proj[expert].clone()
        module.down_proj[expert].zero_()
        try:
            after = module(**call)
        finally:
            module.down_proj[expert].copy_(saved)
    return set(((after - before).reshape(-1, before.shape[-1]) != 0).any(dim=-1).nonzero().flatten().tolist())


def _intermediate(module, x, expert, up):
    """act(gate) * up of rows ``x`` for one expert, from the stacked weights in plain torch."""
    weight = getattr(module, up)[expert]
    h = x @ weight if module.is_transposed else x @ weight.T
    if module.has_bias:
        h = h + getattr(module, up + "_bias")[expert]
    return module._apply_gate(h) if module.has_gate else module.act_fn(h)


def _reference(module, calls, up, all_experts, check_routing):
    """Per expert: its input rows and its down projection's input rows over all calls."""
    inputs, intermediates = [[] for _ in range(E)], [[] for _ in range(E)]
    for call in calls:
        x = call["hidden_states"].reshape(-1, call["hidden_states"].shape[-1])
        index = call.get("top_k_index", call.get("router_indices"))
        for expert in range(E):
            routed = (index == expert).any(dim=-1).nonzero().flatten()
            if check_routing:
                assert _touched_tokens(module, call, expert) <= set(routed.tolist())
            rows = x if all_experts else x[routed]
            inputs[expert].append(rows)
            with torch.no_grad():
                intermediates[expert].append(_intermediate(module, rows, expert, up))
    return [torch.cat(r) for r in inputs], [torch.cat(r) for r in intermediates]


def _assert_site(state, rows, where):
    counts = state.count.reshape(E, -1).sum(dim=1)
    for expert, r in enumerate(rows):
        assert int(counts[expert]) == r.numel(), (where, expert)
        if r.numel():
            torch.testing.assert_close(state.min_val.reshape(E)[expert], r.min(), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(state.max_val.reshape(E)[expert], r.max(), rtol=1e-5, atol=1e-6)


def _per_expert_linear_weights(module, name):
    """Stacked parameter ``name`` as llm-compressor's linearized per-expert Linear weights ``[E, out, in]``:
    transposed stacks (GPT-OSS) swapped back, GPT-OSS' interleaved gate/up columns as gate rows then up rows."""
    param = getattr(module, name).detach()
    if module.is_transposed:
        param = param.transpose(1, 2)
    if name == "gate_up_proj" and not module.is_concatenated:
        param = torch.cat([param[:, 0::2], param[:, 1::2]], dim=1)
    return param


@pytest.mark.parametrize("family", FAMILIES)
def test_stacked_experts_match_per_expert_reference(family, single_thread_quiet):
    model = _model(family)
    modules = _stacked(model)
    first = next(iter(modules.values()))
    stacked = [name for name, p in first.named_parameters(recurse=False) if p.ndim == 3]
    up = "gate_up_proj" if "gate_up_proj" in stacked else "up_proj"
    recipe = qstats.Recipe([
        qstats.Rule(type(first).__name__, sites=tuple(stacked), observer=qstats.minmax, spec=WEIGHTS),
        qstats.Rule(type(first).__name__, sites=("input", "down_proj.input"), observer=qstats.minmax, spec=INPUTS),
    ])
    batches = _batches()
    for implementation in IMPLEMENTATIONS:
        model.set_experts_implementation(implementation)
        calls = _recorded_calls(model, modules, batches)
        for all_experts in (False, True):
            states = qstats.calibrate(model, batches, recipe, progress=False, all_experts=all_experts)
            for path, module in modules.items():
                for name in stacked:
                    param = _per_expert_linear_weights(module, name)
                    assert torch.equal(states[path][name].min_val, param.amin(dim=-1))
                    assert torch.equal(states[path][name].max_val, param.amax(dim=-1))
                check = implementation == "eager" and not all_experts and path == next(iter(modules))
                inputs, intermediates = _reference(module, calls[path], up, all_experts, check)
                where = (family, implementation, all_experts, path)
                _assert_site(states[path]["input"], inputs, where + ("input",))
                _assert_site(states[path]["down_proj.input"], intermediates, where + ("down_proj.input",))


def _one_rule(target, sites, spec=INPUTS):
    return qstats.Recipe([qstats.Rule(target, sites=sites, observer=qstats.minmax, spec=spec)])


@pytest.mark.parametrize("family,target", [("jetmoe", "JetMoeParallelExperts")])
def test_all_experts_input_without_routing_raises_naming_the_module(family, target, single_thread_quiet):
    model = _model(family)  # routed, this raises; with all_experts the rows (not tokens) are observed
    with pytest.raises(ValueError, match="experts module"):
        qstats.calibrate(model, _batches(), _one_rule(target, ("input",)), progress=False, all_experts=True)


def test_jetmoe_parallel_experts(single_thread_quiet):
    """JetMoE's experts take rows already sorted by expert and their counts (no routing tensor):
    ``input`` raises naming the module; ``weight.input`` is each expert's split of the rows."""
    model = _model("jetmoe")
    batches = _batches()
    with pytest.raises(ValueError, match="experts module 'model.layers.0"):
        qstats.calibrate(model, batches, _one_rule("JetMoeParallelExperts", ("input",)), progress=False)
    modules = {name: m for name, m in model.named_modules() if type(m).__name__ == "JetMoeParallelExperts"}
    seen = {name: [] for name in modules}
    handles = [m.register_forward_pre_hook(lambda m, args, name=name: seen[name].append(
        (args[0].detach().clone(), list(args[1])))) for name, m in modules.items()]
    with torch.no_grad():
        for batch in batches:
            model(batch)
    for handle in handles:
        handle.remove()
    states = qstats.calibrate(model, batches, _one_rule("JetMoeParallelExperts", ("weight.input",)), progress=False)
    for name in modules:
        rows = [torch.cat([x.split(sizes)[e] for x, sizes in seen[name]]) for e in range(E)]
        _assert_site(states[name]["weight.input"], rows, name)


LONGCAT = "model.layers.0.mlp.experts"


def _longcat_reference(module, calls, all_experts):
    """Per routed expert: its input rows and act(gate) * up of them, in plain torch. Ids from
    ``num_routed_experts`` on are zero (identity) experts, which have no weights."""
    inputs, intermediates = [[] for _ in range(E)], [[] for _ in range(E)]
    for number, call in enumerate(calls):
        x, index = call["hidden_states"], call["top_k_index"]
        for expert in range(E):
            routed = (index == expert).any(dim=-1).nonzero().flatten()
            if number == 0 and not all_experts:
                assert _touched_tokens(module, call, expert) <= set(routed.tolist())
            rows = x if all_experts else x[routed]
            gate, up = torch.nn.functional.linear(rows, module.gate_up_proj[expert].detach()).chunk(2, dim=-1)
            inputs[expert].append(rows)
            intermediates[expert].append(torch.nn.functional.silu(gate) * up)
    return [torch.cat(r) for r in inputs], [torch.cat(r) for r in intermediates]


@pytest.mark.parametrize("all_experts", [False, True])
def test_longcat_flash_routed_experts_per_expert(all_experts, single_thread_quiet):
    """LongCat-Flash declares num_routed_experts (no num_experts); its router also picks zero
    (identity) experts, ids 8 and 9 here, which observe nothing."""
    model = _model("longcat_flash")
    module = model.get_submodule(LONGCAT)
    assert (module.num_routed_experts, module.zero_expert_num, module.act_fn(torch.ones(1))) == (
        E, 2, torch.nn.functional.silu(torch.ones(1)))
    batches = _batches()
    calls = _recorded_calls(model, {LONGCAT: module}, batches)[LONGCAT]
    assert any(bool((call["top_k_index"] >= E).any()) for call in calls)  # zero experts are routed to
    recipe = qstats.Recipe([
        qstats.Rule("LongcatFlashExperts", sites=("down_proj",), observer=qstats.minmax, spec=WEIGHTS),
        qstats.Rule("LongcatFlashExperts", sites=("input", "down_proj.input"), observer=qstats.minmax, spec=INPUTS),
    ])
    states = qstats.calibrate(model, batches, recipe, progress=False, all_experts=all_experts)[LONGCAT]
    down = module.down_proj.detach()
    assert torch.equal(states["down_proj"].min_val, down.amin(dim=-1))
    assert torch.equal(states["down_proj"].max_val, down.amax(dim=-1))
    inputs, intermediates = _longcat_reference(module, calls, all_experts)
    _assert_site(states["input"], inputs, "input")
    _assert_site(states["down_proj.input"], intermediates, "down_proj.input")


def test_longcat_flash_gate_up_proj_with_zero_experts_raises(single_thread_quiet):
    """Its gate_up_proj stacks the 2 zero experts too ([10, ...] against 8 routed experts): refused,
    naming the module; trimmed to the routed experts (the forward never reads the zero experts'
    rows: same outputs) it is observed per expert."""
    model = _model("longcat_flash")
    rule = _one_rule("LongcatFlashExperts", ("gate_up_proj",), WEIGHTS)
    with pytest.raises(ValueError, match=rf"{LONGCAT}.*gate_up_proj.*\(10, 64, 64\).*8 experts \(num_routed_experts\)"):
        qstats.calibrate(model, _batches(), rule, progress=False)
    batch = _batches()[0]
    with torch.no_grad():
        before = model(batch).logits
        module = model.get_submodule(LONGCAT)
        module.gate_up_proj = torch.nn.Parameter(module.gate_up_proj[:E].clone())
        torch.testing.assert_close(model(batch).logits, before, rtol=0, atol=0)
    state = qstats.calibrate(model, [batch], rule, progress=False)[LONGCAT]["gate_up_proj"]
    assert torch.equal(state.min_val, module.gate_up_proj.detach().amin(dim=-1))
    assert torch.equal(state.max_val, module.gate_up_proj.detach().amax(dim=-1))


@pytest.mark.parametrize("target,site,why", [
    ("DbrxExpertGLU", "w1", "flattened"), ("DbrxExpertGLU", "v1", "flattened"), ("DbrxExpertGLU", "w2", "flattened"),
    ("DbrxExpertGLU", "input", "unstacked"), ("DbrxExperts", "input", "takes the routing"),
])
def test_dbrx_flat_experts_raise_naming_the_module(target, site, why, single_thread_quiet):
    """DBRX keeps its experts as 2-D [E * ffn, hidden] parameters of DbrxExpertGLU, which DbrxExperts
    calls once per expert with slices: a weight or input rule on them would mix the experts."""
    model = _model("dbrx")
    assert not _stacked(model)
    with pytest.raises(ValueError, match=rf"module 'transformer\.blocks\.0\.ffn\.experts.*\({target}\) site '{site}'.*{why}"):
        qstats.calibrate(model, _batches(), _one_rule(target, (site,), WEIGHTS), progress=False)


def test_dbrx_flat_experts_parameter_input_selects_no_site(single_thread_quiet):
    """A ``<param>.input`` rule on DBRX's flat experts selects nothing and says so; the input of
    the MoE block that calls the experts (one shared state) is the block's input, in plain torch."""
    model = _model("dbrx")
    with pytest.warns(UserWarning, match="DbrxExpertGLU"):
        _one_rule("DbrxExpertGLU", ("w2.input",)).resolve(model)
    seen = []
    handle = model.get_submodule("transformer.blocks.0.ffn").register_forward_pre_hook(
        lambda module, args: seen.append(args[0].detach().clone()))
    with torch.no_grad():
        for batch in _batches():
            model(batch)
    handle.remove()
    state = qstats.calibrate(model, _batches(), _one_rule("DbrxFFN", ("input",)), progress=False)
    rows = torch.cat([x.reshape(-1, x.shape[-1]) for x in seen])
    assert torch.equal(state["transformer.blocks.0.ffn"]["input"].min_val, rows.min())
    assert torch.equal(state["transformer.blocks.0.ffn"]["input"].max_val, rows.max())


class _Stack(torch.nn.Module):
    def __init__(self, count=None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, 3, 5))
        if count is not None:
            self.num_experts = count

    def forward(self, x):
        return x @ self.weight.sum(dim=0).T


def test_unstacked_three_dimensional_parameters(single_thread_quiet):
    """A 3-D parameter whose leading dimension is not the declared expert count raises; with no
    declared count it is observed as one tensor with a warning naming the module; a Conv1d weight
    is observed as one tensor without one."""
    x = [torch.randn(2, 5)]
    rule = _one_rule("_Stack", ("weight",), WEIGHTS)
    with pytest.raises(ValueError, match=r"module '0' \(_Stack\) site 'weight'.*leading dimension 4.*3 experts"):
        qstats.calibrate(torch.nn.Sequential(_Stack(3)), x, rule, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("default")
        with pytest.warns(UserWarning, match=r"'weight' of shape \(4, 3, 5\) of module '0' \(_Stack\).*num_experts"):
            state = qstats.calibrate(torch.nn.Sequential(_Stack()), x, rule, progress=False)["0"]["weight"]
        assert state.min_val.shape == (4,)
        state = qstats.calibrate(torch.nn.Sequential(_Stack(4)), x, rule, progress=False)["0"]["weight"]
        assert state.min_val.shape == (4, 3)
        conv = torch.nn.Sequential(torch.nn.Conv1d(2, 3, 3))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            qstats.calibrate(conv, [torch.randn(1, 2, 6)], _one_rule("Conv1d", ("weight",), WEIGHTS), progress=False)
