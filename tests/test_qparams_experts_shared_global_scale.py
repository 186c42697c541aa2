"""Stacked NVFP4 experts whose qparams hold one global scale shared by every expert (compressed-tensors'
``(1,)`` shape, or a scalar as `qstats.fused_global_scale` gives over all experts): `qstats.report` and
`qstats.fake_quantized` treat it as that scale repeated for each expert, as the export writes it."""

import pytest
import torch
from _shared import bit_equal, qwen3_moe_config

import qstats
from qstats._qparams import experts_qparams, per_expert_qparams

transformers = pytest.importorskip("transformers")
from test_export_experts_shared_global_scale import EXPERTS, _with_global_scales  # noqa: E402


@pytest.fixture(scope="module")
def calibrated():
    """A tiny random Qwen3-MoE, its NVFP4 plan over the stacked experts (weights and inputs), a
    batch, the states and their qparams."""
    torch.manual_seed(0)
    config = qwen3_moe_config(num_experts=4, num_experts_per_tok=2, hidden_size=32, moe_intermediate_size=16,
                              head_dim=16)
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    recipe = qstats.Recipe.from_scheme("NVFP4", ignore=["lm_head", "re:.*mlp.gate$"], experts="Qwen3MoeExperts")
    plan = recipe.resolve(model)
    batches = [{"input_ids": torch.randint(1, 64, (1, 12), generator=torch.Generator().manual_seed(1))}]
    states = qstats.calibrate(model, batches, plan, progress=False, all_experts=True)
    return model, plan, batches, states, qstats.compute_qparams_tree(states, plan)


def _repeated(g):
    return g.reshape(1).repeat(4)


SHAPES = pytest.mark.parametrize("shape", [(1,), ()], ids=["compressed-tensors-shape", "scalar"])


@SHAPES
def test_report_of_a_shared_global_scale_equals_it_repeated_per_expert(calibrated, shape):
    model, plan, batches, states, qparams = calibrated
    shared = qstats.report(states, _with_global_scales(qparams, lambda g: g.reshape(shape)), model, plan, batches)
    repeated = qstats.report(states, _with_global_scales(qparams, _repeated), model, plan, batches)
    assert shared.rows == repeated.rows
    assert [row for row in shared.rows if EXPERTS in str(row)]


@SHAPES
def test_fake_quantized_under_a_shared_global_scale_equals_it_repeated_per_expert(calibrated, shape):
    model, plan, batches, _, qparams = calibrated
    outputs = []
    for make in (lambda g: g.reshape(shape), _repeated):
        with torch.no_grad(), qstats.fake_quantized(model, _with_global_scales(qparams, make), plan):
            outputs.append(model(**batches[0]).logits)
    with torch.no_grad():
        float_logits = model(**batches[0]).logits
    assert bit_equal(outputs[0], outputs[1])
    assert not bit_equal(outputs[0], float_logits)  # the experts were quantized


@SHAPES
def test_expert_slices_of_a_shared_global_scale_are_that_scale(calibrated, shape):
    qp = calibrated[4][EXPERTS]["down_proj"]
    shared = qp._replace(global_scale=torch.tensor(0.25).reshape(shape))
    for expert in range(4):
        assert bit_equal(experts_qparams(shared, expert).global_scale, torch.tensor(0.25))
        assert bit_equal(experts_qparams(shared, expert).scale, qp.scale[expert])
    ids = torch.tensor([3, 0, 3])
    assert bit_equal(experts_qparams(shared, ids).global_scale, torch.full((3,), 0.25))


def test_a_global_scale_for_some_experts_is_refused_naming_its_shape(calibrated):
    qp = calibrated[4][EXPERTS]["down_proj"]
    with pytest.raises(ValueError, match=r"global_scale of shape \(3,\) is neither one value shared .* \(\[4\]\)"):
        experts_qparams(qp._replace(global_scale=torch.ones(3)), 0)
    with pytest.raises(ValueError, match=r"leading expert dimension 5, got scale of shape \(4, "):
        per_expert_qparams(qp, 5)
    with pytest.raises(ValueError, match=r"no leading expert dimension \(scale of shape \(\)\)"):
        experts_qparams(qp._replace(scale=qp.scale.reshape(-1)[0]), 0)
