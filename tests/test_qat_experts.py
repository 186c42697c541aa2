"""QAT through ``qstats.fake_quantized`` on stacked experts: loss, gradients and SGD updates of
a W8A8-style recipe (weights per channel, each expert's inputs static per tensor) against an
independent per-expert loop with torch's own straight-through fake-quant ops
(``torch.fake_quantize_per_tensor_affine`` / ``per_channel_affine``), on a plain-torch module and a
tiny transformers Qwen3-MoE in each experts implementation. Before, the experts' fake quantization
ran under ``torch.vmap``, where tensors report ``requires_grad=False``: `fake_quantize` left out its
straight-through term, so the weights (and the inputs of batched/grouped experts) got no gradient."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import qstats
from _shared import qwen3_moe_config

WEIGHT = qstats.QuantSpec(dtype="int8", mapping="symmetric", granularity=qstats.PerRow(-1))
INPUT = qstats.QuantSpec(dtype="int8", mapping="symmetric")


def _recipe(target: str) -> qstats.Recipe:
    return qstats.Recipe([qstats.Rule(target, sites=("gate_up_proj", "down_proj"), spec=WEIGHT),
                          qstats.Rule(target, sites=("input", "down_proj.input"), spec=INPUT)])


def _reference_experts(entry: dict, act=F.silu, scales=None):
    """An experts forward: each expert's loop in plain torch, torch's fake-quant ops under the
    expert's calibrated scales (zero points 0: symmetric); with ``scales`` ({site: tensor}),
    `_hand_fake_quantize` under those."""

    def quantize_input(t, site, e):
        if scales is not None:
            return _hand_fake_quantize(t, scales[site][e])
        return torch.fake_quantize_per_tensor_affine(t, float(entry[site].scale[e]), 0, -128, 127)

    def quantize_weight(w, site, e):
        if scales is not None:
            return _hand_fake_quantize(w, scales[site][e][:, None])
        scale = entry[site].scale[e].reshape(-1)
        zero_point = torch.zeros_like(scale, dtype=torch.int32)
        return torch.fake_quantize_per_channel_affine(w, scale, zero_point, 0, -128, 127)

    def forward(self, x, top_k_index, top_k_weights):
        out = torch.zeros_like(x)
        for e in range(self.gate_up_proj.shape[0]):
            token, slot = torch.where(top_k_index == e)
            h = F.linear(quantize_input(x[token], "input", e), quantize_weight(self.gate_up_proj[e], "gate_up_proj", e))
            gate, up = h.chunk(2, dim=-1)
            y = F.linear(quantize_input(act(gate) * up, "down_proj.input", e),
                         quantize_weight(self.down_proj[e], "down_proj", e))
            out = out.index_add(0, token, y * top_k_weights[token, slot, None])
        return out

    return forward


class _Experts(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.num_experts = 2
        self.gate_up_proj = torch.nn.Parameter(torch.randn(2, 6, 4))
        self.down_proj = torch.nn.Parameter(torch.randn(2, 4, 3))

    def forward(self, x, top_k_index, top_k_weights):
        out = torch.zeros_like(x)
        for e in range(2):
            token, slot = torch.where(top_k_index == e)
            h = F.linear(x[token], self.gate_up_proj[e])
            gate, up = h.chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e])
            out = out.index_add(0, token, y * top_k_weights[token, slot, None])
        return out


def _train_both(model, reference, qparams, recipe, loss_of, steps: int = 3):
    """SGD steps on ``model`` inside `fake_quantized` and on ``reference``: equal losses,
    gradients and parameters after each step."""
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference))
    for _ in range(steps):
        opt.zero_grad()
        ref_opt.zero_grad()
        with qstats.fake_quantized(model, qparams, recipe):
            loss = loss_of(model)
            loss.backward()
        expected = loss_of(reference)
        expected.backward()
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert p.grad is not None, name
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
        opt.step()
        ref_opt.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def _toy():
    torch.manual_seed(0)
    model, recipe = _Experts(), _recipe("_Experts")
    index, weights = torch.tensor([[0], [1]] * 4), torch.ones(8, 1)
    states = qstats.calibrate(model, [(torch.randn(8, 4), index, weights)], recipe, progress=False)
    return model, recipe, index, weights, qstats.compute_qparams_tree(states, recipe, model)


def test_toy_experts_sgd_steps_equal_torch_fake_quant_loop():
    model, recipe, index, weights, qparams = _toy()
    reference = copy.deepcopy(model)
    reference.forward = _reference_experts(qparams[""]).__get__(reference)
    x, y = torch.randn(8, 4) * 1.5, torch.randn(8, 4)  # some inputs past the calibrated range: clipped
    _train_both(model, reference, qparams, recipe, lambda m: F.mse_loss(m(x, index, weights), y))


def _qwen3_moe(implementation: str, dtype=torch.float32):
    """A tiny Qwen3-MoE in ``implementation``, the experts recipe and its calibrated qparams."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(qwen3_moe_config()).to(dtype)
    model.set_attn_implementation("eager")
    model.set_experts_implementation(implementation)
    recipe = _recipe("Qwen3MoeExperts")
    calibration = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    states = qstats.calibrate(model, [{"input_ids": calibration}], recipe, progress=False, all_experts=True)
    return model, recipe, qstats.compute_qparams_tree(states, recipe, model)


TOKENS = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("implementation", ["eager", "batched_mm", "grouped_mm"])
def test_qwen3_moe_sgd_steps_equal_torch_fake_quant_loop(implementation):
    model, recipe, qparams = _qwen3_moe(implementation)
    reference = copy.deepcopy(model)
    for path, entry in qparams.items():
        experts = reference.get_submodule(path)
        experts.forward = _reference_experts(entry, experts.act_fn).__get__(experts)
    _train_both(model, reference, qparams, recipe, lambda m: m(input_ids=TOKENS, labels=TOKENS).loss, steps=2)


def test_qwen3_moe_batched_mm_scale_gradients_equal_a_hand_written_loop():
    """Scales requiring grad at every expert site of both layers (the first layer's get theirs
    through the second layer's straight-through input quantization, lost before)."""
    model, recipe, qparams = _qwen3_moe("batched_mm")
    learned = {path: {site: qp._replace(scale=qp.scale.clone().requires_grad_()) for site, qp in entry.items()}
               for path, entry in qparams.items()}
    with qstats.fake_quantized(model, learned, recipe):
        model(input_ids=TOKENS, labels=TOKENS).loss.backward()
    reference = copy.deepcopy(model)
    scales = {path: {site: qp.scale.clone().requires_grad_() for site, qp in entry.items()}
              for path, entry in qparams.items()}
    for path, entry in qparams.items():
        experts = reference.get_submodule(path)
        experts.forward = _reference_experts(entry, experts.act_fn, scales[path]).__get__(experts)
    reference(input_ids=TOKENS, labels=TOKENS).loss.backward()
    for path, entry in learned.items():
        for site, qp in entry.items():
            torch.testing.assert_close(qp.scale.grad, scales[path][site].grad, rtol=1e-4, atol=1e-6,
                                       msg=f"{path} {site}")


def _hand_fake_quantize(t, s):
    """int8 symmetric fake quantization written out: codes ``round(t * (1/s))`` (torch's kernels)
    clamped; gradient to ``t`` 1 where the code is inside the range; to ``s`` the codes."""
    codes = torch.round(t.detach() * (1.0 / s.detach()))
    inside = (codes >= -128) & (codes <= 127)
    return codes.clamp(-128, 127) * s + torch.where(inside, t - t.detach(), torch.zeros_like(t))


def test_scale_gradients_of_expert_sites_equal_a_hand_written_loop():
    """Scales passed requiring grad get their gradients at expert sites, as at other sites
    (`fake_quantize`: the codes, the round not differentiated)."""
    model, recipe, index, weights, qparams = _toy()
    x, y = torch.randn(8, 4) * 1.5, torch.randn(8, 4)
    learned = {site: qp._replace(scale=qp.scale.clone().requires_grad_()) for site, qp in qparams[""].items()}
    with qstats.fake_quantized(model, {"": learned}, recipe):
        F.mse_loss(model(x, index, weights), y).backward()
    scales = {site: qp.scale.clone().requires_grad_() for site, qp in qparams[""].items()}
    out = torch.zeros_like(x)
    for e in range(2):
        token, slot = torch.where(index == e)
        h = F.linear(_hand_fake_quantize(x[token], scales["input"][e]),
                     _hand_fake_quantize(model.gate_up_proj[e], scales["gate_up_proj"][e][:, None]))
        gate, up = h.chunk(2, dim=-1)
        y_e = F.linear(_hand_fake_quantize(F.silu(gate) * up, scales["down_proj.input"][e]),
                       _hand_fake_quantize(model.down_proj[e], scales["down_proj"][e][:, None]))
        out = out.index_add(0, token, y_e * weights[token, slot, None])
    F.mse_loss(out, y).backward()
    for site, qp in learned.items():
        assert scales[site].grad.abs().sum() > 0, site
        torch.testing.assert_close(qp.scale.grad, scales[site].grad, rtol=1e-5, atol=1e-6, msg=site)


def _functional_grads(model, recipe, qparams, names, x, index, weights, y):
    """``torch.func.grad`` of the loss in ``torch.func.functional_call`` inside `fake_quantized`,
    the parameters passed as ``names`` gives them (a dict: parameter name -> key)."""
    params = {name: p.detach().clone() for name, p in model.named_parameters()}

    def loss_fn(given):
        return F.mse_loss(torch.func.functional_call(model, given, (x, index, weights)), y)

    with qstats.fake_quantized(model, qparams, recipe):
        grads = torch.func.grad(loss_fn)({names[name]: p for name, p in params.items()})
    return {name: grads[names[name]] for name in params}


def _original(name: str) -> str:
    return f"parametrizations.{name}.original"


def test_functional_call_grad_of_fake_quantized_expert_weights():
    """JAX-style step: the weights (under the names the model gives them inside the context)."""
    model, _, index, weights, qparams = _toy()
    recipe = qstats.Recipe([qstats.Rule("_Experts", sites=("gate_up_proj", "down_proj"), spec=WEIGHT)])
    qparams = {"": {site: qparams[""][site] for site in ("gate_up_proj", "down_proj")}}
    x, y = torch.randn(8, 4) * 1.5, torch.randn(8, 4)
    names = {n: _original(n) for n in ("gate_up_proj", "down_proj")}
    grads = _functional_grads(model, recipe, qparams, names, x, index, weights, y)
    reference = copy.deepcopy(model)

    def quantize(w, site, e):
        scale = qparams[""][site].scale[e]
        zero_point = torch.zeros_like(scale, dtype=torch.int32)
        return torch.fake_quantize_per_channel_affine(w, scale, zero_point, 0, -128, 127)

    out = torch.zeros_like(x)
    for e in range(2):
        token, slot = torch.where(index == e)
        gate, up = F.linear(x[token], quantize(reference.gate_up_proj[e], "gate_up_proj", e)).chunk(2, dim=-1)
        y_e = F.linear(F.silu(gate) * up, quantize(reference.down_proj[e], "down_proj", e))
        out = out.index_add(0, token, y_e * weights[token, slot, None])
    F.mse_loss(out, y).backward()
    for name, p in reference.named_parameters():
        assert p.grad.abs().sum() > 0
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_functional_call_under_the_models_own_names_is_refused():
    """Assigning a parametrized tensor copies it into the original under no_grad (its gradient
    lost): a clear error naming the names to use, instead of torch's ``right_inverse`` one."""
    model, recipe, index, weights, qparams = _toy()
    names = {n: n for n in ("gate_up_proj", "down_proj")}
    with pytest.raises(NotImplementedError, match=r"parameter 'gate_up_proj' .*parametrizations.<name>.original"):
        _functional_grads(model, recipe, qparams, names, torch.randn(8, 4), index, weights, torch.randn(8, 4))


def test_functional_call_grad_with_expert_inputs():
    """torch.func.grad's tensors have no storage: matching a slice to its stack by address raised."""
    model, recipe, index, weights, qparams = _toy()
    x, y = torch.randn(8, 4) * 1.5, torch.randn(8, 4)
    names = {n: _original(n) for n in ("gate_up_proj", "down_proj")}
    grads = _functional_grads(model, recipe, qparams, names, x, index, weights, y)
    reference = copy.deepcopy(model)
    reference.forward = _reference_experts(qparams[""]).__get__(reference)
    F.mse_loss(reference(x, index, weights), y).backward()
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_toy_experts_bf16_sgd_steps_equal_torch_fake_quant_loop():
    """bfloat16 weights and activations (qparams calibrated in bfloat16)."""
    torch.manual_seed(0)
    model, recipe = _Experts().to(torch.bfloat16), _recipe("_Experts")
    index, weights = torch.tensor([[0], [1]] * 4), torch.ones(8, 1, dtype=torch.bfloat16)
    calibration = torch.randn(8, 4, dtype=torch.bfloat16)
    states = qstats.calibrate(model, [(calibration, index, weights)], recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    reference = copy.deepcopy(model)
    reference.forward = _reference_experts(qparams[""]).__get__(reference)
    x, y = (torch.randn(8, 4) * 1.5).bfloat16(), torch.randn(8, 4).bfloat16()
    _train_both(model, reference, qparams, recipe, lambda m: F.mse_loss(m(x, index, weights), y))


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
def test_qwen3_moe_sgd_steps_under_gradient_checkpointing(implementation):
    """transformers' gradient checkpointing (non-reentrant: saved-tensor hooks, which torch.func.vjp
    refuses) around the quantized experts: the same steps as the per-expert torch.fake_quantize loop."""
    from torch.utils.checkpoint import checkpoint

    model, recipe, qparams = _qwen3_moe(implementation)
    reference = copy.deepcopy(model)
    for path, entry in qparams.items():
        experts = reference.get_submodule(path)
        experts.forward = _reference_experts(entry, experts.act_fn).__get__(experts)
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert model.model.gradient_checkpointing and model.model.layers[0]._gradient_checkpointing_func.func is checkpoint
    _train_both(model, reference, qparams, recipe, lambda m: m(input_ids=TOKENS, labels=TOKENS).loss, steps=2)
