"""Stacked NVFP4 experts whose qparams hold one global scale shared by every expert (compressed-tensors'
``(1,)`` shape, or a scalar as `qstats.fused_global_scale` gives over all experts): the export wrote
nothing and raised a bare IndexError; now every expert is written under that global scale, as with
one per expert."""

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
    model = transformers.Qwen3MoeForCausalLM(qwen3_moe_config(num_experts=4, num_experts_per_tok=2, hidden_size=32, moe_intermediate_size=16, head_dim=16)).eval()
    recipe = qstats.Recipe.from_scheme("NVFP4A16", ignore=["lm_head", "re:.*mlp.gate$"], experts="Qwen3MoeExperts")
    plan = recipe.resolve(model)
    batches = [{"input_ids": torch.randint(1, 64, (1, 12), generator=torch.Generator().manual_seed(1))}]
    states = qstats.calibrate(model, batches, plan, progress=False, all_experts=True)
    return model, plan, qstats.compute_qparams_tree(states, plan)


def _with_global_scales(qparams, make):
    """``qparams`` whose experts' sites take the global scale ``make(smallest per-expert global scale)``."""
    changed = {path: dict(sites) for path, sites in qparams.items()}
    for site, qp in qparams[EXPERTS].items():
        changed[EXPERTS][site] = qp._replace(global_scale=make(qp.global_scale.amin()))
    return changed


def _export(model, qparams, plan):
    with tempfile.TemporaryDirectory() as folder:
        qstats.export.compressed_tensors(model, qparams, folder, plan)
        return load_file(f"{folder}/model.safetensors")


@pytest.mark.parametrize("shape", [(1,), ()], ids=["compressed-tensors-shape", "scalar"])
def test_one_global_scale_shared_by_the_experts_is_written_for_each(calibrated, shape):
    model, plan, qparams = calibrated
    shared = _export(model, _with_global_scales(qparams, lambda g: g.reshape(shape)), plan)
    per_expert = _export(model, _with_global_scales(qparams, lambda g: g.reshape(1).repeat(4)), plan)
    assert sorted(shared) == sorted(per_expert)
    assert not [name for name in per_expert if not bit_equal(shared[name], per_expert[name])]
    value = qparams[EXPERTS]["down_proj"].global_scale.amin().reshape(1)
    assert bit_equal(shared[f"{EXPERTS}.3.down_proj.weight_global_scale"], value)


def test_a_global_scale_per_some_experts_is_refused_naming_its_shape(calibrated):
    model, plan, qparams = calibrated
    with pytest.raises(ValueError, match=r"global_scale of shape \(3,\) is neither one value shared .* \(\[4\]\)"):
        _export(model, _with_global_scales(qparams, lambda g: g.reshape(1).repeat(3)), plan)
