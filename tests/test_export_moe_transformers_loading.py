"""Which transformers MoE classes load the unpacked experts of a qstats export back into their 3-D
experts: int4 group weights (pack-quantized) of a tiny random model of each family, exported as
llm-compressor writes them (per-expert ``gate_proj``/``up_proj``/``down_proj``), loaded by
``AutoModelForCausalLM.from_pretrained``; every expert's slice must equal the dequantized slice of the
stack under ``qstats.fake_quantized`` and no expert weight may be missing.

transformers 5.17 merges the per-expert names back for most families; for the ones below it expects
other checkpoint names (``w1``/``w2``/``w3``, fused stacks) and leaves the experts randomly
initialised, reporting them MISSING, as it does for llm-compressor's own checkpoints of them (the
names are the same: tests/test_moe_families_more_architectures.py, tests/test_export_moe_linearized.py).
Strict expected failures: a transformers that loads them fails the suite, so docs/export.md's table
gets updated."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs

import qstats
from _shared import exported_and_loaded

transformers = pytest.importorskip("transformers")
import test_moe_families as families  # noqa: E402
import test_moe_families_more_architectures as more  # noqa: E402

W4_GROUP = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=16)
_NOT_MERGED = (
    "transformers 5.17 does not merge per-expert gate_proj/up_proj/down_proj back into this family's 3-D experts: "
    "they load MISSING (randomly initialised), as llm-compressor's checkpoints of it do"
)
LOADED = ("qwen2_moe", "qwen3_moe", "olmoe", "glm4_moe", "ernie4_5_moe", "hunyuan_v1_moe", "jamba", "nemotron_h",
          "afmoe", "cohere2_moe", "dots1", "exaone_moe", "flex_olmo", "hy_v3", "mellum", "mimo_v2_flash",
          "axk1", "deepseek_v2", "deepseek_v32", "glm4_moe_lite", "glm_moe_dsa", "qwen3_5_moe_text", "qwen3_next",
          "solar_open")
NOT_MERGED = ("granitemoeshared", "kimi_linear", "lfm2_moe", "minimax", "minimax_m2", "phimoe", "gpt_oss",
              "granitemoe_swa", "hy_v4", "zaya")


def _model(family):
    return more._model(family) if family in more.MORE else families._model(family)


def w4_experts(family) -> tuple:
    """``(model, qparams, recipe)``: ``family``'s tiny model with its stacked experts' weights (gate/up and
    down) under int4 groups of 16, their qparams computed from the weights alone."""
    model = _model(family)
    experts = next(m for m in model.modules() if qstats.experts.expert_count(m))
    first = "gate_up_proj" if hasattr(experts, "gate_up_proj") else "up_proj"
    spec = qstats.QuantSpec.from_compressed_tensors(W4_GROUP)
    recipe = qstats.Recipe([qstats.Rule(type(experts).__name__, sites=(first, "down_proj"), spec=spec)])
    qparams = qstats.compute_qparams_tree(qstats.calibrate(model, [], recipe, progress=False), recipe, model)
    return model, qparams, recipe


@pytest.mark.parametrize("family", LOADED + tuple(
    pytest.param(family, marks=pytest.mark.xfail(strict=True, reason=_NOT_MERGED)) for family in NOT_MERGED))
def test_transformers_loads_unpacked_experts(family, tmp_path, single_thread_quiet):
    model, qparams, recipe = w4_experts(family)
    loaded, info, expected = exported_and_loaded(model, qparams, recipe, tmp_path)
    assert expected  # the experts of every sparse layer
    assert not [key for key in info["missing_keys"] if ".experts." in key]
    for path, entry in expected.items():
        for site, stack in entry.items():
            assert torch.equal(getattr(loaded.get_submodule(path), site).detach(), stack), (path, site)
