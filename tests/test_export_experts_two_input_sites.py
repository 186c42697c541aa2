"""Stacked experts whose recipe quantizes their routed hidden states twice: ``"input"`` (int8) and
``"gate_up_proj.input"`` (fp8), the same rows. `qstats.fake_quantized` applies both in turn; the export
wrote ``gate_up_proj.input``'s fp8 scales alone, a checkpoint computing what neither the recipe nor
`qstats.fake_quantized` computes, silently. It must refuse them naming both sites; under one spec (equal
qparams, idempotent) it writes what ``"input"`` alone writes."""

from __future__ import annotations

import os

import pytest
import torch
from _shared import qwen3_moe_config

import qstats

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

PATH = "model.layers.0.mlp.experts"
WEIGHTS = qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0))
INT8 = qstats.QuantSpec(dtype="int8", on_uncalibrated="fallback")
FP8 = qstats.QuantSpec(dtype="fp8_e4m3fn", on_uncalibrated="fallback")
BATCH = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = qwen3_moe_config(hidden_size=32, moe_intermediate_size=16, num_hidden_layers=1, head_dim=16,
                              num_experts=4, tie_word_embeddings=False)
    return transformers.Qwen3MoeForCausalLM(config).eval()


def _calibrated(model, *input_rules):
    rules = [qstats.Rule("Qwen3MoeExperts", sites=("gate_up_proj", "down_proj"), spec=WEIGHTS)]
    rules += [qstats.Rule("Qwen3MoeExperts", sites=sites, spec=spec) for sites, spec in input_rules]
    recipe = qstats.Recipe(rules)
    states = qstats.calibrate(model, [BATCH], recipe, progress=False)
    return recipe, qstats.compute_qparams_tree(states, recipe, model)


def _fake_quantized_logits(model, recipe, qparams):
    with torch.no_grad(), qstats.fake_quantized(model, qparams, recipe):
        return model(BATCH).logits


def test_input_and_gate_up_input_of_other_specs_are_refused(model, tmp_path, single_thread_quiet):
    both = _calibrated(model, (("input",), INT8), (("gate_up_proj.input",), FP8))
    written = _calibrated(model, (("gate_up_proj.input",), FP8))  # what the export wrote of them
    # the recipe quantizes twice: not what a checkpoint of gate_up_proj.input's scales computes
    assert not torch.equal(_fake_quantized_logits(model, *both), _fake_quantized_logits(model, *written))
    with pytest.raises(ValueError, match=rf"{PATH}/gate_up_proj.input: sites 'input' and 'gate_up_proj.input'"):
        qstats.export.compressed_tensors(model, both[1], str(tmp_path), both[0])
    assert not os.path.exists(tmp_path / "model.safetensors")


def test_input_and_gate_up_input_of_one_spec_export_as_input_alone(model, tmp_path, single_thread_quiet):
    both = _calibrated(model, (("input", "gate_up_proj.input"), INT8))
    alone = _calibrated(model, (("input",), INT8))
    assert torch.equal(_fake_quantized_logits(model, *both), _fake_quantized_logits(model, *alone))
    for name, (recipe, qparams) in (("both", both), ("alone", alone)):
        qstats.export.compressed_tensors(model, qparams, str(tmp_path / name), recipe)
    ours, reference = (load_file(str(tmp_path / name / "model.safetensors")) for name in ("both", "alone"))
    assert sorted(ours) == sorted(reference)
    assert all(torch.equal(ours[name], reference[name]) for name in reference)
