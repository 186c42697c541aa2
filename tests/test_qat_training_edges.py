"""QAT edge cases a training loop meets, against independent computations (torch's own
``fake_quantize_per_channel_affine`` / ``per_tensor_affine`` in hand-written forwards, the float
model's own ``state_dict``):

- `qstats.qat.prepare` on stacked experts (not Linear layers) left them training in float, silently;
  now it raises naming them.
- `qstats.fake_quantized`: torch's ``register_parametrization`` calls ``original.set_(original)``,
  which gives the parameter a new grad accumulator and drops the hooks on the old one:
  DistributedDataParallel's gradient all-reduce never ran (its second step raised "Expected to have
  finished reduction"). ``state_dict()`` inside the context gave ``parametrizations.<name>.original``
  keys that the float model cannot load; now the float model's keys, order and values.
- Tied weights, gradient accumulation, clipping and an optimizer kept across several contexts equal
  a hand-written straight-through loop (these already held).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import qstats
from _shared import exit_rank, fork_ranks, gloo_group, qwen3_moe_config

WEIGHT = qstats.QuantSpec("int8", granularity=qstats.PerAxis(0))
INPUT = qstats.QuantSpec("int8")
RECIPE = qstats.Recipe([qstats.Rule(("Linear", "Embedding"), sites=("weight",), spec=WEIGHT),
                        qstats.Rule("Linear", sites=("input",), spec=INPUT)])


class _Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.lin = torch.nn.Linear(4, 4)
        self.lm_head = torch.nn.Linear(4, 10, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, tokens):
        return self.lm_head(F.relu(self.lin(self.embed(tokens))))


def _fq_weight(w, qp):
    return torch.fake_quantize_per_channel_affine(
        w, qp.scale.reshape(-1).float(), qp.zero_point.reshape(-1).int(), 0, -128, 127)


def _fq_input(x, qp):
    return torch.fake_quantize_per_tensor_affine(x, float(qp.scale), int(qp.zero_point), -128, 127)


def _hand_tied(model, qp, tokens):
    """The tied model with torch's fake-quant ops: the tied weight quantized at each of its uses."""
    h = F.embedding(tokens, _fq_weight(model.embed.weight, qp["embed"]["weight"]))
    h = F.relu(F.linear(_fq_input(h, qp["lin"]["input"]), _fq_weight(model.lin.weight, qp["lin"]["weight"]),
                        model.lin.bias))
    return F.linear(_fq_input(h, qp["lm_head"]["input"]), _fq_weight(model.lm_head.weight, qp["lm_head"]["weight"]))


def _tied():
    torch.manual_seed(0)
    model = _Tied()
    tokens = torch.randint(0, 10, (4, 6))
    states = qstats.calibrate(model, [tokens[:2]], RECIPE, progress=False)  # later rows: some clipped
    return model, tokens, qstats.compute_qparams_tree(states, RECIPE, model)


# ------------------------------------------------------------------------------------------------
# qat.prepare and stacked experts


class _StackedExperts(torch.nn.Module):
    """Experts whose forward torch.fx traces (an einsum over the stacked weight)."""

    def __init__(self):
        super().__init__()
        self.num_experts = 2
        self.gate_up_proj = torch.nn.Parameter(torch.randn(2, 4, 4))

    def forward(self, x):
        return torch.einsum("eoi,bi->bo", self.gate_up_proj, x)


def test_prepare_refuses_stacked_experts_naming_them():
    """Before: prepared, the experts' weight in float (only 'proj' quantized), no warning."""
    model = torch.nn.Sequential()
    model.add_module("proj", torch.nn.Linear(4, 4))
    model.add_module("experts", _StackedExperts())
    observer = qstats.memoryless_minmax(WEIGHT)
    with pytest.raises(ValueError, match=r"'experts' \(_StackedExperts, 2 experts\).*fake_quantized"):
        qstats.qat.prepare(model, observer)


def test_prepare_refuses_a_qwen3_moe_naming_its_experts():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(qwen3_moe_config())
    model.set_experts_implementation("batched_mm")  # its MoE block traces: before, "no layer" / float
    observer = qstats.memoryless_minmax(WEIGHT)
    with pytest.raises(ValueError, match=r"'experts' \(Qwen3MoeExperts, 8 experts\)"):
        qstats.qat.prepare(model.model.layers[0].mlp, observer)
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.experts' \(Qwen3MoeExperts"):
        qstats.qat.prepare(model, observer)


# ------------------------------------------------------------------------------------------------
# fake_quantized: tied weights, accumulation, clipping, optimizer across contexts


def test_tied_weights_accumulated_clipped_steps_equal_a_hand_written_loop():
    model, tokens, qp = _tied()
    reference = copy.deepcopy(model)
    assert reference.lm_head.weight is reference.embed.weight
    order = [name for name, _ in model.named_parameters()]
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, reference))
    target = torch.randn(4, 6, 10)
    for _ in range(3):  # a new context every step, one optimizer throughout
        with qstats.fake_quantized(model, qp, RECIPE):
            for half in (slice(0, 2), slice(2, 4)):  # gradient accumulation over two micro-batches
                F.mse_loss(model(tokens[half]), target[half]).backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        for half in (slice(0, 2), slice(2, 4)):
            F.mse_loss(_hand_tied(reference, qp, tokens[half]), target[half]).backward()
        torch.testing.assert_close(norm, torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5))
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    assert model.lm_head.weight is model.embed.weight
    assert [name for name, _ in model.named_parameters()] == order
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_hooks_on_a_parameters_grad_accumulator_still_fire():
    """DDP and FSDP hook the parameters' grad accumulators; torch's register_parametrization made new ones."""
    model, tokens, qp = _tied()
    fired = []
    accumulator = model.lin.weight.view_as(model.lin.weight).grad_fn.next_functions[0][0]
    accumulator.register_hook(lambda *_: fired.append(True))
    with qstats.fake_quantized(model, qp, RECIPE):
        model(tokens).sum().backward()
    assert fired


def _ddp_rank(rank, port, model, qp, tokens, target, expected):
    model = copy.deepcopy(model)  # spawned ranks receive their tensors in shared memory
    with gloo_group(rank, port):
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for _ in range(2):
            with qstats.fake_quantized(model, qp, RECIPE):
                F.mse_loss(ddp(tokens[2 * rank:2 * rank + 2]), target[2 * rank:2 * rank + 2]).backward()
            opt.step()
            opt.zero_grad()
        same = all(torch.allclose(p, q, rtol=1e-5, atol=1e-6) for p, q in zip(model.parameters(), expected))
    exit_rank(0 if same else 3)  # the result is the exit code


def test_ddp_steps_equal_a_single_process_hand_written_loop():
    model, tokens, qp = _tied()
    target = torch.randn(4, 6, 10)
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(2):  # DDP averages the two ranks' gradients: the mean loss of the whole batch
        F.mse_loss(_hand_tied(reference, qp, tokens), target).backward()
        opt.step()
        opt.zero_grad()
    expected = [p.detach() for p in reference.parameters()]
    # spawned: forked ranks can hang on the intra-op threads earlier tests started
    assert fork_ranks(_ddp_rank, model, qp, tokens, target, expected, start_method="spawn") == [0, 0]


# ------------------------------------------------------------------------------------------------
# fake_quantized: state_dict


def test_state_dict_inside_is_the_float_models():
    model, tokens, qp = _tied()
    expected = {key: value.clone() for key, value in model.state_dict().items()}  # torch's own, outside the context: tied weight under both names
    with qstats.fake_quantized(model, qp, RECIPE):
        saved = {key: value.clone() for key, value in model.state_dict().items()}
        assert list(saved) == list(expected)
        for key in expected:
            assert torch.equal(saved[key], expected[key]), key
        model.load_state_dict({key: value + 1 for key, value in saved.items()})  # the float keys load inside
    fresh = _Tied()
    fresh.load_state_dict(saved)  # a mid-QAT checkpoint loads into the float model
    assert torch.equal(fresh.lin.weight, expected["lin.weight"])
    assert torch.equal(model.lin.weight, expected["lin.weight"] + 1)


def test_state_dict_inside_of_stacked_experts_is_the_float_models():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(qwen3_moe_config(num_hidden_layers=1))
    recipe = qstats.Recipe([qstats.Rule("Qwen3MoeExperts", sites=("gate_up_proj", "down_proj"),
                                        spec=qstats.QuantSpec("int8", granularity=qstats.PerRow(-1))),
                            qstats.Rule("Linear", sites=("weight",), spec=WEIGHT)])
    tokens = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(1))
    states = qstats.calibrate(model, [{"input_ids": tokens}], recipe, progress=False, all_experts=True)
    qp = qstats.compute_qparams_tree(states, recipe, model)
    expected = model.state_dict()
    with qstats.fake_quantized(model, qp, recipe):
        saved = model.state_dict()
    assert list(saved) == list(expected)
    assert all(torch.equal(saved[key], expected[key]) for key in expected)


def test_state_dict_inside_nested_contexts_on_one_module_is_the_float_models():
    """An inner context fake-quantizing another parameter of a module the outer one parametrized:
    before, its hook ordered the module's parameters by ``_parameters`` at its entry (the outer
    context's already moved out): ``lin.bias`` came before ``lin.weight``."""
    model, tokens, qp = _tied()
    bias_recipe = qstats.Recipe([qstats.Rule("Linear", sites=("bias",), spec=INPUT)])
    bias_qp = qstats.compute_qparams_tree(
        qstats.calibrate(model, [tokens[:2]], bias_recipe, progress=False), bias_recipe, model)
    expected = {key: value.clone() for key, value in model.state_dict().items()}  # torch's own, outside
    parameters = list(model.named_parameters())
    with qstats.fake_quantized(model, qp, RECIPE):
        with qstats.fake_quantized(model, bias_qp, bias_recipe):
            saved = model.state_dict()
            assert list(saved) == list(expected)
            assert all(torch.equal(saved[key], expected[key]) for key in expected)
        assert list(model.state_dict()) == list(expected)
    assert list(model.named_parameters()) == parameters
    assert list(model.state_dict()) == list(expected)
