"""``all_experts=True`` runs extra calls of the experts' forward, whose outputs are discarded, to observe
each expert's ``"<parameter>.input"`` on every token; a site of a module inside the experts (their
activation function) observes the model's own forward only, against a hook recording that module's
inputs, whatever other sites the recipe has."""

from __future__ import annotations

import warnings

import pytest
import torch

import qstats

E, H, I = 4, 8, 6


class ActExperts(torch.nn.Module):
    """Stacked SwiGLU experts whose activation is a child module, as transformers' experts' ``act_fn``."""

    def __init__(self):
        super().__init__()
        self.num_experts = E
        g = torch.Generator().manual_seed(0)
        self.gate_up_proj = torch.nn.Parameter(torch.randn(E, 2 * I, H, generator=g) / H**0.5)
        self.down_proj = torch.nn.Parameter(torch.randn(E, H, I, generator=g) / I**0.5)
        self.act_fn = torch.nn.SiLU()

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for expert in range(self.num_experts):
            token, slot = torch.where(top_k_index == expert)
            gate, up = torch.nn.functional.linear(hidden_states[token], self.gate_up_proj[expert]).chunk(2, dim=-1)
            rows = torch.nn.functional.linear(self.act_fn(gate) * up, self.down_proj[expert])
            out = out.index_add(0, token, rows * top_k_weights[token, slot, None])
        return out


class MoE(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.router = torch.nn.Linear(H, E)
        self.experts = ActExperts()

    def forward(self, x):
        weights, index = torch.topk(torch.softmax(self.router(x), dim=-1), 2, dim=-1)
        return self.experts(x, index, weights)


def _own_forward_rows(model, module, batches):
    rows = []
    handle = module.register_forward_pre_hook(lambda m, args: rows.append(args[0].detach().reshape(-1, args[0].shape[-1])))
    with torch.no_grad():
        for batch in batches:
            model(batch)
    handle.remove()
    return torch.cat(rows).double()


def _check(model, act_path, batches, experts_class):
    rows = _own_forward_rows(model, model.get_submodule(act_path), batches)
    for experts_sites in ((), ("down_proj.input",), ("input", "down_proj.input")):
        rules = [qstats.Rule(act_path, sites=("input",), observer=qstats.hessian)]
        if experts_sites:
            rules.append(qstats.Rule(experts_class, sites=experts_sites, observer=qstats.hessian))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            states = qstats.calibrate(model, batches, qstats.Recipe(rules), progress=False, all_experts=True)
        state = states[act_path]["input"]
        assert int(state.count) == rows.shape[0], experts_sites  # the extra calls' rows were observed too
        torch.testing.assert_close(state.total.double(), rows.T @ rows, rtol=1e-5, atol=1e-5)


def test_a_site_inside_the_experts_observes_the_models_own_forward_under_all_experts():
    model = MoE().eval()
    batches = [torch.randn(5, H, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    _check(model, "experts.act_fn", batches, "ActExperts")


def test_qwen3_moe_act_fn_under_all_experts():
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3MoeConfig(hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                                         vocab_size=64, num_experts=4, num_experts_per_tok=2, use_cache=False)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    experts = next(name for name, m in model.named_modules() if type(m).__name__ == "Qwen3MoeExperts")
    batches = [torch.randint(1, 64, (2, 5), generator=torch.Generator().manual_seed(1))]
    _check(model, experts + ".act_fn", batches, "Qwen3MoeExperts")
