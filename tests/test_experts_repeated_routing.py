"""Stacked experts whose routing lists one expert twice for a token (DeepSeek-V4's hash routing,
``tid2eid[input_ids]``, can repeat an id; transformers' experts forward then runs that token twice
through the expert): the per-expert ``input`` site observes the rows each expert's matmul receives,
as its ``gate_up_proj.input`` does, against a plain-torch loop over experts and slots."""

from __future__ import annotations

import warnings

import pytest
import torch

import qstats

E, H, I = 4, 8, 6


class LoopExperts(torch.nn.Module):
    """SwiGLU experts as stacked parameters, looping over (expert, slot) as transformers' eager experts."""

    def __init__(self):
        super().__init__()
        self.num_experts = E
        g = torch.Generator().manual_seed(0)
        self.gate_up_proj = torch.nn.Parameter(torch.randn(E, 2 * I, H, generator=g) / H**0.5)
        self.down_proj = torch.nn.Parameter(torch.randn(E, H, I, generator=g) / I**0.5)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for expert in range(self.num_experts):
            token, slot = torch.where(top_k_index == expert)
            gate, up = torch.nn.functional.linear(hidden_states[token], self.gate_up_proj[expert]).chunk(2, dim=-1)
            rows = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, self.down_proj[expert])
            out = out.index_add(0, token, rows * top_k_weights[token, slot, None])
        return out


class Block(torch.nn.Module):
    def __init__(self, index):
        super().__init__()
        self.experts = LoopExperts()
        self.index = index

    def forward(self, x):
        flat = x.reshape(-1, H)
        return self.experts(flat, self.index, torch.full(self.index.shape, 0.5))


def _routing():
    # token 0 lists expert 1 twice, token 2 expert 0 three times; expert 3 gets no token
    return torch.tensor([[1, 1, 2], [0, 2, 1], [0, 0, 0], [2, 1, 0], [1, 2, 2], [0, 1, 2]])


def _reference_rows(x, index, keep):
    """Per expert, the rows its matmul receives: every (token, slot) routed to it, padding left out."""
    return [torch.cat([x[(index[:, slot] == expert) & keep] for slot in range(index.shape[1])]) for expert in range(E)]


@pytest.mark.parametrize("observer", [qstats.hessian, qstats.moments])
@pytest.mark.parametrize("padded", [False, True])
def test_input_of_an_expert_listed_twice_counts_the_token_twice(observer, padded):
    # the routed input counted each (token, expert) once while the expert's matmul ran the token per slot
    index = _routing()
    model = Block(index).eval()
    x = torch.randn(2, 3, H, generator=torch.Generator().manual_seed(1))
    mask = torch.tensor([[1, 1, 1], [1, 0, 1]]) if padded else torch.ones(2, 3, dtype=torch.long)
    spec = qstats.QuantSpec(dtype="int8", on_uncalibrated="fallback")
    recipe = qstats.Recipe([qstats.Rule("LoopExperts", sites=("input", "gate_up_proj.input"), observer=observer,
                                        spec=spec)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qstats.UncalibratedWarning)
        states = qstats.calibrate(model, [(x,)], recipe, progress=False, observation_weight=lambda batch: mask)
    rows = _reference_rows(x.reshape(-1, H), index, mask.reshape(-1) != 0)
    state, matmul = states["experts"]["input"], states["experts"]["gate_up_proj.input"]
    for expert, r in enumerate(rows):
        if observer is qstats.hessian:
            assert int(state.count[expert]) == r.shape[0]
            torch.testing.assert_close(state.total[expert].double(), r.double().T @ r.double(), rtol=1e-5, atol=1e-5)
        else:
            assert int(state.count[expert].sum()) == r.numel()
            torch.testing.assert_close(state.total[expert].sum(), r.double().sum().to(state.total.dtype),
                                       rtol=1e-5, atol=1e-5)
        for field in state._fields:  # the matmul's own rows: the same statistics
            torch.testing.assert_close(getattr(state, field)[expert], getattr(matmul, field)[expert])


def test_all_experts_observes_each_token_once_per_expert_whatever_the_routing():
    index = _routing()
    model = Block(index).eval()
    x = torch.randn(6, H, generator=torch.Generator().manual_seed(2))
    recipe = qstats.Recipe([qstats.Rule("LoopExperts", sites=("input",), observer=qstats.hessian)])
    states = qstats.calibrate(model, [(x,)], recipe, progress=False, all_experts=True)
    state = states["experts"]["input"]
    for expert in range(E):
        assert int(state.count[expert]) == x.shape[0]
        torch.testing.assert_close(state.total[expert].double(), x.double().T @ x.double(), rtol=1e-5, atol=1e-5)


def test_deepseek_v4_hash_routing_with_a_repeated_expert_against_each_experts_rows():
    transformers = pytest.importorskip("transformers")
    try:
        config = transformers.AutoConfig.for_model("deepseek_v4")
    except (ValueError, KeyError):
        pytest.skip(f"deepseek_v4 is not in transformers {transformers.__version__}")
    fields = config.to_dict()
    small = dict(hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=1,
                 num_attention_heads=4, num_key_value_heads=4, head_dim=16, vocab_size=128, num_local_experts=8,
                 n_routed_experts=8, num_experts_per_tok=2, max_position_embeddings=64, use_cache=False)
    small = {name: value for name, value in small.items() if name in fields}
    if isinstance(fields.get("mlp_layer_types"), list):
        small["mlp_layer_types"] = ["hash_moe"]
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(type(config)(**{**fields, **small})).eval()
    experts = {name: m for name, m in model.named_modules() if type(m).__name__ == "DeepseekV4Experts"}
    name, module = next(iter(experts.items()))
    gate = model.get_submodule(name.rsplit(".", 1)[0]).gate
    assert type(gate).__name__ == "DeepseekV4HashRouter"
    with torch.no_grad():  # a table whose even token ids list one expert twice
        table = torch.randint(0, 8, (128, 2), generator=torch.Generator().manual_seed(3))
        table[::2, 1] = table[::2, 0]
        gate.tid2eid.copy_(table)
    ids = torch.randint(1, 128, (2, 7), generator=torch.Generator().manual_seed(4))
    hidden = []
    handle = module.register_forward_pre_hook(lambda m, args: hidden.append(args[0].detach().clone()))
    with torch.no_grad():
        model(ids)
    handle.remove()
    recipe = qstats.Recipe([qstats.Rule("DeepseekV4Experts", sites=("input",), observer=qstats.hessian)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qstats.UncalibratedWarning)
        state = qstats.calibrate(model, [ids], recipe, progress=False)[name]["input"]
    x = hidden[0].reshape(-1, hidden[0].shape[-1])
    rows = [torch.cat([x[table[ids.reshape(-1), slot] == expert] for slot in range(2)]) for expert in range(8)]
    assert any(r.shape[0] > 0 for r in rows)
    for expert, r in enumerate(rows):
        assert int(state.count[expert]) == r.shape[0]
        torch.testing.assert_close(state.total[expert].double(), r.double().T @ r.double(), rtol=1e-4, atol=1e-4)
