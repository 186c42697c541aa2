"""`Recipe.from_compressed_tensors` of a checkpoint's config whose targets name per-expert Linears by
their checkpoint names (Mixtral's ``block_sparse_moe.experts.<e>.gate_proj``, which transformers 5 loads
into the stacked ``mlp.experts``): the export writes them so where it cannot write ``["Linear"]``, and
compressed-tensors matches them against the checkpoint's module names. Read back on the model, the recipe
quantizes the stacked experts whose checkpoint-named Linears compressed-tensors' ``match_targets`` puts
in a config group, as the recipe that wrote the checkpoint did (they were left unquantized, silently)."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

import qstats

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")
from compressed_tensors.utils import match_targets  # noqa: E402
from safetensors.torch import load_file  # noqa: E402


def _mixtral():
    config = transformers.MixtralConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                        max_position_embeddings=32, num_local_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(config).eval()


def _sites(plan) -> dict:
    return {(path, site): found.spec for path, sites in plan.sites.items() for site, found in sites.items()}


@pytest.mark.parametrize("scheme", ["FP8", "NVFP4"])
def test_config_read_back_quantizes_the_experts_its_checkpoint_names_target(tmp_path, scheme):
    model = _mixtral()
    # layer 1 left out: the groups cannot be written ["Linear"], so the export names the modules
    recipe = qstats.Recipe.from_scheme(scheme, ignore=["lm_head", "re:.*mlp.gate$", "re:.*layers.1.*"])
    plan = recipe.resolve(model)
    batches = [{"input_ids": torch.randint(1, 64, (1, 12), generator=torch.Generator().manual_seed(i))} for i in range(2)]
    states = qstats.calibrate(model, batches, plan, progress=False, all_experts=True)
    qstats.export.compressed_tensors(model, qstats.compute_qparams_tree(states, plan), str(tmp_path), plan)
    with open(os.path.join(tmp_path, "config.json")) as file:
        config = json.load(file)["quantization_config"]
    targets = [target for group in config["config_groups"].values() for target in group["targets"]]

    # the reference: the checkpoint's per-expert Linears compressed-tensors' matching puts in a group
    names = {name.removesuffix(".weight_scale") for name in load_file(os.path.join(tmp_path, "model.safetensors"))
             if re.search(r"experts\.\d+\.\w+_proj\.weight_scale$", name)}
    linear = torch.nn.Linear(1, 1, device="meta")
    targeted = {name for name in names if match_targets(name, linear, targets)}
    assert targeted and all(".block_sparse_moe." in name and ".layers.0." in name for name in targeted)

    back = _sites(qstats.Recipe.from_compressed_tensors(config).resolve(model))
    expert_sites = {(path, site) for path, site in back if path.endswith(".experts")}
    assert expert_sites == {("model.layers.0.mlp.experts", site)
                            for site in ("gate_up_proj", "down_proj", "input", "down_proj.input")}
    assert back == _sites(plan)  # the recipe that wrote the checkpoint, site for site
