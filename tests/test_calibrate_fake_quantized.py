"""Calibrating activations inside `qstats.fake_quantized` (what llm-compressor does once weights are
quantized), against calibrating a copy of the model whose weights were replaced by their
fake-quantized values, computed here expert by expert (issue 22, item 3)."""

import copy
import warnings

import pytest
import torch
from _shared import qwen3_moe_config

import qstats

transformers = pytest.importorskip("transformers")

WEIGHTS = qstats.QuantSpec(dtype="int4", mapping="symmetric", granularity=qstats.PerAxis(0), on_uncalibrated="fallback")
INPUTS = qstats.QuantSpec(dtype="int8", mapping="asymmetric", on_uncalibrated="fallback")
WEIGHT_RULES = [
    qstats.Rule("Qwen3MoeExperts", sites=("gate_up_proj", "down_proj"), spec=WEIGHTS),
    qstats.Rule("Linear", sites=("weight",), spec=WEIGHTS),
]
ACTIVATION_RULES = [
    qstats.Rule("Qwen3MoeExperts", sites=("input", "down_proj.input"), spec=INPUTS),
    qstats.Rule("Linear", sites=("input",), spec=INPUTS),
]


def _replaced_by_fake_quantized(model, qparams):
    """A copy of ``model`` whose observed weights hold their fake-quantized values (per expert for
    stacks: one unstacked fake_quantize per expert)."""
    replaced = copy.deepcopy(model)
    with torch.no_grad():
        for path, entry in qparams.items():
            module = replaced.get_submodule(path)
            for site, qp in entry.items():
                weight = getattr(module, site)
                if qp.scale.dim() and weight.dim() == 3:  # stacked experts: leading expert dimension
                    values = [qstats.fake_quantize(weight[e], type(qp)(*(f[e] for f in qp)), WEIGHTS)
                              for e in range(weight.shape[0])]
                    weight.copy_(torch.stack(values))
                else:
                    weight.copy_(qstats.fake_quantize(weight, qp, WEIGHTS))
    return replaced


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm", "batched_mm"])
@pytest.mark.parametrize("resolved", ["before", "inside"])
def test_calibrating_inside_fake_quantized_equals_replaced_weights(implementation, resolved):
    """The experts' weight sites, their routed ``input`` and ``down_proj.input`` and every Linear
    site equal, bit for bit, those of the model with fake-quantized weights, whether the recipe is
    resolved before entering `fake_quantized` or inside it; `compute_qparams_tree` then works (it
    used to fail: the parametrized experts were not recognised, ``input`` became unrouted)."""
    config = qwen3_moe_config(num_experts=8, num_experts_per_tok=2)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    model.set_experts_implementation(implementation)
    weight_plan = qstats.Recipe(WEIGHT_RULES).resolve(model)
    weight_qparams = qstats.compute_qparams_tree(qstats.calibrate(model, [], weight_plan, progress=False), weight_plan)
    recipe = qstats.Recipe(WEIGHT_RULES + ACTIVATION_RULES)
    plan = recipe.resolve(model) if resolved == "before" else None
    float_stack = model.model.layers[0].mlp.experts.gate_up_proj.detach().clone()
    batches = [torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(1))]
    replaced = _replaced_by_fake_quantized(model, weight_qparams)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qstats.UncalibratedWarning)
        expected = qstats.calibrate(replaced, batches, recipe, progress=False)
        with qstats.fake_quantized(model, weight_qparams, weight_plan):
            plan = plan or recipe.resolve(model)
            states = qstats.calibrate(model, batches, plan, progress=False)
            qparams = qstats.compute_qparams_tree(states, plan, model)
    assert states.keys() == expected.keys()
    experts = "model.layers.0.mlp.experts"
    assert sorted(states[experts]) == ["down_proj", "down_proj.input", "gate_up_proj", "input"]
    for path, entry in expected.items():
        assert states[path].keys() == entry.keys(), path
        for site, state in entry.items():
            for field, ours, theirs in zip(state._fields, states[path][site], state):
                assert torch.equal(ours, theirs), (path, site, field)
    assert qparams[experts]["input"].scale.shape == (8,)
    # the float weights are back after the context
    assert torch.equal(model.model.layers[0].mlp.experts.gate_up_proj, float_stack)


class _TupleProjection(torch.nn.Module):
    """A projection returning ``(activation, None)``: its first tensor is the q activation."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.linear(x), None


class _TupleAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = _TupleProjection()

    def forward(self, x):
        return self.q_proj(x)[0]


def test_q_site_of_a_projection_returning_a_tuple_is_fake_quantized():
    """`fake_quantized` quantizes the tensor `calibrate` observes for a ``q`` site, the first
    tensor of the projection's output, equal to torch's own per-tensor fake quantization under
    the calibrated scale (it used to pass a tuple through unquantized)."""
    torch.manual_seed(0)
    model = _TupleAttention().eval()
    spec = qstats.QuantSpec(dtype="int8", mapping="asymmetric")
    plan = qstats.Recipe([qstats.Rule("_TupleAttention", sites=("q",), spec=spec)]).resolve(model)
    x = torch.randn(8, 4)
    qp = qstats.compute_qparams_tree(qstats.calibrate(model, [x], plan, progress=False), plan)[""]["q"]
    with torch.no_grad():
        activation = model.q_proj.linear(x)
        expected = torch.fake_quantize_per_tensor_affine(activation, qp.scale.item(), int(qp.zero_point), -128, 127)
        with qstats.fake_quantized(model, {"": {"q": qp}}, plan):
            got = model(x)
    assert not torch.equal(expected, activation)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def _gpt_oss_replaced(model, qparams):
    """A copy of the GPT-OSS ``model`` whose stacked expert weights hold their fake-quantized values, put
    back by hand in its stored layout: ``gate_up_proj [E, H, 2I]`` (the per-expert gate_proj Linear its
    columns ``0::2``, up_proj ``1::2``), ``down_proj [E, I, H]``, each the transpose of the Linear weights."""
    replaced = copy.deepcopy(model)
    with torch.no_grad():
        for path, entry in qparams.items():
            module = replaced.get_submodule(path)
            for site, qp in entry.items():
                stored = getattr(module, site)
                linear = stored.transpose(1, 2)  # [E, out, in]
                if site == "gate_up_proj":  # gate rows, then up rows
                    linear = torch.cat([linear[:, 0::2], linear[:, 1::2]], dim=1)
                values = torch.stack([qstats.fake_quantize(linear[e], type(qp)(*(f[e] for f in qp)), WEIGHTS)
                                      for e in range(linear.shape[0])])
                if site == "gate_up_proj":
                    half = values.shape[1] // 2
                    values = torch.stack([values[:, :half], values[:, half:]], dim=2).flatten(1, 2)
                stored.copy_(values.transpose(1, 2))
    return replaced


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm", "batched_mm"])
def test_transposed_gpt_oss_stacks_inside_fake_quantized_equal_replaced_weights(implementation, single_thread_quiet):
    """GPT-OSS stores its stacks transposed ([E, in, out]): the parametrization gave back a transposed
    view, whose matmuls round otherwise than those of the model holding the same weights (its
    down_proj.input and every later site differed by float32 ulps, and so did the logits)."""
    from test_moe_families import _batches, _model

    model = _model("gpt_oss")
    model.set_experts_implementation(implementation)
    weight_plan = qstats.Recipe([qstats.Rule("GptOssExperts", sites=("gate_up_proj", "down_proj"),
                                             spec=WEIGHTS)]).resolve(model)
    weight_qparams = qstats.compute_qparams_tree(qstats.calibrate(model, [], weight_plan, progress=False), weight_plan)
    recipe = qstats.Recipe([qstats.Rule("GptOssExperts", sites=("input", "down_proj.input"), spec=INPUTS),
                            qstats.Rule("Linear", sites=("input",), spec=INPUTS)], ignore=["lm_head"])
    batches = _batches()
    replaced = _gpt_oss_replaced(model, weight_qparams)
    expected = qstats.calibrate(replaced, batches, recipe, progress=False)
    with qstats.fake_quantized(model, weight_qparams, weight_plan), torch.no_grad():
        states = qstats.calibrate(model, batches, recipe, progress=False)
        logits = model(batches[0]).logits
    with torch.no_grad():
        assert torch.equal(logits, replaced(batches[0]).logits)
    assert states.keys() == expected.keys()
    for path, entry in expected.items():
        for site, state in entry.items():
            for field, ours, theirs in zip(state._fields, states[path][site], state):
                assert torch.equal(ours, theirs), (path, site, field)
