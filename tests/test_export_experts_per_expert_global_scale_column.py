"""Stacked NVFP4 experts whose qparams hold one global scale per expert as a column ``[E, 1]`` (each
expert's compressed-tensors ``(1,)`` global scale stacked, as llm-compressor's linearized experts hold
them): each expert's ``up_proj`` half of ``gate_up_proj`` is written under its expert's global scale,
as with the ``[E]`` shape `qstats.stacked_qparams` gives."""

import tempfile

import pytest
import torch
from _shared import bit_equal, qwen3_moe_config
from safetensors.torch import load_file

import qstats

transformers = pytest.importorskip("transformers")
EXPERTS = "model.layers.0.mlp.experts"


@pytest.fixture(scope="module")
def calibrated():
    """A tiny random Qwen3-MoE, its NVFP4A16 plan over the stacked experts, and its qparams."""
    torch.manual_seed(0)
    config = qwen3_moe_config(num_experts=4, num_experts_per_tok=2, hidden_size=32, moe_intermediate_size=16,
                              head_dim=16)
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    recipe = qstats.Recipe.from_scheme("NVFP4A16", ignore=["lm_head", "re:.*mlp.gate$"], experts="Qwen3MoeExperts")
    plan = recipe.resolve(model)
    batches = [{"input_ids": torch.randint(1, 64, (1, 12), generator=torch.Generator().manual_seed(1))}]
    states = qstats.calibrate(model, batches, plan, progress=False, all_experts=True)
    return model, plan, qstats.compute_qparams_tree(states, plan)


def _export(model, qparams, plan):
    with tempfile.TemporaryDirectory() as folder:
        qstats.export.compressed_tensors(model, qparams, folder, plan)
        return load_file(f"{folder}/model.safetensors")


def test_a_column_of_per_expert_global_scales_is_each_experts_for_gate_and_up(calibrated):
    model, plan, qparams = calibrated
    sites = qparams[EXPERTS]
    # each expert's global scale as compressed-tensors holds it, shape (1,), stacked over the experts
    columns = {site: qp._replace(global_scale=torch.stack([g.reshape(1) for g in qp.global_scale]))
               for site, qp in sites.items()}
    assert all(qp.global_scale.shape == (4, 1) for qp in columns.values())
    written = _export(model, {**qparams, EXPERTS: columns}, plan)
    expected = _export(model, qparams, plan)
    assert sorted(written) == sorted(expected)
    assert not [name for name in expected if not bit_equal(written[name], expected[name])]
    for expert in range(4):
        for projection in ("gate_proj", "up_proj"):
            scale = written[f"{EXPERTS}.{expert}.{projection}.weight_global_scale"]
            assert bit_equal(scale, sites["gate_up_proj"].global_scale[expert].reshape(1))
